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

Built-ins: ``noop``, ``sleep`` and ``run_command`` (a command in the trajectory's process sandbox,
``actors.sandbox.Sandbox``; see ``SandboxCommand`` for how it is classified and why).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.sandbox import Sandbox
from runtime.errors import InputError, PolicyRefusal
from runtime.ports import OutcomeClass, ProbeResult, Settlement, ToolInvocation, ToolOutcome
from runtime.tools import RepeatContract, SideEffect, ToolContract

__all__ = [
    "LOCAL_SCOPE",
    "SANDBOX_POOL",
    "CommandRefused",
    "LocalTool",
    "LocalToolPort",
    "NoArgs",
    "RunCommandArgs",
    "SandboxCommand",
    "SleepArgs",
    "builtin_tools",
]

LOCAL_SCOPE = "local"  # the dependency scope of in-process tools: this actor's own process
SANDBOX_POOL = "sandbox"  # the scheduler's semaphore of concurrently running sandboxed commands

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
        model = tool.contract.arguments
        assert isinstance(model, type), "built-in tools declare pydantic arguments"
        try:
            args = model.model_validate(dict(invocation.arguments))
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

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        recorded = self._results.get(effect_key)
        if recorded is None:
            return ProbeResult(Settlement.UNKNOWN, detail="no record of this effect key in this process")
        return ProbeResult(recorded.settlement, recorded.result, "recorded in process")

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


Arg = Annotated[str, Field(min_length=1, max_length=4096)]


class RunCommandArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[Arg] = Field(
        max_length=256,
        description="the program and its arguments, e.g. ['pytest', '-q'] (no shell unless you name one); "
        "an empty list runs the workspace's configured default command, if the operator set one",
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0.0,
        le=86_400.0,
        description="seconds before the command and everything it started are killed; default and upper "
        "bound: the "
        "trajectory's tool timeout",
    )


class CommandInterrupted(Exception):
    """``run_command``'s process was killed from outside while it ran: its effect is unknown."""


class CommandRefused(InputError):
    """``run_command`` ran nothing: no sandbox, no command, or the sandbox was killed or cannot isolate."""


class SandboxCommand:
    """The body of ``run_command`` over one trajectory's sandbox.

    Classification (``ToolContract``), honestly: the command runs in the trajectory's workspace, in a PID
    namespace of its own with a read-only root, under rlimits and without network (``isolate_network``;
    the sandbox refuses to run it when the host cannot cut the network), but the workspace it writes is
    not snapshotted. What a command did can therefore not be undone by Tether: it is IRREVERSIBLE,
    and since running it twice may not equal running it once it is NEVER_REPEAT (an outcome lost to a crash
    or a kill stays *in doubt* with an owner, never re-run). It is not approval-gated by default: the
    sandbox bounds what a call can reach and "the gate is reserved for the calls they cannot make safe"
    (harness chapter, approval gates); a workload that wants a person on every command lists it in
    ``approval_required``.

    The empty ``argv``: a scripted model (``testbed/provider``) fills a list argument with ``[]``. An empty
    list then means "the workspace's default command" (``TrajectoryLaunch.sandbox_default_argv``, set by
    the operator, never by the model); with no default configured it is refused, nothing runs.

    A call cancelled by its caller (deadline, cancel) cancels the sandbox's run, which kills the command
    with everything it started and waits until it is gone; a trajectory kill tears every command down
    through ``Sandbox.kill_all``.
    """

    def __init__(
        self,
        sandbox: Sandbox | None,
        default_argv: Sequence[str] = (),
        *,
        max_timeout_s: float | None = None,
        output_chars: int = 4000,
    ) -> None:
        self.sandbox = sandbox
        self.default_argv = tuple(default_argv)
        self.max_timeout_s = max_timeout_s
        self.output_chars = output_chars

    async def __call__(self, args: RunCommandArgs) -> Mapping[str, Any]:
        sandbox = self.sandbox
        if sandbox is None:
            raise CommandRefused("this trajectory has no sandbox (no workspace root)", where="run_command")
        argv = tuple(args.argv) or self.default_argv
        if not argv:
            raise CommandRefused(
                "argv is empty and no default command is configured", where="run_command.argv"
            )
        timeout = _timeout(args.timeout_s, self.max_timeout_s)
        task = asyncio.ensure_future(sandbox.run(argv, timeout, network=False))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            # Cancelling the sandbox's run kills the command with everything it started and waits until it
            # is gone; only then does this call end.
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 10.0)
            raise
        except PolicyRefusal as e:  # SandboxClosed (killed), IsolationUnavailable: nothing started
            raise CommandRefused(str(e), where="run_command") from e
        if result.killed and not result.timed_out:
            # torn down from outside (a trajectory kill): what the command did before it died is unknown
            raise CommandInterrupted(f"{argv[0]!r} was killed before it finished (exit {result.exit_code})")
        tail = self.output_chars
        return {
            "argv": list(argv),
            "exit_code": result.exit_code,
            "stdout": result.stdout[-tail:],
            "stderr": result.stderr[-tail:],
            "timed_out": result.timed_out,
            "killed": result.killed,
            "truncated": result.truncated or len(result.stdout) > tail or len(result.stderr) > tail,
            "network_isolated": result.network_isolated,
        }


_FALLBACK_TIMEOUT_S = 30.0  # when neither the call nor the trajectory names one


def _timeout(asked: float | None, cap: float | None) -> float:
    if asked is None:
        return cap if cap is not None else _FALLBACK_TIMEOUT_S
    return asked if cap is None else min(asked, cap)


def builtin_tools(
    sandbox: Sandbox | None = None,
    *,
    default_argv: Sequence[str] = (),
    max_command_timeout_s: float | None = None,
) -> dict[str, LocalTool]:
    """The in-process tools a workload may name with ``source: builtin``.

    ``sandbox`` is the trajectory's process sandbox (``run_command`` is refused without one);
    ``default_argv`` what an empty ``argv`` runs; ``max_command_timeout_s`` caps a command's timeout (the
    trajectory's tool timeout). The contracts do not depend on these.
    """
    command = SandboxCommand(sandbox, default_argv, max_timeout_s=max_command_timeout_s)
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
        LocalTool(
            ToolContract(
                name="run_command",
                description="Run a command in this trajectory's sandbox workspace (isolated processes, "
                "resource limits, no network) and report its exit code and the tail of its output.",
                arguments=RunCommandArgs,
                side_effect=SideEffect.IRREVERSIBLE,
                repeat=RepeatContract.NEVER_REPEAT,
                needs_approval=False,  # see SandboxCommand: the sandbox bounds it; approval_required opts in
                dependency_scope=LOCAL_SCOPE,
                sandbox_pool=SANDBOX_POOL,
                isolate_network=True,
            ),
            command,
        ),
    ]
    return {t.name: t for t in tools}
