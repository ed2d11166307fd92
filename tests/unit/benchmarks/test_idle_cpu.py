"""node_capacity's idle CPU part: a process's CPU time and wakeups read from /proc, and the summary of the
windows (what an idle trajectory costs the node beside a bare Ray actor)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from benchmarks.node_capacity import cpu_rates, process_cpu, summarise_idle


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds  # this thread's own CPU time
    while time.thread_time() < end:
        pass


def test_a_process_cpu_time_is_what_the_kernel_charged_every_thread() -> None:
    # Given this process burns CPU in its main thread and in a second thread
    before, clock_before = process_cpu(), time.process_time()
    worker = threading.Thread(target=_spin, args=(0.15,))
    worker.start()
    _spin(0.15)
    worker.join()
    after, clock_after = process_cpu(), time.process_time()
    # Then /proc's account of it matches the process CPU clock (both threads), to a few clock ticks
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    used = after["cpu_s"] - before["cpu_s"]
    assert abs(used - (clock_after - clock_before)) <= 4 * tick, (used, clock_after - clock_before)
    assert used >= 0.3 - 4 * tick


def _until_the_task_is_gone(thread: threading.Thread) -> None:
    """``join`` returns before the kernel has reaped the thread's task; while its entry is still listed,
    a reading counts its switches, and the next one, taken once it is gone, would not."""
    task = Path(f"/proc/self/task/{thread.native_id}")
    deadline = time.monotonic() + 10.0
    while task.exists():
        assert time.monotonic() < deadline, f"{task} still listed 10 s after the thread was joined"
        time.sleep(0.001)


def test_each_sleep_of_the_main_thread_is_a_wakeup_of_the_main_thread_and_of_the_process() -> None:
    # Given the main thread sleeps 30 times, and another thread 30 times
    before = process_cpu()
    sleeper = threading.Thread(target=lambda: [time.sleep(0.001) for _ in range(30)])
    sleeper.start()
    sleeper.join()
    joined = process_cpu()
    _until_the_task_is_gone(sleeper)  # its polls sleep too: the main thread's check below ends at the join
    middle = process_cpu()
    for _ in range(30):
        time.sleep(0.001)
    after = process_cpu()
    # Then the main thread's switches grew by its own sleeps only (the other thread's are not its own),
    # while the process's switches counted both (the other thread's task is gone by then: its switches
    # are in neither reading's sum, so only the main thread's are compared across the second interval)
    assert after["main_switches"] - middle["main_switches"] >= 30
    assert after["switches"] - middle["switches"] >= 30
    assert joined["main_switches"] - before["main_switches"] < 30  # it only waited for the join


def test_rates_are_per_second_and_cpu_is_a_percentage_of_one_core() -> None:
    before = {"cpu_s": 10.0, "switches": 1_000, "main_switches": 400}
    after = {"cpu_s": 10.3, "switches": 4_000, "main_switches": 3_400}
    assert cpu_rates(before, after, 30.0) == {
        "cpu_pct": 1.0,
        "switches_per_s": 100.0,
        "main_switches_per_s": 100.0,
    }


def test_the_summary_pools_every_process_of_every_window_and_spreads_the_window_medians() -> None:
    def rates(cpu: float) -> dict[str, float]:
        return {"cpu_pct": cpu, "switches_per_s": 10 * cpu, "main_switches_per_s": cpu}

    windows = [
        {
            "trajectory": [rates(1.0), rates(3.0)],
            "bare": [rates(1.0)],
            "relay": [rates(2.0)],
            "machine_busy_share": 0.1,
            "seconds": 30.0,
        },
        {
            "trajectory": [rates(5.0), rates(7.0)],
            "bare": [rates(2.0)],
            "relay": [rates(2.0)],
            "machine_busy_share": None,
            "seconds": 30.0,
        },
    ]
    out = summarise_idle({"windows": windows, "trajectories": 2, "still_waiting_tool": 2})
    cpu = out["trajectory"]["cpu_pct"]
    assert cpu["per_process"] == {"min": 1.0, "median": 4.0, "max": 7.0, "runs": 4}
    assert cpu["window_medians"] == {"min": 2.0, "median": 4.0, "max": 6.0, "runs": 2}
    assert out["bare"]["switches_per_s"]["per_process"]["median"] == 15.0
    # a window whose machine reading failed is left out, not counted as 0
    assert out["machine_busy_share"] == {"min": 0.1, "median": 0.1, "max": 0.1, "runs": 1}
