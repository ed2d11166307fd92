"""In-process tools: Python functions with pydantic argument schemas served as a ``runtime.ports.ToolPort``.

A minimal registry so trajectories can use tools that need no service of their own (issue 3, "A minimal
in-process tool registry"). Each ``LocalTool`` pairs a ``ToolContract`` (what the harness needs to dispatch
it safely) with the function that performs it. The port keeps its own effect table keyed by effect key:

- a repeated effect key returns the recorded result without running the function again (the port
  deduplicates, so ``RepeatContract.DEDUPLICATED`` is honest for local tools);
- ``probe`` answers from that table. The table lives in this process only, so after a restart a key it
  does not know is *unknown*, never "established absent": we cannot see what a dead process did;
- ``cancel`` cancels the running function for that key.

Outcomes follow the settlement rule: a function that returned established its effect; one that raised
``InputError`` was a client rejection (nothing happened); anything else is an infrastructure failure whose
effect is unknown.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.errors import InputError
from runtime.ports import OutcomeClass, Settlement, ToolInvocation, ToolOutcome
from runtime.tools import RepeatContract, SideEffect, ToolContract

__all__ = [
    "LOCAL_SCOPE",
    "LocalTool",
    "LocalToolPort",
    "NoArgs",
    "SleepArgs",
    "builtin_tools",
]

LOCAL_SCOPE = "local"  # the dependency scope of in-process tools: this actor's own process

ToolFunction = Callable[[Any], Any | Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class LocalTool:
    """A contract and the function that performs it; the function receives the validated argument model."""

    contract: ToolContract
    function: ToolFunction

    @property
    def name(self) -> str:
        return self.contract.name


class LocalToolPort:
    """``ToolPort`` over in-process functions, deduplicating by effect key."""

    def __init__(self, tools: Iterable[LocalTool]) -> None:
        self._tools: dict[str, LocalTool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise InputError("registered twice", where=f"local tool {tool.name!r}")
            self._tools[tool.name] = tool
        self._results: dict[str, ToolOutcome] = {}
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._cancelled: set[str] = set()
        self.executions = 0  # how many times a function really ran (tests judge duplicates by it)

    @property
    def contracts(self) -> list[ToolContract]:
        return [t.contract for t in self._tools.values()]

    def __contains__(self, tool: object) -> bool:
        return tool in self._tools

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        """Run the function once per effect key; a repeat returns the recorded outcome."""
        recorded = self._results.get(invocation.effect_key)
        if recorded is not None:
            return recorded
        tool = self._tools.get(invocation.tool)
        if tool is None:
            return ToolOutcome(
                Settlement.ESTABLISHED_ABSENT,
                OutcomeClass.CLIENT_REJECTION,
                error=f"no local tool {invocation.tool!r}",
            )
        try:
            args = tool.contract.arguments.model_validate(dict(invocation.arguments))
        except ValidationError as e:
            return ToolOutcome(Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error=str(e))
        task = asyncio.ensure_future(_call(tool.function, args))
        self._running[invocation.effect_key] = task
        self.executions += 1
        try:
            result = await task
        except asyncio.CancelledError:
            if invocation.effect_key not in self._cancelled:
                raise  # our caller was cancelled, not the work
            self._cancelled.discard(invocation.effect_key)
            return ToolOutcome(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="cancelled")
        except InputError as e:
            outcome = ToolOutcome(Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error=str(e))
        except Exception as e:  # any failure of the function is an observation, not a crash
            return ToolOutcome(
                Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error=f"{type(e).__name__}: {e}"
            )
        else:
            outcome = ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, result=result)
        finally:
            self._running.pop(invocation.effect_key, None)
        self._results[invocation.effect_key] = outcome
        return outcome

    async def probe(self, tool: str, effect_key: str, deadline: float) -> Settlement:
        recorded = self._results.get(effect_key)
        return recorded.settlement if recorded is not None else Settlement.UNKNOWN

    async def cancel(self, tool: str, effect_key: str) -> None:
        task = self._running.get(effect_key)
        if task is not None and not task.done():
            self._cancelled.add(effect_key)
            task.cancel()


async def _call(function: ToolFunction, args: BaseModel) -> Any:
    result = function(args)
    if inspect.isawaitable(result):
        result = await result
    return result


# --------------------------------------------------------------------------- built-in tools


class NoArgs(BaseModel):
    """A tool that takes no arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SleepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seconds: float = Field(default=0.1, ge=0.0, le=60.0, description="how long to wait")


def _noop(_: NoArgs) -> Mapping[str, Any]:
    return {"ok": True}


async def _sleep(args: SleepArgs) -> Mapping[str, Any]:
    await asyncio.sleep(args.seconds)
    return {"slept_s": args.seconds}


def builtin_tools() -> dict[str, LocalTool]:
    """The in-process tools a workload may name with ``source: builtin``."""
    tools = [
        LocalTool(
            ToolContract(
                name="noop",
                description="Do nothing and report success.",
                arguments=NoArgs,
                side_effect=SideEffect.READ_ONLY,
                repeat=RepeatContract.IDEMPOTENT,
                dependency_scope=LOCAL_SCOPE,
            ),
            _noop,
        ),
        LocalTool(
            ToolContract(
                name="sleep",
                description="Wait a number of seconds, then report success.",
                arguments=SleepArgs,
                side_effect=SideEffect.READ_ONLY,
                repeat=RepeatContract.IDEMPOTENT,
                dependency_scope=LOCAL_SCOPE,
            ),
            _sleep,
        ),
    ]
    return {t.name: t for t in tools}
