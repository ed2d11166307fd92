"""``tether run``'s driver on a local Ray: a small workload ends in the states its scripts imply, the report
has exactly the shape issue 3 specifies, and a bad workload is a clear error (exit 2, no traceback)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cluster.cli_run import register
from cluster.runner import RunOptions, Services, run_driver, write_timeline_png
from cluster.workload import parse_workload

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

WORKLOAD = """\
name: small
provider:
  kind: simulated
  model: sim-small
  limits: {tpm: 100000, rpm: 600}
  latency: {ttft_ms: 5, tokens_per_s: 5000}
tools:
  - {name: run_tests}
  - {name: send_notification}
  - {name: noop, source: builtin}
approval_timeout_s: 2
guard: actor
trajectories:
  - id: fix
    scenario: "finish_after:2"
    grants: [run_tests]
    completion_check: {kind: min_tool_results, count: 2}
    expected_state: COMPLETED
  - id: local-tool
    class: batch
    scenario: "finish_after:1"
    grants: [noop]
    expected_state: COMPLETED
  - id: unapproved
    class: interactive
    scenario: "irreversible:send_notification"
    grants: [send_notification]
    completion_check: {kind: tool_succeeded, tool: send_notification}
    expected_state: FAILED
  - id: budget
    scenario: "finish_after:9"
    grants: [run_tests]
    budget: {turns: 2}
    expected_state: FAILED
"""


LOCAL_WORKLOAD = """\
name: local
provider: {kind: simulated, model: sim-small}
tools: [{name: noop, source: builtin}]
scheduler: false
guard: local
trajectories: [{id: a, grants: [noop]}]
"""


def test_a_local_run_keeps_ray_on_loopback_and_runs_its_relays(
    no_shared_ray: None, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given no Ray in this process
    import ray

    assert not ray.is_initialized()
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    workload = parse_workload(LOCAL_WORKLOAD, "local.yaml")
    # When tether run's services start their own local Ray with two relays
    with Services(workload, RunOptions(relays=2)) as services:
        # Then every node of it is on loopback, and the relays are up
        assert services.started_ray
        assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}
        assert [ray.get(h.stats.remote())["running"] for h in services.relay_handles] == [True, True]
    # And everything it started is stopped with it
    assert not ray.is_initialized()


async def test_small_workload_ends_in_expected_states_with_the_specified_report(
    ray_local: None, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a workload of four scripted trajectories and a Redis of our own
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    workload = parse_workload(WORKLOAD, "small.yaml")
    options = RunOptions(run_id="itest")
    # When tether run's driver runs it (the provider and the testbed tools start as subprocesses)
    with Services(workload, options) as services:
        result = await _run_in_thread(workload, services, options)
    # Then every trajectory ended as its script implies
    by_name = {r.name: r for r in result.results}
    assert {n: (r.state, r.exit_reason) for n, r in by_name.items()} == {
        "fix": ("COMPLETED", "COMPLETED"),
        "local-tool": ("COMPLETED", "COMPLETED"),
        "unapproved": ("FAILED", "COMPLETION_CHECK_FAILED"),
        "budget": ("FAILED", "BUDGET_EXCEEDED"),
    }
    assert not result.unexpected and by_name["budget"].binding_dimension == "turns"
    # And the report has exactly the specified keys; the provider saw one request per turn, no 429
    report = json.loads(json.dumps(result.report()))
    # (issue 11 adds the ledger, handoff packets and operator actions; issue 12 the supervision section)
    assert set(report) == {
        "summary",
        "trajectories",
        "provider",
        "ledger",
        "handoff",
        "operator_actions",
        "supervision",
    }
    assert set(report["summary"]) == {
        "states",
        "exit_reasons",
        "tokens",
        "dollars",
        "rungs",  # issue 12: each result's rung and completeness, escalations, incidents
        "results",
        "degraded_result_rate",
    }
    assert report["summary"]["states"] == {"COMPLETED": 2, "FAILED": 2}
    assert report["summary"]["rungs"] == {"full": 4} and report["summary"]["degraded_result_rate"] == 0.0
    assert set(report["supervision"]) == {"escalations", "incidents", "quarantined_artifacts"}
    assert report["supervision"]["escalations"]["by_trigger"]["approval_request"] == 1
    keys = {"id", "state", "exit_reason", "turns", "tokens", "dollars", "binding_dimension"}
    keys |= {"rung", "result", "escalations", "children"}
    assert all(set(t) == keys for t in report["trajectories"])
    assert {t["id"] for t in report["trajectories"]} == {f"itest.{n}" for n in by_name}
    provider = report["provider"]
    assert (provider["requests"], provider["rate_limited"]) == (sum(r.turns for r in result.results), 0)
    assert provider["simulated"] == {"requests": provider["requests"], "rate_limited": 0}
    # And the scheduler's view of the same key sits beside it: every call admitted, none rate limited
    (lane,) = provider["scheduler"].values()
    assert (lane["granted"], lane["rate_limited"]) == (provider["requests"], 0)
    assert report["summary"]["tokens"] == sum(r.tokens for r in result.results) > 0
    # And the timeline picture is written beside the report
    png = write_timeline_png(result, tmp_path / "report.png", "small")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


APPROVAL_WORKLOAD = """\
name: approve-during-run
provider: {kind: simulated, model: sim-small}
tools: [{name: send_notification}]
approval_timeout_s: 120
scheduler: false
trajectories:
  - id: notify
    scenario: "irreversible:send_notification"
    grants: [send_notification]
    completion_check: {kind: tool_succeeded, tool: send_notification}
    expected_state: COMPLETED
"""


async def test_an_operator_approves_a_held_call_while_tether_run_is_going(
    ray_local: None, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run whose only trajectory holds an irreversible call for approval (nobody else decides)
    import asyncio

    from cluster.control_client import ControlClient

    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    workload = parse_workload(APPROVAL_WORKLOAD, "approve.yaml")
    options = RunOptions(run_id="approve")
    with Services(workload, options) as services:
        assert services.keyring_path is not None  # the local run created the default operator key
        stop = threading.Event()
        running = asyncio.ensure_future(_run_in_thread(workload, services, options, stop))
        client = ControlClient.from_url(redis_url, keyring=Path(services.keyring_path))
        try:
            held = await _held_call(client, "approve.notify", running)
            # When the operator approves it through the control stream, as `tether approve` does
            await client.approve("approve.notify", issuer="operator", call_digest=held)
            result = await running
        finally:
            stop.set()  # a failed test must not leave the driver's thread waiting behind it
            await client.close()
    # Then the run's own relay delivered it: the call ran and the trajectory completed
    (only,) = result.results
    assert (only.state, only.exit_reason) == ("COMPLETED", "COMPLETED")


async def _held_call(client, trajectory_id: str, running) -> str:  # type: ignore[no-untyped-def]
    import asyncio

    for _ in range(1200):
        assert not running.done(), "the run ended before the call was held"
        for view in await client.pending():
            if view.trajectory_id == trajectory_id:
                return str(view.digest)
        await asyncio.sleep(0.05)
    raise AssertionError(f"{trajectory_id} never held a call")


async def _run_in_thread(workload, services, options, stop=None):  # type: ignore[no-untyped-def]
    # run_driver owns its event loop (asyncio.run), as in the CLI; keep it off the test's loop. However the
    # test ends, the driver stops waiting, so its thread never outlives the test.
    import asyncio

    stop = stop or threading.Event()
    try:
        return await asyncio.to_thread(run_driver, workload, services, options, None, stop)
    finally:
        stop.set()


def _cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # a group, so the command is invoked by name as on the real CLI
        return None

    register(app)
    return app


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trajectories:\n  - id: a\n    scenario: 'teleport:3'\n", "trajectories[0].scenario"),
        ("tools: [{name: rm_rf}]\ntrajectories: [{id: a}]\n", "testbed tool 'rm_rf' is unknown"),
        ("trajectories:\n  - id: a\n    grants: [run_tests]\n", "grants names undeclared tools: run_tests"),
    ],
)
def test_bad_workload_exits_2_with_the_message_and_no_traceback(
    tmp_path: Path, text: str, expected: str
) -> None:
    # Given a workload file with one mistake
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    # When tether run reads it
    result = CliRunner().invoke(_cli(), ["run", str(path)])
    # Then it exits 2 naming the file and the problem, before starting anything
    assert result.exit_code == 2, result.output
    assert str(path) in result.output and expected in result.output
    assert "Traceback" not in result.output
