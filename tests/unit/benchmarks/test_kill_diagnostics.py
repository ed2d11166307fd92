"""control_latency's look at a slow kill: what the sandbox group's processes are doing while the kill waits,
and the diagnostic that stops the kernel's DAMON monitors for a run and starts them again."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.control_latency import (
    damon_paused,
    group_members,
    group_pids,
    slow_kill_states,
    vmstat,
    vmstat_delta,
)


def _two_asleep(pgid: int) -> list[str]:
    """The group's members once both of its two are asleep (the child starts a moment after the shell and
    runs, R, until it has exec'd sleep), or the last look after 10 s: the caller's assertion judges it."""
    members: list[str] = []
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        members = group_members(pgid)
        if len(members) == 2 and all(m.startswith("S") for m in members):
            break
        time.sleep(0.005)
    return members


def test_a_group_is_listed_with_each_members_state_until_it_is_reaped() -> None:
    # Given a process group of two sleeping processes (a shell and its child)
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        members = _two_asleep(proc.pid)
        # Then both are seen, sleeping (S) in the kernel
        assert len(members) == 2 and all(m.startswith("S") for m in members), members
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # When the shell is reaped, only its orphan (reparented, maybe not yet reaped) can remain
    assert all(m.split()[0] in ("Z", "D", "R") for m in group_members(proc.pid))
    assert group_members(2**22 + 7) == []  # a group nobody is in


def test_a_look_from_the_known_processes_finds_the_same_group_as_a_full_scan() -> None:
    # Given a group whose shell starts its child after the group's processes were listed
    proc = subprocess.Popen(
        ["sh", "-c", "read line; sleep 30 & wait"], start_new_session=True, stdin=subprocess.PIPE
    )
    try:
        known = group_pids([proc.pid, 2**22 + 7])
        assert known == {proc.pid: {proc.pid}, 2**22 + 7: set()}
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        full = _two_asleep(proc.pid)  # both settled, so two looks a moment apart agree
        # When the look starts from the known processes / Then it finds the later child too (a descendant)
        assert len(full) == 2 and group_members(proc.pid, known[proc.pid]) == full
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # and, once the shell is reaped, nothing is reached from it
    assert group_members(proc.pid, known[proc.pid]) == []


def test_slow_kill_states_count_what_the_waiting_kills_showed() -> None:
    hops: list[dict[str, Any]] = [
        {"gone": 250.0},  # fast: never looked at
        {
            "gone": 2900.0,
            "members_at": [
                {
                    "after_ms": 301,
                    "members": ["D unlink_file_vma_batch_process", "D unlink_file_vma_batch_process"],
                },
                {"after_ms": 1002, "members": ["D unlink_file_vma_batch_process", "R zap_pid_ns_processes"]},
            ],
        },
        {"gone": 400.0, "members_at": [{"after_ms": 300, "members": ["Z"]}]},
    ]
    assert slow_kill_states(hops) == {
        "D unlink_file_vma_batch_process": 3,
        "R zap_pid_ns_processes": 1,
        "Z": 1,
    }


def _monitors(admin: Path, *states: str) -> None:
    for i, state in enumerate(states):
        (admin / str(i) / "contexts").mkdir(parents=True)
        (admin / str(i) / "state").write_text(state + "\n")


def test_damon_is_stopped_for_the_block_and_started_again_after(tmp_path: Path) -> None:
    # Given one running monitor and one its operator had stopped
    _monitors(tmp_path, "on", "off")
    # When a run pauses DAMON
    with damon_paused(True, tmp_path) as during:
        # Then both are off during it
        assert [m["state"] for m in during or []] == ["off", "off"]
    # and afterwards only the one that was running runs again
    assert [(tmp_path / str(i) / "state").read_text().strip() for i in (0, 1)] == ["on", "off"]


def test_damon_is_left_alone_without_the_diagnostic_even_when_the_run_fails(tmp_path: Path) -> None:
    _monitors(tmp_path, "on")
    try:
        with damon_paused(False, tmp_path) as during:
            assert [m["state"] for m in during or []] == ["on"]
            raise RuntimeError("the run failed")
    except RuntimeError:
        pass
    with damon_paused(True, tmp_path):
        pass
    assert (tmp_path / "0" / "state").read_text().strip() == "on"


def test_page_cache_counters_are_read_by_name_and_their_growth_is_the_difference(tmp_path: Path) -> None:
    # Given two readings of a vmstat file (other counters around the three that are read)
    path = tmp_path / "vmstat"
    path.write_text("nr_free_pages 10\nworkingset_refault_file 400\npgpgin 9000\npgmajfault 5\npgpgout 1\n")
    before = vmstat(path)
    path.write_text("nr_free_pages 3\nworkingset_refault_file 1400\npgpgin 9500\npgmajfault 5\npgpgout 9\n")
    # Then only the three are kept, and the growth is per counter
    assert before == {"workingset_refault_file": 400, "pgpgin": 9000, "pgmajfault": 5}
    assert vmstat_delta(before, vmstat(path)) == {
        "workingset_refault_file": 1000,
        "pgmajfault": 0,
        "pgpgin": 500,
    }
    # And an unreadable file gives no counters, so no growth, rather than an error in the middle of a run
    assert vmstat(tmp_path / "missing") == {}
    assert vmstat_delta(before, {}) == {}
