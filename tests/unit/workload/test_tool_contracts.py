"""Tool contracts declared in the workload (issue 17): any gRPC ToolService and MCP server tools, validated
with the field path; MCP annotations fill only what is not declared, never overriding a declaration."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from actors.contracts import ServerHints
from cluster.runner import plan_launches
from cluster.workload import WorkloadError, parse_workload, resolve_tool_contracts
from runtime.tools import CandidateRole, RepeatContract, SideEffect

_GRPC = """\
tools:
  - name: lookup_order
    source: grpc
    address: "orders.internal:7070"
    description: Look an order up by id.
    arguments:
      type: object
      properties:
        order_id: {type: string, minLength: 1}
        verbose: {type: boolean, default: false}
      required: [order_id]
      additionalProperties: false
    side_effect: read_only
    target_keys: [order_id]
  - name: refund
    source: grpc
    address: "orders.internal:7070"
    arguments:
      type: object
      properties: {order_id: {type: string}, cents: {type: integer, minimum: 1}}
      required: [order_id, cents]
    side_effect: reversible
    repeat: deduplicated
    compensation: {tool: charge, from_args: {order_id: order_id, cents: cents}}
    pivot: true
    scope: payments
    charge: 0.01
  - name: charge
    source: grpc
    address: "orders.internal:7070"
    arguments: {type: object, properties: {order_id: {type: string}, cents: {type: integer}}}
    side_effect: irreversible
    needs_approval: false
trajectories: [{id: a, grants: [lookup_order, refund]}]
"""

_MCP = """\
mcp_servers:
  git: {command: [mcp-server-git, --repository, repo], cwd: work}
  clock: {url: "http://127.0.0.1:9/mcp", scope: shared-clock}
tools:
  - {name: git_status, source: mcp, server: git}
  - {name: git_commit, source: mcp, server: git, side_effect: irreversible, repeat: never_repeat}
  - {name: git_log, source: mcp, server: git, side_effect: irreversible}
  - {name: now, source: mcp, server: clock, remote: get_current_time}
trajectories: [{id: a, grants: [git_status, git_commit, now]}]
"""

_STATUS_SCHEMA = {
    "type": "object",
    "properties": {"repo_path": {"type": "string"}},
    "required": ["repo_path"],
}
_CATALOG = {
    "git": {
        "git_status": ServerHints("Working tree status", _STATUS_SCHEMA, read_only=True, idempotent=True),
        "git_commit": ServerHints("Records changes", _STATUS_SCHEMA, read_only=False, destructive=False),
        "git_log": ServerHints("Commit log", _STATUS_SCHEMA, read_only=True, idempotent=True),
    },
    "clock": {"get_current_time": ServerHints("Now", {"type": "object"}, read_only=True)},
}


def test_grpc_tools_declare_their_contracts_and_the_launch_carries_them() -> None:
    # Given a workload declaring three tools of its own gRPC service
    wl = parse_workload(_GRPC, "w.yaml")
    # When the contracts are resolved and planned into a launch
    contracts, notes = resolve_tool_contracts(wl)
    [(_, launch)] = plan_launches(
        wl, run_id="r", redis_url="redis://x", base_url="http://p", testbed_address=None, created_at=1.0
    )
    # Then each contract is what was declared, the safe defaults filling the rest
    lookup, refund = contracts["lookup_order"], contracts["refund"]
    assert (lookup.side_effect, lookup.repeat, lookup.scope) == (
        SideEffect.READ_ONLY,
        RepeatContract.IDEMPOTENT,
        "grpc-orders.internal:7070",
    )
    assert (refund.repeat, refund.pivot, refund.scope, refund.charge) == (
        RepeatContract.DEDUPLICATED,
        True,
        "payments",
        0.01,
    )
    assert contracts["charge"].repeat is RepeatContract.NEVER_REPEAT and not notes
    # And the launch routes them to the address with the resolved contracts, which build runtime contracts
    assert launch.tool_routes == dict.fromkeys(["lookup_order", "refund", "charge"], "orders.internal:7070")
    built = launch.tool_contracts["refund"].build("refund")
    assert built.pivot and built.compensation is not None and built.compensation.tool == "charge"


_CANDIDATE = """\
tools:
  - {name: apply_patch, source: grpc, address: "127.0.0.1:7000", side_effect: irreversible,
     needs_approval: false, arguments: {type: object}, candidate: revises}
  - {name: run_suite, source: grpc, address: "127.0.0.1:7000", side_effect: read_only,
     arguments: {type: object}, candidate: checks}
trajectories:
  - id: fix
    grants: [apply_patch, run_suite]
    completion_check: {kind: candidate_checked, tools: [run_suite]}
"""


def test_candidate_roles_and_the_candidate_check_reach_the_launch() -> None:
    # Given the docs/tools.md example: one tool revises the candidate, one checks it
    wl = parse_workload(_CANDIDATE, "w.yaml")
    [(_, launch)] = plan_launches(
        wl, run_id="r", redis_url="redis://x", base_url="http://p", testbed_address=None, created_at=1.0
    )
    # Then the runtime contracts carry the roles and the task contract names the required check
    assert launch.tool_contracts["apply_patch"].build("apply_patch").candidate is CandidateRole.REVISES
    assert launch.tool_contracts["run_suite"].build("run_suite").candidate is CandidateRole.CHECKS
    assert (launch.completion_check.name, launch.completion_check.params["tools"]) == (
        "candidate_checked",
        ["run_suite"],
    )


def test_mcp_annotations_set_defaults_and_never_override_a_declaration(tmp_path: Path) -> None:
    # Given MCP tools, some declared, with the servers' listings
    wl = parse_workload(_MCP, "w.yaml")
    # When the contracts are resolved against what the servers listed
    contracts, notes = resolve_tool_contracts(wl, _CATALOG)
    # Then an undeclared tool takes its server's hints (read-only, idempotent) and its schema
    status = contracts["git_status"]
    assert (status.side_effect, status.repeat, status.scope) == (
        SideEffect.READ_ONLY,
        RepeatContract.IDEMPOTENT,
        "mcp-git",
    )
    assert status.arguments == _STATUS_SCHEMA and status.description == "Working tree status"
    # And a declaration stands against the server's hint: git_log says read-only, the workload irreversible
    log = contracts["git_log"]
    assert log.side_effect is SideEffect.IRREVERSIBLE and log.build("git_log").requires_approval
    commit = contracts["git_commit"]
    assert (commit.side_effect, commit.repeat) == (SideEffect.IRREVERSIBLE, RepeatContract.NEVER_REPEAT)
    # And the renamed tool, on a server with its own scope
    assert contracts["now"].scope == "shared-clock" and not notes
    # And the launch routes Tether names to (server, remote name) with the stdio cwd made absolute
    [(_, launch)] = plan_launches(
        wl,
        run_id="r",
        redis_url="redis://x",
        base_url="http://p",
        testbed_address=None,
        created_at=1.0,
        mcp_catalog=_CATALOG,
        base_dir=tmp_path,
    )
    assert launch.mcp_tools["now"].remote == "get_current_time"
    assert launch.mcp_servers["git"].cwd == str((tmp_path / "work").resolve())


def test_a_declared_read_only_tool_the_server_calls_destructive_is_noted() -> None:
    # Given a tool declared read-only whose server marks it destructive
    wl = parse_workload(
        _MCP.replace(
            "{name: git_status, source: mcp, server: git}",
            "{name: git_status, source: mcp, server: git, side_effect: read_only}",
        ),
        "w.yaml",
    )
    catalog = {
        **_CATALOG,
        "git": {
            **_CATALOG["git"],
            "git_status": ServerHints(None, _STATUS_SCHEMA, read_only=False, destructive=True),
        },
    }
    # When resolved
    contracts, notes = resolve_tool_contracts(wl, catalog)
    # Then the declaration stands and the disagreement is reported
    assert contracts["git_status"].side_effect is SideEffect.READ_ONLY
    assert any("git_status" in n and "destructiveHint=True" in n for n in notes)


def test_an_mcp_tool_the_server_does_not_offer_is_named_with_its_path() -> None:
    # Given a server that does not list git_log
    wl = parse_workload(_MCP, "w.yaml")
    catalog = {**_CATALOG, "git": {k: v for k, v in _CATALOG["git"].items() if k != "git_log"}}
    # When resolved, Then the error names the tool's path and what the server offers
    with pytest.raises(
        WorkloadError,
        match=r"tools\[2\]\.name: MCP server 'git' has no tool 'git_log'; it offers: git_commit, git_status",
    ):
        resolve_tool_contracts(wl, catalog, source="w.yaml")


def _bad(doc: str) -> str:
    with pytest.raises(WorkloadError) as info:
        parse_workload(textwrap.dedent(doc), "bad.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (
            "tools: [{name: lookup, source: grpc, address: 'h:1'}]\ntrajectories: [{id: a}]\n",
            "grpc tool 'lookup' needs its contract declared: arguments, side_effect",
        ),
        (
            "tools: [{name: lookup, source: grpc, address: 'h:1', side_effect: sometimes, arguments: {}}]\n"
            "trajectories: [{id: a}]\n",
            "line 1, tools[0].side_effect: Input should be 'read_only', 'reversible' or 'irreversible'",
        ),
        (
            "tools:\n  - name: lookup\n    source: grpc\n    address: 'h:1'\n    side_effect: read_only\n"
            "    arguments: {type: object, properties: {n: {type: integr}}}\n"
            "trajectories: [{id: a}]\n",
            "line 6, tools[0].arguments: Value error, arguments.properties.n.type: not a valid JSON Schema",
        ),
        (
            "tools: [{name: run_tests, side_effect: read_only}]\ntrajectories: [{id: a}]\n",
            "testbed tool 'run_tests' has its contract built in; remove side_effect",
        ),
        (
            "tools: [{name: t, source: grpc, address: 'h:1', side_effect: reversible, arguments: {}}]\n"
            "trajectories: [{id: a}]\n",
            "reversible tool must declare its compensation",
        ),
        (
            "tools: [{name: t, source: grpc, address: 'h:1', side_effect: irreversible, arguments: {},"
            " compensation: {tool: undo}}]\ntrajectories: [{id: a}]\n",
            "tools[0].compensation.tool 'undo' is not a declared tool",
        ),
        (
            "tools: [{name: t, source: mcp}]\ntrajectories: [{id: a}]\n",
            "mcp tool 't' needs server",
        ),
        (
            "tools: [{name: t, source: mcp, server: nowhere}]\ntrajectories: [{id: a}]\n",
            "tools[0].server 'nowhere' is not under mcp_servers (declared: none)",
        ),
        (
            "mcp_servers: {g: {command: [x]}}\ntools: [{name: t, source: mcp, server: g, probe: true}]\n"
            "trajectories: [{id: a}]\n",
            "MCP has no result recovery",
        ),
        (
            "mcp_servers: {g: {command: [x], url: 'http://h/mcp'}}\ntrajectories: [{id: a}]\n",
            "mcp_servers.g: Value error, give exactly one of `command`",
        ),
        (
            "mcp_servers: {g: {url: 'ftp://h/mcp'}}\ntrajectories: [{id: a}]\n",
            "line 1, mcp_servers.g.url: Value error, an MCP url is http(s)",
        ),
        (
            "guard: local\nmcp_servers: {g: {command: [x]}}\ntrajectories: [{id: a}]\n",
            "mcp_servers need guard: actor",
        ),
        (
            "tools: [{name: t, source: grpc, address: 'h:1', side_effect: read_only, arguments: {},"
            " candidate: edits}]\ntrajectories: [{id: a}]\n",
            "tools[0].candidate: Input should be 'revises' or 'checks'",
        ),
        (
            "tools: [{name: run_tests}]\n"
            "trajectories: [{id: a, grants: [run_tests], completion_check: {kind: candidate_checked,"
            " tools: [lint]}}]\n",
            "completion_check.tools not in its grants: lint",
        ),
        (
            "trajectories: [{id: a, completion_check: {kind: min_tool_results, tools: [lint]}}]\n",
            "`tools` belongs to the completion check candidate_checked",
        ),
        (
            "tools: [{name: 'has space', source: grpc, address: 'h:1'}]\ntrajectories: [{id: a}]\n",
            "tools[0].name: Value error, a tool name is 1-64 letters",
        ),
    ],
)
def test_bad_contracts_say_what_and_where(doc: str, expected: str) -> None:
    # Given a workload with one mistake, When parsed, Then the error names the file, path and problem
    message = _bad(doc)
    assert message.startswith("bad.yaml") and expected in message, message
