"""Fault knobs for the testbed tool services, applied through the server framework's hooks.

Each service has a list of ``FaultPlan`` rules, set at start (``--faults``: a plan or a list per service) or
at run time (``FaultControl.SetFaults`` replaces the list with one plan). A call meets the first rule whose
mode, tools and trajectories match it and whose count is not spent. Each mode changes behaviour as
documented on ``FaultMode``; ``trajectories`` aims a rule at some trajectories only (a name matches its id
or ``<run id>.<name>``), so one run can lose one trajectory's reply and not another's.

Effect keys: by default the testbed applies every delivery, seen key or not (``EffectKeys.IGNORE``), so
a runtime that re-dispatches leaves a visible second effect. A test that needs a service which honours
effect keys (deduplicates a repeat) names it: ``EffectKeys.HONOUR`` for the whole testbed, or
``FaultPlan(honour_effect_keys=True)`` for one service.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Self

import grpc
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.tools_grpc import tether_tools_pb2 as pb
from actors.tools_grpc.codec import ToolCall
from actors.tools_grpc.errors import ToolError
from actors.tools_grpc.server import ServerHooks, ToolContext
from runtime.errors import InputError

__all__ = ["MALFORMED_PAYLOAD", "EffectKeys", "FaultInjector", "FaultMode", "FaultPlan"]

MALFORMED_PAYLOAD = '{"env_id": "env-'  # truncated JSON: the effect happened, the reply is unreadable


class EffectKeys(StrEnum):
    """What the testbed services do with a delivery whose effect key they have seen before."""

    IGNORE = "ignore"  # apply it again (the default: a duplicate delivery becomes a duplicate effect)
    HONOUR = "honour"  # answer from the first delivery (a named mode for tests of that contract)


class FaultMode(StrEnum):
    """What a faulty service does to a call."""

    NONE = "none"
    DROP_REPLY = "drop_reply"  # apply the effect, then never answer: the caller hits its deadline
    HANG = "hang"  # hold the call past its deadline (+ hang_s) before the tool runs; never applied
    FAIL = "fail"  # refuse with ``status`` before any effect (retry-after in trailing metadata if set)
    SLOW = "slow"  # wait ``delay_s`` before the tool runs, then answer normally if time remains
    MALFORMED = "malformed"  # apply the effect, answer OK with a payload that is not JSON
    DUPLICATE = "duplicate"  # hand the request to the tool twice (an at-least-once queue behind the door)


class FaultPlan(BaseModel):
    """The faults of one service. ``tools`` empty = every tool of the service; ``count`` = next N calls."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: FaultMode = FaultMode.NONE
    status: str | None = None
    delay_s: float = Field(default=0.0, ge=0.0, le=600.0)
    hang_s: float = Field(default=0.5, ge=0.0, le=600.0)
    retry_after_s: float | None = Field(default=None, ge=0.0)
    honour_effect_keys: bool | None = None  # None: the testbed's ``EffectKeys`` mode
    tools: frozenset[str] = frozenset()
    trajectories: frozenset[str] = frozenset()  # empty: every trajectory
    count: int | None = Field(default=None, ge=1)

    def aims_at(self, call: ToolCall) -> bool:
        """Whether this rule covers ``call`` (its tool and its trajectory), whatever its mode and count."""
        if self.tools and call.tool not in self.tools:
            return False
        if not self.trajectories:
            return True
        tid = call.trajectory_id
        return tid in self.trajectories or tid.rsplit(".", 1)[-1] in self.trajectories

    @field_validator("status")
    @classmethod
    def _known_status(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.upper()
        if name not in grpc.StatusCode.__members__ or name == "OK":
            raise ValueError(f"status must be a non-OK gRPC status name, not {value!r}")
        return name

    @model_validator(mode="after")
    def _fail_needs_status(self) -> Self:
        if self.mode is FaultMode.FAIL and self.status is None:
            raise ValueError("mode 'fail' needs a status (e.g. UNAVAILABLE, INVALID_ARGUMENT)")
        return self

    @property
    def status_code(self) -> grpc.StatusCode:
        return grpc.StatusCode[self.status or "INTERNAL"]


class FaultInjector(ServerHooks):
    """``ServerHooks`` that apply each service's ``FaultPlan`` to the calls of its tools."""

    def __init__(
        self,
        tool_services: Mapping[str, str],
        plans: Mapping[str, FaultPlan | Sequence[FaultPlan]] | None = None,
    ) -> None:
        self._service_of = dict(tool_services)  # tool -> service
        self._plans: dict[str, list[FaultPlan]] = {}
        self._left: dict[str, list[int | None]] = {}
        self._lock = threading.Lock()
        for service, plan in (plans or {}).items():
            self.set_plans(service, [plan] if isinstance(plan, FaultPlan) else plan)

    @property
    def services(self) -> frozenset[str]:
        return frozenset(self._service_of.values())

    def set_plan(self, service: str, plan: FaultPlan) -> None:
        """Replace one service's rules by ``plan`` ("" = every service)."""
        self.set_plans(service, [plan])

    def set_plans(self, service: str, plans: Sequence[FaultPlan]) -> None:
        """Replace one service's rules ("" = every service); the first matching rule applies."""
        targets = sorted(self.services) if service == "" else [service]
        for name in targets:
            if name not in self.services:
                raise InputError(f"unknown service {name!r}; known: {sorted(self.services)}", where="service")
            with self._lock:
                self._plans[name] = list(plans)
                self._left[name] = [p.count for p in plans]

    def plan(self, service: str) -> FaultPlan:
        """The service's first rule (a plan with no fault when it has none)."""
        plans = self._plans.get(service)
        return plans[0] if plans else FaultPlan()

    def _active(self, call: ToolCall, mode: FaultMode) -> FaultPlan | None:
        """The first rule of ``mode`` that applies to ``call`` now, consuming one unit of its count."""
        service = self._service_of.get(call.tool)
        if service is None:
            return None
        with self._lock:
            left = self._left.get(service, [])
            for i, plan in enumerate(self._plans.get(service, [])):
                if plan.mode is not mode or not plan.aims_at(call):
                    continue
                remaining = left[i]
                if remaining is not None:
                    if remaining <= 0:
                        continue
                    left[i] = remaining - 1
                return plan
            return None

    # ------------------------------------------------------------------ hooks

    def honour_effect_keys(self, call: ToolCall) -> bool | None:
        service = self._service_of.get(call.tool)
        return None if service is None else self.plan(service).honour_effect_keys

    def deliveries(self, call: ToolCall) -> int:
        return 2 if self._active(call, FaultMode.DUPLICATE) else 1

    async def before_effect(self, call: ToolCall, ctx: ToolContext) -> None:
        if plan := self._active(call, FaultMode.FAIL):
            raise ToolError(plan.status_code, "injected failure", retry_after=plan.retry_after_s)
        if plan := self._active(call, FaultMode.SLOW):
            await ctx.sleep(plan.delay_s)
        elif plan := self._active(call, FaultMode.HANG):
            await ctx.sleep(max(0.0, ctx.time_remaining()) + plan.hang_s)

    async def after_effect(
        self, call: ToolCall, ctx: ToolContext, reply: pb.InvokeReply
    ) -> pb.InvokeReply | None:
        if self._active(call, FaultMode.DROP_REPLY):
            return None
        if self._active(call, FaultMode.MALFORMED):
            return pb.InvokeReply(result_json=MALFORMED_PAYLOAD, effect_key=reply.effect_key)
        return reply
