"""Shared limits across jobs: two ``tether run`` jobs on one Ray cluster against one provider key.

Each run starts a fresh private ``redis-server``, a fresh testbed provider (the default OpenAI-like limiter:
a sliding minute window, sub-second windows, rejected requests counted) and a ``ray start --head``
(loopback, 2 CPUs, ``--slots`` trajectory slots). Two policies, one after the other in every run:

- ``tether``: two ``tether run`` subprocesses joining that head, each with its own run id and the same
  workload (``--per-job`` long trajectories dealt 40/30/30 % interactive/standard/batch, each far more turns
  than the run lasts, calling the built-in ``sleep`` tool every turn for 0.05-0.5 s, the baseline's tool
  time: a ``script:`` scenario, since ``finish_after:N`` would ask it to sleep ``step`` seconds). Both name
  the same provider key, so the second job finds the first job's scheduler actor by name and both admit
  against one set of buckets.
- ``backoff``: two plain Python processes, each running ``--per-job`` agent loops over the ``openai`` SDK
  with the competent client-side policy (full-jitter exponential backoff honouring ``Retry-After``, SDK
  retries off: ``benchmarks._rate_policies.baseline_trajectory``), with the same classes and scenario.

Both jobs run through a warm-up (once the provider has seen both jobs' trajectories, one provider window),
then ``measure`` seconds judged by the provider's own counters: **combined goodput** (tokens billed for served
requests per window / the limit), **429s**, and each job's share of the billed tokens.

    .venv/bin/python -m benchmarks.shared_limits [--quick] [--runs 3]

Writes ``benchmarks/results/shared_limits.json`` (``--quick``: ``shared_limits.quick.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks._common import MIN_RUNS, calibration, provenance, result_path, spread, write_json

NAME = "shared_limits"
MODEL = "tether-sim"
POLICIES = ("tether", "backoff")
JOBS = ("job-a", "job-b")
# class, its DRR weight and share of each job's trajectories, and the prompt/answer sizes of rate_limit
CLASSES = (("interactive", 4.0, 0.4, 40), ("standard", 2.0, 0.3, 64), ("batch", 1.0, 0.3, 96))


@dataclass(frozen=True)
class Spec:
    per_job: int = 10  # trajectories per job, all live at once
    tpm: int = 60_000
    rpm: int = 600
    window_s: float = 60.0  # the provider's window (the workload's limits are per minute)
    warmup_s: float = 60.0
    measure_s: float = 120.0
    turns: int = 40  # each trajectory's scripted length: more than the run lasts (~25 turns at 60k TPM)
    slots: int = 24
    runs: int = 3
    start_bound_s: float = 300.0
    quick: bool = False


FULL = Spec()
QUICK = Spec(per_job=4, tpm=30_000, rpm=300, warmup_s=30.0, measure_s=60.0, runs=MIN_RUNS, quick=True)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def counts(per_job: int) -> dict[str, int]:
    """Trajectories per class for one job (at least one interactive)."""
    out = {name: round(share * per_job) for name, _w, share, _m in CLASSES}
    out["interactive"] = max(1, per_job - out["standard"] - out["batch"])
    return out


def sleep_script(name: str, turns: int) -> str:
    """A ``script:`` scenario: ``turns`` calls of ``sleep`` for 0.05-0.5 s each (the baseline's tool time).

    Seeded by the group's name, so every run scripts the same calls. No duration recurs within ten calls
    (the exact-repeat watchdog's window), and two decimals keep the script, which travels in a request
    header, well under the provider's 8 KB header-field limit.
    """
    rng = random.Random(f"shared-limits:{name}")
    seconds: list[float] = []
    while len(seconds) < turns:
        s = round(rng.uniform(0.05, 0.5), 2)
        if s not in seconds[-9:]:
            seconds.append(s)
    steps = [["sleep", {"seconds": s}] for s in seconds]
    return "script:" + json.dumps(steps, separators=(",", ":"))


def workload_yaml(spec: Spec, provider_url: str) -> str:
    groups = "".join(
        f"""\
  - id: {name}
    class: {name}
    count: {n}
    goal: "{"Task: " + " ".join(["plan", "edit", "test"] * 20)}"
    scenario: '{sleep_script(name, spec.turns)}'
    grants: [sleep]
    max_tokens: {max_tokens}
    deadline_s: 3600
    budget: {{turns: {spec.turns + 10}, tokens: 100000000, wall_seconds: 3600, dollars: 10000}}
"""
        for (name, _w, _s, max_tokens), n in zip(CLASSES, counts(spec.per_job).values(), strict=True)
        if n
    )
    weights = ", ".join(f"{name}: {w:g}" for name, w, _s, _m in CLASSES)
    return f"""\
name: shared-limits
provider:
  kind: openai_compatible
  base_url: {provider_url}
  model: {MODEL}
  limits: {{tpm: {spec.tpm}, rpm: {spec.rpm}}}
classes: {{{weights}}}
tools:
  - {{name: sleep, source: builtin}}
scheduler: true
trajectories:
{groups}"""


def _env(home: Path, redis_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "TETHER_REDIS_URL": redis_url,
        "TETHER_HOME": str(home),  # one keyring: both jobs' relays verify the same operators
        "RAY_AUTH_MODE": "disabled",  # as RayHead starts the head (see benchmarks/chaos.py)
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each job's process group (``tether run`` stops its trajectories, as on Ctrl-C), SIGKILL
    stragglers. Not SIGINT: run from a shell's background job, the jobs inherit SIGINT ignored and each one
    sat out the 90 s before its SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _billed(stats: Mapping[str, Any]) -> int:
    return int(stats["tokens"]["prompt"]) + int(stats["tokens"]["completion"])


def _by_job(stats: Mapping[str, Any]) -> dict[str, int]:
    out = dict.fromkeys(JOBS, 0)
    for trajectory, c in stats.get("trajectories", {}).items():
        job = next((j for j in JOBS if trajectory.startswith(j)), None)
        if job is not None:
            out[job] += int(c.get("prompt_tokens", 0)) + int(c.get("completion_tokens", 0))
    return out


def _wait_for_jobs(provider: Any, procs: list[subprocess.Popen[bytes]], bound_s: float) -> bool:
    """Until the provider has served a request of every job (or a job exited, or ``bound_s`` passed)."""
    give_up = time.monotonic() + bound_s
    while time.monotonic() < give_up:
        if any(p.poll() is not None for p in procs):
            return False
        seen = provider.stats().get("trajectories", {})
        if all(any(t.startswith(job) for t in seen) for job in JOBS):
            return True
        time.sleep(1.0)
    return False


def run_once(policy: str, spec: Spec, work: Path) -> dict[str, Any]:
    from cluster.fake_cluster import RayHead
    from cluster.redis_server import RedisServer
    from testbed.provider import ProviderConfig, start_provider_subprocess

    work.mkdir(parents=True, exist_ok=True)
    provider = start_provider_subprocess(
        ProviderConfig(tpm=spec.tpm, rpm=spec.rpm, window_s=spec.window_s, models=(MODEL,)),
        log_path=work / "provider.log",
    )
    server = head = None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if policy == "tether":
            server = RedisServer(data_dir=work / "redis").start()
            head = RayHead(num_cpus=2, resources={"tether_trajectory": spec.slots}).start()
            workload = work / "shared.yaml"
            workload.write_text(workload_yaml(spec, provider.base_url))
            env = _env(work / "home", server.url)
            tether = str(Path(sys.executable).parent / "tether")
            for job in JOBS:
                command = [tether, "run", str(workload), "--address", head.gcs_address, "--run-id", job]
                with (work / f"{job}.log").open("w") as out:
                    procs.append(
                        subprocess.Popen(
                            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                        )
                    )
        else:
            for job in JOBS:
                command = [
                    sys.executable,
                    "-m",
                    "benchmarks.shared_limits",
                    "--baseline-job",
                    job,
                    "--base-url",
                    provider.base_url,
                    "--per-job",
                    str(spec.per_job),
                    "--turns",
                    str(spec.turns),
                ]
                with (work / f"{job}.log").open("w") as out:
                    procs.append(
                        subprocess.Popen(
                            command,
                            env=_env(work / "home", ""),
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
        if not _wait_for_jobs(provider, procs, spec.start_bound_s):
            tails = {job: (work / f"{job}.log").read_text(errors="replace")[-800:] for job in JOBS}
            raise RuntimeError(f"{policy}: the jobs did not both reach the provider; their output: {tails}")
        progress(f"  {policy}: both jobs are calling the provider; warm-up {spec.warmup_s:g} s")
        time.sleep(spec.warmup_s)
        before = provider.stats()
        time.sleep(spec.measure_s)
        after = provider.stats()
        alive = [job for job, p in zip(JOBS, procs, strict=True) if p.poll() is None]
    finally:
        _stop(procs)
        if head is not None:
            head.stop()
        if server is not None:
            server.stop()
        provider.stop()
    windows = (after["uptime_s"] - before["uptime_s"]) / spec.window_s
    job_before, job_after = _by_job(before), _by_job(after)
    job_tokens = {job: job_after[job] - job_before[job] for job in JOBS}
    total = sum(job_tokens.values()) or 1
    return {
        "goodput_ratio": (_billed(after) - _billed(before)) / (spec.tpm * windows),
        "rate_limited": after["rate_limited"] - before["rate_limited"],
        # the provider's 429s from its start to the measured window: the jobs' start-up and the warm-up
        "rate_limited_before": before["rate_limited"],
        "accepted_requests_per_min": (after["accepted"] - before["accepted"])
        / (windows * spec.window_s / 60),
        "job_share": {job: tokens / total for job, tokens in job_tokens.items()},
        "jobs_alive_at_end": alive,
    }


def run(spec: Spec, policies: tuple[str, ...], work: Path) -> dict[str, Any]:
    before = calibration()
    per_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for run_no in range(spec.runs):
        for policy in policies:
            progress(f"run {run_no + 1}/{spec.runs}: {policy}")
            result = run_once(policy, spec, work / f"{policy}-{run_no}")
            per_policy[policy].append(result)
            progress(
                f"  goodput {result['goodput_ratio']:.3f}, 429s {result['rate_limited']} "
                f"({result['rate_limited_before']} before the measured window), "
                f"shares {result['job_share']}"
            )
    agg = {
        policy: {
            "goodput_ratio": spread([r["goodput_ratio"] for r in rs]),
            "rate_limited": spread([float(r["rate_limited"]) for r in rs], 0),
            "rate_limited_before": spread([float(r["rate_limited_before"]) for r in rs], 0),
            "accepted_requests_per_min": spread([r["accepted_requests_per_min"] for r in rs], 1),
            "job_share": {job: spread([r["job_share"][job] for r in rs]) for job in JOBS},
            "per_run": rs,
        }
        for policy, rs in per_policy.items()
    }
    settings = {**asdict(spec), "policies": list(policies), "classes": [c[0] for c in CLASSES]}
    return {"runs": spec.runs, "jobs": len(JOBS), "policies": agg, **provenance(settings, before)}


async def baseline_job(job: str, base_url: str, per_job: int, turns: int) -> None:
    """One baseline job: ``per_job`` backoff agent loops until this process is interrupted."""
    import openai

    from benchmarks._rate_policies import ClassSpec, Trace, baseline_trajectory

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    trace = Trace()
    specs = {
        name: ClassSpec(
            name, w, share, goal_words=60, max_tokens=m, turns=turns, tool_s=(0.05, 0.5), long_tool_p=0.0
        )
        for name, w, share, m in CLASSES
    }
    names = [name for name, n in counts(per_job).items() for _ in range(n)]

    async def slot(index: int, name: str) -> None:
        rng = random.Random(index)
        for k in range(10**9):
            await baseline_trajectory(
                f"{job}.{name}-{index}-{k}",
                specs[name],
                policy="backoff",
                client=client,
                model_name=MODEL,
                window_s=60.0,
                rng=rng,
                trace=trace,
            )

    await asyncio.gather(*(slot(i, name) for i, name in enumerate(names)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer trajectories, shorter intervals")
    parser.add_argument("--runs", type=int, help=f"repetitions (at least {MIN_RUNS})")
    parser.add_argument("--per-job", type=int, help="trajectories per job")
    parser.add_argument("--turns", type=int, help="turns each trajectory is scripted to take")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, help="result path (default: results/shared_limits[.quick].json)")
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw the PNG from the stored result JSON, run nothing"
    )
    parser.add_argument("--baseline-job", help=argparse.SUPPRESS)  # internal: one baseline job's process
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_job:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(baseline_job(args.baseline_job, args.base_url, args.per_job, args.turns))
        return
    spec = QUICK if args.quick else FULL
    if args.plot_only:
        stored: Path = args.out or result_path(NAME, spec.quick)
        print(write_png(stored.with_suffix(".png"), json.loads(stored.read_text())))
        return
    overrides: dict[str, Any] = {}
    if args.runs is not None:
        overrides["runs"] = max(MIN_RUNS, args.runs)
    if args.per_job is not None:
        overrides["per_job"] = args.per_job
    if args.turns is not None:
        overrides["turns"] = args.turns
    spec = replace(spec, **overrides)
    with tempfile.TemporaryDirectory(prefix="tether-shared-") as tmp:
        report = run(spec, tuple(p for p in args.policies.split(",") if p), Path(tmp))
    out: Path = args.out or result_path(NAME, spec.quick)
    write_json(out.stem, report, out.parent)
    print(out)
    print(write_png(out.with_suffix(".png"), report))
    for policy, a in report["policies"].items():
        print(f"{policy:8s} goodput {a['goodput_ratio']}  429s {a['rate_limited']}  shares {a['job_share']}")


def write_png(path: Path, report: Mapping[str, Any]) -> Path:
    """Per run and policy: the combined goodput of the two jobs (bars, left axis, with each job's part)
    and the provider's 429s (right panel)."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    policies = report["policies"]
    fig, (ax_g, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(1, len(policies))
    for k, (policy, agg) in enumerate(policies.items()):
        runs = agg["per_run"]
        xs = [i + k * width for i in range(len(runs))]
        bottom = [0.0] * len(runs)
        for j, job in enumerate(sorted(runs[0]["job_share"])):
            part = [r["goodput_ratio"] * r["job_share"][job] for r in runs]
            combined = f" (combined median {agg['goodput_ratio']['median']:.3f})" if j else ""
            label = f"{policy}: {job}{combined}"
            ax_g.bar(xs, part, width, bottom=bottom, label=label, alpha=0.55 + 0.3 * j)
            bottom = [b + p for b, p in zip(bottom, part, strict=True)]
        bars = ax_r.bar(xs, [r["rate_limited"] for r in runs], width, label=policy)
        ax_r.bar_label(bars, fontsize=8)  # a policy's 0 shows as a number, not as nothing
    ticks = [i + 0.4 - width / 2 for i in range(len(next(iter(policies.values()))["per_run"]))]
    for ax in (ax_g, ax_r):
        ax.set_xticks(ticks, [f"run {i + 1}" for i in range(len(ticks))])
        ax.grid(alpha=0.3, axis="y")
    ax_g.axhline(1.0, color="grey", linestyle=":", label="the key's limit")
    ax_g.set_ylabel("goodput: useful tokens per minute / limit")
    ax_g.set_title(f"two jobs on one key, one Ray cluster (commit {report['commit']['sha'][:8]})")
    ax_g.set_ylim(0, 1.45)
    ax_g.legend(fontsize=7, loc="upper left", ncol=2)
    ax_r.set_ylabel("429 answers from the provider")
    ax_r.set_title("rate-limited requests per run")
    ax_r.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
