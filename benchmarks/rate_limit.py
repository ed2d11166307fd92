"""Shared rate limit benchmark: Tether's scheduler vs naive SDK retries vs a static per-trajectory split.

One testbed provider (sliding-window TPM/RPM limits, 429 + Retry-After, its own counters) serves N
concurrent trajectories, three ways, one after the other, with the provider reset in between:

1. ``tether``: every model call is admitted by one shared scheduler (``InProcessScheduler`` over the
   same ``SchedulerCore`` the actor runs; ``--ray`` uses the real actor through ``SchedulerHandle``),
   settled with the provider-reported usage, 429s reported back. SDK retries off.
2. ``naive``: each trajectory has its own ``openai.AsyncOpenAI`` with the SDK's default retries
   (exponential backoff, ``Retry-After`` honoured) and no shared limiter; after the SDK gives up the
   trajectory retries the turn.
3. ``static_split``: each trajectory has its own local limiter (the same bucket + window code) holding
   L/N; SDK retries off.

A trajectory is an asyncio task in this process (200 Ray actors do not fit a 2-core machine): it loops
model call → tool time → model call. The priority classes are equal thirds of the trajectories; every
class asks for far more than its weighted share (interactive turns are small but come back fast), so all
three are backlogged and the class shares under saturation are measurable.

Each policy runs ``warmup`` (one provider window, so a policy cannot profit from an empty window) and
then ``measure`` seconds. Everything below is judged from the provider's own counters over the measured
interval (``GET /testbed/stats`` before and after), except the wait, which only a client can see:
``wait_ms`` is from "turn ready" to its first streamed token (scheduler wait or SDK backoff and 429
round trips, plus the provider's time to first token).

``python -m benchmarks.rate_limit --quick --out PATH`` runs a time-compressed version (5 s provider
windows) in under a minute with the same report shape.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from actors.model_openai import estimate_prompt_tokens
from benchmarks._common import RESULTS_DIR, environment, percentile
from runtime.ports import AdmissionPort, ModelRequest, TurnRequest
from scheduler import InProcessScheduler, ProviderLimits, SchedulerConfig
from testbed.provider import ProviderConfig, start_provider_subprocess
from testbed.provider.server import SCENARIO_HEADER, TRAJECTORY_HEADER

POLICIES = ("tether", "naive", "static_split")
MODEL = "tether-sim"
HEADROOM = 0.05


@dataclass(frozen=True)
class ClassSpec:
    """One priority class's turns: prompt size, output, and how long its tool step takes."""

    name: str
    weight: float
    prompt_words: int
    max_tokens: int
    completion_tokens: int
    tool_s: tuple[float, float]  # usual tool time, uniform
    long_tool_p: float  # chance a tool step is a long build of 1-2 provider windows


CLASSES = (
    ClassSpec("interactive", 4.0, 60, 40, 24, (0.05, 0.2), 0.0),
    ClassSpec("standard", 2.0, 160, 64, 40, (0.1, 0.5), 0.10),
    ClassSpec("batch", 1.0, 280, 96, 64, (0.1, 0.5), 0.20),
)


@dataclass(frozen=True)
class RunSpec:
    trajectories: int
    limit_tokens: int  # per provider window
    limit_requests: int  # per provider window
    window_s: float
    warmup_s: float
    measure_s: float
    ttft_ms: float = 50.0
    tokens_per_s: float = 400.0
    seed: int = 7
    use_ray: bool = False
    headroom: float = HEADROOM  # the scheduler's default: capacity = limit x (1 - headroom)

    @property
    def limit_tpm(self) -> float:
        return self.limit_tokens * 60.0 / self.window_s


# The measured interval is a whole number of provider windows: the provider allows L per sliding window,
# so over a fractional interval a policy could show more than L per window without exceeding the limit.
FULL = RunSpec(
    trajectories=200,
    limit_tokens=180_000,
    limit_requests=3_000,
    window_s=60.0,
    warmup_s=60.0,
    measure_s=120.0,
)
QUICK = RunSpec(
    trajectories=30, limit_tokens=15_000, limit_requests=200, window_s=4.0, warmup_s=4.0, measure_s=8.0
)


@dataclass
class Trace:
    """What the client saw: waits per class, 429s it was handed, prompt estimates vs provider counts."""

    waits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    under_estimates: int = 0
    turns: int = 0
    measuring: bool = False


# Share of trajectories per class. Interactive gets the most: its turns are small and a trajectory has
# one turn in flight at a time, so it takes many of them to keep the class backlogged at a 4/7 share.
MIX = (("interactive", 0.4), ("standard", 0.3), ("batch", 0.3))


def class_of(index: int, trajectories: int) -> ClassSpec:
    """Trajectories 0..N-1 are dealt to classes by ``MIX``, interleaved so start-up order is fair."""
    by_name = {c.name: c for c in CLASSES}
    counts = {name: round(share * trajectories) for name, share in MIX}
    order: list[str] = []
    while len(order) < trajectories:
        for name, _ in MIX:
            if counts[name] > 0 and len(order) < trajectories:
                order.append(name)
                counts[name] -= 1
        if all(v <= 0 for v in counts.values()):
            order.extend(MIX[0][0] for _ in range(trajectories - len(order)))
    return by_name[order[index]]


def build_request(trajectory: str, spec: ClassSpec, turn: int, rng: random.Random) -> ModelRequest:
    words = " ".join(
        rng.choice(("plan", "edit", "test", "fix", "read", "log", "diff")) for _ in range(spec.prompt_words)
    )
    return ModelRequest(
        trajectory_id=trajectory,
        model=MODEL,
        messages=[{"role": "user", "content": f"turn {turn}: {words}"}],
        max_tokens=spec.max_tokens,
        deadline=time.time() + 3_600,
    )


async def stream_call(
    client: openai.AsyncOpenAI, request: ModelRequest, spec: ClassSpec
) -> tuple[float, Any]:
    """One streamed call. Returns (time of first token, provider usage)."""
    first = 0.0
    usage = None
    kwargs: dict[str, Any] = {
        "model": request.model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_headers": {
            TRAJECTORY_HEADER: request.trajectory_id,
            SCENARIO_HEADER: f"slow:{spec.completion_tokens}",
        },
    }
    stream = await client.chat.completions.create(**kwargs)
    async for chunk in stream:
        if not first and chunk.choices:
            first = time.monotonic()
        if chunk.usage is not None:
            usage = chunk.usage
    return first, usage


def retry_after_of(error: openai.RateLimitError) -> float | None:
    headers = error.response.headers
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            with contextlib.suppress(ValueError):
                return float(value) * scale
    return None


async def trajectory_loop(
    index: int,
    spec: RunSpec,
    client: openai.AsyncOpenAI,
    port: AdmissionPort | None,
    provider_key: str,
    trace: Trace,
) -> None:
    """Model call, tool time, model call, ... until cancelled. ``port`` None: call the provider directly."""
    cls = class_of(index, spec.trajectories)
    name = f"{cls.name}-{index}"
    rng = random.Random(spec.seed * 1_000 + index)
    turn = 0
    while True:
        turn += 1
        request = build_request(name, cls, turn, rng)
        estimate = estimate_prompt_tokens(request) + request.max_tokens
        ready = time.monotonic()
        while True:  # until the turn is accepted
            grant = None
            if port is not None:
                grant = await port.admit_turn(
                    TurnRequest(name, cls.name, provider_key, estimate, request.deadline)
                )
            try:
                first, usage = await stream_call(client, request, cls)
            except openai.RateLimitError as limited:
                if port is not None and grant is not None:
                    await port.report_rate_limited(provider_key, retry_after_of(limited), {})
                    await port.settle_turn(grant.grant_id, 0)
                continue
            break
        if port is not None and grant is not None:
            await port.settle_turn(grant.grant_id, usage.total_tokens if usage else estimate)
        if trace.measuring:
            trace.turns += 1
            trace.waits[cls.name].append(first - ready)
            if usage is not None and usage.prompt_tokens + request.max_tokens > estimate:
                trace.under_estimates += 1
        tool_s = rng.uniform(*cls.tool_s)
        if rng.random() < cls.long_tool_p:
            tool_s = rng.uniform(1.0, 2.0) * spec.window_s
        await asyncio.sleep(tool_s)


def limits_for(spec: RunSpec, share: float = 1.0) -> ProviderLimits:
    return ProviderLimits(
        tokens_per_minute=max(1, int(spec.limit_tokens * share)),
        requests_per_minute=max(2, int(spec.limit_requests * share)),
        headroom=spec.headroom,
        window_s=spec.window_s,
    )


async def run_policy(
    policy: str, spec: RunSpec, base_url: str, stats: Callable[[], dict[str, Any]], reset: Callable[[], None]
) -> dict[str, Any]:
    provider_key = f"{base_url}|{MODEL}"
    trace = Trace()
    closers: list[Callable[[], Awaitable[None]]] = []
    n = spec.trajectories
    shared = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    closers.append(shared.close)
    ports: list[AdmissionPort | None]
    clients: list[openai.AsyncOpenAI]
    if policy == "tether":
        config = SchedulerConfig(providers={provider_key: limits_for(spec)})
        if spec.use_ray:
            from scheduler.actor import SchedulerHandle

            port: AdmissionPort = SchedulerHandle.connect(config)
        else:
            scheduler = InProcessScheduler(config)
            closers.append(scheduler.aclose)
            port = scheduler
        ports, clients = [port] * n, [shared] * n
    elif policy == "static_split":
        split = [
            InProcessScheduler(SchedulerConfig(providers={provider_key: limits_for(spec, 1.0 / n)}))
            for _ in range(n)
        ]
        closers.extend(s.aclose for s in split)
        ports, clients = list(split), [shared] * n
    elif policy == "naive":
        own = [
            openai.AsyncOpenAI(base_url=base_url, api_key="unused") for _ in range(n)
        ]  # SDK default retries
        closers.extend(c.close for c in own)
        ports, clients = [None] * n, own
    else:
        raise ValueError(f"unknown policy {policy!r}")

    reset()
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    tasks = [
        asyncio.create_task(trajectory_loop(i, spec, clients[i], ports[i], provider_key, trace))
        for i in range(n)
    ]
    await asyncio.sleep(spec.warmup_s)
    before = stats()
    trace.measuring = True
    await asyncio.sleep(spec.measure_s)
    trace.measuring = False
    after = stats()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for close in closers:
        with contextlib.suppress(Exception):
            await close()
    result = summarize(policy, spec, before, after, trace, time.monotonic() - started)
    # Other work on the machine starves the client and the provider alike: record it beside the numbers.
    result["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def tokens_of(counters: dict[str, Any]) -> int:
    return int(counters.get("prompt_tokens", 0)) + int(counters.get("completion_tokens", 0))


def summarize(
    policy: str, spec: RunSpec, before: dict[str, Any], after: dict[str, Any], trace: Trace, elapsed: float
) -> dict[str, Any]:
    billed = (after["tokens"]["prompt"] + after["tokens"]["completion"]) - (
        before["tokens"]["prompt"] + before["tokens"]["completion"]
    )
    # The interval as the provider's clock measured it (a busy client loop can oversleep a little).
    windows = (after["uptime_s"] - before["uptime_s"]) / spec.window_s
    by_class: dict[str, int] = dict.fromkeys((c.name for c in CLASSES), 0)
    for trajectory, counters in after["trajectories"].items():
        cls = trajectory.split("-", 1)[0]
        if cls in by_class:
            by_class[cls] += tokens_of(counters) - tokens_of(before["trajectories"].get(trajectory, {}))
    total = sum(by_class.values()) or 1
    accepted = after["accepted"] - before["accepted"]
    # Wasted: requests the provider answered without serving them (429s, other rejections, failures).
    wasted = sum(after[k] - before[k] for k in ("rate_limited", "rejected", "failed"))
    # Fixed amount of work: 80 % of the limit's worth of tokens over the measured interval, counted from
    # the provider's per-second timeline; how long each policy took to have it served.
    warm_t = int(before["uptime_s"])
    target = 0.8 * spec.limit_tokens * windows
    done_at: float | None = None
    cumulative = 0
    for row in after["timeline"]:
        if row["t"] < warm_t:
            continue
        cumulative += row["tokens"]
        if cumulative >= target:
            done_at = row["t"] + 1 - warm_t
            break
    timeline = [(row["t"], row["tokens"]) for row in after["timeline"]]
    return {
        "goodput_ratio": round(billed / (spec.limit_tokens * windows), 4),
        "rate_limited": after["rate_limited"] - before["rate_limited"],
        "wasted_requests": wasted,
        "wait_ms": {
            c.name: {
                "p50": round(percentile(trace.waits[c.name], 50) * 1000, 1) if trace.waits[c.name] else None,
                "p99": round(percentile(trace.waits[c.name], 99) * 1000, 1) if trace.waits[c.name] else None,
            }
            for c in CLASSES
        },
        "class_share": {name: round(tokens / total, 4) for name, tokens in by_class.items()},
        "accepted_tokens": billed,
        "accepted_requests": accepted,
        "time_to_fixed_work_s": done_at,
        "fixed_work_tokens": int(target),
        "prompt_under_estimates": trace.under_estimates,
        "elapsed_s": round(elapsed, 1),
        "_timeline": timeline,
    }


def class_share_error_pp(shares: dict[str, float]) -> float:
    total_weight = sum(c.weight for c in CLASSES)
    return round(max(abs(shares[c.name] - c.weight / total_weight) * 100 for c in CLASSES), 2)


def write_png(path: Path, spec: RunSpec, results: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [2, 1]})
    per_window = max(1, round(spec.window_s))
    for policy, result in results.items():
        rows = dict(result["_timeline"])
        if not rows:
            continue
        horizon = max(rows) + 1
        series = [rows.get(t, 0) for t in range(horizon)]
        rolling = [
            sum(series[max(0, t - per_window + 1) : t + 1]) / spec.limit_tokens for t in range(horizon)
        ]
        ax_t.plot(range(horizon), rolling, label=f"{policy} (goodput {result['goodput_ratio']:.2f} L)")
    ax_t.axhline(1.0, color="grey", linestyle=":", label="provider limit L")
    ax_t.axhline(1.0 - spec.headroom, color="grey", linestyle="--", linewidth=0.8, label="L * (1 - headroom)")
    ax_t.axvline(spec.warmup_s, color="black", linewidth=0.6)
    ax_t.set_xlabel("seconds since start (measured after the vertical line)")
    ax_t.set_ylabel(f"accepted tokens in the last {spec.window_s:g} s / L")
    ax_t.set_title(f"throughput, {spec.trajectories} trajectories")
    ax_t.legend(fontsize=8, loc="lower right")
    ax_t.grid(alpha=0.3)
    names = [c.name for c in CLASSES]
    total_weight = sum(c.weight for c in CLASSES)
    width = 0.2
    xs = range(len(names))
    ax_s.bar(
        [x - 1.5 * width for x in xs],
        [c.weight / total_weight for c in CLASSES],
        width,
        label="weight",
        color="lightgrey",
    )
    for k, (policy, result) in enumerate(results.items()):
        ax_s.bar(
            [x + (k - 0.5) * width for x in xs],
            [result["class_share"][n] for n in names],
            width,
            label=policy,
        )
    ax_s.set_xticks(list(xs), names)
    ax_s.set_ylabel("share of accepted tokens")
    ax_s.set_title("class shares under saturation")
    ax_s.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(spec: RunSpec, policies: tuple[str, ...]) -> dict[str, Any]:
    provider = start_provider_subprocess(
        ProviderConfig(
            tpm=spec.limit_tokens,
            rpm=spec.limit_requests,
            window_s=spec.window_s,
            ttft_ms=spec.ttft_ms,
            tokens_per_s=spec.tokens_per_s,
            models=(MODEL,),
        )
    )
    try:
        if spec.use_ray:
            import ray

            ray.init(
                _node_ip_address="127.0.0.1",  # loopback only
                num_cpus=1,
                include_dashboard=False,
                namespace="tether",
                logging_level=logging.WARNING,
            )
        results: dict[str, dict[str, Any]] = {}
        for policy in policies:
            results[policy] = await run_policy(
                policy, spec, provider.base_url, provider.stats, provider.reset
            )
    finally:
        provider.stop()
        if spec.use_ray:
            import ray

            ray.shutdown()
    return {
        "trajectories": spec.trajectories,
        "limit_tpm": spec.limit_tpm,
        "policies": results,
        "class_share_error_pp": class_share_error_pp(results["tether"]["class_share"])
        if "tether" in results
        else None,
        "setup": {
            "provider_window_s": spec.window_s,
            "limit_tokens_per_window": spec.limit_tokens,
            "limit_requests_per_window": spec.limit_requests,
            "warmup_s": spec.warmup_s,
            "measure_s": spec.measure_s,
            "headroom": spec.headroom,
            "scheduler": "SchedulerHandle (Ray actor)" if spec.use_ray else "InProcessScheduler (same core)",
            "trajectory": "asyncio task in one process: model call, tool time, model call, ...",
            "classes": [c.__dict__ for c in CLASSES],
            "ttft_ms": spec.ttft_ms,
            "tokens_per_s": spec.tokens_per_s,
        },
        "environment": environment(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--quick", action="store_true", help="time-compressed run (5 s windows), under a minute"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "rate_limit.json")
    parser.add_argument("--trajectories", type=int)
    parser.add_argument("--measure-s", type=float)
    parser.add_argument(
        "--ray", action="store_true", help="admit through the scheduler actor instead of in-process"
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--headroom", type=float, default=HEADROOM, help="scheduler headroom below the limit (default 0.05)"
    )
    args = parser.parse_args(argv)
    spec = QUICK if args.quick else FULL
    overrides: dict[str, Any] = {"use_ray": args.ray, "headroom": args.headroom}
    if args.trajectories:
        overrides["trajectories"] = args.trajectories
    if args.measure_s:
        overrides["measure_s"] = args.measure_s
    spec = RunSpec(**{**spec.__dict__, **overrides})
    report = asyncio.run(run(spec, tuple(p for p in args.policies.split(",") if p)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_png(args.out.with_suffix(".png"), spec, report["policies"])
    for result in report["policies"].values():
        result.pop("_timeline", None)
    args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("environment", "setup")}, indent=2))


if __name__ == "__main__":
    main()
