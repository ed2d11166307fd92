"""The local process sandbox with real subprocesses: limits, group teardown, kill, network cut-off."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from actors.sandbox import (
    NetworkIsolationUnavailable,
    ResourceLimits,
    Sandbox,
    SandboxClosed,
    probe_isolation,
)

pytestmark = pytest.mark.integration

PY = sys.executable
# A leader that starts two grandchildren in its own group and waits on them.
FAMILY = ["sh", "-c", "sleep 60 & sleep 60 & wait"]


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[Sandbox]:
    box = Sandbox(
        "traj-1", tmp_path, limits=ResourceLimits(cpu_seconds=5, memory_bytes=512 << 20, open_files=64)
    )
    try:
        yield box
    finally:
        await box.kill_all()


async def started_group(box: Sandbox) -> int:
    """Wait until ``box`` has exactly one live group and return it."""
    for _ in range(500):
        if box.live_process_groups:
            [pgid] = box.live_process_groups
            return pgid
        await asyncio.sleep(0.01)
    raise AssertionError("no process group started")


async def test_commands_run_in_the_trajectory_workspace(sandbox: Sandbox) -> None:
    result = await sandbox.run(["sh", "-c", "pwd; echo data > out.txt"], timeout=10)
    assert result.exit_code == 0
    assert result.stdout.strip() == str(sandbox.workspace)
    assert (sandbox.workspace / "out.txt").read_text() == "data\n"


async def test_every_command_runs_in_a_pid_namespace_of_its_own(sandbox: Sandbox) -> None:
    # When a command reports its pid namespace and the processes it can see
    code = (
        "import os; print(os.readlink('/proc/self/ns/pid'));"
        "print(*sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    )
    result = await sandbox.run([PY, "-c", code], timeout=10, network=True)
    namespace, visible = result.stdout.splitlines()
    # Then it lives in a namespace that is not ours, sees only its own few processes, and says so
    assert result.isolated and namespace != os.readlink("/proc/self/ns/pid")
    assert len(visible.split()) <= 3 and str(os.getpid()) not in visible.split()
    assert os.getpgrp() not in sandbox.live_process_groups


async def test_resource_limits_are_applied_in_the_child(sandbox: Sandbox) -> None:
    code = (
        "import resource as r; "
        "print(*(r.getrlimit(x)[0] for x in (r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_NOFILE, r.RLIMIT_CORE)))"
    )
    result = await sandbox.run([PY, "-c", code], timeout=10)
    assert result.stdout.split() == ["5", str(512 << 20), "64", "0"]


async def test_memory_limit_is_enforced(sandbox: Sandbox) -> None:
    result = await sandbox.run([PY, "-c", "b = bytearray(1 << 30)"], timeout=20)
    assert result.exit_code != 0
    assert "MemoryError" in result.stderr


async def test_open_files_limit_is_enforced(sandbox: Sandbox) -> None:
    code = "fs = [open('/dev/null') for _ in range(200)]"
    result = await sandbox.run([PY, "-c", code], timeout=10)
    assert result.exit_code != 0
    assert "Too many open files" in result.stderr


async def test_cpu_limit_is_enforced(tmp_path: Path) -> None:
    box = Sandbox("traj-cpu", tmp_path, limits=ResourceLimits(cpu_seconds=1))
    result = await box.run([PY, "-c", "while True: pass"], timeout=30)
    assert result.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
    assert not result.timed_out


async def test_timeout_tears_down_the_whole_group(sandbox: Sandbox) -> None:
    # Given a command whose grandchildren would outlive it
    run = asyncio.create_task(sandbox.run(FAMILY, timeout=0.5))
    pgid = await started_group(sandbox)
    # When it times out
    result = await run
    # Then it is reported as a timeout and its group is gone
    assert (result.timed_out, result.killed) == (True, False)
    assert not group_exists(pgid)


async def test_a_group_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    box = Sandbox("traj-stubborn", tmp_path, term_grace_s=0.2)
    run = asyncio.create_task(box.run(["sh", "-c", "trap '' TERM; sleep 60 & wait; sleep 60"], timeout=0.5))
    pgid = await started_group(box)
    result = await run
    assert result.exit_code == -signal.SIGKILL
    assert not group_exists(pgid)


async def test_kill_all_sends_sigkill_at_once_without_a_sigterm_grace(tmp_path: Path) -> None:
    # Given a command that records any SIGTERM it gets (and then waits on), in a sandbox whose grace for
    # SIGTERM is an hour: a kill that went through SIGTERM and its grace would show in the file, and one
    # whose command ignored SIGTERM would wait out the hour
    box = Sandbox("traj-kill-now", tmp_path, term_grace_s=3600.0)
    script = "trap 'echo TERM >> got-term' TERM; sleep 3600 & echo ready > ready; wait; wait"
    run = asyncio.create_task(box.run(["sh", "-c", script], timeout=3600))
    pgid = await started_group(box)
    for _ in range(1000):
        if (box.workspace / "ready").exists():
            break
        await asyncio.sleep(0.01)
    assert (box.workspace / "ready").exists(), "the command never started"
    # When the trajectory is killed
    await box.kill_all()
    result = await run
    # Then the group is gone, killed by SIGKILL, and no process of it ever saw a SIGTERM (kill acts at once)
    assert not group_exists(pgid)
    assert (result.killed, result.exit_code) == (True, -signal.SIGKILL)
    assert not (box.workspace / "got-term").exists()


async def test_leftovers_of_a_finished_command_are_torn_down(sandbox: Sandbox) -> None:
    # Given a command that exits at once but leaves a background child behind (marked in its argv)
    marker = f"tether-leftover-{os.getpid()}-{id(sandbox)}"
    child = f"{PY} -c 'import time; time.sleep(60)' {marker} >/dev/null 2>&1 &"
    result = await sandbox.run(["sh", "-c", f"{child} echo started"], timeout=10)
    # Then nothing of it survives the call
    assert (result.exit_code, result.stdout) == (0, "started\n")
    assert not any(marker.encode() in cmdline for cmdline in command_lines())


def command_lines() -> list[bytes]:
    """Every host process's command line, now."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    found.append(f.read())
            except OSError:
                continue
    return found


async def test_kill_all_terminates_every_group_and_closes_the_sandbox(sandbox: Sandbox) -> None:
    # Given two commands running, each with grandchildren
    runs = [asyncio.create_task(sandbox.run(FAMILY, timeout=60)) for _ in range(2)]
    for _ in range(500):
        if len(sandbox.live_process_groups) == 2:
            break
        await asyncio.sleep(0.01)
    groups = sandbox.live_process_groups
    assert len(groups) == 2
    # When the trajectory is killed
    teardown_s = await sandbox.kill_all()
    results = await asyncio.gather(*runs)
    # Then every group is gone, both runs report the kill, and nothing more may run
    assert all(not group_exists(pgid) for pgid in groups)
    assert all(r.killed and not r.timed_out for r in results)
    assert teardown_s >= 0
    with pytest.raises(SandboxClosed):
        await sandbox.run(["true"], timeout=1)


async def test_output_is_capped(tmp_path: Path) -> None:
    box = Sandbox("traj-out", tmp_path, max_output_bytes=1000)
    result = await box.run([PY, "-c", "print('x' * 100000)"], timeout=10)
    assert (len(result.stdout), result.truncated, result.exit_code) == (1000, True, 0)


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP listener on the host's loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


CONNECT = (
    "import socket, sys; "
    "socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3); "
    "print('connected')"
)


@pytest.mark.skipif(not probe_isolation().pid_namespace, reason=probe_isolation().reason)
async def test_network_is_cut_off_unless_the_tool_needs_it(sandbox: Sandbox, listener: int) -> None:
    # Given a listener on the host loopback
    # When the same connect runs with and without network
    offline = await sandbox.run([PY, "-c", CONNECT, str(listener)], timeout=10, network=False)
    online = await sandbox.run([PY, "-c", CONNECT, str(listener)], timeout=10, network=True)
    # Then only the networked run reaches it
    assert (offline.network_isolated, offline.exit_code != 0, "connected" in offline.stdout) == (
        True,
        True,
        False,
    )
    assert (online.network_isolated, online.exit_code, online.stdout.strip()) == (False, 0, "connected")


@pytest.fixture
def no_unshare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A host where neither bwrap nor unshare(1) can be found (PATH without them); the probe is redone."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    probe_isolation.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        probe_isolation.cache_clear()


async def test_missing_network_isolation_is_warned_and_recorded_not_silent(
    tmp_path: Path, no_unshare: None
) -> None:
    # Given a host without unshare
    box = Sandbox("traj-net", tmp_path)
    # When a command asks for no network
    result = await box.run([PY, "-c", "print('ran')"], timeout=10, network=False)
    # Then it runs, but the result and the sandbox both say the network was NOT cut
    assert (result.exit_code, result.network_isolated) == (0, False)
    assert any("network isolation unavailable" in w for w in box.warnings)
    # And a sandbox that requires isolation refuses instead
    strict = Sandbox("traj-net-strict", tmp_path, require_network_isolation=True)
    with pytest.raises(NetworkIsolationUnavailable, match="unshare"):
        await strict.run([PY, "-c", "print('ran')"], timeout=10, network=False)
