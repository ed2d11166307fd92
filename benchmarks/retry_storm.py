"""Retry storm: a shared dependency degrades under N trajectories. Tether's single retry owner + breaker +
bulkhead against naive layered retries (client, gateway and agent, 3 attempts each).

The dependency is SIMULATED inside this benchmark (first version): a FIFO queue served by a fixed pool of
workers, with a concurrency counter at the door. During the outage each job takes longer than the
callers' timeout, and, as in the recovery chapter §12.7, work whose caller gave up keeps running on the
server (orphaned work). After it heals, jobs are fast again, but whatever backlog the retries built must
drain first. The testbed's gRPC tool services have static fault knobs, not load-dependent service time,
so they cannot show this feedback loop yet.

Everything runs on a virtual-time asyncio loop (timers advance instantly, nothing sleeps for real), so a
two-minute scenario takes seconds and both policies see the identical, seeded load. The Tether side uses
the real ``RetryOwner`` (full jitter, one budget per logical operation, admission before every attempt)
and the real ``InProcessGuard`` (breaker + bulkhead) on that loop's clock.

Measured per policy: attempts per logical operation (for operations started during the outage, the
chapter's 27-vs-3 quantity, and overall), peak concurrent calls at the dependency (in service + queued),
and recovery time: seconds after the heal until successful operations per second are back to 90 % of the
pre-outage rate for three consecutive seconds.

    .venv/bin/python -m benchmarks.retry_storm [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import selectors
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, environment, write_json
from breakers import (
    Attempt,
    AttemptResult,
    BreakerPolicy,
    BulkheadPolicy,
    GuardPolicy,
    InProcessGuard,
    RetryAction,
    RetryOwner,
    RetryPolicy,
)
from runtime.errors import PolicyRefusal
from runtime.ports import GuardPermit, OutcomeClass, Settlement
from runtime.tools import RepeatContract

NAME = "retry_storm"
SCOPE = "test-service"

# ----------------------------------------------------------------------------- virtual time


class _VirtualSelector(selectors.DefaultSelector):
    """A selector that, instead of blocking for ``timeout``, moves the loop's virtual time forward."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            self.now += timeout
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock is virtual: the next timer is always 'due now'."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(selector=self._virtual)

    def time(self) -> float:
        return self._virtual.now


class LoopClock:
    """``runtime.clock.Clock`` on the running loop's (virtual) time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wall_offset: float = 1_700_000_000.0) -> None:
        self._loop = loop
        self._offset = wall_offset

    def now(self) -> float:
        return self._loop.time()

    def wall(self) -> float:
        return self._loop.time() + self._offset

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


# ----------------------------------------------------------------------------- the dependency


@dataclass
class Scenario:
    trajectories: int = 200
    duration_s: float = 120.0
    outage_start_s: float = 20.0
    outage_end_s: float = 50.0
    workers: int = 8
    healthy_service_s: float = 0.05
    degraded_service_s: float = 4.0
    call_timeout_s: float = 1.0
    think_s: float = 1.0
    operation_deadline_s: float = 60.0
    seed: int = 11


@dataclass
class Timeline:
    arrivals: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    in_system: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    ok_operations: dict[int, int] = field(default_factory=lambda: defaultdict(int))


class SimulatedDependency:
    """``workers`` servers behind one FIFO queue; callers wait at most their timeout, the work does not."""

    def __init__(self, scenario: Scenario, clock: LoopClock, timeline: Timeline) -> None:
        self._s = scenario
        self._clock = clock
        self._timeline = timeline
        self._queue: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()
        self.in_system = 0
        self.peak = 0
        self.attempts = 0
        self._workers = [asyncio.ensure_future(self._serve()) for _ in range(scenario.workers)]

    def degraded(self) -> bool:
        return self._s.outage_start_s <= self._clock.now() < self._s.outage_end_s

    async def call(self) -> bool:
        """True when the reply arrived within the caller's timeout."""
        self.attempts += 1
        self.in_system += 1
        self.peak = max(self.peak, self.in_system)
        second = int(self._clock.now())
        self._timeline.arrivals[second] += 1
        self._timeline.in_system[second] = max(self._timeline.in_system[second], self.in_system)
        job: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(job)
        try:
            await asyncio.wait_for(asyncio.shield(job), self._s.call_timeout_s)
            return True
        except TimeoutError:
            return False  # the caller gave up; the job stays queued or running (orphaned work)

    async def _serve(self) -> None:
        while True:
            job = await self._queue.get()
            service = self._s.degraded_service_s if self.degraded() else self._s.healthy_service_s
            await asyncio.sleep(service)
            self.in_system -= 1
            if not job.done():
                job.set_result(None)

    def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()


# ----------------------------------------------------------------------------- policies


@dataclass
class Tally:
    operations: int = 0
    attempts: int = 0
    outage_operations: int = 0
    outage_attempts: int = 0
    ok: int = 0
    max_attempts: int = 0

    def add(self, started_at: float, attempts: int, ok: bool, scenario: Scenario) -> None:
        self.operations += 1
        self.max_attempts = max(self.max_attempts, attempts)
        self.attempts += attempts
        self.ok += ok
        if scenario.outage_start_s <= started_at < scenario.outage_end_s:
            self.outage_operations += 1
            self.outage_attempts += attempts


Operation = Callable[[int, int], Awaitable[tuple[int, bool, float]]]  # -> (attempts, ok, wait before next)


def naive_layered(
    dep: SimulatedDependency, layers: int = 3, tries: int = 3, backoff_s: float = 0.1
) -> Operation:
    """Each layer retries the layer below on its own allowance, fixed backoff, no breaker, no bulkhead."""

    async def operation(_traj: int, _op: int) -> tuple[int, bool, float]:
        sent = 0

        async def layer(depth: int) -> bool:
            nonlocal sent
            for attempt in range(tries):
                if depth == layers - 1:
                    sent += 1
                    ok = await dep.call()
                else:
                    ok = await layer(depth + 1)
                if ok:
                    return True
                if attempt < tries - 1:
                    await asyncio.sleep(backoff_s)
            return False

        ok = await layer(0)
        return sent, ok, 0.0

    return operation


def tether(
    dep: SimulatedDependency,
    clock: LoopClock,
    scenario: Scenario,
    rng: random.Random,
    max_cooldown_s: float = 16.0,
) -> Operation:
    """Single retry owner (3 attempts total, full jitter) + breaker + bulkhead for the dependency scope."""
    guard = InProcessGuard(
        clock,
        GuardPolicy(
            breaker=BreakerPolicy(
                window_size=50,
                min_samples=20,
                trip_threshold=0.5,
                cooldown_s=2.0,
                max_cooldown_s=max_cooldown_s,
            ),
            bulkhead=BulkheadPolicy(
                max_concurrent=scenario.workers, max_queued=scenario.workers, lease_s=60.0
            ),
        ),
    )
    policy = RetryPolicy(max_attempts=3, base_backoff_s=0.2, max_backoff_s=5.0)
    ids = itertools.count()

    async def operation(traj: int, op: int) -> tuple[int, bool, float]:
        owner = RetryOwner(f"traj-{traj}", policy, clock, rng, lambda: f"a{next(ids)}")
        deadline = clock.wall() + scenario.operation_deadline_s
        permits: dict[str, GuardPermit] = {}

        async def admit(attempt: Attempt) -> None:
            permits[attempt.attempt_id] = await guard.admit(SCOPE, attempt.attempt_id, deadline)

        async def call(attempt: Attempt) -> AttemptResult:
            permit = permits.pop(attempt.attempt_id)
            ok = await dep.call()
            outcome = OutcomeClass.SUCCESS if ok else OutcomeClass.INFRASTRUCTURE_FAILURE
            await guard.record(permit, outcome)
            await guard.release(permit)
            if ok:
                return AttemptResult(Settlement.ESTABLISHED, OutcomeClass.SUCCESS)
            return AttemptResult(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="timeout")

        report = await owner.run(f"traj-{traj}/op-{op}", RepeatContract.DEDUPLICATED, deadline, call, admit)
        wait = 0.0
        if isinstance(report.refusal, PolicyRefusal) and report.refusal.retry_after:
            wait = report.refusal.retry_after  # the structured answer names the cooldown: honour it
        return len(report.attempts), report.action is RetryAction.DONE, wait

    return operation


# ----------------------------------------------------------------------------- one run


async def _run(policy_name: str, scenario: Scenario) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    clock = LoopClock(loop)
    timeline = Timeline()
    dep = SimulatedDependency(scenario, clock, timeline)
    rng = random.Random(scenario.seed)
    if policy_name == "naive_layered":
        operation = naive_layered(dep)
    else:  # "tether_cap4": the same with a 4 s breaker cooldown cap (the cap trades probes for recovery)
        operation = tether(dep, clock, scenario, rng, 4.0 if policy_name == "tether_cap4" else 16.0)
    tally = Tally()

    async def trajectory(traj: int) -> None:
        await asyncio.sleep(rng.uniform(0.0, scenario.think_s))  # desynchronised start
        for op in itertools.count():
            if clock.now() >= scenario.duration_s:
                return
            started = clock.now()
            attempts, ok, wait = await operation(traj, op)
            tally.add(started, attempts, ok, scenario)
            if ok:
                timeline.ok_operations[int(clock.now())] += 1
            # A refused trajectory honours the named cooldown, jittered so refusals do not return as a wave.
            await asyncio.sleep(wait + rng.uniform(0.0, scenario.think_s) if wait else scenario.think_s)

    await asyncio.gather(*(trajectory(t) for t in range(scenario.trajectories)))
    dep.stop()
    return _summarise(scenario, tally, dep, timeline)


def _recovery_s(scenario: Scenario, timeline: Timeline) -> tuple[float | None, float]:
    """Seconds after the heal until ok-operations/s are back to 90 % of the pre-outage rate for 3 s."""
    warm = range(int(scenario.think_s) + 2, int(scenario.outage_start_s))
    baseline = sum(timeline.ok_operations[s] for s in warm) / max(1, len(warm))
    target = 0.9 * baseline
    end = int(scenario.duration_s)
    for second in range(int(scenario.outage_end_s), end - 2):
        if all(timeline.ok_operations[second + k] >= target for k in range(3)):
            return float(second - scenario.outage_end_s), baseline
    return None, baseline


def _summarise(
    scenario: Scenario, tally: Tally, dep: SimulatedDependency, timeline: Timeline
) -> dict[str, Any]:
    recovery, baseline = _recovery_s(scenario, timeline)
    seconds = range(int(scenario.duration_s) + 1)
    return {
        "attempts_per_operation": round(tally.outage_attempts / max(1, tally.outage_operations), 3),
        "attempts_per_operation_overall": round(tally.attempts / max(1, tally.operations), 3),
        "max_attempts_per_operation": tally.max_attempts,
        "peak_concurrency": dep.peak,
        # None would mean "not recovered within the run": report the censored bound instead, flagged.
        "recovery_s": recovery
        if recovery is not None
        else float(scenario.duration_s - scenario.outage_end_s),
        "recovered_within_run": recovery is not None,
        "operations": tally.operations,
        "operations_ok": tally.ok,
        "attempts_at_dependency": dep.attempts,
        "baseline_ok_operations_per_s": round(baseline, 2),
        "timeline": {
            "arrivals_per_s": [timeline.arrivals[s] for s in seconds],
            "peak_in_system_per_s": [timeline.in_system[s] for s in seconds],
            "ok_operations_per_s": [timeline.ok_operations[s] for s in seconds],
        },
    }


def run_policy(policy_name: str, scenario: Scenario) -> dict[str, Any]:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(_run(policy_name, scenario))
    finally:
        loop.close()


def _plot(results: dict[str, dict[str, Any]], scenario: Scenario, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    panels = [
        ("arrivals_per_s", "attempts arriving / s"),
        ("peak_in_system_per_s", "calls at dependency (peak)"),
        ("ok_operations_per_s", "successful operations / s"),
    ]
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, result in results.items():
            series = result["timeline"][key]
            ax.plot(range(len(series)), series, label=name)
        ax.axvspan(scenario.outage_start_s, scenario.outage_end_s, color="red", alpha=0.1)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    axes[0].set_title(
        f"retry storm: {scenario.trajectories} trajectories, outage shaded (simulated dependency)"
    )
    axes[-1].set_xlabel("time (s, virtual)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller scenario (well under a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"{NAME}.json")
    args = parser.parse_args()
    scenario = Scenario()
    if args.quick:
        scenario = Scenario(duration_s=60.0, outage_start_s=10.0, outage_end_s=25.0)

    results = {name: run_policy(name, scenario) for name in ("tether", "naive_layered", "tether_cap4")}
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "policies": results,
        "scenario": scenario.__dict__,
        "dependency": "simulated in-process: FIFO queue + worker pool, orphaned work continues; virtual time",
        "definitions": {
            "attempts_per_operation": "dispatched attempts / logical operations started during the outage",
            "peak_concurrency": "max calls in service + queued at the dependency",
            "recovery_s": "heal -> ok operations/s >= 90% of pre-outage rate for 3 consecutive seconds",
        },
        "environment": environment(),
    }
    write_json(out.stem, data, out.parent)
    _plot(results, scenario, out.with_suffix(".png"))
    for name, r in results.items():
        print(
            f"{name}: attempts/op {r['attempts_per_operation']} "
            f"(overall {r['attempts_per_operation_overall']}, max {r['max_attempts_per_operation']}), "
            f"peak {r['peak_concurrency']}, recovery {r['recovery_s']} s "
            f"(recovered={r['recovered_within_run']})"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
