"""How many live trajectories one node serves on time: part 7 of ``node_capacity`` (``--only on_time``).

The max_live probe (part 6) finds how many trajectory actors a node *holds*; on 2 cores most of them then
stop turning. This sweep asks the question a user has: up to how many live trajectories does each one still
take its next turn when it should? Trajectories are started ``PROBE_BATCH`` at a time up to each step of
``steps``; each turn is one model call and then the ``sleep`` tool for ``sleep_s``, so a trajectory served
on time starts a turn every ``sleep_s`` plus its model call. At each step, after one settling period, a
window of ``window_periods`` periods is observed:

- **lateness**: for every two consecutive turns of a trajectory that both started inside the window, the
  time between them minus ``sleep_s``, read afterwards from the trajectory's own log (the Redis stream id
  of each ``turn_started`` entry is the server's clock at the append, in ms); no poll of any trajectory runs
  during the window;
- **silent**: live trajectories that started no turn in the whole window;
- **parts**: where the turns' time went, from the same logs (``turn_parts_s``);
- **floor**: one bare async Ray actor in the same window sleeping ``TICK_S`` in a loop, and how late each
  wake-up was: what any process on the node waits for a CPU at that count, with no work of Tether's;
- the machine's CPU busy share and load over the window.

A step is *on time* when the p99 lateness is at most ``ON_TIME_S`` and no trajectory was silent. The sweep
stops early when a batch does not start within ``PROBE_BATCH_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from benchmarks._common import busy_times, mem_available_mb, percentile, tick_share

ON_TIME_S = 1.0  # a turn later than this (beyond its sleep) is late
STEPS = (32, 64, 96, 128, 160, 192, 224, 256)
SLEEP_S = 20.0
WINDOW_PERIODS = 5  # window = this many sleeps; about 4 turn periods per trajectory inside it
SCRIPT_TURNS = 200  # the scenario's length (it travels in a request header, so it cannot grow much)
TICK_S = 0.5
PARTS = ("sleep_overrun", "next_turn", "model")


def sweep_scenario(sleep_s: float) -> str:
    """Every turn calls ``sleep`` for ``sleep_s``; ``SCRIPT_TURNS`` turns outlast any sweep."""
    return "script:" + json.dumps([["sleep", {"seconds": sleep_s}]] * SCRIPT_TURNS, separators=(",", ":"))


def tolerant_supervision() -> Any:
    """Supervision whose watchdogs let the sweep's deliberate loop run: the same ``sleep`` call every turn
    is exactly what the exact-repeat watchdog stops at its third call by default (the benchmark measures
    turns, not loop detection)."""
    from actors.supervision_config import SupervisionSpec

    n = SCRIPT_TURNS
    return SupervisionSpec.model_validate(
        {
            "watchdog": {
                "exact_window": n,
                "exact_limit": n,
                "coarse_window": n,
                "coarse_limit": n,
                "stagnation_turns": n,
            }
        }
    )


def entry_ms(entry_id: bytes | str) -> int:
    """The server time (ms) in a Redis stream id ``<ms>-<seq>``."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def turn_periods_s(turn_starts_ms: Sequence[int], start_ms: int, end_ms: int) -> list[float]:
    """Seconds between consecutive turn starts that both fall inside ``[start_ms, end_ms]``."""
    inside = sorted(t for t in turn_starts_ms if start_ms <= t <= end_ms)
    return [(b - a) / 1000.0 for a, b in itertools.pairwise(inside)]


def turn_parts_s(
    log: Sequence[tuple[str, int]], start_ms: int, end_ms: int, sleep_s: float
) -> dict[str, list[float]]:
    """Where the turns' time went, from one trajectory's log as ``(event kind, server ms)`` in order, for the
    steps that ended inside the window:

    - ``sleep_overrun``: tool result accepted minus its dispatch intent minus ``sleep_s`` (the actor's
      event loop woke late from the sleep, or the result's append waited);
    - ``next_turn``: turn started minus the tool result before it (deciding and admitting the next turn);
    - ``model``: model call settled minus its intent (the call through the node's model client actor and the
      provider, and the settlement's append).
    """
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    last: dict[str, int] = {}
    for kind, ms in log:
        inside = start_ms <= ms <= end_ms
        if kind == "tool_result_accepted" and "tool_dispatch_intent" in last and inside:
            parts["sleep_overrun"].append((ms - last["tool_dispatch_intent"]) / 1000.0 - sleep_s)
        elif kind == "turn_started" and "tool_result_accepted" in last and inside:
            parts["next_turn"].append((ms - last["tool_result_accepted"]) / 1000.0)
        elif kind == "model_call_settled" and "model_call_intent" in last and inside:
            parts["model"].append((ms - last["model_call_intent"]) / 1000.0)
        last[kind] = ms
    return parts


def summarise_step(
    live: int,
    logs: Mapping[str, Sequence[tuple[str, int]]],
    window_ms: tuple[int, int],
    sleep_s: float,
    ticks_late_s: Sequence[float],
) -> dict[str, Any]:
    """One step's row: the lateness of every observed turn period, the silent trajectories, where the turns'
    time went, and the floor."""
    lateness: list[float] = []
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    silent = 0
    for log in logs.values():
        starts = [ms for kind, ms in log if kind == "turn_started"]
        if not any(window_ms[0] <= t <= window_ms[1] for t in starts):
            silent += 1
        lateness += [period - sleep_s for period in turn_periods_s(starts, *window_ms)]
        for name, values in turn_parts_s(log, *window_ms, sleep_s).items():
            parts[name] += values
    row: dict[str, Any] = {
        "live": live,
        "periods": len(lateness),
        "silent": silent,
        "lateness_s": _quantiles(lateness),
        "parts_s": {name: _quantiles(values) for name, values in parts.items()},
        "floor_late_s": _quantiles(ticks_late_s),
    }
    p99 = row["lateness_s"]["p99"] if lateness else None
    row["on_time"] = p99 is not None and p99 <= ON_TIME_S and silent == 0
    return row


def _quantiles(samples: Sequence[float]) -> dict[str, float | None]:
    if not samples:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    return {
        "p50": round(percentile(samples, 50), 3),
        "p90": round(percentile(samples, 90), 3),
        "p99": round(percentile(samples, 99), 3),
        "max": round(max(samples), 3),
    }


def largest_on_time(rows: Sequence[Mapping[str, Any]]) -> int:
    """The largest live count of an on-time step below which every step was on time too (0: none)."""
    best = 0
    for row in sorted(rows, key=lambda r: int(r["live"])):
        if not row["on_time"]:
            break
        best = int(row["live"])
    return best


@ray.remote(num_cpus=0)
class Ticker:
    """The floor: an async actor that sleeps ``tick_s`` in a loop and records how late each wake-up was."""

    async def ping(self) -> int:
        return 1

    async def late_s(self, window_s: float, tick_s: float) -> list[float]:
        late: list[float] = []
        end = time.monotonic() + window_s
        while time.monotonic() < end:
            due = time.monotonic() + tick_s
            await asyncio.sleep(tick_s)
            late.append(time.monotonic() - due)
        return late


async def read_logs(redis: Any, tids: Sequence[str]) -> dict[str, list[tuple[str, int]]]:
    """Each trajectory's log as ``(event kind, server time of its append in ms)``, in order."""
    from cluster.log_store import FIELD, log_key
    from runtime.codec import decode

    out: dict[str, list[tuple[str, int]]] = {}
    for tid in tids:
        entries = await redis.xrange(log_key(tid))
        out[tid] = [(decode(fields[FIELD]).kind, entry_ms(eid)) for eid, fields in entries]
    return out


async def sweep(
    fleet: Any, steps: Sequence[int], sleep_s: float, batch: int, batch_timeout_s: float, progress: Any
) -> dict[str, Any]:
    """Ramp through ``steps`` with one fleet, observing a window at each; the rows and why it ended."""
    import redis.asyncio as aioredis

    scenario = sweep_scenario(sleep_s)
    supervision = tolerant_supervision()
    window_s = sleep_s * WINDOW_PERIODS
    ticker = Ticker.remote()  # type: ignore[attr-defined]
    ray.get(ticker.ping.remote())
    redis = aioredis.Redis.from_url(fleet.redis_url, socket_timeout=120.0)
    tids: list[str] = []
    rows: list[dict[str, Any]] = []
    failed: str | None = None  # why a batch did not start
    started = time.monotonic()
    try:
        for step in steps:
            while len(tids) < step and failed is None:
                n = min(batch, step - len(tids))
                new, failed = await fleet.start_working("ontime", n, scenario, batch_timeout_s, supervision)
                tids += new
            if failed is not None:
                break
            await asyncio.sleep(sleep_s)  # the last batch's first sleep ends inside the settling period
            busy_before = busy_times()
            window = (int(time.time() * 1000), 0)
            ticks = ticker.late_s.remote(window_s, TICK_S)
            await asyncio.sleep(window_s)
            window = (window[0], int(time.time() * 1000))
            ticks_late: list[float] = await asyncio.wrap_future(ticks.future())
            row = summarise_step(len(tids), await read_logs(redis, tids), window, sleep_s, ticks_late)
            row.update(
                cpu_busy=tick_share(busy_before, busy_times()),
                load1=round(os.getloadavg()[0], 2),
                available_mb=mem_available_mb(),
                elapsed_s=round(time.monotonic() - started, 1),
            )
            rows.append(row)
            late, floor = row["lateness_s"], row["floor_late_s"]
            progress(
                f"{row['live']} live: lateness p50 {late['p50']} s, p99 {late['p99']} s over "
                f"{row['periods']} turns, {row['silent']} silent; p99 of its parts "
                + ", ".join(f"{name} {v['p99']} s" for name, v in row["parts_s"].items())
                + f"; floor p99 {floor['p99']} s, CPU busy {row['cpu_busy']}"
            )
    finally:
        await redis.aclose()
        ray.kill(ticker)
    return {"rows": rows, "ended": failed or "last step", "tids": tids}
