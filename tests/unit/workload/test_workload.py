"""Workload files: valid documents expand; bad ones name file, path, line and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.workload import WorkloadError, load_workload, parse_workload

GOOD = """\
name: t
provider:
  kind: simulated
  limits: {tpm: 1000, rpm: 10}
tools:
  - name: run_tests
trajectories:
  - id: a
    count: 3
    class: batch
    grants: [run_tests]
  - id: solo
"""


def test_valid_workload_expands_templates() -> None:
    # Given a workload with a 3-count template and a single trajectory
    wl = parse_workload(GOOD, "good.yaml")
    # When it is expanded
    ids = [t.id for t in wl.expanded()]
    # Then every copy has its own id and the template's settings
    assert ids == ["a-0", "a-1", "a-2", "solo"]
    assert {t.priority_class for t in wl.expanded()[:3]} == {"batch"}
    assert wl.provider.limits.tpm == 1000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trajectories: []\n", "line 1, trajectories: Tuple should have at least 1 item"),
        ("trajectories:\n  - id: a\n    class: vip\n", "class 'vip' is not declared"),
        ("trajectories:\n  - id: a\n    grants: [nope]\n", "grants names undeclared tools: nope"),
        ("trajectories:\n  - id: a\n  - id: a\n", "trajectory id 'a' is used twice"),
        ("trajectories:\n  - id: a\n    budget: {turns: -1}\n", "line 3, trajectories[0].budget.turns"),
        ("trajectories:\n  - id: a\n    bogus: 1\n", "line 3, trajectories[0].bogus: Extra inputs"),
        ("provider: {kind: openai_compatible}\ntrajectories: [{id: a}]\n", "needs base_url"),
        (
            "provider: {top_class_reserve: 0.5}\ntrajectories: [{id: a}]\n",
            "provider.top_class_reserve: Input should be less than 0.5",
        ),
        ("- just a list\n", "expected a mapping at the top level"),
        ("trajectories: [\n", "not valid YAML"),
        ("trajectories:\n  - id: 'has space'\n", "id must be 1-96 characters"),
        (
            "testbed_faults: {nope: {mode: fail, status: UNAVAILABLE}}\ntrajectories: [{id: a}]\n",
            "unknown service 'nope'",
        ),
        (
            "testbed_faults: {env-provisioner: [{mode: fail, status: UNAVAILABLE}, {mode: bogus}]}\n"
            "trajectories: [{id: a}]\n",
            "testbed_faults.env-provisioner[1]",
        ),
    ],
)
def test_bad_workloads_say_what_and_where(text: str, expected: str) -> None:
    # Given a malformed document / When it is parsed / Then the error names the file and the problem
    with pytest.raises(WorkloadError) as info:
        parse_workload(text, "bad.yaml")
    message = str(info.value)
    assert message.startswith("bad.yaml"), message
    assert expected in message, message


def test_testbed_faults_take_a_plan_or_a_list_of_rules_per_service() -> None:
    # Given a workload giving one service a plan and another a list of rules
    text = (
        "testbed_faults:\n  env-provisioner: {mode: fail, status: UNAVAILABLE, count: 1}\n"
        "  notifier: [{mode: drop_reply, trajectories: [a]}, {mode: fail, status: UNAVAILABLE}]\n"
        "trajectories: [{id: a}]\n"
    )
    # When it is parsed / Then both forms are kept as given
    wl = parse_workload(text, "faults.yaml")
    assert wl.testbed_faults["env-provisioner"] == {"mode": "fail", "status": "UNAVAILABLE", "count": 1}
    assert [r["mode"] for r in wl.testbed_faults["notifier"]] == ["drop_reply", "fail"]  # type: ignore[index]


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no such file"):
        load_workload(tmp_path / "absent.yaml")


def test_approval_quorum_and_roles_reach_every_launch() -> None:
    # Given a workload asking two signers who together cover operator and secops
    wl = parse_workload(
        "approval_quorum: 2\napproval_roles: [operator, secops]\ntrajectories:\n  - id: a\n  - id: b\n",
        "w.yaml",
    )
    # When its launches are planned
    from cluster.runner import plan_launches

    planned = plan_launches(
        wl, run_id="r", redis_url="redis://x", base_url="http://p", testbed_address=None, created_at=1.0
    )
    # Then every trajectory's gate asks for both (the decider checks them on every approval)
    assert {(launch.approval_quorum, launch.approval_roles) for _, launch in planned} == {
        (2, ("operator", "secops"))
    }


def test_a_quorum_of_zero_is_refused_with_its_field() -> None:
    with pytest.raises(WorkloadError, match="approval_quorum"):
        parse_workload("approval_quorum: 0\ntrajectories:\n  - id: a\n", "w.yaml")
