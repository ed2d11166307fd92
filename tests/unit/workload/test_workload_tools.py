"""Workload extensions for tether run: tools are known by name, scenarios follow the grammar, completion
checks name granted tools, run settings are validated."""

from __future__ import annotations

import pytest

from cluster.workload import WorkloadError, parse_workload


def test_run_settings_and_tool_sources_parse() -> None:
    wl = parse_workload(
        """
tools:
  - {name: run_tests}
  - {name: sleep, source: builtin}
  - {name: search_packages, source: grpc, address: "h:1"}
guard: local
hibernate_after_s: 5
retry: {max_attempts: 2}
trajectories: [{id: a, grants: [sleep], scenario: "parallel:2"}]
""",
        "w.yaml",
    )
    assert (wl.guard, wl.hibernate_after_s, wl.retry.max_attempts) == ("local", 5.0, 2)
    assert [t.source.value for t in wl.tools] == ["testbed", "builtin", "grpc"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tools: [{name: noop}]\ntrajectories: [{id: a}]\n", "testbed tool 'noop' is unknown"),
        ("tools: [{name: rm, source: builtin}]\ntrajectories: [{id: a}]\n", "builtin tool 'rm' is unknown"),
        ("tools: [{name: run_tests, address: 'h:1'}]\ntrajectories: [{id: a}]\n", "only for source grpc"),
        ("trajectories: [{id: a, scenario: 'finish_after:x'}]\n", "line 1, trajectories[0].scenario"),
        (
            "tools: [{name: run_tests}]\ntrajectories:\n  - id: a\n    grants: [run_tests]\n"
            "    completion_check: {kind: tool_succeeded, tool: send_notification}\n",
            "completion_check.tool 'send_notification' is not in its grants",
        ),
        ("guard: sometimes\ntrajectories: [{id: a}]\n", "line 1, guard"),
    ],
)
def test_bad_tool_and_run_settings_say_what_and_where(text: str, expected: str) -> None:
    with pytest.raises(WorkloadError) as info:
        parse_workload(text, "bad.yaml")
    assert str(info.value).startswith("bad.yaml") and expected in str(info.value), str(info.value)
