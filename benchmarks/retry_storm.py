"""Retry storm: a shared dependency degrades under N trajectories; Tether's single retry owner + breaker +
bulkhead against a single jittered retry layer and against naive layered retries (3 x 3 x 3).

The dependency is the real testbed gRPC service ``package-search`` (``testbed/tools``), with a load-dependent
service time (``FaultMode.CONTENDED``: a base time plus a little per call already in service, and work whose
caller gave up keeps running and keeps its place). Healthy, it answers in tens of milliseconds. During the
outage its base time jumps above the callers' timeout, so every attempt times out and every retry adds load
that makes the next attempt slower; after the heal, whatever the retries piled up must drain first.
The model is the testbed provider (no limits), and the testbed tool services run in a process of their own
(``TestbedProcess``): on a thread of this process the dependency shared the GIL with the callers, so the
policy spending the most CPU per call (Tether: 100 trajectories through the decider in one process) saw the
slowest dependency, and its breaker probes timed out on that after the heal. Each policy run is a fresh
process of its own too, so no policy inherits another's leftovers. Policies and trajectory code are in
:mod:`benchmarks._storm_policies`.

Judged at the dependency by the testbed's own counters (its door: every attempt that reached it, how many
were in service at once) and, on the callers' side, by operations: one per tool call the model made.
Operations the breaker or bulkhead refused sent nothing and are counted as refused, separately, never as
"0 attempts". Recovery: seconds after the heal until successful operations per second are back to 90 % of
the pre-outage rate for three consecutive seconds. Repeated ``--runs`` times (min/median/max).

    .venv/bin/python -m benchmarks.retry_storm [--quick] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import openai

from actors.tools_grpc import GrpcToolPort
from benchmarks._common import MIN_RUNS, calibration, provenance, result_path, spread, write_json
from benchmarks._storm_policies import TOOL, Counters, TestbedProcess, run_baseline, run_tether
from breakers import InProcessGuard
from runtime.clock import SystemClock
from testbed.provider import ProviderConfig, start_provider_subprocess
from testbed.tools.faults import FaultMode, FaultPlan

NAME = "retry_storm"
POLICIES = ("tether", "single_retry", "naive_layered")


@dataclass(frozen=True)
class Scenario:
    trajectories: int = 100
    duration_s: float = 120.0
    outage_start_s: float = 20.0
    outage_end_s: float = 50.0
    call_timeout_s: float = 1.0
    turns: int = 10  # tool calls per trajectory
    healthy_s: float = 0.05  # service time, healthy
    degraded_s: float = 2.0  # service time during the outage
    per_call_s: float = 0.004  # added per call already in service (healthy and degraded)
    model_ttft_ms: float = 100.0
    runs: int = 3
    seed: int = 11
    quick: bool = False

    def plan(self, degraded: bool) -> FaultPlan:
        base = self.degraded_s if degraded else self.healthy_s
        return FaultPlan(mode=FaultMode.CONTENDED, delay_s=base, per_call_s=self.per_call_s)


QUICK = Scenario(trajectories=30, duration_s=45.0, outage_start_s=10.0, outage_end_s=25.0, quick=True)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def run_policy(policy: str, s: Scenario, provider_url: str, run_no: int) -> dict[str, Any]:
    testbed = TestbedProcess(s.plan(degraded=False))
    counters = Counters(outage=(s.outage_start_s, s.outage_end_s))
    stop = asyncio.Event()
    client = openai.AsyncOpenAI(base_url=provider_url, api_key="unused", max_retries=0)
    tools = GrpcToolPort({TOOL: testbed.address})
    guard = InProcessGuard(SystemClock())  # GuardPolicy() defaults, shared by every trajectory
    from actors.contracts import testbed_contracts
    from runtime.tools import ToolRegistry

    spec = ToolRegistry([c for c in testbed_contracts() if c.name == TOOL]).openai_tool_specs([TOOL])[0]

    async def slot(index: int) -> None:
        rng = random.Random(s.seed * 7919 + run_no * 131 + index)
        await asyncio.sleep(rng.uniform(0.0, 1.0))  # desynchronised start
        for k in itertools.count():
            if stop.is_set():
                return
            tid = f"{policy}-{index}-{k}"
            try:
                if policy == "tether":
                    await run_tether(
                        tid,
                        provider_url=provider_url,
                        testbed_address=testbed.address,
                        guard=guard,
                        client=client,
                        tools=tools,
                        counters=counters,
                        turns=s.turns,
                        call_timeout_s=s.call_timeout_s,
                    )
                else:
                    await run_baseline(
                        tid,
                        policy=policy,
                        client=client,
                        tools=tools,
                        tool_spec=spec,
                        counters=counters,
                        turns=s.turns,
                        call_timeout_s=s.call_timeout_s,
                        rng=rng,
                    )
            except asyncio.CancelledError:
                raise
            except Exception as e:
                progress(f"{tid} raised {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)

    timeline: list[dict[str, Any]] = []
    searches_before = testbed.searches()
    tasks = [asyncio.create_task(slot(i)) for i in range(s.trajectories)]
    previous = testbed.door()
    degraded = False
    for second in range(int(s.duration_s)):
        target = counters.started_at + second + 1
        await asyncio.sleep(max(0.0, target - time.monotonic()))
        now = counters.now()
        if not degraded and s.outage_start_s <= now < s.outage_end_s:
            testbed.set_plan(s.plan(degraded=True))
            degraded = True
        elif degraded and now >= s.outage_end_s:
            testbed.set_plan(s.plan(degraded=False))
            degraded = False
        door = testbed.door()
        timeline.append(
            {
                "t": second,
                "arrivals": door.arrivals - previous.arrivals,
                "in_service": door.in_service,
                "ok_operations": counters.ok.get(second, 0),
            }
        )
        previous = door
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    counters.finish()
    final = testbed.door()
    applied = testbed.searches() - searches_before
    with contextlib.suppress(Exception):
        await tools.close()
    await client.close()
    testbed.stop()
    return summarize(s, counters, timeline, final.peak_in_service, final.arrivals, applied)


def run_policy_isolated(policy: str, s: Scenario, provider_url: str, run_no: int) -> dict[str, Any]:
    """``run_policy`` in a fresh process: nothing one policy leaves behind in a process (tasks, channels,
    connection pools) may slow the next one (a policy run after another once took 9 s to send its first
    call)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_policy_sync, policy, s, provider_url, run_no).result()


def _run_policy_sync(policy: str, s: Scenario, provider_url: str, run_no: int) -> dict[str, Any]:
    return asyncio.run(run_policy(policy, s, provider_url, run_no))


def recovery_s(s: Scenario, timeline: list[dict[str, Any]]) -> tuple[float | None, float]:
    """Seconds after the heal until ok operations/s are >= 90 % of the pre-outage rate for 3 s."""
    ok = [row["ok_operations"] for row in timeline]
    warm = range(3, int(s.outage_start_s))
    baseline = sum(ok[t] for t in warm) / max(1, len(warm))
    end = int(s.outage_end_s)
    for second in range(end, len(ok) - 2):
        if all(ok[second + k] >= 0.9 * baseline for k in range(3)):
            return float(second - end), baseline
    return None, baseline


def settled_ratio(s: Scenario, timeline: list[dict[str, Any]], baseline: float) -> float:
    """Mean ok operations/s from 20 s after the heal to the end, over the pre-outage rate: whether a policy
    is back to its own healthy throughput, where ``recovery_s``'s three consecutive seconds can be missed by a
    noisy series that has recovered (or met by a burst that has not)."""
    ok = [row["ok_operations"] for row in timeline if row["t"] >= s.outage_end_s + 20.0]
    return (sum(ok) / len(ok)) / baseline if ok and baseline > 0 else 0.0


def summarize(
    s: Scenario, c: Counters, timeline: list[dict[str, Any]], peak: int, arrivals: int, applied: int
) -> dict[str, Any]:
    recovered, baseline = recovery_s(s, timeline)
    outage = [row for row in timeline if s.outage_start_s <= row["t"] < s.outage_end_s]
    return {
        "attempts_at_dependency_outage": sum(row["arrivals"] for row in outage),
        "attempts_at_dependency_total": arrivals,
        "peak_in_service": peak,
        "peak_in_service_outage": max((row["in_service"] for row in outage), default=0),
        "applied_searches": applied,
        "operations": c.operations,
        "operations_ok": c.succeeded,
        "operations_refused": c.refused,
        "outage_operations": c.outage_operations,
        "outage_operations_dispatched": c.outage_dispatched,
        "attempts_per_dispatched_operation_outage": c.outage_attempts_of_ops / max(1, c.outage_dispatched),
        "attempts_per_dispatched_operation": c.attempts / max(1, c.dispatched_operations),
        "baseline_ok_operations_per_s": baseline,
        "recovery_s": recovered if recovered is not None else s.duration_s - s.outage_end_s,
        "recovered_within_run": recovered is not None,
        "settled_ratio_after_heal": settled_ratio(s, timeline, baseline),
        "timeline": timeline,
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "attempts_at_dependency_outage",
        "attempts_at_dependency_total",
        "peak_in_service",
        "peak_in_service_outage",
        "operations",
        "operations_ok",
        "operations_refused",
        "outage_operations",
        "outage_operations_dispatched",
        "attempts_per_dispatched_operation_outage",
        "attempts_per_dispatched_operation",
        "baseline_ok_operations_per_s",
        "recovery_s",
        "settled_ratio_after_heal",
        "applied_searches",
    )
    out: dict[str, Any] = {k: spread([float(r[k]) for r in runs], 3) for k in keys}
    out["recovered_within_run"] = [r["recovered_within_run"] for r in runs]
    return out


def plot(path: Path, s: Scenario, last: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    panels = [
        ("arrivals", "attempts arriving at the service / s"),
        ("in_service", "calls in service (incl. orphaned work)"),
        ("ok_operations", "successful operations / s"),
    ]
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, result in last.items():
            ax.plot(
                [row["t"] for row in result["timeline"]], [row[key] for row in result["timeline"]], label=name
            )
        ax.axvspan(s.outage_start_s, s.outage_end_s, color="red", alpha=0.1)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title(
        f"retry storm: {s.trajectories} trajectories, testbed gRPC service, outage shaded (last run)"
    )
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(s: Scenario, policies: tuple[str, ...]) -> dict[str, Any]:
    before = calibration()
    provider = start_provider_subprocess(
        ProviderConfig(ttft_ms=s.model_ttft_ms, tokens_per_s=2_000.0, models=("sim",))
    )
    per_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    try:
        for run_no in range(s.runs):
            for policy in policies:
                progress(f"run {run_no + 1}/{s.runs}: {policy}")
                result = await asyncio.to_thread(run_policy_isolated, policy, s, provider.base_url, run_no)
                per_policy[policy].append(result)
                progress(
                    f"  attempts at dependency in outage {result['attempts_at_dependency_outage']}, peak in "
                    f"service {result['peak_in_service']}, refused ops {result['operations_refused']}, "
                    f"recovery {result['recovery_s']} s, settled at "
                    f"{result['settled_ratio_after_heal']:.2f} of the pre-outage rate"
                )
    finally:
        provider.stop()
    return {
        "runs": s.runs,
        "policies": {p: aggregate(rs) for p, rs in per_policy.items()},
        "_last": {p: rs[-1] for p, rs in per_policy.items()},
        "dependency": "testbed gRPC service package-search, FaultMode.CONTENDED (load-dependent service "
        "time, orphaned work continues); effect-key deduplication off",
        "definitions": {
            "attempts_at_dependency_outage": "attempts that reached the service (its door counter) during "
            "the outage",
            "attempts_per_dispatched_operation_outage": "attempts / operations started in the outage that "
            "sent at least one attempt (refused operations are counted in outage_operations - "
            "outage_operations_dispatched, not as 0 attempts)",
            "peak_in_service": "most calls in service at once at the dependency, orphaned work included",
            "recovery_s": "heal -> ok operations/s >= 90% of the pre-outage rate for 3 consecutive seconds "
            "(censored at the end of the run when not recovered)",
            "settled_ratio_after_heal": "mean ok operations/s from 20 s after the heal to the end, over the "
            "pre-outage rate of the same run",
        },
        **provenance({**asdict(s), "policies": list(policies)}, before),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 trajectories, 45 s per run")
    parser.add_argument("--runs", type=int, help=f"repetitions (at least {MIN_RUNS})")
    parser.add_argument("--trajectories", type=int)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Scenario()
    if args.runs is not None:
        s = replace(s, runs=max(MIN_RUNS, args.runs))
    if args.trajectories:
        s = replace(s, trajectories=args.trajectories)
    report = asyncio.run(run(s, tuple(p for p in args.policies.split(",") if p)))
    last = report.pop("_last")
    out = result_path(NAME, s.quick)
    write_json(out.stem, report, out.parent)
    plot(out.with_suffix(".png"), s, last)
    print(out)
    for name, r in report["policies"].items():
        print(
            f"{name:14s} attempts@dep outage {r['attempts_at_dependency_outage']['median']:.0f}, peak "
            f"{r['peak_in_service']['median']:.0f}, refused ops {r['operations_refused']['median']:.0f}, "
            f"attempts/dispatched op (outage) {r['attempts_per_dispatched_operation_outage']['median']:.2f}, "
            f"recovery {r['recovery_s']['median']:.0f} s"
        )


if __name__ == "__main__":
    main()
