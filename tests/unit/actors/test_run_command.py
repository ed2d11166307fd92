"""``run_command``'s contract and refusals, without starting a process (subprocess behaviour is covered in
tests/integration/test_run_command.py)."""

from __future__ import annotations

import pytest

from actors.sandbox import SandboxResult
from actors.tools_local import (
    LOCAL_SCOPE,
    SANDBOX_POOL,
    LocalToolPort,
    RunCommandArgs,
    builtin_tools,
)
from runtime.ports import OutcomeClass, Settlement, ToolInvocation
from runtime.tools import RepeatContract, SideEffect
from testbed.provider.arguments import example_arguments


def invocation(arguments: dict[str, object], key: str = "k1") -> ToolInvocation:
    return ToolInvocation(
        trajectory_id="t-1",
        call_id="c1",
        tool="run_command",
        arguments=arguments,
        effect_key=key,
        operation_id="op1",
        attempt_id="a1",
        deadline=1e12,
    )


def test_the_contract_says_what_the_sandbox_can_and_cannot_undo() -> None:
    contract = builtin_tools()["run_command"].contract
    # irreversible (no filesystem isolation or snapshot), never repeated, yet not approval-gated by default
    assert (contract.side_effect, contract.repeat) == (SideEffect.IRREVERSIBLE, RepeatContract.NEVER_REPEAT)
    assert contract.requires_approval is False
    assert (contract.sandbox_pool, contract.dependency_scope) == (SANDBOX_POOL, LOCAL_SCOPE)
    assert contract.isolate_network is True


def test_a_scripted_model_fills_argv_with_an_empty_list_and_leaves_the_timeout_alone() -> None:
    # The simulated provider calls the first offered tool with schema-derived arguments.
    schema = builtin_tools()["run_command"].contract.openai_spec()["function"]["parameters"]
    args = example_arguments(schema, step=3, tag="step3")
    assert args == {"argv": []}
    assert RunCommandArgs.model_validate(args).timeout_s is None  # the trajectory's tool timeout applies


@pytest.mark.parametrize(
    ("with_sandbox", "default_argv", "arguments", "error"),
    [
        (False, (), {"argv": ["true"]}, "no sandbox"),
        (True, (), {"argv": []}, "no default command"),
        (True, (), {"argv": [""]}, "at least 1 character"),
        (True, (), {"argv": ["true"], "timeout_s": 0}, "greater than 0"),
        (True, (), {"argv": ["true"], "shell": True}, "Extra inputs"),
    ],
)
async def test_calls_that_cannot_run_are_refused_before_anything_starts(
    with_sandbox: bool, default_argv: tuple[str, ...], arguments: dict[str, object], error: str
) -> None:
    # Given run_command without a sandbox, or with one but a call that names nothing valid to run
    sandbox = _UnusedSandbox() if with_sandbox else None
    port = LocalToolPort([builtin_tools(sandbox, default_argv=default_argv)["run_command"]])  # type: ignore[arg-type]
    # When it is invoked
    outcome = await port.invoke(invocation(arguments))
    # Then nothing ran: a client rejection, established absent, naming why
    assert (outcome.settlement, outcome.outcome_class) == (
        Settlement.ESTABLISHED_ABSENT,
        OutcomeClass.CLIENT_REJECTION,
    )
    assert outcome.error is not None and error in outcome.error
    assert sandbox is None or sandbox.runs == 0


class _UnusedSandbox:
    """Stands in for ``actors.sandbox.Sandbox`` where the call must be refused before ``run``."""

    live_process_groups: frozenset[int] = frozenset()
    runs = 0

    async def run(self, *args: object, **kwargs: object) -> None:
        self.runs += 1
        raise AssertionError("a refused call must not start a process")


class _RecordingSandbox:
    """Stands in for ``actors.sandbox.Sandbox``: records what it was asked to run, runs nothing."""

    live_process_groups: frozenset[int] = frozenset()

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, ...], float, bool]] = []

    async def run(self, cmd: tuple[str, ...], timeout: float, network: bool = False) -> SandboxResult:
        self.calls.append((tuple(cmd), timeout, network))
        return SandboxResult(0, "", "", timed_out=False, killed=False, network_isolated=True)


@pytest.mark.parametrize(
    ("asked", "tool_timeout", "argv", "expected"),
    [
        (None, 45.0, ["make"], (("make",), 45.0)),  # default: the trajectory's tool timeout
        (5.0, 45.0, ["make"], (("make",), 5.0)),  # a shorter timeout is honoured
        (600.0, 45.0, ["make"], (("make",), 45.0)),  # a longer one is capped
        (None, None, [], (("sleep", "30"), 30.0)),  # empty argv: the operator's default command
    ],
)
async def test_what_runs_and_for_how_long(
    asked: float | None, tool_timeout: float | None, argv: list[str], expected: tuple[tuple[str, ...], float]
) -> None:
    sandbox = _RecordingSandbox()
    tools = builtin_tools(sandbox, default_argv=("sleep", "30"), max_command_timeout_s=tool_timeout)  # type: ignore[arg-type]
    port = LocalToolPort([tools["run_command"]])
    arguments: dict[str, object] = {"argv": argv} | ({} if asked is None else {"timeout_s": asked})
    outcome = await port.invoke(invocation(arguments))
    assert outcome.settlement is Settlement.ESTABLISHED
    # always without network: the contract promises it
    assert sandbox.calls == [(*expected, False)]
