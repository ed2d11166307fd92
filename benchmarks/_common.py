"""Small helpers shared by the benchmarks: percentiles, timing, provenance, and writing results.

Benchmarks measure against a baseline in the same run and write ``benchmarks/results/<name>.json`` plus a
PNG next to it. Nothing here asserts on speed; it only records.

Every result carries its provenance (:func:`provenance`): the commit it measured (and whether the tree
had uncommitted changes), the machine calibration taken before and after the run (a fixed CPU loop,
process spawn, fsync, load average, free memory: numbers from a busy machine say so), and the settings.
Headline numbers are repeated (``--runs``, at least 3) and reported as ``{min, median, max}``
(:func:`spread`). A ``--quick`` run writes ``<name>.quick.json`` next to the headline file, never over it
(:func:`result_path`).

On a virtual machine two things outside the benchmark move its numbers and are recorded with them: the share
of CPU time the hypervisor gave to other guests while the calibration ran (``cpu_steal``: 20-30 % was seen
here on an afternoon whose load average was below 2, and a Ray round trip then took twice as long), and the
kernel's DAMON monitors (``environment()["damon"]``: the platform runs a ``kdamond`` with a ``pageout``
scheme, and with it on the kill p99 at 100 live trajectories was three times what it was with it off,
``docs/perf/capacity.md``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DAMON_ADMIN",
    "MIN_RUNS",
    "RESULTS_DIR",
    "Stopwatch",
    "busy_times",
    "bytecode_cached",
    "calibration",
    "cpu_times",
    "damon_state",
    "environment",
    "git_commit",
    "mem_available_mb",
    "percentile",
    "provenance",
    "result_path",
    "spread",
    "summarize_ms",
    "tick_share",
    "write_json",
    "write_plot",
]

MIN_RUNS = 3

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PRODUCT_PACKAGES = ("runtime", "scheduler", "breakers", "actors", "cluster")


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks.

    Raises ``ValueError`` on an empty sample or a ``q`` outside [0, 100].
    """
    if not samples:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], not {q}")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    if low == high:
        return float(ordered[low])
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def summarize_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/max/mean of samples given in seconds, reported in milliseconds (3 decimals)."""
    ms = [s * 1000.0 for s in samples_s]
    return {
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(sum(ms) / len(ms), 3),
    }


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.elapsed`` in seconds (``perf_counter``)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.elapsed = 0.0

    def __enter__(self) -> Stopwatch:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.started


def environment() -> dict[str, Any]:
    """What the numbers were measured on, recorded next to them."""
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "system": platform.system(),
        "cpus": os.cpu_count(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "bytecode_cached": bytecode_cached(),
        "dont_write_bytecode": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
        "damon": damon_state(),
    }


DAMON_ADMIN = Path("/sys/kernel/mm/damon/admin/kdamonds")


def damon_state(admin: Path = DAMON_ADMIN) -> list[dict[str, Any]] | None:
    """The kernel's DAMON monitors (``kdamond``), as the sysfs admin interface shows them: per monitor its
    state (``on``/``off``), the address space it watches (``paddr``: all physical memory) and the actions
    of its schemes (``pageout``: proactive reclaim). None where the kernel has no DAMON sysfs."""
    if not admin.is_dir():
        return None
    monitors = []
    for kdamond in sorted(p for p in admin.iterdir() if p.name.isdigit()):
        contexts = sorted(p for p in (kdamond / "contexts").glob("[0-9]*"))
        monitors.append(
            {
                "state": _read(kdamond / "state"),
                "operations": [_read(c / "operations") for c in contexts],
                "actions": [_read(a) for c in contexts for a in sorted(c.glob("schemes/[0-9]*/action"))],
            }
        )
    return monitors


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def bytecode_cached(root: Path = RESULTS_DIR.parent.parent) -> float:
    """The share of the product's modules whose compiled bytecode is on disk and current.

    Below 1.0, every Ray worker that imports them compiles them again from source (with
    ``PYTHONDONTWRITEBYTECODE`` set nothing is written back): about 0.2 s of CPU and 1.7 MB of private memory
    per trajectory process on this machine. ``make setup`` compiles them (``make bytecode``)."""
    sources = [p for pkg in PRODUCT_PACKAGES for p in (root / pkg).rglob("*.py")]
    if not sources:
        return 0.0
    current = 0
    for source in sources:
        cached = Path(importlib.util.cache_from_source(str(source)))
        if cached.exists():
            current += cached.stat().st_mtime >= source.stat().st_mtime
    return round(current / len(sources), 3)


def spread(values: Sequence[float], digits: int = 4) -> dict[str, float | int]:
    """``{min, median, max, runs}`` of one headline quantity over repeated runs."""
    if not values:
        raise ValueError("spread of no runs")
    return {
        "min": round(min(values), digits),
        "median": round(statistics.median(values), digits),
        "max": round(max(values), digits),
        "runs": len(values),
    }


def git_commit() -> dict[str, Any]:
    """The commit measured, and whether the working tree differed from it (``dirty``)."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"sha": None, "dirty": None}
    # results files are rewritten by the run itself: they do not make the measured code dirty
    changed = [line for line in status.splitlines() if "benchmarks/results/" not in line]
    return {"sha": sha, "dirty": bool(changed)}


def _meminfo_mb(field: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return -1


def mem_available_mb() -> int:
    """The kernel's ``MemAvailable`` in MB (-1 where it cannot be read)."""
    return _meminfo_mb("MemAvailable")


def _cpu_ticks(stat: Path) -> list[int] | None:
    """``/proc/stat``'s ``cpu`` line: user nice system idle iowait irq softirq steal, in clock ticks since
    boot (guest time is in user); None where it cannot be read."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    return [int(x) for x in fields[1:9]]


def cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(steal, total) CPU time of the whole machine since boot, in clock ticks; None where it cannot be
    read. Steal is time the hypervisor ran another guest while this one had work: on a shared host it is
    where a quiet-looking machine's lost speed goes."""
    ticks = _cpu_ticks(stat)
    return None if ticks is None else (ticks[7], sum(ticks))


def busy_times(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine since boot, in clock ticks (busy: all but idle and
    iowait); None where it cannot be read."""
    ticks = _cpu_ticks(stat)
    return None if ticks is None else (sum(ticks) - ticks[3] - ticks[4], sum(ticks))


def tick_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time between two ``(part, total)`` readings that went to the part:
    stolen for ``cpu_times``, busy for ``busy_times``; None if unknown."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)


def calibration() -> dict[str, Any]:
    """A few fixed operations timed now, to compare machines and to tell a busy machine from a quiet one.

    The same operations as the test suite's summary line (``tests/conftest.py``); where the suite was
    written a quiet run gave cpu loop 0.07-0.15 s, process spawn ~1 ms, fsync ~0.2 ms. ``cpu_steal``: the
    share of CPU time the hypervisor took while these ran and for half a second after (a busy host).
    """
    ticks = cpu_times()
    started = time.perf_counter()
    total = 0
    for i in range(2_000_000):
        total += i
    cpu = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(10):
        subprocess.run(["true"], check=False)
    spawn = (time.perf_counter() - started) / 10
    with tempfile.NamedTemporaryFile() as f:
        started = time.perf_counter()
        for _ in range(20):
            f.write(b"x" * 64)
            f.flush()
            os.fsync(f.fileno())
        fsync = (time.perf_counter() - started) / 20
    time.sleep(0.5)  # the loops above take ~0.2 s: too few clock ticks to tell a steal share from noise
    steal = tick_share(ticks, cpu_times())
    load = os.getloadavg()
    return {
        "cpu_loop_s": round(cpu, 3),
        "process_spawn_ms": round(spawn * 1000, 2),
        "fsync_ms": round(fsync * 1000, 2),
        "load_avg": [round(x, 2) for x in load],
        "cpus": os.cpu_count(),
        "mem_available_mb": _meminfo_mb("MemAvailable"),
        "mem_total_mb": _meminfo_mb("MemTotal"),
        "cpu_steal": steal,
        "busy": load[0] > 0.75 * (os.cpu_count() or 1) or (steal or 0.0) >= _BUSY_STEAL,
    }


_BUSY_STEAL = 0.1  # a tenth of the CPU going to other guests: the machine is busy whatever its load says


def provenance(settings: Mapping[str, Any], before: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a result was measured on: commit, environment, calibration before (``before``, taken when the
    run started) and now, and the run's settings."""
    return {
        "commit": git_commit(),
        "environment": environment(),
        "calibration": {"before": dict(before) if before else None, "after": calibration()},
        "settings": dict(settings),
    }


def result_path(name: str, quick: bool = False, results_dir: Path = RESULTS_DIR) -> Path:
    """``<name>.json`` for a headline run, ``<name>.quick.json`` for a quick one (never the headline)."""
    return results_dir / (f"{name}.quick.json" if quick else f"{name}.json")


def write_json(name: str, data: Mapping[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``results_dir/<name>.json`` (pretty, sorted keys) atomically and return its path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def write_plot(
    name: str,
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str = "latency (ms)",
    results_dir: Path = RESULTS_DIR,
) -> Path:
    """Plot each series' empirical CDF (values in ms) to ``results_dir/<name>.png`` and return its path.

    A CDF shows the median and the tail in one picture, which is what p50/p99 summarise.
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: benchmarks run on servers without a display
    import matplotlib.pyplot as plt

    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.png"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, values in series.items():
        ordered = sorted(values)
        if not ordered:
            continue
        ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
        p50, p99 = percentile(ordered, 50), percentile(ordered, 99)
        ax.plot(ordered, ys, label=f"{label} (p50 {p50:.2f}, p99 {p99:.2f})")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples ≤ x")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def filesystem_of(path: Path) -> str:
    """The filesystem holding ``path``, as ``"<type> (<device> on <mount point>)"`` from ``/proc/mounts``
    (the longest mount point above it); ``"unknown"`` when that cannot be read. An fsync on tmpfs is free,
    so an fsync-bound number measured there means nothing about a disk."""
    best, found = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return found
    resolved = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1]
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, found = point, f"{parts[2]} ({parts[0]} on {point})"
    return found


def durable_filesystem(described: str) -> bool:
    """False for a memory-backed filesystem as ``filesystem_of`` names it (tmpfs, ramfs): fsync is free."""
    return described.split(" ", 1)[0] not in ("tmpfs", "ramfs")
