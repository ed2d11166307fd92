"""The built-in ``run_command`` tool on a real process sandbox: it runs in the trajectory's workspace, an
empty argv runs the operator's default, a cancelled call takes its process group with it, and after a
trajectory kill nothing more runs."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors.sandbox import Sandbox
from actors.tools_local import LocalToolPort, builtin_tools
from runtime.ports import OutcomeClass, Settlement, ToolInvocation, ToolOutcome

pytestmark = pytest.mark.integration


def invocation(arguments: dict[str, object], key: str) -> ToolInvocation:
    return ToolInvocation(
        trajectory_id="t-1",
        call_id=f"call-{key}",
        tool="run_command",
        arguments=arguments,
        effect_key=key,
        operation_id=f"op-{key}",
        attempt_id=f"a-{key}",
        deadline=1e12,
    )


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[Sandbox]:
    box = Sandbox("t-1", tmp_path / "workspaces", require_network_isolation=True)
    try:
        yield box
    finally:
        await box.kill_all()


def port_for(sandbox: Sandbox, default_argv: tuple[str, ...] = ()) -> LocalToolPort:
    return LocalToolPort([builtin_tools(sandbox, default_argv=default_argv)["run_command"]])


async def running_group(sandbox: Sandbox) -> int:
    for _ in range(1000):
        if sandbox.live_process_groups:
            (pgid,) = sandbox.live_process_groups
            return pgid
        await asyncio.sleep(0.01)
    raise AssertionError("the command never started")


async def test_a_command_runs_in_the_workspace_and_its_result_is_established(sandbox: Sandbox) -> None:
    port = port_for(sandbox)
    outcome = await port.invoke(invocation({"argv": ["sh", "-c", "pwd; echo made > out.txt; exit 3"]}, "k1"))
    assert (outcome.settlement, outcome.outcome_class) == (Settlement.ESTABLISHED, OutcomeClass.SUCCESS)
    result = outcome.result
    assert result is not None
    assert result["stdout"].strip() == str(sandbox.workspace) and result["exit_code"] == 3
    assert result["network_isolated"] is True and not result["timed_out"]
    assert (sandbox.workspace / "out.txt").read_text() == "made\n"


async def test_an_empty_argv_runs_the_operators_default_command(sandbox: Sandbox) -> None:
    port = port_for(sandbox, default_argv=("sh", "-c", "echo default-ran"))
    outcome = await port.invoke(invocation({"argv": []}, "k2"))
    assert outcome.result is not None
    assert outcome.result["stdout"] == "default-ran\n"
    assert outcome.result["argv"] == ["sh", "-c", "echo default-ran"]


async def test_a_cancelled_call_takes_its_process_group_with_it(sandbox: Sandbox) -> None:
    # Given a command that would run for a minute, with a child of its own in the group
    port = port_for(sandbox)
    call = asyncio.ensure_future(port.invoke(invocation({"argv": ["sh", "-c", "sleep 60 & wait"]}, "k3")))
    pgid = await running_group(sandbox)

    # When the harness cancels the call (its deadline passed)
    await port.cancel("run_command", "k3")
    outcome: ToolOutcome = await asyncio.wait_for(call, 15)

    # Then the outcome is unknown (it may have done something) and the whole group is gone
    assert (outcome.settlement, outcome.outcome_class) == (
        Settlement.UNKNOWN,
        OutcomeClass.INFRASTRUCTURE_FAILURE,
    )
    assert group_gone(pgid)
    assert sandbox.live_process_groups == frozenset()


async def test_after_a_trajectory_kill_the_group_is_gone_and_nothing_more_runs(sandbox: Sandbox) -> None:
    port = port_for(sandbox)
    call = asyncio.ensure_future(port.invoke(invocation({"argv": ["sleep", "60"]}, "k4")))
    pgid = await running_group(sandbox)

    await sandbox.kill_all()  # what the trajectory actor's on_kill hook does

    assert group_gone(pgid)
    killed = await asyncio.wait_for(call, 15)
    # interrupted from outside: what the command did before it died is unknown, never "established"
    assert killed.settlement is Settlement.UNKNOWN and "killed before it finished" in (killed.error or "")
    refused = await port.invoke(invocation({"argv": ["true"]}, "k5"))
    assert refused.outcome_class is OutcomeClass.CLIENT_REJECTION
    assert refused.error is not None and "killed" in refused.error
