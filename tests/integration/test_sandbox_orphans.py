"""A sandbox reaps the process groups its dead predecessor left behind, and nothing else."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from actors.sandbox import Sandbox

pytestmark = pytest.mark.integration


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def _recorded_group(sandbox: Sandbox) -> int:
    for _ in range(500):  # bounded: the subprocess starts within milliseconds
        if sandbox.live_process_groups:
            (pgid,) = sandbox.live_process_groups
            return pgid
        await asyncio.sleep(0.01)
    raise AssertionError("the sandboxed command never started")


async def test_a_new_sandbox_kills_the_groups_a_dead_predecessor_left(tmp_path: Path) -> None:
    # Given a sandboxed command running, and its owner gone without tearing it down (an actor SIGKILLed:
    # the Python object is simply never used again)
    first = Sandbox("t-orphan", tmp_path)
    task = asyncio.ensure_future(first.run(["sh", "-c", "sleep 30 & wait"], timeout=60))
    pgid = await _recorded_group(first)
    # When the restarted actor creates the trajectory's sandbox again
    second = Sandbox("t-orphan", tmp_path)
    # Then the orphaned group was killed, and the new sandbox says so
    assert second.reaped == (pgid,)
    for _ in range(500):
        if _gone(pgid):
            break
        await asyncio.sleep(0.01)
    assert _gone(pgid)
    await asyncio.wait_for(task, 10)


async def test_a_recorded_pid_reused_by_an_unrelated_process_is_left_alone(tmp_path: Path) -> None:
    # Given the groups file names a live process that does not work in this trajectory's workspace
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stranger = subprocess.Popen(["sleep", "30"], cwd=elsewhere, start_new_session=True)
    try:
        (tmp_path / ".t-reuse.process-groups").write_text(f"{stranger.pid}\n")
        # When a sandbox for that trajectory is created
        sandbox = Sandbox("t-reuse", tmp_path)
        # Then it kills nothing: a reused pid is not an orphan of ours
        assert sandbox.reaped == ()
        assert stranger.poll() is None and not _gone(stranger.pid)
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait(5)
