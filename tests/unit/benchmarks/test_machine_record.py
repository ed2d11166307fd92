"""What a result records about the machine beside its numbers: the hypervisor's steal share and the
kernel's DAMON monitors (both move latency on a shared virtual machine at a load average that looks quiet)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks._common import busy_times, cpu_times, damon_state, tick_share
from benchmarks.readme_table import table


def _stat(path: Path, user: int, idle: int, steal: int, iowait: int = 0) -> Path:
    # user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {user} 0 10 {idle} {iowait} 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return path


def test_the_steal_share_is_the_stolen_part_of_the_cpu_time_between_two_readings(tmp_path: Path) -> None:
    # Given /proc/stat before and after: 100 ticks passed, 25 of them stolen by the hypervisor
    before = cpu_times(_stat(tmp_path / "a", user=100, idle=500, steal=40))
    after = cpu_times(_stat(tmp_path / "b", user=150, idle=525, steal=65))
    # Then
    assert before == (40, 650) and after == (65, 750)
    assert tick_share(before, after) == 0.25
    # and an unreadable or non-advancing reading gives no share rather than a wrong one
    assert cpu_times(tmp_path / "missing") is None
    assert tick_share(None, after) is None and tick_share(after, after) is None


def test_the_busy_share_is_the_cpu_time_spent_neither_idle_nor_waiting_for_io(tmp_path: Path) -> None:
    # Given 200 ticks between the readings: 50 user, 10 steal, 100 idle, 40 waiting for I/O
    before = busy_times(_stat(tmp_path / "a", user=100, idle=500, steal=40, iowait=20))
    after = busy_times(_stat(tmp_path / "b", user=150, idle=600, steal=50, iowait=60))
    # Then busy counts user, system and steal, not idle or iowait
    assert before == (150, 670) and after == (210, 870)
    assert tick_share(before, after) == 0.3
    assert busy_times(tmp_path / "missing") is None


def test_damon_monitors_are_read_from_the_sysfs_admin_tree(tmp_path: Path) -> None:
    # Given a kdamond watching physical memory with a pageout scheme, and one stopped
    on = tmp_path / "0"
    (on / "contexts" / "0" / "schemes" / "0").mkdir(parents=True)
    (on / "state").write_text("on\n")
    (on / "contexts" / "0" / "operations").write_text("paddr\n")
    (on / "contexts" / "0" / "schemes" / "0" / "action").write_text("pageout\n")
    (tmp_path / "1" / "contexts").mkdir(parents=True)
    (tmp_path / "1" / "state").write_text("off\n")
    (tmp_path / "nr_kdamonds").write_text("2\n")
    # Then
    assert damon_state(tmp_path) == [
        {"state": "on", "operations": ["paddr"], "actions": ["pageout"]},
        {"state": "off", "operations": [], "actions": []},
    ]
    assert damon_state(tmp_path / "no-damon") is None


def test_the_readme_row_shows_the_steal_share_it_was_measured_under(tmp_path: Path) -> None:
    result = {
        "harness_ms": {"p50": 9.0, "p99": 18.0},
        "floor_ms": {"p50": 1.0, "p99": 2.0},
        "runs": {"ratio_p50": {"min": 2.0, "median": 3.0, "max": 4.0, "runs": 3}},
        "commit": {"sha": "0123456789abcdef", "dirty": False},
        "calibration": {
            "before": {"load_avg": [0.4, 1, 1], "busy": True, "cpu_loop_s": 0.1, "cpu_steal": 0.27}
        },
        "environment": {"measured_at": "2026-12-03T12:00:00Z"},
    }
    (tmp_path / "turn_overhead.json").write_text(json.dumps(result))
    row = next(line for line in table(tmp_path).splitlines() if "`turn_overhead`" in line)
    assert "busy machine (load 0.4, cpu loop 0.1 s, cpu steal 27 %)" in row
