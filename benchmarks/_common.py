"""Small helpers shared by the benchmarks: percentiles, timing, and writing results as JSON + PNG.

Benchmarks measure against a baseline in the same run and write ``benchmarks/results/<name>.json`` plus a
PNG next to it. Nothing here asserts on speed; it only records.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_DIR",
    "Stopwatch",
    "environment",
    "percentile",
    "summarize_ms",
    "write_json",
    "write_plot",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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
    }


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
