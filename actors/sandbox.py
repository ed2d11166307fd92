"""A local process sandbox: one workspace directory per trajectory, every process in its own process
group with resource limits, network cut off on request, torn down as a group on kill or timeout.

- Each ``run`` starts its command with ``start_new_session=True`` (a new session, so a new process
  group whose id is the leader's pid) and applies ``setrlimit`` in the child before ``exec``: CPU
  seconds, address space, open files, no core dumps.
- ``network=False`` (the default) runs the command under ``unshare -n`` (a fresh network namespace
  with only a downed loopback). Whether that works is probed once per process; when it does not,
  the sandbox logs a warning, records it in ``warnings`` and marks ``SandboxResult.network_isolated``
  False (or raises ``NetworkIsolationUnavailable`` when ``require_network_isolation`` is set).
- Teardown sends SIGTERM to the whole group, then SIGKILL after ``term_grace_s``, and waits until
  ``os.killpg(pgid, 0)`` says the group is gone. The hosting process makes itself a *child
  subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``) so that grandchildren orphaned by the teardown are
  reparented to it and reaped here; otherwise their zombies would keep the group alive wherever
  PID 1 does not reap (as in many containers).
- ``kill_all`` is the trajectory kill (issue 4): every live group is torn down, the sandbox refuses
  further runs, and the teardown time is returned.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runtime.clock import Clock, SystemClock
from runtime.errors import InputError, PolicyRefusal

__all__ = [
    "NetworkIsolation",
    "NetworkIsolationUnavailable",
    "ResourceLimits",
    "Sandbox",
    "SandboxClosed",
    "SandboxResult",
    "probe_network_isolation",
]

log = logging.getLogger(__name__)

_TRAJECTORY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.005  # how often teardown re-checks a dying group
_GONE_WITHIN_S = 5.0  # how long SIGKILL may take before the group counts as stuck


class SandboxClosed(PolicyRefusal):
    """The sandbox was killed (trajectory kill) and runs nothing more."""


class NetworkIsolationUnavailable(PolicyRefusal):
    """Network isolation was required but ``unshare -n`` does not work on this host."""


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """Per-process limits applied with ``setrlimit`` before exec (``None`` = inherit)."""

    cpu_seconds: int | None = 60
    memory_bytes: int | None = 1 << 30
    open_files: int | None = 256

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "open_files"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InputError(f"must be positive or None, not {value}", where=f"ResourceLimits.{name}")

    def preexec(self) -> Callable[[], None]:
        """The function the child runs between fork and exec (no allocation-heavy work there)."""
        limits: list[tuple[int, int, int]] = [(resource.RLIMIT_CORE, 0, 0)]
        if self.cpu_seconds is not None:
            # Soft limit -> SIGXCPU; the hard limit one second later -> SIGKILL for a process that ignores it.
            limits.append((resource.RLIMIT_CPU, self.cpu_seconds, self.cpu_seconds + 1))
        if self.memory_bytes is not None:
            limits.append((resource.RLIMIT_AS, self.memory_bytes, self.memory_bytes))
        if self.open_files is not None:
            limits.append((resource.RLIMIT_NOFILE, self.open_files, self.open_files))

        def apply() -> None:
            for which, soft, hard in limits:
                resource.setrlimit(which, (soft, hard))

        return apply


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """How one command ended. ``exit_code`` is negative for a signal (``-9`` = SIGKILL)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed: bool
    network_isolated: bool
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class NetworkIsolation:
    """Result of the one-time probe: the command prefix that cuts the network, or why there is none."""

    available: bool
    prefix: tuple[str, ...]
    reason: str


@functools.cache
def probe_network_isolation() -> NetworkIsolation:
    """Try ``unshare -n`` (root or CAP_SYS_ADMIN), then ``unshare -rn`` (user namespaces). Cached."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return NetworkIsolation(False, (), "unshare(1) is not installed")
    failures: list[str] = []
    for prefix in ((unshare, "-n"), (unshare, "-r", "-n")):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            failures.append(f"{' '.join(prefix)}: {e}")
            continue
        if done.returncode == 0:
            return NetworkIsolation(True, prefix, f"{' '.join(prefix)} works")
        failures.append(f"{' '.join(prefix)}: {done.stderr.decode(errors='replace').strip()}")
    return NetworkIsolation(False, (), "; ".join(failures))


@functools.cache
def _become_subreaper() -> str | None:
    """Make this process a child subreaper; returns why not, or ``None`` on success."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}"
    except (OSError, AttributeError) as e:
        return f"prctl unavailable: {e}"
    return None


@dataclass(eq=False)
class _Running:
    proc: asyncio.subprocess.Process
    pgid: int
    killed: bool = False


@dataclass
class Sandbox:
    """The sandbox of one trajectory. All methods run on one event loop."""

    trajectory_id: str
    root: Path
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    term_grace_s: float = 0.5
    max_output_bytes: int = 1 << 20
    require_network_isolation: bool = False
    clock: Clock = field(default_factory=SystemClock)
    warnings: list[str] = field(default_factory=list, init=False)
    _running: dict[int, _Running] = field(default_factory=dict, init=False, repr=False)
    _closed: bool = field(default=False, init=False)
    reaped: tuple[int, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        if not _TRAJECTORY_ID.match(self.trajectory_id):
            raise InputError(
                f"{self.trajectory_id!r} is not a safe directory name ([A-Za-z0-9._-], max 128)",
                where="Sandbox.trajectory_id",
            )
        if self.term_grace_s < 0:
            raise InputError("must be >= 0", where="Sandbox.term_grace_s")
        self.workspace.mkdir(parents=True, exist_ok=True)
        if (why := _become_subreaper()) is not None:
            self._warn(f"orphaned grandchildren may linger as zombies: {why}")
        # A predecessor that died without teardown (its actor was SIGKILLed) left its groups running.
        self.reaped = self._reap_orphans()

    @property
    def _groups_file(self) -> Path:
        # beside the workspace, not in it: the commands it records must not be able to edit it
        return self.root / f".{self.trajectory_id}.process-groups"

    def _save_groups(self) -> None:
        tmp = self._groups_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{pgid}\n" for pgid in sorted(self._running)))
        tmp.replace(self._groups_file)

    def _reap_orphans(self) -> tuple[int, ...]:
        """Kill the process groups a previous sandbox of this trajectory recorded and never tore down.
        Only a group with a member still working inside this workspace is killed (pids are reused)."""
        try:
            recorded = [int(line) for line in self._groups_file.read_text().split()]
        except (FileNotFoundError, ValueError):
            return ()
        reaped = []
        for pgid in recorded:
            if not _group_gone(pgid) and _group_works_in(pgid, self.workspace):
                _signal_group(pgid, signal.SIGKILL)
                reaped.append(pgid)
        self._groups_file.unlink(missing_ok=True)
        if reaped:
            self._warn(f"killed process groups left by a previous sandbox of this trajectory: {reaped}")
        return tuple(reaped)

    @property
    def workspace(self) -> Path:
        """The trajectory's working directory (every command runs here)."""
        return self.root / self.trajectory_id

    @property
    def live_process_groups(self) -> frozenset[int]:
        """Process group ids of commands still running."""
        return frozenset(self._running)

    @property
    def closed(self) -> bool:
        return self._closed

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning("sandbox %s: %s", self.trajectory_id, message)

    async def run(
        self,
        cmd: Sequence[str],
        timeout: float,
        network: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        """Run ``cmd`` in the workspace; tear its process group down on exit, timeout or kill."""
        if self._closed:
            raise SandboxClosed(f"sandbox of {self.trajectory_id!r} was killed; it runs nothing more")
        if not cmd or not all(isinstance(part, str) and part for part in cmd):
            raise InputError("must be a non-empty list of non-empty strings", where="Sandbox.run.cmd")
        if not timeout > 0:
            raise InputError(f"must be > 0 seconds, not {timeout}", where="Sandbox.run.timeout")
        prefix, isolated = self._network_prefix(network)
        proc = await asyncio.create_subprocess_exec(
            *prefix,
            *cmd,
            cwd=self.workspace,
            env=self._environment(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # own session => own process group, pgid == pid
            preexec_fn=self.limits.preexec(),
        )
        running = _Running(proc, pgid=proc.pid)
        self._running[running.pgid] = running
        self._save_groups()
        assert proc.stdout is not None and proc.stderr is not None
        readers = (
            asyncio.create_task(_read_capped(proc.stdout, self.max_output_bytes)),
            asyncio.create_task(_read_capped(proc.stderr, self.max_output_bytes)),
        )
        timed_out = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
            except TimeoutError:
                timed_out = True
            # Whether the leader exited, timed out or was killed: nothing it started outlives the call.
            await self._teardown(running)
        finally:
            self._running.pop(running.pgid, None)
            self._save_groups()
        (out, out_cut), (err, err_cut) = await asyncio.gather(*readers)
        return SandboxResult(
            exit_code=proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out and not running.killed,
            killed=running.killed,
            network_isolated=isolated,
            truncated=out_cut or err_cut,
        )

    async def kill_all(self) -> float:
        """Trajectory kill: tear down every live process group, refuse further runs.

        Returns the seconds from the call until every group was gone (``os.killpg(pgid, 0)`` raises).
        """
        started = self.clock.now()
        self._closed = True
        targets = list(self._running.values())
        for running in targets:
            running.killed = True
        await asyncio.gather(*(self._teardown(r) for r in targets))
        return self.clock.now() - started

    def remove_workspace(self) -> None:
        """Delete the workspace directory (only once nothing runs in it)."""
        if self._running:
            raise PolicyRefusal(f"sandbox of {self.trajectory_id!r} still runs {len(self._running)} group(s)")
        shutil.rmtree(self.workspace, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    def _network_prefix(self, network: bool) -> tuple[tuple[str, ...], bool]:
        if network:
            return (), False
        probe = probe_network_isolation()
        if probe.available:
            return probe.prefix, True
        if self.require_network_isolation:
            raise NetworkIsolationUnavailable(f"cannot cut the network: {probe.reason}")
        self._warn(f"network isolation unavailable, command runs WITH network: {probe.reason}")
        return (), False

    def _environment(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        # A small, explicit environment: nothing from the host process leaks in by accident.
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.workspace),
            "LANG": "C.UTF-8",
            "TETHER_TRAJECTORY_ID": self.trajectory_id,
        }
        env.update(extra or {})
        return env

    async def _teardown(self, running: _Running) -> None:
        """SIGTERM the group, SIGKILL it after the grace period, and wait until it is gone."""
        pgid = running.pgid
        if not _signal_group(pgid, signal.SIGTERM):
            return
        if await self._wait_gone(running, self.term_grace_s):
            return
        _signal_group(pgid, signal.SIGKILL)
        if not await self._wait_gone(running, _GONE_WITHIN_S):
            self._warn(f"process group {pgid} still present {_GONE_WITHIN_S}s after SIGKILL")

    async def _wait_gone(self, running: _Running, within: float) -> bool:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + within
        while True:
            # The leader is reaped by asyncio's child watcher; reap the rest only after it, so the
            # watcher never loses the leader's exit status to us.
            if running.proc.returncode is not None:
                _reap_group(running.pgid)
            if _group_gone(running.pgid):
                return True
            if loop.time() >= give_up:
                return False
            await asyncio.sleep(_POLL_S)


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the group; False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _group_works_in(pgid: int, workspace: Path) -> bool:
    """Whether some live process of group ``pgid`` has its working directory inside ``workspace``."""
    home = str(workspace.resolve())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # field 5 of /proc/PID/stat is the process group; the command name (field 2) may hold spaces
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            cwd = os.readlink(entry / "cwd")
        except (OSError, ValueError, IndexError):
            continue
        if cwd == home or cwd.startswith(home + os.sep):
            return True
    return False


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _reap_group(pgid: int) -> None:
    """Collect exited members of ``pgid`` that are our children (reparented to us as subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    """Read to EOF keeping at most ``limit`` bytes (the rest is drained so the child never blocks)."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = limit - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > room:
            truncated = True
    return bytes(kept), truncated
