"""Shared rate limit: N trajectories against one provider key, four admission policies side by side.

One testbed provider (``testbed/provider``: by default the OpenAI-like limiter, a sliding minute window
that is also enforced per sub-window, where a 429 still costs its request and prompt;
``--provider-mode token_bucket`` for the Anthropic-like bucket) serves N concurrent trajectory slots. In
every run each policy gets the same provider, freshly reset, one after the other:

- ``tether``: the real trajectory code (the decider through its interpreter) and the real scheduler at its
  default settings, one scheduler for every trajectory (see :mod:`benchmarks._rate_policies`);
- ``sdk_default``: the ``openai`` SDK with its own retries in a plain agent loop;
- ``backoff``: per-trajectory full-jitter exponential backoff honouring ``Retry-After`` (the provider
  cookbook's recommendation), SDK retries off;
- ``static_split``: Tether's trajectory code and scheduler, but the limit split statically across three jobs
  (one per class, each holding its share of the trajectories' share of the limit; ``--split`` sets other
  shares, e.g. the ones a run measured, to try the split an operator who knew the demand would set).

Trajectory slots are asyncio tasks in this process (200 Ray actors of ~150 MB do not fit beside the other work
on this 2-core machine; ``benchmarks/node_capacity.py`` measures what actors cost); ``--ray`` admits through
the scheduler actor instead of the in-process scheduler. Classes are dealt 40/30/30 % interactive/standard/
batch, and each asks for far more than its weighted share, so all three are backlogged.

Two demand scenarios (``--scenario``). ``backlogged``, the headline: every class asks for far more than its
share all the time, the one case a static split fills its slices in. ``interactive_users``: each interactive
slot is a user who pauses 1.5-3.5 provider windows between trajectories (drawn per slot, the same for every
policy), so interactive asks for about a third of its 40 % (0.13 of the limit) while standard and batch stay
backlogged; it writes ``rate_limit.interactive_users.json``.

Each policy runs ``warmup`` (one provider window: nobody profits from an empty window) then ``measure`` (two
windows). Judged by the provider's own counters over the measured interval: **goodput** (tokens billed for
served requests per window / the limit), **429s**, **completed trajectories per minute**, class shares of the
tokens; the client's view: per class p50/p99 **wait** from "turn ready" to the model's complete reply (429
round trips and backoff included). Every quantity is repeated ``--runs`` times (min/median/max).

    .venv/bin/python -m benchmarks.rate_limit [--quick] [--runs 3] [--provider-mode token_bucket] [--ray]
        [--scenario interactive_users] [--policies tether,static_split]

Writes ``benchmarks/results/rate_limit[.<scenario>].json`` (``--quick``: ``...quick.json``) and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import openai

from actors.launch import ProviderLaunch
from actors.model_openai import OpenAIModel
from benchmarks._common import (
    MIN_RUNS,
    calibration,
    percentile,
    provenance,
    result_path,
    spread,
    write_json,
)
from benchmarks._rate_policies import ClassSpec, Trace, baseline_trajectory, run_tether
from runtime.ports import AdmissionPort
from scheduler import InProcessScheduler, ProviderLimits, SchedulerConfig
from testbed.provider import LimiterMode, ProviderConfig, start_provider_subprocess

NAME = "rate_limit"
POLICIES = ("tether", "sdk_default", "backoff", "static_split")
# Run only when named (--policies): Tether with the top class's reserve (SchedulerConfig.top_class_reserve,
# off by default), this fraction of the limit unless --top-class-reserve says otherwise
OPTIONAL_POLICIES = ("tether_reserve",)
TOP_CLASS_RESERVE = 0.005
MODEL = "tether-sim"

CLASSES = (
    ClassSpec(
        "interactive", 4.0, 0.4, goal_words=60, max_tokens=40, turns=3, tool_s=(0.05, 0.2), long_tool_p=0.0
    ),
    ClassSpec(
        "standard", 2.0, 0.3, goal_words=160, max_tokens=64, turns=5, tool_s=(0.1, 0.5), long_tool_p=0.1
    ),
    ClassSpec("batch", 1.0, 0.3, goal_words=280, max_tokens=96, turns=8, tool_s=(0.1, 0.5), long_tool_p=0.2),
)
# ``backlogged`` (the headline): every class asks for far more than its share, the case a static split is
# built for. ``interactive_users``: the same classes, but each interactive slot is a user who pauses 1.5-3.5
# provider windows (90-210 s at the full size) before the next trajectory, so that class asks for about a
# third of its 40 % share (0.13 of the limit at the full size) while standard and batch stay backlogged: the
# case a split set in advance meets whenever demand moves away from the shares it was set to.
SCENARIOS: dict[str, tuple[ClassSpec, ...]] = {
    "backlogged": CLASSES,
    "interactive_users": (replace(CLASSES[0], think_windows=(1.5, 3.5)), *CLASSES[1:]),
}


@dataclass(frozen=True)
class RunSpec:
    trajectories: int
    limit_tokens: int  # per provider window
    limit_requests: int  # per provider window
    window_s: float
    warmup_s: float
    measure_s: float
    runs: int = 3
    sub_window_s: float | None = None  # None: window / 60, as the provider's default
    provider_mode: str = LimiterMode.SLIDING_WINDOW.value
    headroom: float | None = None  # None: the scheduler's default
    ttft_ms: float = 50.0
    tokens_per_s: float = 400.0
    seed: int = 7
    use_ray: bool = False
    quick: bool = False
    scenario: str = "backlogged"  # a key of SCENARIOS
    split: tuple[float, ...] | None = None  # the static split's shares; None: the classes' shares
    top_class_reserve: float | None = None  # Tether's SchedulerConfig.top_class_reserve; None: its default

    @property
    def classes(self) -> tuple[ClassSpec, ...]:
        return SCENARIOS[self.scenario]

    @property
    def limit_tpm(self) -> float:
        return self.limit_tokens * 60.0 / self.window_s


# A whole number of provider windows is measured: over a fractional interval a policy could show more than
# L per window without exceeding the limit.
FULL = RunSpec(
    trajectories=200,
    limit_tokens=180_000,
    limit_requests=3_000,
    window_s=60.0,
    warmup_s=60.0,
    measure_s=120.0,
)
# Time-compressed, to check the benchmark works: 10 s windows; the sub-window stays 1 s (a tenth of a second
# would measure this machine's scheduling jitter, not the policies).
QUICK = RunSpec(
    trajectories=30,
    limit_tokens=20_000,
    limit_requests=300,
    window_s=10.0,
    warmup_s=10.0,
    measure_s=20.0,
    sub_window_s=1.0,
    quick=True,
)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def class_of(index: int, trajectories: int, classes: tuple[ClassSpec, ...] = CLASSES) -> ClassSpec:
    """Slots 0..N-1 are dealt to classes by their share, interleaved so start-up order is fair."""
    counts = {c.name: round(c.share * trajectories) for c in classes}
    order: list[str] = []
    while len(order) < trajectories:
        for c in classes:
            if counts[c.name] > 0 and len(order) < trajectories:
                order.append(c.name)
                counts[c.name] -= 1
        if all(v <= 0 for v in counts.values()):
            order.extend(classes[0].name for _ in range(trajectories - len(order)))
    return next(c for c in classes if c.name == order[index])


def think_times(cls: ClassSpec, window_s: float, rng: random.Random) -> Iterator[float]:
    """A user's pauses in one slot, in seconds: the first before its first trajectory (uniform up to the
    longest pause, so the users' arrivals are spread from the start), then one after each trajectory. None
    for a backlogged class. Drawn from a generator of the slot's own, so every policy sees the same users."""
    low, high = cls.think_windows
    if high <= 0:
        return
    yield rng.uniform(0.0, high * window_s)
    while True:
        yield rng.uniform(low, high) * window_s


def limits_for(spec: RunSpec, share: float = 1.0) -> ProviderLimits:
    extra: dict[str, Any] = {} if spec.headroom is None else {"headroom": spec.headroom}
    return ProviderLimits(
        tokens_per_minute=max(1, int(spec.limit_tokens * share)),
        requests_per_minute=max(2, int(spec.limit_requests * share)),
        window_s=spec.window_s,
        sub_window_s=spec.sub_window_s,
        **extra,
    )


Slot = Callable[[str, ClassSpec, random.Random], Awaitable[bool]]


async def run_policy(policy: str, spec: RunSpec, provider: Any, run_no: int) -> dict[str, Any]:
    base_url = provider.base_url
    key = ProviderLaunch(base_url=base_url, model=MODEL).provider_key  # the scheduler key the actor uses
    trace = Trace()
    closers: list[Callable[[], Awaitable[None]]] = []
    shared = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    closers.append(shared.close)

    def tether_slot(port_of: Callable[[ClassSpec], AdmissionPort]) -> Slot:
        model = OpenAIModel(base_url=base_url, client=shared)

        async def slot(tid: str, cls: ClassSpec, rng: random.Random) -> bool:
            return await run_tether(
                tid,
                cls,
                model=model,
                admission=port_of(cls),
                base_url=base_url,
                model_name=MODEL,
                window_s=spec.window_s,
                rng=rng,
                trace=trace,
            )

        return slot

    if policy in ("tether", "tether_reserve"):
        config = SchedulerConfig(providers={key: limits_for(spec)})
        if policy == "tether_reserve":
            reserve = TOP_CLASS_RESERVE if spec.top_class_reserve is None else spec.top_class_reserve
            config = config.model_copy(update={"top_class_reserve": reserve})
        if spec.use_ray:
            from scheduler.actor import SchedulerHandle

            port: AdmissionPort = SchedulerHandle.connect(config, name=f"bench-scheduler-{run_no}")
        else:
            scheduler = InProcessScheduler(config)
            closers.append(scheduler.aclose)
            port = scheduler
        drive = tether_slot(lambda _cls: port)
    elif policy == "static_split":
        per_job = {
            c.name: InProcessScheduler(SchedulerConfig(providers={key: limits_for(spec, share)}))
            for c, share in zip(spec.classes, spec.split or [c.share for c in spec.classes], strict=True)
        }
        closers.extend(s.aclose for s in per_job.values())
        drive = tether_slot(lambda cls: per_job[cls.name])
    elif policy in ("sdk_default", "backoff"):
        client = (
            openai.AsyncOpenAI(base_url=base_url, api_key="unused")  # the SDK's defaults: 2 retries
            if policy == "sdk_default"
            else shared
        )
        if client is not shared:
            closers.append(client.close)

        async def drive(tid: str, cls: ClassSpec, rng: random.Random) -> bool:
            return await baseline_trajectory(
                tid,
                cls,
                policy=policy,
                client=client,
                model_name=MODEL,
                window_s=spec.window_s,
                rng=rng,
                trace=trace,
            )
    else:
        raise ValueError(f"unknown policy {policy!r}")

    async def slot(index: int) -> None:
        cls = class_of(index, spec.trajectories, spec.classes)
        rng = random.Random(spec.seed * 100_003 + run_no * 1_009 + index)
        pauses = think_times(cls, spec.window_s, random.Random(f"think-{spec.seed}-{run_no}-{index}"))
        for k in range(10**9):
            pause = next(pauses, 0.0)
            if pause:
                await asyncio.sleep(pause)
            tid = f"{cls.name}-{index}-{k}"
            try:
                completed = await drive(tid, cls, rng)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a trajectory that crashed is a failed trajectory, not a failed benchmark
                progress(f"{policy}: {tid} raised {type(e).__name__}: {e}")
                completed = False
            trace.ended(cls.name, completed)

    await asyncio.to_thread(provider.reset)
    load_before = os.getloadavg()[0]
    tasks = [asyncio.create_task(slot(i)) for i in range(spec.trajectories)]
    await asyncio.sleep(spec.warmup_s)
    before = await asyncio.to_thread(provider.stats)
    trace.measuring = True
    await asyncio.sleep(spec.measure_s)
    trace.measuring = False
    after = await asyncio.to_thread(provider.stats)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for close in closers:
        with contextlib.suppress(Exception):
            await close()
    result = summarize(spec, before, after, trace)
    result["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def _tokens(counters: dict[str, Any]) -> int:
    return int(counters.get("prompt_tokens", 0)) + int(counters.get("completion_tokens", 0))


def summarize(spec: RunSpec, before: dict[str, Any], after: dict[str, Any], trace: Trace) -> dict[str, Any]:
    billed = (after["tokens"]["prompt"] + after["tokens"]["completion"]) - (
        before["tokens"]["prompt"] + before["tokens"]["completion"]
    )
    windows = (after["uptime_s"] - before["uptime_s"]) / spec.window_s  # as the provider's clock measured it
    minutes = (after["uptime_s"] - before["uptime_s"]) / 60.0
    by_class = dict.fromkeys((c.name for c in CLASSES), 0)
    for trajectory, counters in after["trajectories"].items():
        cls = trajectory.split("-", 1)[0]
        if cls in by_class:
            by_class[cls] += _tokens(counters) - _tokens(before["trajectories"].get(trajectory, {}))
    total = sum(by_class.values()) or 1
    accepted = after["accepted"] - before["accepted"]
    prompt = after["tokens"]["prompt"] - before["tokens"]["prompt"]
    return {
        "goodput_ratio": billed / (spec.limit_tokens * windows),
        "rate_limited": after["rate_limited"] - before["rate_limited"],
        "completed_per_min": sum(trace.completed.values()) / (spec.measure_s / 60.0),
        "completed": dict(trace.completed),
        "completed_per_min_by_class": {
            c.name: trace.completed.get(c.name, 0) / (spec.measure_s / 60.0) for c in CLASSES
        },
        "failed": dict(trace.failed),
        "accepted_requests_per_min": accepted / minutes,
        "prompt_tokens_per_request": prompt / accepted if accepted else None,
        "class_share": {name: tokens / total for name, tokens in by_class.items()},
        "waits": {name: list(samples) for name, samples in trace.waits.items()},
        "timeline": [(row["t"], row["tokens"]) for row in after["timeline"]],
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy over its runs: spreads of the headline numbers, waits pooled over runs."""
    waits: dict[str, list[float]] = {c.name: [] for c in CLASSES}
    for r in runs:
        for name, samples in r["waits"].items():
            waits[name] += samples

    def pct(samples: list[float], q: float) -> float | None:
        return round(percentile(samples, q) * 1000, 1) if samples else None

    return {
        "goodput_ratio": spread([r["goodput_ratio"] for r in runs]),
        "rate_limited": spread([float(r["rate_limited"]) for r in runs], 0),
        "completed_per_min": spread([r["completed_per_min"] for r in runs], 1),
        "completed_per_min_by_class": {
            c.name: spread([r["completed_per_min_by_class"][c.name] for r in runs], 1) for c in CLASSES
        },
        "failed_trajectories": spread([float(sum(r["failed"].values())) for r in runs], 0),
        "accepted_requests_per_min": spread([r["accepted_requests_per_min"] for r in runs], 1),
        "prompt_tokens_per_request": spread([r["prompt_tokens_per_request"] or 0.0 for r in runs], 1),
        "wait_ms": {
            name: {"p50": pct(s, 50), "p99": pct(s, 99), "samples": len(s)} for name, s in waits.items()
        },
        "wait_p99_ms_per_run": {
            name: spread(
                [percentile(r["waits"][name], 99) * 1000 for r in runs if r["waits"].get(name)] or [0.0], 1
            )
            for name in waits
        },
        "class_share": {c.name: spread([r["class_share"][c.name] for r in runs]) for c in CLASSES},
        "load_avg_1m": [r["load_avg_1m"] for r in runs],
    }


def write_png(
    path: Path, spec: RunSpec, last: dict[str, dict[str, Any]], agg: dict[str, dict[str, Any]]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_w) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    per_window = max(1, round(spec.window_s))
    for policy, result in last.items():
        rows = dict(result["timeline"])
        if not rows:
            continue
        horizon = max(rows) + 1
        series = [rows.get(t, 0) for t in range(horizon)]
        rolling = [
            sum(series[max(0, t - per_window + 1) : t + 1]) / spec.limit_tokens for t in range(horizon)
        ]
        g = agg[policy]["goodput_ratio"]["median"]
        ax_t.plot(range(horizon), rolling, label=f"{policy} (goodput median {g:.3f} L)")
    ax_t.axhline(1.0, color="grey", linestyle=":", label="provider limit L")
    ax_t.axvline(spec.warmup_s, color="black", linewidth=0.6)
    ax_t.set_xlabel("seconds since start, last run (measured after the vertical line)")
    ax_t.set_ylabel(f"served tokens in the last {spec.window_s:g} s / L")
    ax_t.set_title(f"{spec.trajectories} trajectories ({spec.scenario}), provider {spec.provider_mode}")
    ax_t.legend(fontsize=8, loc="lower right")
    ax_t.grid(alpha=0.3)
    names = [c.name for c in CLASSES]
    width = 0.8 / max(1, len(agg))
    for k, (policy, a) in enumerate(agg.items()):
        p99 = [(a["wait_ms"][n]["p99"] or 0) / 1000 for n in names]
        ax_w.bar([x + k * width for x in range(len(names))], p99, width, label=policy)
    ax_w.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
    ax_w.set_yscale("log")
    ax_w.set_ylabel("p99 wait, ready -> reply (s)")
    ax_w.set_title("per-class p99 wait (all runs pooled)")
    ax_w.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(spec: RunSpec, policies: tuple[str, ...]) -> dict[str, Any]:
    before = calibration()
    provider = start_provider_subprocess(
        ProviderConfig(
            tpm=spec.limit_tokens,
            rpm=spec.limit_requests,
            window_s=spec.window_s,
            sub_window_s=spec.sub_window_s,
            limiter=LimiterMode(spec.provider_mode),
            ttft_ms=spec.ttft_ms,
            tokens_per_s=spec.tokens_per_s,
            models=(MODEL,),
        )
    )
    if spec.use_ray:
        from cluster.runner import start_local_ray

        start_local_ray(num_cpus=2)
    per_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    try:
        for run_no in range(spec.runs):
            for policy in policies:
                progress(f"run {run_no + 1}/{spec.runs}: {policy}")
                result = await run_policy(policy, spec, provider, run_no)
                per_policy[policy].append(result)
                progress(
                    f"  goodput {result['goodput_ratio']:.3f}, 429s {result['rate_limited']}, "
                    f"completed/min {result['completed_per_min']:.1f}"
                )
    finally:
        provider.stop()
        if spec.use_ray:
            import ray

            ray.shutdown()
    agg = {p: aggregate(rs) for p, rs in per_policy.items()}
    last = {p: rs[-1] for p, rs in per_policy.items()}
    settings = {**asdict(spec), "classes": [asdict(c) for c in spec.classes], "policies": list(policies)}
    settings["scheduler"] = (
        "SchedulerHandle (Ray actor)" if spec.use_ray else "InProcessScheduler (same core)"
    )
    settings["headroom_used"] = limits_for(spec).headroom
    settings["trajectory_code"] = (
        "runtime.decide through actors.interpreter.Interpreter (tether, tether_reserve, static_split); "
        "openai SDK loop (others)"
    )
    if "tether_reserve" in policies:
        settings["tether_reserve"] = (
            TOP_CLASS_RESERVE if spec.top_class_reserve is None else spec.top_class_reserve
        )
    return {
        "runs": spec.runs,
        "provider_mode": spec.provider_mode,
        "trajectories": spec.trajectories,
        "limit_tpm": spec.limit_tpm,
        "policies": agg,
        "_last": last,
        **provenance(settings, before),
    }


def result_name(spec: RunSpec, policies: Sequence[str] = POLICIES) -> str:
    """``rate_limit`` only for the headline: every policy, the default provider, headroom, admission path
    and scheduler. A run that changes any of them is named for what it changed, so it never writes over the
    headline: ``rate_limit[.<scenario>][.<provider mode>][.headroom<h>][.ray][.reserve<r>][.tuned_split]
    [.<policies>]``."""
    parts = [NAME]
    if spec.scenario != "backlogged":
        parts.append(spec.scenario)
    if spec.provider_mode != LimiterMode.SLIDING_WINDOW.value:
        parts.append(spec.provider_mode)
    if spec.headroom is not None:
        parts.append(f"headroom{spec.headroom:g}")
    if spec.use_ray:
        parts.append("ray")
    if spec.top_class_reserve is not None:
        parts.append(f"reserve{spec.top_class_reserve:g}")
    if spec.split is not None:
        parts.append("tuned_split")
    if tuple(policies) != POLICIES:
        parts.append("+".join(policies))
    return ".".join(parts)


def policy_list(text: str) -> tuple[str, ...]:
    """``--policies``: known names, comma-separated, each once."""
    policies = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in policies if p not in POLICIES + OPTIONAL_POLICIES]
    if unknown or not policies or len(set(policies)) != len(policies):
        why = f"unknown {', '.join(unknown)}" if unknown else "empty" if not policies else "a policy twice"
        known = ",".join(POLICIES + OPTIONAL_POLICIES)
        raise argparse.ArgumentTypeError(f"--policies {text!r}: {why}; known: {known}")
    return policies


def split_shares(text: str) -> tuple[float, ...]:
    """``--split``: one share per class, in the classes' order, each above 0, together at most 1."""
    try:
        shares = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--split {text!r}: expected numbers separated by commas") from None
    if len(shares) != len(CLASSES):
        names = ",".join(c.name for c in CLASSES)
        raise argparse.ArgumentTypeError(f"--split {text!r}: expected {len(CLASSES)} shares ({names})")
    if min(shares) <= 0 or sum(shares) > 1.0 + 1e-9:
        raise argparse.ArgumentTypeError(
            f"--split {text!r}: each share must be above 0 and together at most 1 (sum {sum(shares):g})"
        )
    return shares


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="time-compressed (10 s windows), a few minutes")
    parser.add_argument("--runs", type=int, help=f"repetitions of every policy (at least {MIN_RUNS})")
    parser.add_argument("--trajectories", type=int)
    parser.add_argument("--measure-s", type=float)
    parser.add_argument("--provider-mode", choices=[m.value for m in LimiterMode])
    parser.add_argument("--headroom", type=float, help="override the scheduler's default headroom")
    parser.add_argument("--ray", action="store_true", help="admit through the scheduler actor")
    parser.add_argument(
        "--top-class-reserve",
        type=float,
        help="the tether_reserve policy's SchedulerConfig.top_class_reserve: the fraction of the limit kept "
        f"for the interactive class (default {TOP_CLASS_RESERVE})",
    )
    parser.add_argument(
        "--policies",
        type=policy_list,
        default=POLICIES,
        help=f"any of {','.join(POLICIES + OPTIONAL_POLICIES)} (default: {','.join(POLICIES)})",
    )
    parser.add_argument(
        "--scenario",
        choices=list(SCENARIOS),
        default="backlogged",
        help="backlogged: every class asks for more than its share (the headline); interactive_users: "
        "interactive users pause between trajectories (writes rate_limit.interactive_users.json)",
    )
    parser.add_argument(
        "--split",
        type=split_shares,
        help="the static split's shares of the limit per class, interactive,standard,batch "
        "(default: the classes' shares, 0.4,0.3,0.3)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="result path (default: results/rate_limit.json at default settings, else named for what the run "
        "changed: see result_name; .quick.json for --quick)",
    )
    args = parser.parse_args(argv)
    spec = QUICK if args.quick else FULL
    overrides: dict[str, Any] = {"use_ray": args.ray, "scenario": args.scenario}
    for field_name, value in (
        ("runs", None if args.runs is None else max(MIN_RUNS, args.runs)),
        ("trajectories", args.trajectories),
        ("measure_s", args.measure_s),
        ("provider_mode", args.provider_mode),
        ("headroom", args.headroom),
        ("split", args.split),
        ("top_class_reserve", args.top_class_reserve),
    ):
        if value is not None:
            overrides[field_name] = value
    spec = replace(spec, **overrides)
    policies: tuple[str, ...] = args.policies
    report = asyncio.run(run(spec, policies))
    last = report.pop("_last")
    out: Path = args.out or result_path(result_name(spec, policies), spec.quick)
    write_png(out.with_suffix(".png"), spec, last, report["policies"])
    write_json(out.stem, report, out.parent)
    print(out)
    for policy, a in report["policies"].items():
        print(
            f"{policy:13s} goodput {a['goodput_ratio']}  429s {a['rate_limited']}  "
            f"completed/min {a['completed_per_min']}  wait p99 ms "
            f"{ {k: v['p99'] for k, v in a['wait_ms'].items()} }"
        )


if __name__ == "__main__":
    main()
