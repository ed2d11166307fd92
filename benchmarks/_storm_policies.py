"""The trajectories of ``benchmarks.retry_storm``, one driver per retry policy, and the testbed it runs on.

Every policy runs the same agent: a model call (the testbed provider, scenario ``finish_after:<turns>``: the
model asks for ``search_packages`` each turn), then that tool call against the real testbed gRPC service
(``package-search``), the reply fed back, until the final answer; then the next trajectory. Every attempt has
the same caller timeout (``call_timeout_s``).

- ``tether``: the real trajectory code, built the way the trajectory actor builds it (``actors.wiring``:
  registry, creation event and policy from a ``TrajectoryLaunch``): the decider (``runtime.decide``) through
  its interpreter (``actors.interpreter.Interpreter``) with the real gRPC tool client, the decider's single
  retry rule (the workload's default ``RetryLaunch``: 3 attempts, full jitter) and one breaker + bulkhead per
  dependency scope shared by every trajectory (``InProcessGuard`` at ``GuardPolicy()`` defaults: the logic
  the guard actor shells). No extra steps: a call the breaker refuses goes back to the model as the decider
  reports it.
- ``single_retry``: a competent client without Tether: one retry layer, 3 attempts with full-jitter
  exponential backoff (0.2 s base, 5 s cap), no breaker.
- ``naive_layered``: client, gateway and agent each retry the layer below 3 times with a fixed 0.1 s backoff
  (27 attempts per operation at worst), no breaker.

Baseline attempts carry a fresh effect key each (plain clients have none of Tether's intent-derived keys);
the testbed runs with effect-key deduplication off, so every attempt is real work at the dependency for every
policy alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import openai

from actors.interpreter import Interpreter, InterpreterPorts
from actors.launch import CheckLaunch, ProviderLaunch, RetryLaunch, TrajectoryLaunch
from actors.model_openai import SCENARIO_HEADER, TRAJECTORY_HEADER, OpenAIModel
from actors.tools_grpc import GrpcToolPort
from actors.wiring import build_created, build_policy, build_registry
from breakers import InProcessGuard
from runtime.clock import SystemClock
from runtime.memstore import MemoryLogStore
from runtime.ports import (
    GuardPermit,
    GuardPort,
    OutcomeClass,
    Settlement,
    ToolInvocation,
    ToolOutcome,
    ToolPort,
)
from scheduler.inprocess import AlwaysAdmit
from testbed.tools.faults import DoorCounts, EffectKeys, FaultPlan
from testbed.tools.host import Testbed, start_testbed

__all__ = ["SERVICE", "TOOL", "Counters", "TestbedProcess", "TestbedThread", "run_baseline", "run_tether"]

SERVICE = "package-search"
TOOL = "search_packages"


@dataclass
class Counters:
    """The callers' side: operations (one per tool call the model made), their attempts, refusals, and
    successful operations per second since the start."""

    started_at: float = field(default_factory=time.monotonic)
    outage: tuple[float, float] = (0.0, 0.0)
    ok: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    operations: int = 0
    dispatched_operations: int = 0  # operations that sent at least one attempt
    refused: int = 0  # operations refused before any attempt (breaker open, bulkhead full)
    succeeded: int = 0
    attempts: int = 0
    outage_operations: int = 0
    outage_dispatched: int = 0
    outage_attempts_of_ops: int = 0  # attempts of the operations started during the outage
    _started: dict[str, float] = field(default_factory=dict)
    _attempts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _ok: set[str] = field(default_factory=set)

    def now(self) -> float:
        return time.monotonic() - self.started_at

    def in_outage(self, t: float) -> bool:
        return self.outage[0] <= t < self.outage[1]

    def begin(self, key: str) -> None:
        self._started.setdefault(key, self.now())

    def attempt(self, key: str) -> None:
        self.begin(key)
        self.attempts += 1
        self._attempts[key] += 1

    def success(self, key: str) -> None:
        if key not in self._ok:
            self._ok.add(key)
            self.ok[int(self.now())] += 1

    def finish(self, keys: list[str] | None = None) -> None:
        """Tally the operations ``keys`` (default: every open one) as done."""
        for key in list(self._started) if keys is None else keys:
            started = self._started.pop(key, None)
            if started is None:
                continue
            attempts = self._attempts.pop(key, 0)
            self.operations += 1
            self.succeeded += key in self._ok
            self._ok.discard(key)
            if attempts:
                self.dispatched_operations += 1
            else:
                self.refused += 1
            if self.in_outage(started):
                self.outage_operations += 1
                self.outage_dispatched += bool(attempts)
                self.outage_attempts_of_ops += attempts


class TestbedThread:
    """The testbed tool services on their own event loop in a daemon thread; plans and door counters are
    read from here (the injector is thread-safe)."""

    __test__ = False

    def __init__(self, plan: FaultPlan) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="testbed-tools", daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            # every attempt applied, repeated effect key or not: the storm's work is real at the service
            start_testbed(services=(SERVICE,), effect_keys=EffectKeys.IGNORE, faults={SERVICE: plan}),
            self._loop,
        )
        self.testbed: Testbed = future.result(timeout=30)

    @property
    def address(self) -> str:
        return self.testbed.address

    def set_plan(self, plan: FaultPlan) -> None:
        self.testbed.faults.set_plan(SERVICE, plan)

    def door(self) -> DoorCounts:
        return self.testbed.faults.door(SERVICE)

    def searches(self) -> int:
        return self.testbed.ledger.searches

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.testbed.stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _serve_testbed(plan: FaultPlan, conn: Connection) -> None:
    """The child process of ``TestbedProcess``: the testbed on its own thread, commands from ``conn``."""
    testbed = TestbedThread(plan)
    conn.send(testbed.address)
    while True:
        command, arg = conn.recv()
        if command == "set_plan":
            testbed.set_plan(arg)
            conn.send(None)
        elif command == "door":
            conn.send(testbed.door())
        elif command == "searches":
            conn.send(testbed.searches())
        else:
            testbed.stop()
            conn.send(None)
            return


class TestbedProcess:
    """``TestbedThread`` in a process of its own, as a real dependency is: the callers' CPU use (100
    trajectories in one Python process) must not slow the dependency through the GIL, or a caller that
    spends more CPU per call would see a slower dependency (a breaker probe would time out on the
    callers' own load, not the dependency's)."""

    __test__ = False

    def __init__(self, plan: FaultPlan) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with gRPC and event loops
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve_testbed, args=(plan, child), name="testbed-tools", daemon=True
        )
        self._process.start()
        child.close()
        if not self._conn.poll(60):
            self._process.kill()
            raise RuntimeError("the testbed process did not start within 60 s")
        self.address: str = self._conn.recv()
        self._lock = threading.Lock()

    def _ask(self, command: str, arg: Any = None) -> Any:
        with self._lock:
            self._conn.send((command, arg))
            return self._conn.recv()

    def set_plan(self, plan: FaultPlan) -> None:
        self._ask("set_plan", plan)

    def door(self) -> DoorCounts:
        door: DoorCounts = self._ask("door")
        return door

    def searches(self) -> int:
        return int(self._ask("searches"))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._ask("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)


# ----------------------------------------------------------------------------- Tether (decider + interpreter)


class CountingTools:
    """One trajectory's tool port, counting attempts and successes per operation."""

    def __init__(self, inner: ToolPort, counters: Counters, trajectory_id: str) -> None:
        self.inner, self.counters, self.tid = inner, counters, trajectory_id
        self.keys: list[str] = []

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        key = f"{self.tid}/{invocation.call_id}"
        self.counters.attempt(key)
        outcome = await self.inner.invoke(invocation)
        if outcome.settlement is Settlement.ESTABLISHED and outcome.error is None:
            self.counters.success(key)
        return outcome

    async def probe(self, tool: str, effect_key: str, deadline: float) -> Any:
        return await self.inner.probe(tool, effect_key, deadline)

    async def cancel(self, tool: str, effect_key: str) -> None:
        await self.inner.cancel(tool, effect_key)


class CountingGuard:
    """The shared guard seen by one trajectory: an operation begins at its first admission request."""

    def __init__(self, inner: GuardPort, counters: Counters, trajectory_id: str) -> None:
        self.inner, self.counters, self.tid = inner, counters, trajectory_id
        self.keys: list[str] = []

    async def admit(self, scope: str, call_id: str, deadline: float) -> GuardPermit:
        key = f"{self.tid}/{call_id}"
        if key not in self.keys:
            self.keys.append(key)
            self.counters.begin(key)
        return await self.inner.admit(scope, call_id, deadline)

    async def record(self, permit: GuardPermit, outcome: OutcomeClass) -> None:
        await self.inner.record(permit, outcome)

    async def release(self, permit: GuardPermit) -> None:
        await self.inner.release(permit)

    async def settle(self, permit: GuardPermit, outcome: OutcomeClass | None) -> None:
        await self.inner.settle(permit, outcome)


async def run_tether(
    trajectory_id: str,
    *,
    provider_url: str,
    testbed_address: str,
    guard: InProcessGuard,
    client: openai.AsyncOpenAI,
    tools: GrpcToolPort,
    counters: Counters,
    turns: int,
    call_timeout_s: float,
) -> None:
    """One trajectory through the decider and its interpreter, wired as the trajectory actor wires it.

    ``client`` and ``tools`` are shared by every trajectory of the run, as the baselines share theirs and
    as the per-node model client (``actors.model_client``) shares its pool: building an ``AsyncOpenAI``
    per trajectory spent ~40 % of this process's event loop in ``ssl.create_default_context`` (py-spy), and
    the lag it caused (0.3-1.2 s) turned healthy calls into caller-side timeouts that reopened the breaker.
    """
    launch = TrajectoryLaunch(
        trajectory_id=trajectory_id,
        goal="Find the packages the task needs.",
        ceilings={"tokens": 10_000_000, "turns": 1_000},
        grants=(TOOL,),
        created_at=time.time(),
        deadline_s=3_600.0,
        metadata={"scenario": f"finish_after:{turns}"},
        provider=ProviderLaunch(base_url=provider_url, model="sim"),
        redis_url="memory://",
        tool_routes={TOOL: testbed_address},
        use_scheduler=False,
        guard="local",
        retry=RetryLaunch(),
        completion_check=CheckLaunch(name="always"),
        tool_timeout_s=call_timeout_s,
    )
    clock = SystemClock()
    registry = build_registry(launch)
    counting_guard = CountingGuard(guard, counters, trajectory_id)
    model = OpenAIModel(base_url=provider_url, clock=clock, client=client)
    ports = InterpreterPorts(
        model=model,
        tools=CountingTools(tools, counters, trajectory_id),
        log=MemoryLogStore(),  # the log is not what this benchmark measures
        admission=AlwaysAdmit(clock=clock),
        clock=clock,
        guard=counting_guard,
    )
    interpreter = Interpreter(trajectory_id, build_policy(launch, registry), ports)
    try:
        await interpreter.create(build_created(launch, registry))
        await interpreter.run()
    finally:
        counters.finish(counting_guard.keys)
        await interpreter.close()


# ----------------------------------------------------------------------------- baselines


async def _model_turn(
    client: openai.AsyncOpenAI,
    trajectory_id: str,
    turns: int,
    messages: list[dict[str, Any]],
    tool: dict[str, Any],
) -> dict[str, Any]:
    reply = await client.chat.completions.create(
        model="sim",
        messages=messages,  # type: ignore[arg-type]
        tools=[tool],  # type: ignore[list-item]
        max_tokens=128,
        extra_headers={TRAJECTORY_HEADER: trajectory_id, SCENARIO_HEADER: f"finish_after:{turns}"},
    )
    return reply.choices[0].message.model_dump(exclude_none=True)


async def run_baseline(
    trajectory_id: str,
    *,
    policy: str,
    client: openai.AsyncOpenAI,
    tools: GrpcToolPort,
    tool_spec: dict[str, Any],
    counters: Counters,
    turns: int,
    call_timeout_s: float,
    rng: random.Random,
) -> None:
    """One trajectory as a plain agent loop; tool calls retried by ``policy``."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find the packages the task needs."}]
    while True:
        reply = await _model_turn(client, trajectory_id, turns, messages, tool_spec)
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls:
            return
        for call in calls:
            operation = f"{trajectory_id}/{call['id']}"
            args = json.loads(call["function"]["arguments"] or "{}")

            async def attempt(args: dict[str, Any] = args, operation: str = operation) -> bool:
                counters.attempt(operation)
                outcome = await tools.invoke(
                    ToolInvocation(
                        trajectory_id=trajectory_id,
                        call_id=operation,
                        tool=TOOL,
                        arguments=args,
                        effect_key=uuid.uuid4().hex,  # no intent-derived key: every attempt is new work
                        operation_id=operation,
                        attempt_id=uuid.uuid4().hex,
                        deadline=time.time() + call_timeout_s,
                    )
                )
                ok = outcome.settlement is Settlement.ESTABLISHED and outcome.error is None
                if ok:
                    counters.success(operation)
                return ok

            ok = await (naive_layered(attempt) if policy == "naive_layered" else single_retry(attempt, rng))
            counters.finish([operation])
            content = json.dumps({"status": "ESTABLISHED" if ok else "FAILED"})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})


async def naive_layered(
    attempt: Callable[[], Any], layers: int = 3, tries: int = 3, backoff_s: float = 0.1
) -> bool:
    """Each layer retries the layer below on its own allowance, fixed backoff, no breaker."""

    async def layer(depth: int) -> bool:
        for n in range(tries):
            ok = await attempt() if depth == layers - 1 else await layer(depth + 1)
            if ok:
                return True
            if n < tries - 1:
                await asyncio.sleep(backoff_s)
        return False

    return await layer(0)


async def single_retry(
    attempt: Callable[[], Any], rng: random.Random, tries: int = 3, base_s: float = 0.2, cap_s: float = 5.0
) -> bool:
    """One retry layer: full-jitter exponential backoff between attempts."""
    for n in range(tries):
        if await attempt():
            return True
        if n < tries - 1:
            await asyncio.sleep(rng.uniform(0.0, min(cap_s, base_s * 2**n)))
    return False
