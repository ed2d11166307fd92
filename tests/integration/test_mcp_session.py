"""MCP servers nobody here wrote, through the official SDK (issue 17): ``mcp-server-time`` (read-only) and
``mcp-server-git`` (side-effecting), installed from the package registry into the project's environment
(``make setup``: the dev extra), and a streamable-HTTP server built with the SDK.

No Ray here: ``McpSession`` and ``McpToolPort`` over ``InProcessMcpHosts``. The judges are the servers' own
answers and, for git, the repository's history.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from actors.tools_mcp.config import McpRoute, McpServerConfig
from actors.tools_mcp.host import InProcessMcpHosts
from actors.tools_mcp.port import McpDeadlinePassed, McpToolPort
from actors.tools_mcp.session import McpSession
from runtime.ports import OutcomeClass, Settlement, ToolInvocation
from tests.integration.mcp_kit import Repo, echo_server, stop

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TIME = McpServerConfig(command=("mcp-server-time", "--local-timezone", "Etc/UTC"))
GIT = McpServerConfig(command=("mcp-server-git",))


def _call(tool: str, arguments: dict[str, object], key: str, within_s: float = 20.0) -> ToolInvocation:
    return ToolInvocation("t", key, tool, arguments, key, f"op-{key}", "a1", time.time() + within_s)


async def test_time_server_lists_its_tools_and_answers_read_only_calls() -> None:
    # Given mcp-server-time behind a tool port
    hosts = InProcessMcpHosts({"time": TIME})
    port = McpToolPort({"now": McpRoute(server="time", remote="get_current_time")}, hosts)
    try:
        # When its tools are listed and called well, badly, and under a name it does not have
        listed = {t.name: t for t in await hosts.list_tools("time")}
        ok = await port.invoke(_call("now", {"timezone": "Europe/Paris"}, "k1"))
        bad = await port.invoke(_call("now", {"timezone": "Mars/Olympus"}, "k2"))
        unknown = await hosts.call("time", "no_such_tool", {}, time.time() + 10, "k3")
    finally:
        await port.close()
    # Then the listing carries the schema and the read-only annotation
    assert listed["get_current_time"].read_only is True
    assert listed["get_current_time"].input_schema["required"] == ["timezone"]
    # And a good call is established with the server's structured answer
    assert (ok.settlement, ok.outcome_class) == (Settlement.ESTABLISHED, OutcomeClass.SUCCESS)
    assert ok.result["timezone"] == "Europe/Paris"
    # And the tool's own error (isError) and the protocol error are rejections, not infrastructure failures
    assert (bad.settlement, bad.outcome_class) == (
        Settlement.ESTABLISHED_ABSENT,
        OutcomeClass.CLIENT_REJECTION,
    )
    assert "Mars/Olympus" in (bad.error or "")
    assert unknown.outcome_class is OutcomeClass.CLIENT_REJECTION and "-32602" in (unknown.error or "")


async def test_git_server_stages_and_commits_in_a_temporary_repository(tmp_path: Path) -> None:
    # Given mcp-server-git confined to a fresh repository with one untracked file
    repo = Repo.create(tmp_path)
    session = McpSession("git", McpServerConfig(command=("mcp-server-git", "--repository", str(repo.path))))
    try:
        # When it stages and commits, and is asked to commit again with nothing staged
        added = await session.call(
            "git_add", {"repo_path": str(repo.path), "files": ["notes.txt"]}, time.time() + 20
        )
        first = await session.call(
            "git_commit", {"repo_path": str(repo.path), "message": "one"}, time.time() + 20
        )
        again = await session.call(
            "git_commit", {"repo_path": str(repo.path), "message": "two"}, time.time() + 20
        )
    finally:
        await session.close()
    # Then the repository shows exactly the one commit, and the empty commit was the tool's refusal
    assert added.settlement is first.settlement is Settlement.ESTABLISHED
    assert repo.commits() == ["one"]
    assert again.outcome_class is OutcomeClass.CLIENT_REJECTION and "No changes staged" in (again.error or "")


async def test_a_call_past_its_deadline_settles_nothing_and_the_port_refuses_late_ones(
    tmp_path: Path,
) -> None:
    # Given a repository whose commit takes 3 s (a slow pre-commit hook), staged
    repo = Repo.create(tmp_path, commit_takes_s=3.0)
    session = McpSession("git", GIT)
    try:
        await session.call("git_add", {"repo_path": str(repo.path), "files": ["notes.txt"]}, time.time() + 20)
        # When the commit is called with a 1 s deadline
        started = time.monotonic()
        outcome = await session.call(
            "git_commit", {"repo_path": str(repo.path), "message": "slow"}, time.time() + 1.0
        )
        waited = time.monotonic() - started
        # Then the caller is answered at the deadline, the outcome unknown (a timeout settles nothing)
        assert waited < 2.5, f"waited {waited:.1f}s past a 1 s deadline"
        assert (outcome.settlement, outcome.outcome_class) == (
            Settlement.UNKNOWN,
            OutcomeClass.INFRASTRUCTURE_FAILURE,
        )
        # And the port refuses locally what is already late: nothing is sent
        port = McpToolPort(
            {"git_commit": McpRoute(server="git", remote="git_commit")}, InProcessMcpHosts({"git": GIT})
        )
        with pytest.raises(McpDeadlinePassed):
            await port.invoke(
                _call("git_commit", {"repo_path": str(repo.path), "message": "late"}, "late", -1.0)
            )
    finally:
        await session.close()


async def test_cancel_abandons_the_call_in_flight(tmp_path: Path) -> None:
    # Given a slow commit in flight under the key "k"
    repo = Repo.create(tmp_path, commit_takes_s=3.0)
    hosts = InProcessMcpHosts({"git": GIT})
    port = McpToolPort({"git_commit": McpRoute(server="git", remote="git_commit")}, hosts)
    try:
        await hosts.call(
            "git", "git_add", {"repo_path": str(repo.path), "files": ["notes.txt"]}, time.time() + 20, "a"
        )
        running = asyncio.ensure_future(
            port.invoke(_call("git_commit", {"repo_path": str(repo.path), "message": "c"}, "k"))
        )
        while not repo.hook_started.exists():
            await asyncio.sleep(0.02)
        # When the port is asked to cancel it
        started = time.monotonic()
        cancelling = asyncio.ensure_future(port.cancel("git_commit", "k"))
        outcome = await running
        answered_in = time.monotonic() - started
        await cancelling
    finally:
        await port.close()
    # Then the caller is answered at once with an unknown outcome (the server may still apply it)
    assert answered_in < 2.0, f"answered {answered_in:.1f}s after the cancel"
    assert outcome.settlement is Settlement.UNKNOWN


async def test_streamable_http_server_answers_and_its_loss_is_an_infrastructure_failure() -> None:
    # Given the SDK-built echo server over streamable HTTP
    with echo_server() as (url, proc):
        session = McpSession("echo", McpServerConfig(url=url, connect_timeout_s=5.0))
        try:
            listed = await session.list_tools()
            ok = await session.call("echo", {"text": "hello"}, time.time() + 10)
            # When the server goes away
            stop(proc)
            lost = await session.call("echo", {"text": "again"}, time.time() + 10)
            after = await session.call("echo", {"text": "and again"}, time.time() + 10)
        finally:
            await session.close()
    # Then while it ran it listed and answered, and once gone every call is an infrastructure failure
    assert [t.name for t in listed] == ["echo"] and ok.result["text"] == "hello"
    assert lost.outcome_class is after.outcome_class is OutcomeClass.INFRASTRUCTURE_FAILURE
    assert after.settlement is Settlement.ESTABLISHED_ABSENT  # reconnecting failed: nothing was sent


async def test_a_server_that_does_not_start_is_not_sent_to() -> None:
    # Given a stdio server whose command exits at once
    session = McpSession("broken", McpServerConfig(command=("false",), connect_timeout_s=5.0))
    # When called
    outcome = await session.call("anything", {}, time.time() + 10)
    await session.close()
    # Then absence is established (nothing left this process) and the dependency counts as failing
    assert (outcome.settlement, outcome.outcome_class) == (
        Settlement.ESTABLISHED_ABSENT,
        OutcomeClass.INFRASTRUCTURE_FAILURE,
    )
