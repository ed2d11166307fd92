"""A local process sandbox: one workspace directory per trajectory; every command in its own PID (and, unless
the tool needs it, network) namespace with a read-only root and resource limits; nothing it starts
outlives it.

- Isolation (``actors.sandbox_isolation``): under bubblewrap each command runs in a fresh PID namespace
  with the host's root read-only and only the workspace writable (it is also ``HOME`` and ``TMPDIR``),
  no network unless asked, and ``--die-with-parent``. When the namespace's PID 1 dies the kernel kills
  every process in it, so ``setsid``, double forks, ``nohup`` and daemons die with the command: at its
  exit, its timeout, a kill, or the death of the process hosting the sandbox (an actor SIGKILLed). ``unshare``
  is the fallback (same namespaces, root writable); with neither, a plain process group is used, which
  a command can leave with ``setsid``: warned about, recorded on every result (``isolated=False``), and
  refused when ``require_isolation`` is set (``require_network_isolation`` refuses a run that asks for
  no network when the network cannot be cut).
- Each command is started in a new session (its wrapper's process group, whose id is the wrapper's
  pid) with ``setrlimit`` applied before ``exec`` and inherited by everything inside: CPU seconds,
  address space, open files, no core dumps.
- Teardown at a command's exit, timeout or cancellation: SIGTERM to the command's processes (every
  process of the namespace but its PID 1), SIGKILL to the wrapper's group and the namespace's PID 1 after
  ``term_grace_s``, then wait until no process of the namespace or the group is left. The hosting process
  is a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``) so orphans reparented to it are reaped here.
- ``kill_all`` is the trajectory kill (issue 4; ARCHITECTURE.md: "kill acts at once"): SIGKILL at once,
  no SIGTERM and no grace, so a command that ignores or is slow to act on SIGTERM (or a namespace whose
  PID 1 is slow to pass its exit on) cannot hold the kill for ``term_grace_s``; the sandbox refuses
  further runs, and the teardown time is returned. ``teardown`` also removes the workspace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import os
import re
import resource
import shutil
import signal
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from actors.sandbox_isolation import (
    Isolation,
    IsolationKind,
    Namespace,
    child_in_new_namespace,
    command_prefix,
    exit_status,
    namespace_members,
    namespace_of,
    probe_isolation,
    reap,
    signal_namespace,
)
from runtime.clock import Clock, SystemClock
from runtime.errors import InputError, PolicyRefusal

__all__ = [
    "Isolation",
    "IsolationKind",
    "IsolationUnavailable",
    "NetworkIsolationUnavailable",
    "ResourceLimits",
    "Sandbox",
    "SandboxClosed",
    "SandboxResult",
    "probe_isolation",
]

log = logging.getLogger(__name__)

_TRAJECTORY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.005  # how often teardown re-checks a dying group
_GONE_WITHIN_S = 5.0  # how long SIGKILL may take before the group counts as stuck
RUN_ENV = "TETHER_SANDBOX_RUN"  # one id per command, in the environment of everything it starts


class SandboxClosed(PolicyRefusal):
    """The sandbox was killed (trajectory kill) and runs nothing more."""


class IsolationUnavailable(PolicyRefusal):
    """Namespace isolation was required but neither bubblewrap nor unshare works on this host."""


class NetworkIsolationUnavailable(IsolationUnavailable):
    """Network isolation was required but cannot be had on this host."""


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
    isolated: bool = False  # in a PID namespace of its own: nothing the command started outlived it


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
    pgid: int  # the wrapper's (or, without isolation, the command's) process group
    isolation: Isolation
    run_id: str  # in the environment of the wrapper and everything it starts (RUN_ENV)
    ns: Namespace | None = None  # the command's PID namespace, once known
    killed: bool = False
    by_kill: bool = False  # torn down by the trajectory kill (``kill_all``): SIGKILL at once, no grace


@dataclass
class Sandbox:
    """The sandbox of one trajectory. All methods run on one event loop."""

    trajectory_id: str
    root: Path
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    term_grace_s: float = 0.5
    max_output_bytes: int = 1 << 20
    require_network_isolation: bool = False
    require_isolation: bool = False
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
        """Kill what a previous sandbox of this trajectory left running: the process groups it recorded
        (only a group with a member still working inside this workspace: pids are reused), and any sandbox
        process whose environment names this workspace (a namespace that outlived its wrapper)."""
        try:
            recorded = [int(line) for line in self._groups_file.read_text().split()]
        except (FileNotFoundError, ValueError):
            recorded = []
        reaped = []
        for pgid in recorded:
            if not _group_gone(pgid) and _group_works_in(pgid, self.workspace):
                _signal_group(pgid, signal.SIGKILL)
                reaped.append(pgid)
        self._groups_file.unlink(missing_ok=True)
        strays = _sandbox_processes_of(self.workspace)
        for pid in strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if reaped or strays:
            self._warn(
                f"killed what a previous sandbox of this trajectory left: groups {reaped}, processes {strays}"
            )
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
        """Run ``cmd`` in the workspace; tear down everything it started on exit, timeout or kill, and when
        this call is cancelled (the command is then killed before the cancellation propagates)."""
        if self._closed:
            raise SandboxClosed(f"sandbox of {self.trajectory_id!r} was killed; it runs nothing more")
        if not cmd or not all(isinstance(part, str) and part for part in cmd):
            raise InputError("must be a non-empty list of non-empty strings", where="Sandbox.run.cmd")
        if not timeout > 0:
            raise InputError(f"must be > 0 seconds, not {timeout}", where="Sandbox.run.timeout")
        isolation = self._isolation(network)
        run_id = uuid.uuid4().hex
        info_r, info_w = os.pipe() if isolation.kind is IsolationKind.BWRAP else (-1, -1)
        cancelled = False
        try:
            prefix = command_prefix(
                isolation, self.workspace, network=network, info_fd=info_w if info_w >= 0 else None
            )
            spawn = asyncio.ensure_future(
                asyncio.create_subprocess_exec(
                    *prefix,
                    *cmd,
                    cwd=self.workspace,
                    env={**self._environment(env), RUN_ENV: run_id},
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,  # own session => own process group, pgid == pid
                    preexec_fn=self.limits.preexec(),
                    pass_fds=(info_w,) if info_w >= 0 else (),
                )
            )
            try:
                proc = await asyncio.shield(spawn)
            except asyncio.CancelledError:
                # Cancelled while starting: let the start finish, then tear it down like any other run
                # (asyncio's own clean-up would kill only the wrapper, and wait on pipes a survivor holds).
                cancelled = True
                proc = await spawn
        except BaseException:
            for fd in (info_r, info_w):
                if fd >= 0:
                    os.close(fd)
            raise
        if info_w >= 0:
            os.close(info_w)  # the wrapper holds its own copy; EOF comes when it is done with it
        running = _Running(proc, pgid=proc.pid, isolation=isolation, run_id=run_id)
        self._running[running.pgid] = running
        self._save_groups()
        # A kill that came while the process was being started did not see it: it is torn down below.
        running.killed = self._closed or cancelled
        running.by_kill = self._closed
        assert proc.stdout is not None and proc.stderr is not None
        readers = (
            asyncio.create_task(_read_capped(proc.stdout, self.max_output_bytes)),
            asyncio.create_task(_read_capped(proc.stderr, self.max_output_bytes)),
        )
        timed_out = False
        try:
            running.ns = await self._namespace(running, info_r)
            if not running.killed:
                try:
                    await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
                except TimeoutError:
                    timed_out = True
            # Whether the command exited, timed out or was killed: nothing it started outlives the call
            # (a kill is SIGKILL at once here too: the group may still be dying when the wrapper exits).
            await self._teardown(running, graceful=not running.by_kill)
            if cancelled:
                raise asyncio.CancelledError
        except asyncio.CancelledError:
            # The caller gave up on the command (its deadline, a cancel): it goes, with everything it started.
            running.killed = True
            await asyncio.shield(self._teardown(running, graceful=not running.by_kill))
            for reader in readers:
                reader.cancel()
            raise
        finally:
            self._running.pop(running.pgid, None)
            self._save_groups()
        (out, out_cut), (err, err_cut) = await asyncio.gather(*readers)
        return SandboxResult(
            exit_code=exit_status(proc.returncode, isolation),
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out and not running.killed,
            killed=running.killed,
            network_isolated=isolation.pid_namespace and not network,
            truncated=out_cut or err_cut,
            isolated=isolation.pid_namespace,
        )

    async def kill_all(self) -> float:
        """Trajectory kill: SIGKILL every live command with everything it started (no SIGTERM, no grace:
        a kill acts at once), wait until it is gone, and refuse further runs.

        Returns the seconds from the call until every namespace and process group was gone.
        """
        started = self.clock.now()
        self._closed = True
        targets = list(self._running.values())
        for running in targets:
            running.killed = running.by_kill = True
        await asyncio.gather(*(self._teardown(r, graceful=False) for r in targets))
        return self.clock.now() - started

    async def teardown(self) -> float:
        """End of the trajectory: ``kill_all``, then remove the workspace and the sandbox's bookkeeping."""
        took = await self.kill_all()
        # Every process is gone (kill_all waited for it); runs still finishing only collect their output.
        shutil.rmtree(self.workspace, ignore_errors=True)
        self._groups_file.unlink(missing_ok=True)
        return took

    def remove_workspace(self) -> None:
        """Delete the workspace directory (only once nothing runs in it)."""
        if self._running:
            raise PolicyRefusal(f"sandbox of {self.trajectory_id!r} still runs {len(self._running)} group(s)")
        shutil.rmtree(self.workspace, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    def _isolation(self, network: bool) -> Isolation:
        isolation = probe_isolation()
        if isolation.pid_namespace:
            return isolation
        if self.require_isolation:
            raise IsolationUnavailable(
                f"cannot run the command in a namespace of its own: {isolation.reason}"
            )
        if not network and self.require_network_isolation:
            raise NetworkIsolationUnavailable(f"cannot cut the network: {isolation.reason}")
        self._warn(
            "namespace isolation unavailable: commands run as a plain process group, WITH network, "
            f"and can escape it with setsid ({isolation.reason})"
        )
        if not network:
            self._warn(f"network isolation unavailable, command runs WITH network: {isolation.reason}")
        return isolation

    async def _namespace(self, running: _Running, info_r: int) -> Namespace | None:
        """The command's PID namespace: from bwrap's info fd, or the wrapper's child for unshare."""
        if running.isolation.kind is IsolationKind.BWRAP:
            info = await _read_info(info_r, running.proc)
            pid = info.get("child-pid") if info else None
            link = namespace_of(pid) if isinstance(pid, int) else None
            return Namespace(pid, link) if isinstance(pid, int) and link is not None else None
        if running.isolation.kind is IsolationKind.UNSHARE:
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 2.0
            while running.proc.returncode is None and loop.time() < give_up:
                if (ns := child_in_new_namespace(running.pgid)) is not None:
                    return ns
                await asyncio.sleep(_POLL_S)
        return None

    def _environment(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        # A small, explicit environment: nothing from the host process leaks in by accident.
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.workspace),
            "TMPDIR": str(self.workspace),  # the only writable place under isolation
            "LANG": "C.UTF-8",
            "TETHER_TRAJECTORY_ID": self.trajectory_id,
        }
        env.update(extra or {})
        return env

    async def _teardown(self, running: _Running, *, graceful: bool) -> None:
        """Graceful: SIGTERM the command's processes and SIGKILL what is left after the grace period; else
        (a kill) SIGKILL at once. Then wait until nothing of the namespace or the group is left."""
        ns = running.ns
        if graceful:
            if ns is not None:
                # bwrap's PID 1 is its own small init: spared, so the command can exit on SIGTERM
                # (unshare's PID 1 is the command itself)
                spare_init = running.isolation.kind is IsolationKind.BWRAP
                alive = signal_namespace(ns, signal.SIGTERM, spare_init=spare_init)
                alive = _group_alive(running.pgid) or alive
            else:
                alive = _signal_group(running.pgid, signal.SIGTERM)
            if not alive or await self._wait_gone(running, self.term_grace_s):
                return
        # The wrapper's group first (one syscall; its namespace's PID 1 has the wrapper's death as its
        # parent-death signal), then the namespace's PID 1 itself (one more: the kernel then kills every
        # other process of the namespace). Nothing here scans /proc: under load a scan of every process's
        # environment costs tens of ms, and the group would wait for it to be reaped. The waiting below
        # scans once the group and the namespace are gone, for whatever still carries this run's id.
        _signal_group(running.pgid, signal.SIGKILL)
        if ns is not None and namespace_of(ns.init_pid) == ns.link:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(ns.init_pid, signal.SIGKILL)
        if not await self._wait_gone(running, _GONE_WITHIN_S):
            self._warn(f"sandbox group {running.pgid} still present {_GONE_WITHIN_S}s after SIGKILL")

    async def _wait_gone(self, running: _Running, within: float) -> bool:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + within
        while True:
            # The leader is reaped by asyncio's child watcher; reap the rest only after it, so the
            # watcher never loses the leader's exit status to us.
            if running.proc.returncode is not None:
                _reap_group(running.pgid)
                if running.ns is not None:
                    reap(running.ns.init_pid)
            # The cheap checks first (a syscall, a readlink: the namespace lives while its PID 1 does), then
            # the /proc scans, once they pass: the namespace's members, and last what carries this run's id
            # and is neither (a namespace whose PID 1 outlived a wrapper killed during its setup: bwrap
            # sets its parent-death signal too late to see that). A survivor found is SIGKILLed, and the
            # loop goes on until a scan finds nothing.
            # The scans run in a thread: under load they take tens to hundreds of ms, and the actor's loop
            # has messages to answer meanwhile.
            if (
                _group_gone(running.pgid)
                and (running.ns is None or namespace_of(running.ns.init_pid) != running.ns.link)
                and await asyncio.to_thread(_nothing_left, running.ns, running.run_id)
            ):
                return True
            if loop.time() >= give_up:
                return False
            await asyncio.sleep(_POLL_S)


async def _read_info(fd: int, proc: asyncio.subprocess.Process) -> dict[str, object] | None:
    """Read bwrap's info (one JSON object) from ``fd``, then close it; ``None`` if the wrapper ended first
    (killed during its setup: its namespace's PID 1 may then survive it, see ``_survivors``)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    ended = asyncio.ensure_future(proc.wait())
    data = b""
    try:
        while True:
            chunk = asyncio.ensure_future(reader.read(4096))
            await asyncio.wait({chunk, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not chunk.done():
                chunk.cancel()
                return None
            if not (piece := chunk.result()):
                return None
            data += piece
            try:
                value = json.loads(data)
            except ValueError:
                continue
            return value if isinstance(value, dict) else None
    finally:
        ended.cancel()
        transport.close()


def _survivors(run_id: str, *, outside: str | None = None) -> list[int]:
    """Live processes whose environment carries ``RUN_ENV=run_id`` (zombies show no environment). With
    ``outside`` (a PID-namespace link), processes of that namespace are not read: a run isolated in a
    namespace of its own starts nothing in the host's, and reading every Ray worker's environment was most
    of a kill's cost on a loaded node (hundreds of ms for ~600 processes)."""
    needle = f"{RUN_ENV}={run_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        if outside is not None and namespace_of(int(entry.name)) == outside:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _sandbox_processes_of(workspace: Path) -> list[int]:
    """Live sandbox processes (``RUN_ENV`` set) whose ``HOME`` is ``workspace``."""
    home = f"HOME={workspace}".encode()
    run = f"{RUN_ENV}=".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if home in environ and any(v.startswith(run) for v in environ):
            found.append(int(entry.name))
    return found


def _nothing_left(ns: Namespace | None, run_id: str) -> bool:
    """No member of ``ns`` and no process carrying ``run_id`` (a survivor found is SIGKILLed)."""
    if ns is not None and namespace_members(ns.link):
        return False
    # a namespaced run's survivors live in some other namespace (its own PID 1 outliving the wrapper)
    return not _kill_survivors(run_id, outside=namespace_of(os.getpid()) if ns is not None else None)


def _kill_survivors(run_id: str, *, outside: str | None = None) -> bool:
    """SIGKILL every survivor of ``run_id`` (and reap those reparented to us); False if there was none."""
    survivors = _survivors(run_id, outside=outside)
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        reap(pid)
    return bool(survivors)


def _group_alive(pgid: int) -> bool:
    return not _group_gone(pgid)


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
