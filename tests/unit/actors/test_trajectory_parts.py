"""The pure parts of the trajectory actor: launch records, wiring (registry, creation event, policy, tool
routing), in-process tools, the status view, and tether run's planning. No Ray, no Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from actors.launch import CheckLaunch, ProviderLaunch, RetryLaunch, TrajectoryLaunch
from actors.status import status_fields, summarize
from actors.tools_local import LocalTool, LocalToolPort, builtin_tools
from actors.wiring import RoutedToolPort, build_created, build_policy, build_registry
from cluster.runner import plan_launches
from cluster.workload import WorkloadError, parse_workload
from runtime.errors import CodecError, InputError
from runtime.fold import start
from runtime.ports import OutcomeClass, Settlement, ToolInvocation
from runtime.tools import UnknownTool


def launch(**overrides: Any) -> TrajectoryLaunch:
    fields: dict[str, Any] = {
        "trajectory_id": "run.t1",
        "goal": "Fix it.",
        "ceilings": {"turns": 5, "tokens": 1000},
        "grants": ("run_tests", "send_notification"),
        "created_at": 1_700_000_000.0,
        "provider": ProviderLaunch(base_url="http://sim/v1", model="m"),
        "redis_url": "redis://127.0.0.1:1/0",
        "tool_routes": {"run_tests": "h:1", "send_notification": "h:1"},
        "completion_check": CheckLaunch(name="min_tool_results", params={"count": 2}),
    }
    fields.update(overrides)
    return TrajectoryLaunch(**fields)


def invocation(tool: str, key: str, args: dict[str, Any] | None = None) -> ToolInvocation:
    return ToolInvocation("t", f"c-{key}", tool, args or {}, key, f"op-{key}", "a1", time.time() + 5)


# --------------------------------------------------------------------------- launch and wiring


def test_launch_round_trips_through_json_and_bad_json_names_the_field() -> None:
    original = launch()
    assert TrajectoryLaunch.from_json(original.to_json()) == original
    with pytest.raises(CodecError, match="ceilings"):
        TrajectoryLaunch.from_json(original.to_json().replace('"turns":5.0', '"turns":-1'))


def test_a_stored_launch_is_compressed_and_reads_back_exactly() -> None:
    # Given a launch as save_launch stores it, and one stored as plain JSON (before compression)
    original = launch()
    stored = original.to_stored()
    # Then it is smaller than its JSON, and both read back as the same launch
    assert len(stored) < len(original.to_json())
    assert TrajectoryLaunch.from_json(stored) == original
    assert TrajectoryLaunch.from_json(original.to_json().encode()) == original
    # and a truncated one is a CodecError naming the key, not a zlib error
    with pytest.raises(CodecError, match="tether:launch:x"):
        TrajectoryLaunch.from_json(stored[:10], where="tether:launch:x")


def test_creation_event_is_a_pure_function_of_the_launch() -> None:
    # Given the same launch built twice (a re-created actor) / When its creation event is derived
    registry = build_registry(launch())
    first, again = build_created(launch(), registry), build_created(launch(), build_registry(launch()))
    # Then both are equal, read-only tools are derived from the contracts, the deadline is absolute
    assert first == again
    rec = start(first)
    assert rec.grants.read_only_tools == frozenset({"run_tests"})
    assert rec.deadline == 1_700_000_000.0 + 600.0 and rec.limits.model == "m"
    assert rec.contract.completion_check.params == {"count": 2}
    policy = build_policy(launch(), registry)
    assert policy.provider_key == "http://sim/v1|m" and policy.registry is registry
    # the decider's seed is the same in every process (never Python's salted str hash)
    assert policy.rng_seed == build_policy(launch(), registry).rng_seed == 901_592_516
    # a compensation's own attempt budget reaches the decider; the forward budget stays the forward one's
    assert (policy.retry.max_attempts, policy.cleanup_retry.max_attempts) == (3, 8)
    tuned = build_policy(launch(retry=RetryLaunch(max_attempts=2, cleanup_max_attempts=5)), registry)
    assert (tuned.retry.max_attempts, tuned.cleanup_retry.max_attempts) == (2, 5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"grants": ("search_packages",)}, "grants name tools that are not routed: search_packages"),
        ({"tool_routes": {"teleport": "h:1"}}, "no contract for gRPC tool 'teleport'"),
        ({"local_tools": ("rm",)}, "no built-in tool 'rm'"),
    ],
)
def test_inconsistent_launches_are_refused_with_what_and_where(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(InputError, match=message) as info:
        bad = launch(**overrides)
        build_created(bad, build_registry(bad))
    assert "launch[run.t1]" in str(info.value)


def test_the_policy_carries_the_launchs_single_retry_budget() -> None:
    # the decider applies runtime.retry with it (tests/unit/trajectory/test_retry_rule.py)
    policy = build_policy(launch(), build_registry(launch()))
    assert (policy.retry.max_attempts, policy.retry.base_backoff_s) == (3, 0.2)


def test_the_policy_carries_the_launchs_approval_quorum_and_required_roles() -> None:
    # issue 10, defect 5: the decider's role check (tests/unit/trajectory/test_defects.py) needs the roles
    # from the launch; without them no live trajectory could require one
    assert build_policy(launch(), build_registry(launch())).approval_roles == frozenset()
    roled = launch(approval_quorum=2, approval_roles=("secops", "sre"))
    policy = build_policy(roled, build_registry(roled))
    assert (policy.approval_quorum, policy.approval_roles) == (2, frozenset({"secops", "sre"}))


async def test_routed_tool_port_refuses_an_unrouted_tool() -> None:
    port = RoutedToolPort({"noop": LocalToolPort([builtin_tools()["noop"]])})
    assert (await port.invoke(invocation("noop", "k"))).settlement is Settlement.ESTABLISHED
    with pytest.raises(UnknownTool):
        await port.invoke(invocation("rm", "k"))


# --------------------------------------------------------------------------- in-process tools


async def test_local_tools_apply_each_effect_key_once_and_classify_failures() -> None:
    calls: list[int] = []

    def count(args: Any) -> dict[str, int]:
        calls.append(1)
        return {"n": len(calls)}

    def refuse(args: Any) -> None:
        raise InputError("no such suite", where="suite")

    def crash(args: Any) -> None:
        raise RuntimeError("disk on fire")

    base = builtin_tools()["noop"].contract
    tools = [LocalTool(base, count)]
    port = LocalToolPort(tools)
    first, repeat = await port.invoke(invocation("noop", "k1")), await port.invoke(invocation("noop", "k1"))
    assert first == repeat and calls == [1] and port.executions == 1
    found = await port.probe("noop", "k1", 0.0)
    assert found.settlement is Settlement.ESTABLISHED and found.result == {"n": 1}  # the result comes back
    missing = await port.probe("noop", "never-seen", 0.0)
    assert missing.settlement is Settlement.UNKNOWN  # not "absent": we cannot know
    refused = await LocalToolPort([LocalTool(base, refuse)]).invoke(invocation("noop", "k2"))
    crashed = await LocalToolPort([LocalTool(base, crash)]).invoke(invocation("noop", "k3"))
    assert (refused.settlement, refused.outcome_class) == (
        Settlement.ESTABLISHED_ABSENT,
        OutcomeClass.CLIENT_REJECTION,
    )
    assert (crashed.settlement, crashed.outcome_class) == (
        Settlement.UNKNOWN,
        OutcomeClass.INFRASTRUCTURE_FAILURE,
    )
    invalid = await port.invoke(invocation("noop", "k4", {"unexpected": 1}))
    assert invalid.outcome_class is OutcomeClass.CLIENT_REJECTION and calls == [1]


async def test_cancelling_a_running_local_tool_leaves_its_outcome_unknown() -> None:
    port = LocalToolPort([builtin_tools()["sleep"]])
    running = asyncio.ensure_future(port.invoke(invocation("sleep", "k", {"seconds": 30})))
    await asyncio.sleep(0)
    await port.cancel("sleep", "k")
    outcome = await running
    assert outcome.settlement is Settlement.UNKNOWN and outcome.error == "cancelled"


# --------------------------------------------------------------------------- status view and planning


def test_summary_and_status_snapshot_describe_the_record() -> None:
    rec = start(build_created(launch(), build_registry(launch())))
    summary = summarize(rec)
    assert summary == {
        "id": "run.t1",
        "state": "READY",
        "exit_reason": None,
        "turns": 0,
        "tokens": 0,
        "dollars": 0.0,
        "binding_dimension": None,
        "rho": 0.0,
        "hibernated": False,
        "result": {
            "status": "in_progress",
            "rung": "full",
            "done": [],
            "not_done": [],
            "next_action": "wait for the trajectory to end",
        },
        "rung": "full",
        "hold": None,
        "escalations": {},
        "parent_id": None,
        "children": {},
        "spend": {},
    }
    fields = status_fields(rec, hibernated=True, now=12.5)
    assert fields["state"] == "READY" and fields["hibernated"] == "1" and fields["held_digest"] == ""
    assert fields["updated_at"] == "12.500"


def test_plan_expands_templates_and_routes_every_declared_tool() -> None:
    workload = parse_workload(
        """
tools: [{name: run_tests}, {name: noop, source: builtin}]
trajectories:
  - {id: a, count: 2, grants: [run_tests], budget: {turns: 3}}
  - {id: b, class: batch, grants: [noop], completion_check: {kind: tool_succeeded, tool: noop}}
""",
        "w.yaml",
    )
    planned = plan_launches(
        workload,
        run_id="r1",
        redis_url="redis://x:1/0",
        base_url="http://p/v1",
        testbed_address="127.0.0.1:9",
        created_at=5.0,
        workspace_root="/srv/tether/workspaces",
    )
    launches = [launch for _, launch in planned]
    assert {lt.workspace_root for lt in launches} == {"/srv/tether/workspaces"}  # every one gets a sandbox
    assert [lt.trajectory_id for lt in launches] == ["r1.a-0", "r1.a-1", "r1.b"]
    assert all(
        lt.tool_routes == {"run_tests": "127.0.0.1:9"} and lt.local_tools == ("noop",) for lt in launches
    )
    assert launches[0].ceilings["turns"] == 3.0 and launches[2].priority_class == "batch"
    assert launches[2].completion_check.params == {"count": 1, "tool": "noop"}
    for lt in launches:  # every planned launch builds a valid creation event
        start(build_created(lt, build_registry(lt)))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("", None),  # absent: the actor requests tether_trajectory only where a live node declares it
        ("trajectory_resources: {tether_trajectory: 1}\n", {"tether_trajectory": 1.0}),
        ("trajectory_resources: {}\n", {}),
    ],
)
def test_the_workloads_trajectory_resources_reach_every_launch(
    line: str, expected: dict[str, float] | None
) -> None:
    workload = parse_workload(line + "trajectories: [{id: a, count: 2}]\n", "w.yaml")
    planned = plan_launches(
        workload,
        run_id="r",
        redis_url="redis://x:1/0",
        base_url="http://p/v1",
        testbed_address=None,
        created_at=1.0,
    )
    assert [launch.resources for _, launch in planned] == [expected, expected]
    assert TrajectoryLaunch.from_json(planned[0][1].to_json()).resources == expected


def test_a_non_positive_trajectory_resource_is_a_clear_workload_error() -> None:
    with pytest.raises(WorkloadError, match=r"trajectory_resources\.tether_trajectory"):
        parse_workload("trajectory_resources: {tether_trajectory: 0}\ntrajectories: [{id: a}]\n", "w.yaml")
