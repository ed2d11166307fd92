"""The trajectories of ``benchmarks.rate_limit``, one driver per admission policy.

Every policy runs the same work: a trajectory of class ``c`` is a goal message of ``c.goal_words`` words, then
``c.turns`` model calls that each ask for the one tool (``work``: sleeps ``c.tool_s``, sometimes a long build
of 1-2 provider windows), then a final answer (the testbed scenario ``finish_after:<turns>``). A slot runs
trajectories back to back until the run stops.

- ``tether`` and ``static_split`` run the real trajectory code: the decider (``runtime.decide``) through its
  interpreter (``actors.interpreter.Interpreter``, what the trajectory actor shells), in this process, its
  creation event and policy built from a ``TrajectoryLaunch`` by ``actors.wiring`` as the trajectory actor
  builds them for ``tether run`` (workload defaults: retry, finalization reserve, jitter seed), with
  the real ``OpenAIModel`` adapter (SDK retries off), a local tool port, an in-memory log, and the real
  scheduler (``InProcessScheduler`` over ``SchedulerCore``; the actor is a thin shell around it, ``--ray``
  uses it). ``tether`` shares one scheduler holding the whole limit; ``static_split`` gives each job (one per
  class) its own scheduler holding that job's share.
- ``sdk_default`` and ``backoff`` are what a user writes without Tether: the ``openai`` SDK in an agent loop
  that builds the same chat messages. ``sdk_default`` keeps the SDK's own retries (2 retries, exponential
  backoff honouring ``Retry-After``); when the SDK gives up, the loop sends the turn again. ``backoff`` turns
  SDK retries off and waits full-jitter exponential backoff (``uniform(0, min(60, 2**attempt))``, at least
  1 s, the cookbook's ``wait_random_exponential(min=1, max=60)``) or ``Retry-After`` if longer.

A :class:`Trace` records, per class, the wait from "turn ready" (the turn boundary: the first admission
request of a turn, or the loop reaching the call) to the model's complete reply, counting every 429 round
trip and backoff in between.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import openai
from pydantic import BaseModel, ConfigDict

from actors.interpreter import Interpreter, InterpreterPorts
from actors.launch import CheckLaunch, ProviderLaunch, TrajectoryLaunch
from actors.model_openai import SCENARIO_HEADER, TRAJECTORY_HEADER
from actors.tools_local import LOCAL_SCOPE, LocalTool, LocalToolPort
from actors.wiring import build_created, build_policy
from runtime.clock import SystemClock
from runtime.memstore import MemoryLogStore
from runtime.ports import (
    AdmissionPort,
    CancelToken,
    ForwardingAdmission,
    ModelPort,
    ModelReply,
    ModelRequest,
    TurnGrant,
    TurnRequest,
)
from runtime.tools import RepeatContract, SideEffect, ToolContract, ToolRegistry

__all__ = ["ClassSpec", "Trace", "baseline_trajectory", "run_tether"]

TOOL = "work"
DEADLINE_S = 3_600.0
WORDS = ("plan", "edit", "test", "fix", "read", "log", "diff", "build", "check", "merge")


@dataclass(frozen=True)
class ClassSpec:
    """One priority class's trajectories."""

    name: str
    weight: float
    share: float  # of the trajectories (and of the limit, for the static split)
    goal_words: int
    max_tokens: int
    turns: int  # tool calls before the final answer
    tool_s: tuple[float, float]  # usual tool time, uniform
    long_tool_p: float  # chance a tool step is a long build of 1-2 provider windows
    # A user's pause between one trajectory and the next, in provider windows (uniform); (0, 0): none, the
    # slot starts its next trajectory at once and the class is backlogged.
    think_windows: tuple[float, float] = (0.0, 0.0)


@dataclass
class Trace:
    """What the clients saw while ``measuring``."""

    waits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    completed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    client_429s: int = 0
    measuring: bool = False
    ready: dict[str, float] = field(default_factory=dict)

    def turn_ready(self, trajectory: str) -> None:
        self.ready.setdefault(trajectory, time.monotonic())

    def replied(self, trajectory: str, cls: str) -> None:
        started = self.ready.pop(trajectory, None)
        if started is not None and self.measuring:
            self.waits[cls].append(time.monotonic() - started)

    def ended(self, cls: str, completed: bool) -> None:
        if self.measuring:
            (self.completed if completed else self.failed)[cls] += 1


class WorkArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    step: int


def work_tool(cls: ClassSpec, rng: random.Random, window_s: float) -> LocalTool:
    async def work(args: WorkArgs) -> Mapping[str, Any]:
        seconds = rng.uniform(*cls.tool_s)
        if rng.random() < cls.long_tool_p:
            seconds = rng.uniform(1.0, 2.0) * window_s
        await asyncio.sleep(seconds)
        return {"step": args.step, "ok": True}

    contract = ToolContract(
        name=TOOL,
        description="Do one step of the task.",
        arguments=WorkArgs,
        side_effect=SideEffect.READ_ONLY,
        repeat=RepeatContract.IDEMPOTENT,
        dependency_scope=LOCAL_SCOPE,
    )
    return LocalTool(contract, work)


def goal_text(cls: ClassSpec, rng: random.Random) -> str:
    return "Task: " + " ".join(rng.choice(WORDS) for _ in range(cls.goal_words))


# ----------------------------------------------------------------------------- Tether (decider + interpreter)


class TracedAdmission(ForwardingAdmission):
    """The scheduler port, noting when a turn became ready (its first admission request)."""

    def __init__(self, inner: AdmissionPort, trace: Trace) -> None:
        super().__init__(inner)
        self.trace = trace

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        self.trace.turn_ready(request.trajectory_id)
        return await self.inner.admit_turn(request)

    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None:
        self.trace.client_429s += self.trace.measuring
        await self.inner.report_rate_limited(provider_key, retry_after, remaining)


class TracedModel:
    """The model port, noting when a turn's reply arrived."""

    def __init__(self, inner: ModelPort, trace: Trace, cls: str) -> None:
        self.inner, self.trace, self.cls = inner, trace, cls

    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        reply = await self.inner.complete(request, cancel)
        self.trace.replied(request.trajectory_id, self.cls)
        return reply


async def run_tether(
    trajectory_id: str,
    cls: ClassSpec,
    *,
    model: ModelPort,
    admission: AdmissionPort,
    base_url: str,
    model_name: str,
    window_s: float,
    rng: random.Random,
    trace: Trace,
) -> bool:
    """One trajectory through the real decider and interpreter at default settings; True when COMPLETED."""
    clock = SystemClock()
    tool = work_tool(cls, rng, window_s)
    launch = TrajectoryLaunch(
        trajectory_id=trajectory_id,
        tenant="bench",
        goal=goal_text(cls, rng),
        priority_class=cls.name,
        ceilings={"turns": 100, "tokens": 10**7, "dollars": 100.0, "wall_seconds": 86_400},
        grants=(TOOL,),
        max_tokens=cls.max_tokens,
        call_deadline_s=30.0,
        deadline_s=DEADLINE_S,
        reserve_s=min(120.0, max(5.0, 0.1 * DEADLINE_S)),  # a workload's default reserve at this deadline
        created_at=clock.wall(),
        completion_check=CheckLaunch(name="always"),
        metadata={"scenario": f"finish_after:{cls.turns}"},
        provider=ProviderLaunch(base_url=base_url, model=model_name),
        redis_url="memory://",  # the log is not what this benchmark measures
        tool_timeout_s=3 * window_s + 60.0,  # the workload's tool timeout: longer than its longest build
    )
    # the benchmark's own tool (a sleep) instead of the launch's routes; the rest as the actor builds it
    registry = ToolRegistry([tool.contract])
    ports = InterpreterPorts(
        model=TracedModel(model, trace, cls.name),
        tools=LocalToolPort([tool]),
        log=MemoryLogStore(),
        admission=TracedAdmission(admission, trace),
        clock=clock,
    )
    interpreter = Interpreter(trajectory_id, build_policy(launch, registry), ports)
    await interpreter.create(build_created(launch, registry))
    try:
        outcome = await interpreter.run()
    except BaseException:
        await interpreter.close()
        raise
    # As the trajectory actor does on completion: no close(), which cancels effects still running (the
    # last turn's settlement), leaving that grant's reservation to its lease expiry.
    return outcome.record.state.value == "COMPLETED"


# ----------------------------------------------------------------------------- baselines (plain SDK loops)


def _retry_after(error: openai.RateLimitError) -> float | None:
    headers = error.response.headers
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return float(value) * scale
            except ValueError:
                continue
    return None


def tool_spec() -> dict[str, Any]:
    schema = WorkArgs.model_json_schema()
    return {
        "type": "function",
        "function": {"name": TOOL, "description": "Do one step of the task.", "parameters": schema},
    }


async def _stream(
    client: openai.AsyncOpenAI,
    trajectory_id: str,
    cls: ClassSpec,
    messages: list[dict[str, Any]],
    model_name: str,
) -> dict[str, Any]:
    """One streamed call; the assistant message it produced (tool calls assembled)."""
    kwargs: dict[str, Any] = {
        "model": model_name,
        "messages": messages,
        "tools": [tool_spec()],
        "max_tokens": cls.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_headers": {TRAJECTORY_HEADER: trajectory_id, SCENARIO_HEADER: f"finish_after:{cls.turns}"},
    }
    stream = await client.chat.completions.create(**kwargs)
    text: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
            for tc in choice.delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
    return message


async def baseline_trajectory(
    trajectory_id: str,
    cls: ClassSpec,
    *,
    policy: str,
    client: openai.AsyncOpenAI,
    model_name: str,
    window_s: float,
    rng: random.Random,
    trace: Trace,
) -> bool:
    """One trajectory as a plain agent loop over the SDK (``sdk_default`` or ``backoff``)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": goal_text(cls, rng)}]
    tool = work_tool(cls, rng, window_s)
    while True:
        trace.turn_ready(trajectory_id)
        attempt = 0
        while True:
            try:
                reply = await _stream(client, trajectory_id, cls, messages, model_name)
                break
            except openai.RateLimitError as limited:
                trace.client_429s += trace.measuring
                if policy == "sdk_default":
                    continue  # the SDK already retried twice; the agent loop sends the turn again
                attempt += 1
                wait = max(1.0, rng.uniform(0.0, min(60.0, 2.0**attempt)))
                await asyncio.sleep(max(wait, _retry_after(limited) or 0.0))
        trace.replied(trajectory_id, cls.name)
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls:
            return True
        for call in calls:
            args = WorkArgs.model_validate(json.loads(call["function"]["arguments"] or "{}"))
            result = await tool.function(args)
            content = json.dumps({"result": result, "status": "ESTABLISHED"}, sort_keys=True)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})


Driver = Callable[[str, ClassSpec, random.Random], Awaitable[bool]]
