"""What intent-before-effect costs: log append latency with ``appendfsync always`` vs ``everysec``.

Two private ``redis-server`` instances (same binary, same disk, AOF on) differ only in their fsync policy.
Appends go through ``RedisLogStore.append`` (the path every intent takes), with the same payload sizes
for both. Rounds interleave the two servers in a shuffled order so drift in machine load (other jobs on
this 2-core box) hits both equally. Result: ``benchmarks/results/log_append.json`` + ``.png``.

Repeated ``--runs`` times (each run: fresh appends on the same servers); p50/p99 per run as
min/median/max, and the pooled distribution.

    .venv/bin/python -m benchmarks.log_append [--n 3000] [--warmup 200] [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks._common import (
    MIN_RUNS,
    calibration,
    filesystem_of,
    percentile,
    provenance,
    result_path,
    spread,
    summarize_ms,
    write_json,
    write_plot,
)
from cluster.log_store import RedisLogStore
from cluster.redis_server import RedisServer

NAME = "log_append"
MODES = ("always", "everysec")
PAYLOAD_SIZES = (256, 1024, 4096)  # a small event, a typical tool intent, a large observation


async def measure(urls: dict[str, str], n: int, warmup: int, seed: int) -> dict[str, list[float]]:
    """Append latencies in seconds per mode, ``n`` each, interleaved in shuffled order per round."""
    rng = random.Random(seed)
    payloads = [os.urandom(size) for size in PAYLOAD_SIZES]
    stores = {mode: RedisLogStore.from_url(url) for mode, url in urls.items()}
    samples: dict[str, list[float]] = {mode: [] for mode in urls}
    try:
        for i in range(warmup + n):
            payload = payloads[i % len(payloads)]
            order = list(urls)
            rng.shuffle(order)
            for mode in order:
                started = time.perf_counter()
                await stores[mode].append("bench", payload)
                elapsed = time.perf_counter() - started
                if i >= warmup:
                    samples[mode].append(elapsed)
    finally:
        for store in stores.values():
            await store.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=3000, help="measured appends per fsync mode")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured appends per mode first")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--runs", type=int, default=MIN_RUNS, help=f"repetitions (at least {MIN_RUNS})")
    parser.add_argument("--quick", action="store_true", help="300 appends per mode and run")
    args = parser.parse_args()
    if args.quick:
        args.n, args.warmup = 300, 50
    args.runs = max(MIN_RUNS, args.runs)
    before = calibration()

    per_run: list[dict[str, list[float]]] = []
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        servers = {mode: RedisServer(data_dir=Path(tmp) / mode, appendfsync=mode) for mode in MODES}
        try:
            urls = {mode: server.start().url for mode, server in servers.items()}
            for run in range(args.runs):
                per_run.append(asyncio.run(measure(urls, args.n, args.warmup, args.seed + run)))
        finally:
            for server in servers.values():
                server.stop()
    samples = {mode: [x for r in per_run for x in r[mode]] for mode in MODES}

    result: dict[str, object] = {mode: summarize_ms(samples[mode]) for mode in MODES}
    result["runs"] = {
        mode: {
            "p50_ms": spread([percentile(r[mode], 50) * 1000 for r in per_run], 3),
            "p99_ms": spread([percentile(r[mode], 99) * 1000 for r in per_run], 3),
        }
        for mode in MODES
    }
    always, everysec = summarize_ms(samples["always"]), summarize_ms(samples["everysec"])
    result["ratio_always_over_everysec"] = {
        "p50": round(always["p50_ms"] / everysec["p50_ms"], 2),
        "p99": round(always["p99_ms"] / everysec["p99_ms"], 2),
    }
    result["n"] = args.n
    result["warmup"] = args.warmup
    result["payload_bytes"] = list(PAYLOAD_SIZES)
    result["path"] = "RedisLogStore.append (redis.asyncio XADD) to a loopback redis-server, AOF on"
    result["data_dir_filesystem"] = filesystem_of(Path(tempfile.gettempdir()))
    result.update(
        provenance({"n": args.n, "warmup": args.warmup, "runs": args.runs, "seed": args.seed}, before)
    )
    out = result_path(NAME, args.quick)
    json_path = write_json(out.stem, result, out.parent)
    png_path = write_plot(
        out.stem,
        {f"appendfsync {mode}": [s * 1000 for s in samples[mode]] for mode in MODES},
        title=f"Log append latency, {args.n} appends/mode, payloads {'/'.join(map(str, PAYLOAD_SIZES))} B",
    )
    print(f"always:   p50 {always['p50_ms']:.3f} ms  p99 {always['p99_ms']:.3f} ms")
    print(f"everysec: p50 {everysec['p50_ms']:.3f} ms  p99 {everysec['p99_ms']:.3f} ms")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
