"""Is the guard actor a bottleneck? Calls/s through one guard vs a bare Ray actor round trip.

One local Ray (2 CPUs, no dashboard). The baseline is an async actor whose method does nothing; the guard
is the real ``GuardActor`` for one scope, reached through ``GuardHandle`` exactly as a trajectory reaches it.
Caps are set high so nothing queues and the breaker never trips: this measures the bookkeeping cost, not
the policy. Two shapes, each measured for both sides in alternating rounds so machine drift hits both:

- latency: one caller, sequential round trips (bare ``ping``; guard ``admit``; a full guarded call as the
  interpreter makes it = ``admit`` + ``settle``, two round trips; and, beside it, the same call as it was
  made before ``settle`` existed = ``admit`` + ``record`` + ``release``, three round trips);
- throughput: ``--concurrency`` callers in the driver issuing back-to-back calls for ``--seconds``.

The driver shares the 2 cores with the actors, so absolute numbers are this box's; the ratios are the point.
Result: ``benchmarks/results/guard_throughput.json`` + ``.png``.

    .venv/bin/python -m benchmarks.guard_throughput [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import ray

from benchmarks._common import (
    MIN_RUNS,
    calibration,
    provenance,
    result_path,
    spread,
    summarize_ms,
    write_json,
    write_plot,
)
from breakers import BreakerPolicy, BulkheadPolicy, GuardPolicy
from breakers.guard import GuardHandle
from runtime.ports import OutcomeClass

NAME = "guard_throughput"
SCOPE = "bench-service"
POLICY = GuardPolicy(
    breaker=BreakerPolicy(window_size=100, min_samples=100, trip_threshold=1.0),
    bulkhead=BulkheadPolicy(max_concurrent=100_000, max_queued=0, lease_s=600.0),
)


@ray.remote(num_cpus=0)
class BareActor:
    """The baseline: an async actor round trip that does nothing."""

    async def ping(self) -> None:
        return None


async def _latencies(bare: Any, guard: GuardHandle, n: int, rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {
        "bare_ping": [],
        "guard_admit": [],
        "guarded_call": [],
        "guarded_call_separate": [],
    }
    per_round = max(1, n // rounds)
    for r in range(rounds):
        for i in range(per_round):
            t0 = time.perf_counter()
            await bare.ping.remote()
            samples["bare_ping"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            permit = await guard.admit(SCOPE, f"lat-{r}-{i}", time.time() + 600)
            samples["guard_admit"].append(time.perf_counter() - t0)
            await guard.settle(permit, OutcomeClass.SUCCESS)

            t0 = time.perf_counter()
            permit = await guard.admit(SCOPE, f"call-{r}-{i}", time.time() + 600)
            await guard.settle(permit, OutcomeClass.SUCCESS)
            samples["guarded_call"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            permit = await guard.admit(SCOPE, f"sep-{r}-{i}", time.time() + 600)
            await guard.record(permit, OutcomeClass.SUCCESS)
            await guard.release(permit)
            samples["guarded_call_separate"].append(time.perf_counter() - t0)
    return samples


async def _throughput(shape: str, bare: Any, guard: GuardHandle, concurrency: int, seconds: float) -> float:
    """Completed operations per second with ``concurrency`` callers for ``seconds``."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop_at:
            if shape == "bare_ping":
                await bare.ping.remote()
            else:
                permit = await guard.admit(SCOPE, f"tp-{k}-{i}", time.time() + 600)
                if shape == "guarded_call":
                    await guard.settle(permit, OutcomeClass.SUCCESS)
                elif shape == "guarded_call_separate":
                    await guard.record(permit, OutcomeClass.SUCCESS)
                    await guard.release(permit)
                else:
                    await guard.release(permit)
            done += 1
            i += 1

    started = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    return done / (time.perf_counter() - started)


async def measure(n: int, rounds: int, concurrency: int, seconds: float) -> dict[str, Any]:
    bare = BareActor.remote()  # type: ignore[attr-defined]
    guard = GuardHandle(POLICY, holder="benchmark")
    await bare.ping.remote()
    await guard.snapshot(SCOPE)  # create the actor before timing
    await _latencies(bare, guard, max(50, n // 10), 1)  # warm-up
    latencies = await _latencies(bare, guard, n, rounds)

    shapes = ("bare_ping", "guard_admit_release", "guarded_call", "guarded_call_separate")
    rates: dict[str, list[float]] = {s: [] for s in shapes}
    for r in range(rounds):  # alternate the order each round
        for shape in shapes if r % 2 == 0 else tuple(reversed(shapes)):
            rates[shape].append(await _throughput(shape, bare, guard, concurrency, seconds / rounds))
    mean_rate = {s: sum(v) / len(v) for s, v in rates.items()}
    lat = {k: summarize_ms(v) for k, v in latencies.items()}
    snap = await guard.snapshot(SCOPE)
    return {
        "latency": lat,
        "throughput_per_s": {s: round(v, 1) for s, v in mean_rate.items()},
        "throughput_rounds_per_s": {s: [round(x, 1) for x in v] for s, v in rates.items()},
        "throughput_spread_per_s": {s: spread(v, 1) for s, v in rates.items()},
        "ratios": {
            # round trips/s through the guard relative to a bare actor round trip
            "guard_rtt_vs_bare": round(mean_rate["guard_admit_release"] * 2 / mean_rate["bare_ping"], 3),
            "guarded_calls_vs_bare_pings": round(mean_rate["guarded_call"] / mean_rate["bare_ping"], 3),
            "guarded_calls_settle_vs_separate": round(
                mean_rate["guarded_call"] / mean_rate["guarded_call_separate"], 3
            ),
            "admit_p50_vs_bare_p50": round(lat["guard_admit"]["p50_ms"] / lat["bare_ping"]["p50_ms"], 3),
        },
        "guard_end_state": {"in_flight": snap.in_flight, "queued": snap.queued, "state": snap.state.value},
        "_samples": latencies,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run (seconds, not minutes)")
    parser.add_argument("--n", type=int, default=3000, help="sequential latency samples per shape")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent callers for throughput")
    parser.add_argument("--seconds", type=float, default=24.0, help="throughput time per shape, all rounds")
    parser.add_argument("--rounds", type=int, default=4, help=f"throughput repetitions (at least {MIN_RUNS})")
    parser.add_argument(
        "--out", type=Path, help="result path (default: results/guard_throughput[.quick].json)"
    )
    args = parser.parse_args()
    if args.quick:
        args.n, args.seconds, args.rounds = 400, 6.0, MIN_RUNS
    args.rounds = max(MIN_RUNS, args.rounds)
    before = calibration()

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(
        _node_ip_address="127.0.0.1",  # loopback only
        num_cpus=2,
        include_dashboard=False,
        namespace="tether",
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        result = asyncio.run(measure(args.n, args.rounds, args.concurrency, args.seconds))
    finally:
        ray.shutdown()

    samples = result.pop("_samples")
    out: Path = args.out or result_path(NAME, args.quick)
    data = {
        **result,
        "params": {
            "n": args.n,
            "concurrency": args.concurrency,
            "seconds_per_shape": args.seconds,
            "rounds": args.rounds,
            "quick": args.quick,
        },
        "what": {
            "bare_ping": "one round trip to an async actor method that does nothing",
            "guard_admit": "GuardHandle.admit: one round trip into GuardActor (breaker + bulkhead)",
            "guard_admit_release": "admit + release: two guard round trips (throughput counts pairs)",
            "guarded_call": "admit + settle: the two guard round trips one tool call makes",
            "guarded_call_separate": (
                "admit + record + release: the same call as three round trips (how it was made before settle)"
            ),
        },
        **provenance(
            {"n": args.n, "concurrency": args.concurrency, "seconds": args.seconds, "rounds": args.rounds},
            before,
        ),
    }
    json_path = write_json(out.stem, data, out.parent)
    png_path = write_plot(
        out.stem,
        samples,
        title=f"guard actor vs bare actor round trip (n={args.n} each)",
        results_dir=out.parent,
    )
    print(f"wrote {json_path} and {png_path}")
    print(f"throughput/s: {data['throughput_per_s']}  ratios: {data['ratios']}")


if __name__ == "__main__":
    main()
