"""What one turn costs the runtime: the trajectory's own per-turn cost against the floor it is built on.

A trajectory actor-shaped Ray actor runs the real decider and its interpreter (``runtime.decide`` through
``actors.interpreter.Interpreter``) with a zero-latency model (a tool call per
turn, answered in-process) and a no-op in-process tool, so everything measured is the runtime itself:
admission through the scheduler actor (admit + settle: two actor round trips), the durable log on a real
``redis-server`` with ``appendfsync always`` (every event acknowledged on disk before it takes effect),
folding, context building, dispatch and settlement.

In the same run and from inside the same actor, the floor: one bare Ray actor round trip plus one Redis
``XADD`` under the same fsync setting. Per turn the harness also records where its time went (log appends
and how many, admission hops, the model and tool calls, and the remainder: pure harness compute). A tool
turn is two durable batches, one per intent (the model call's, the dispatch's): the interpreter holds the
events of decisions that start only admission, settlement, permits or local timers and writes them with the
next intent.

    .venv/bin/python -m benchmarks.turn_overhead [--turns 150] [--trajectories 3] [--long-turns 1000]

One more trajectory of ``--long-turns`` turns shows how a turn's cost grows with the history the record
carries (``detail.history_growth``: the first hundred turns after the warm-up against the last hundred).

Result: ``benchmarks/results/turn_overhead.json`` (``harness_ms``/``floor_ms`` p50/p99 plus a breakdown)
and ``turn_overhead.png`` (CDFs).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from actors.interpreter import Interpreter, InterpreterPorts
from actors.status import StatusPublisher
from actors.tools_local import LOCAL_SCOPE, LocalTool, LocalToolPort
from benchmarks._common import (
    MIN_RUNS,
    calibration,
    percentile,
    provenance,
    result_path,
    spread,
    summarize_ms,
    write_json,
    write_plot,
)
from cluster.adapters import LiveEvents
from cluster.control import ControlStream
from cluster.log_store import RedisLogStore
from cluster.redis_server import RedisServer
from runtime.budget import PriceTable
from runtime.clock import SystemClock
from runtime.events import Event, TrajectoryCreated, TurnStarted
from runtime.policy import TrajectoryPolicy
from runtime.ports import (
    CancelToken,
    ModelReply,
    ModelRequest,
    SandboxPermit,
    StopReason,
    ToolCallProposal,
    TurnGrant,
    TurnRequest,
    Usage,
)
from runtime.record import CallLimits, CompletionCheck, Grants, TaskContract, TrajectoryRecord
from runtime.tools import RepeatContract, SideEffect, ToolContract, ToolRegistry

NAME = "turn_overhead"
PROVIDER_KEY = "bench|zero"


class StepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    step: int


def _step(args: StepArgs) -> Mapping[str, Any]:
    return {"step": args.step}


class ZeroLatencyModel:
    """Answers at once: a call to ``step`` (fresh arguments, so no watchdog fires) until ``turns``."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.calls = 0
        self.seconds = 0.0

    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        started = time.perf_counter()
        self.calls += 1
        if self.calls >= self.turns:
            reply = ModelReply(StopReason.END_TURN, "done", [], Usage(50, 0, 5))
        else:
            call = ToolCallProposal(f"c{self.calls}", "step", f'{{"step": {self.calls}}}')
            reply = ModelReply(StopReason.TOOL_USE, "", [call], Usage(50, 0, 10))
        self.seconds += time.perf_counter() - started
        return reply


class TimedLog:
    """The Redis log store, timing every append."""

    def __init__(self, inner: RedisLogStore) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.appends = 0
        self.events = 0

    async def append(self, trajectory_id: str, payload: bytes) -> str:
        started = time.perf_counter()
        entry = await self.inner.append(trajectory_id, payload)
        self.seconds += time.perf_counter() - started
        self.appends += 1
        return entry

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        """One durable batch; ``appends`` counts round trips to Redis, ``events`` what they carried."""
        started = time.perf_counter()
        entries = await self.inner.append_many(trajectory_id, payloads)
        self.seconds += time.perf_counter() - started
        self.appends += 1
        self.events += len(payloads)
        return entries

    async def read(self, trajectory_id: str, after: str | None = None) -> list[tuple[str, bytes]]:
        return await self.inner.read(trajectory_id, after)

    async def exists(self, trajectory_id: str) -> bool:
        return await self.inner.exists(trajectory_id)

    async def trim(self, trajectory_id: str, snapshot_id: str) -> int:
        return await self.inner.trim(trajectory_id, snapshot_id)


class TimedAdmission:
    """An admission port timing every call to the wrapped one (the scheduler actor)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    async def _timed(self, coro: Any) -> Any:
        started = time.perf_counter()
        try:
            return await coro
        finally:
            self.seconds += time.perf_counter() - started

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        grant: TurnGrant = await self._timed(self.inner.admit_turn(request))
        return grant

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None:
        # not timed: the harness settles in the background, so its time overlaps the turn's other work
        # and adding it would count the same milliseconds twice
        await self.inner.settle_turn(grant_id, actual_tokens)

    async def report_rate_limited(self, provider_key: str, retry_after: float | None, remaining: Any) -> None:
        await self._timed(self.inner.report_rate_limited(provider_key, retry_after, remaining))

    async def report_limits(
        self, provider_key: str, info: Any, rate_limited: bool, grant_id: str | None = None
    ) -> None:
        await self._timed(self.inner.report_limits(provider_key, info, rate_limited, grant_id))

    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> SandboxPermit:
        permit: SandboxPermit = await self._timed(
            self.inner.acquire_sandbox(trajectory_id, pool, priority_class, deadline)
        )
        return permit

    async def release_sandbox(self, permit_id: str) -> None:
        await self._timed(self.inner.release_sandbox(permit_id))


class TimedTools(LocalToolPort):
    seconds = 0.0

    async def invoke(self, invocation: Any) -> Any:
        started = time.perf_counter()
        try:
            return await super().invoke(invocation)
        finally:
            self.seconds += time.perf_counter() - started


class _Probe:
    """Per-turn sampling hook: at every ``TurnStarted`` it closes the previous turn's sample."""

    def __init__(self, log: TimedLog, admission: TimedAdmission, model: ZeroLatencyModel, tools: TimedTools):
        self.parts = (log, admission, model, tools)
        self.samples: list[dict[str, float]] = []
        self._mark: tuple[float, ...] | None = None

    def _now(self) -> tuple[float, ...]:
        log, admission, model, tools = self.parts
        return (
            time.perf_counter(),
            log.seconds,
            float(log.appends),
            admission.seconds,
            model.seconds,
            tools.seconds,
        )

    def on_event(self, record: TrajectoryRecord, event: Event) -> None:
        if not isinstance(event, TurnStarted):
            return
        now = self._now()
        if self._mark is not None:
            total, log_s, appends, admission_s, model_s, tool_s = (
                a - b for a, b in zip(now, self._mark, strict=True)
            )
            self.samples.append(
                {
                    "turn": total,
                    "log_appends": log_s,
                    "appends": appends,
                    "admission": admission_s,
                    "model": model_s,
                    "tool": tool_s,
                    "harness_compute": total - log_s - admission_s - model_s - tool_s,
                }
            )
        self._mark = now

    async def on_kill(self, record: TrajectoryRecord) -> None:
        return None


class _Both:
    def __init__(self, probe: _Probe, status: StatusPublisher) -> None:
        self.probe, self.status = probe, status

    def on_event(self, record: TrajectoryRecord, event: Event) -> None:
        self.probe.on_event(record, event)
        self.status.on_event(record, event)

    async def on_kill(self, record: TrajectoryRecord) -> None:
        return None


def _registry() -> tuple[ToolRegistry, LocalTool]:
    contract = ToolContract(
        name="step",
        description="no-op",
        arguments=StepArgs,
        side_effect=SideEffect.READ_ONLY,
        repeat=RepeatContract.IDEMPOTENT,
        dependency_scope=LOCAL_SCOPE,
    )
    return ToolRegistry([contract]), LocalTool(contract, _step)


@ray.remote(num_cpus=0)
class Echo:
    """The floor's bare actor: answers at once."""

    async def ping(self) -> int:
        return 1


@ray.remote(num_cpus=0, max_concurrency=100)  # type: ignore[call-overload]
class BenchTrajectory:
    """A trajectory actor's shape: one harness, its log on Redis, admission through the scheduler actor."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    async def run_turns(self, trajectory_id: str, turns: int) -> list[dict[str, float]]:
        from scheduler.actor import SCHEDULER_NAME, SCHEDULER_NAMESPACE, SchedulerHandle

        clock = SystemClock()
        registry, tool = _registry()
        log = TimedLog(RedisLogStore.from_url(self.redis_url))
        admission = TimedAdmission(
            SchedulerHandle(ray.get_actor(SCHEDULER_NAME, namespace=SCHEDULER_NAMESPACE))
        )
        model = ZeroLatencyModel(turns + 1)
        tools = TimedTools([tool])
        probe = _Probe(log, admission, model, tools)
        # the production shell's status view rides along (its writes are off the turn's path, on its loop)
        client = aioredis.Redis.from_url(self.redis_url)
        status = StatusPublisher(client, LiveEvents(ControlStream(client)), trajectory_id, clock)
        ports = InterpreterPorts(model=model, tools=tools, log=log, admission=admission, clock=clock)
        policy = TrajectoryPolicy(
            registry=registry, provider_key=PROVIDER_KEY, prices=PriceTable(3.0, 0.3, 15.0)
        )
        harness = Interpreter(trajectory_id, policy, ports, _Both(probe, status))
        now = clock.wall()
        await harness.create(
            TrajectoryCreated(
                trajectory_id=trajectory_id,
                parent_id=None,
                tenant="bench",
                contract=TaskContract("benchmark", CompletionCheck("always")),
                limits=CallLimits("zero", 64, 30.0),
                ceilings={"turns": turns + 10, "tokens": 10**9, "dollars": 10**6, "wall_seconds": 10**6},
                grants=Grants(tools=frozenset({"step"}), read_only_tools=frozenset({"step"})),
                priority_class="standard",
                created_at=now,
                deadline=now + 3600,
                context_ref=f"ctx:{trajectory_id}",
            )
        )
        outcome = await harness.run()
        await harness.close()
        await status.flush()
        await status.close()
        await client.aclose()
        await log.inner.close()
        assert outcome.record.state.value == "COMPLETED", outcome.record.state
        return probe.samples

    async def floor(self, echo: Any, n: int) -> list[float]:
        store = RedisLogStore.from_url(self.redis_url)
        payload = b"x" * 256  # about one intent event
        samples = []
        try:
            for _ in range(n):
                started = time.perf_counter()
                await echo.ping.remote()
                await store.append("floor", payload)
                samples.append(time.perf_counter() - started)
        finally:
            await store.close()
        return samples


def _history_growth(bench: Any, turns: int, skip: int) -> dict[str, Any] | None:
    """One long trajectory: a turn's cost early (the first hundred turns after the warm-up) against late
    (the last hundred), so a rule that walks the whole history every turn shows as a late/early ratio
    above 1. The turns in between are not reported."""
    if turns < skip + 200:
        return None
    samples = ray.get(bench.run_turns.remote("bench-long", turns))
    early, late = samples[skip : skip + 100], samples[-100:]

    def p50(part: str, window: list[dict[str, float]]) -> float:
        return round(percentile([t[part] for t in window], 50) * 1000, 3)

    out: dict[str, Any] = {"turns": turns, "window": 100}
    for name, window in (("early", early), ("late", late)):
        out[name] = {
            "turn_p50_ms": p50("turn", window),
            "harness_compute_p50_ms": p50("harness_compute", window),
        }
    out["late_over_early"] = round(out["late"]["turn_p50_ms"] / out["early"]["turn_p50_ms"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.turn_overhead", description=__doc__)
    parser.add_argument("--turns", type=int, default=150, help="turns per trajectory")
    parser.add_argument(
        "--trajectories", type=int, default=MIN_RUNS, help="trajectories (the repetitions), one after another"
    )
    parser.add_argument("--skip", type=int, default=10, help="warm-up turns dropped from each trajectory")
    parser.add_argument(
        "--long-turns",
        type=int,
        default=1000,
        help="turns of the one trajectory that shows how a turn's cost grows with its history (0: skip)",
    )
    parser.add_argument("--quick", action="store_true", help="40 turns per trajectory, a 300-turn long one")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = 40
        args.long_turns = min(args.long_turns, 300)
    args.trajectories = max(MIN_RUNS, args.trajectories)
    before = calibration()

    from scheduler.actor import SchedulerHandle
    from scheduler.config import ProviderLimits, SchedulerConfig

    with tempfile.TemporaryDirectory() as tmp, RedisServer(data_dir=Path(tmp) / "redis") as server:
        ray.init(
            _node_ip_address="127.0.0.1",  # loopback only
            num_cpus=2,
            include_dashboard=False,
            namespace="tether",
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        try:
            limits = ProviderLimits(tokens_per_minute=10**9, requests_per_minute=10**7)
            scheduler = SchedulerHandle.connect(SchedulerConfig(providers={PROVIDER_KEY: limits}))
            echo = Echo.remote()  # type: ignore[attr-defined]
            bench = BenchTrajectory.remote(server.url)  # type: ignore[attr-defined]
            ray.get(bench.floor.remote(echo, 50))  # warm both paths
            harness_samples: list[dict[str, float]] = []
            floor_samples: list[float] = []
            run_ratios: list[float] = []
            run_harness_p50: list[float] = []
            run_floor_p50: list[float] = []
            for i in range(args.trajectories):
                # interleave: the floor is measured between trajectories, under the same machine load
                floor_run = ray.get(bench.floor.remote(echo, args.turns))
                turns = ray.get(bench.run_turns.remote(f"bench-{i}", args.turns))[args.skip :]
                floor_samples += floor_run
                harness_samples += turns
                h50 = percentile([t["turn"] for t in turns], 50) * 1000
                f50 = percentile(floor_run, 50) * 1000
                run_harness_p50.append(h50)
                run_floor_p50.append(f50)
                run_ratios.append(h50 / f50)
            growth = _history_growth(bench, args.long_turns, args.skip)
            del scheduler
        finally:
            ray.shutdown()

    turn_s = [s["turn"] for s in harness_samples]
    harness = summarize_ms(turn_s)
    floor = summarize_ms(floor_samples)
    parts = ("log_appends", "admission", "model", "tool", "harness_compute")
    breakdown = {p: round(percentile([s[p] for s in harness_samples], 50) * 1000, 3) for p in parts}
    appends = percentile([s["appends"] for s in harness_samples], 50)
    result = {
        "harness_ms": {"p50": harness["p50_ms"], "p99": harness["p99_ms"]},
        "floor_ms": {"p50": floor["p50_ms"], "p99": floor["p99_ms"]},
        "runs": {
            "harness_p50_ms": spread(run_harness_p50, 3),
            "floor_p50_ms": spread(run_floor_p50, 3),
            "ratio_p50": spread(run_ratios, 2),
        },
        "detail": {
            "ratio_p50": round(harness["p50_ms"] / floor["p50_ms"], 2),
            "harness": harness,
            "floor": floor,
            "breakdown_p50_ms": breakdown,
            "log_appends_per_turn_p50": appends,
            "turn_samples": len(turn_s),
            "floor_samples": len(floor_samples),
            "appendfsync": "always",
            "turns_per_trajectory": args.turns,
            "history_growth": growth,
        },
        **provenance(
            {
                "turns": args.turns,
                "trajectories": args.trajectories,
                "skip": args.skip,
                "long_turns": args.long_turns,
            },
            before,
        ),
    }
    out = result_path(NAME, args.quick)
    path = write_json(out.stem, result, out.parent)

    def ms(values: list[float]) -> list[float]:
        return [v * 1000.0 for v in values]

    write_plot(
        out.stem,
        {
            "harness turn": ms(turn_s),
            "floor (actor round trip + XADD)": ms(floor_samples),
            "log appends per turn": ms([s["log_appends"] for s in harness_samples]),
            "admission per turn (2 actor hops)": ms([s["admission"] for s in harness_samples]),
            "harness compute per turn": ms([s["harness_compute"] for s in harness_samples]),
        },
        title="Per-turn runtime cost (zero-latency model, no-op tool, appendfsync always)",
    )
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
