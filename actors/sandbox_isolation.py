"""How a sandboxed command is isolated: the probe that picks a method, the command prefix it needs, and the
process bookkeeping a namespace requires (who is in it, is it gone).

Methods, best first (``probe_isolation``, cached per process):

- ``bwrap`` (bubblewrap): a new PID namespace, and a new network namespace unless the tool needs the
  network; the host's root filesystem read-only with only the workspace writable, a private ``/tmp``,
  ``/proc`` and ``/dev``; ``--die-with-parent`` so the whole sandbox is killed when the process hosting
  it dies (an actor SIGKILLed takes its sandboxes with it). The namespace's first process (its PID 1)
  is reported on an info fd; when it dies the kernel kills every other process in the namespace, so
  nothing a command starts (``setsid``, double fork, ``nohup``, a daemon) outlives it.
- ``unshare``: ``unshare --pid --fork --kill-child --mount-proc`` (plus ``--net``): the same PID and
  network namespaces, without the read-only root.
- none: a plain process group (the command can escape with ``setsid``); allowed only when the sandbox
  does not require isolation, and then warned about and recorded on every result.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

__all__ = [
    "Isolation",
    "IsolationKind",
    "Namespace",
    "command_prefix",
    "namespace_members",
    "probe_isolation",
    "signal_namespace",
]


class IsolationKind(StrEnum):
    BWRAP = "bwrap"
    UNSHARE = "unshare"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Isolation:
    """The method this host supports, its binary, and why the better ones are not available."""

    kind: IsolationKind
    binary: str | None
    reason: str

    @property
    def pid_namespace(self) -> bool:
        return self.kind is not IsolationKind.NONE


def _works(argv: Sequence[str]) -> str | None:
    """``None`` if ``argv`` runs and exits 0, else why not."""
    try:
        done = subprocess.run(list(argv), capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{argv[0]}: {e}"
    if done.returncode != 0:
        return f"{' '.join(argv[:3])}...: {done.stderr.decode(errors='replace').strip()[:300]}"
    return None


@functools.cache
def probe_isolation() -> Isolation:
    """Try bubblewrap, then unshare(1); cached (``probe_isolation.cache_clear()`` to redo)."""
    failures: list[str] = []
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        failures.append("bwrap is not installed (Debian package bubblewrap; `make setup` installs it)")
    else:
        trial = [bwrap, *_bwrap_flags(Path("/"), network=False, info_fd=None), "true"]
        if (why := _works(trial)) is None:
            return Isolation(IsolationKind.BWRAP, bwrap, "bwrap: pid+net namespaces, read-only root")
        failures.append(why)
    unshare = shutil.which("unshare")
    if unshare is None:
        failures.append("unshare(1) is not installed")
    else:
        if (why := _works([unshare, *_unshare_flags(network=False), "true"])) is None:
            return Isolation(IsolationKind.UNSHARE, unshare, "unshare: pid+net namespaces; root writable")
        failures.append(why)
    return Isolation(IsolationKind.NONE, None, "; ".join(failures))


def _bwrap_flags(workspace: Path, *, network: bool, info_fd: int | None) -> list[str]:
    flags = ["--die-with-parent", "--unshare-pid", "--new-session"]
    if not network:
        flags.append("--unshare-net")
    flags += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    if str(workspace) != "/":
        flags += ["--bind", str(workspace), str(workspace), "--chdir", str(workspace)]
    if info_fd is not None:
        flags += ["--info-fd", str(info_fd)]
    return [*flags, "--"]


def _unshare_flags(*, network: bool) -> list[str]:
    flags = ["--pid", "--fork", "--kill-child", "--mount-proc"]
    if not network:
        flags.append("--net")
    return [*flags, "--"]


def command_prefix(isolation: Isolation, workspace: Path, *, network: bool, info_fd: int | None) -> list[str]:
    """What runs before the command: the isolation wrapper (empty for a plain process group)."""
    if isolation.kind is IsolationKind.BWRAP:
        assert isolation.binary is not None
        return [isolation.binary, *_bwrap_flags(workspace.resolve(), network=network, info_fd=info_fd)]
    if isolation.kind is IsolationKind.UNSHARE:
        assert isolation.binary is not None
        return [isolation.binary, *_unshare_flags(network=network)]
    return []


@dataclass(frozen=True, slots=True)
class Namespace:
    """A sandbox's PID namespace: its first process (host pid) and the namespace's identity."""

    init_pid: int
    link: str  # readlink /proc/<pid>/ns/pid, e.g. "pid:[4026532178]"


def namespace_of(pid: int) -> str | None:
    """The PID-namespace link of ``pid`` (``None`` once it is gone)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def child_in_new_namespace(leader: int) -> Namespace | None:
    """The first descendant of ``leader`` that lives in another PID namespace (``unshare``'s forked child)."""
    ours = namespace_of(os.getpid())
    frontier = [leader]
    while frontier:
        pid = frontier.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for raw in children:
            child = int(raw)
            link = namespace_of(child)
            if link is not None and link != ours:
                return Namespace(child, link)
            frontier.append(child)
    return None


def namespace_members(link: str) -> list[int]:
    """Host pids of every process (zombies included) in the PID namespace ``link``."""
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and namespace_of(int(entry.name)) == link:
            members.append(int(entry.name))
    return members


def signal_namespace(ns: Namespace, sig: signal.Signals, *, spare_init: bool) -> bool:
    """Send ``sig`` to every process of ``ns`` (but its PID 1 when ``spare_init``); False if none is left."""
    members = namespace_members(ns.link)
    for pid in members:
        if spare_init and pid == ns.init_pid:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    return bool(members)


def reap(pid: int) -> None:
    """Collect ``pid`` if it is an exited child of ours (a namespace PID 1 reparented to us)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def exit_status(returncode: int | None, isolation: Isolation) -> int | None:
    """The command's exit status as ``SandboxResult`` reports it: negative for a signal. bwrap exits 128+N
    when the command died of signal N (as shells report it), so that is read back as -N."""
    if returncode is None or isolation.kind is not IsolationKind.BWRAP:
        return returncode  # unshare re-raises the command's signal on itself: already negative
    if 128 < returncode <= 128 + 64:
        return -(returncode - 128)
    return returncode
