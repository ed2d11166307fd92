"""The complete workloads in docs/tools.md and examples/mcp.yaml are valid (docs that cannot drift)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.workload import ToolSource, WorkloadError, load_workload, parse_workload

ROOT = Path(__file__).resolve().parents[3]


def _yaml_blocks(path: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(2))
def test_the_complete_workloads_in_docs_tools_parse(index: int) -> None:
    # Given the complete workloads of "Bring your own tools" (an MCP one and a gRPC one)
    blocks = [b for b in _yaml_blocks(ROOT / "docs" / "tools.md") if "trajectories:" in b]
    # When parsed, Then they validate
    workload = parse_workload(blocks[index], f"docs/tools.md[{index}]")
    assert {t.source for t in workload.tools} <= {ToolSource.MCP, ToolSource.GRPC}


def test_the_mcp_example_parses_and_declares_the_commit_irreversible() -> None:
    workload = load_workload(ROOT / "examples" / "mcp.yaml")
    commit = next(t for t in workload.tools if t.name == "git_commit")
    assert (commit.side_effect, commit.repeat) == ("irreversible", "never_repeat")


def test_the_error_quoted_in_the_docs_is_what_a_user_gets() -> None:
    with pytest.raises(WorkloadError) as info:
        parse_workload(
            "tools:\n  - {name: lookup, source: grpc, address: 'h:1'}\ntrajectories: [{id: a}]\n", "bad.yaml"
        )
    assert (
        "line 2, tools[0]: Value error, grpc tool 'lookup' needs its contract declared: "
        "arguments, side_effect" in str(info.value)
    )
