"""``examples/mcp.yaml`` runs through ``tether run``'s own driver (issue 17): the simulated model scripts
calls to mcp-server-time and mcp-server-git; every trajectory ends in the state its script implies, and the
unapproved commit never reached the repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cluster.runner import RunOptions, Services, run_driver
from cluster.workload import load_workload

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mcp.yaml"


def test_the_mcp_example_runs_as_its_scripts_imply(
    ray_local: None, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the example workload, run from a fresh directory (its git server makes a scratch repository here)
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    workload = load_workload(EXAMPLE)
    # When tether run's services and driver run it
    with Services(workload, RunOptions()) as services:
        listed = {server: sorted(tools) for server, tools in services.mcp_catalog.items()}
        result = run_driver(workload, services, RunOptions(run_id="mcp-example", poll_s=0.1))
    # Then the servers' tools were listed at start, and every trajectory ended as expected
    assert "get_current_time" in listed["time"] and "git_commit" in listed["git"]
    assert not result.unexpected, [(r.name, r.state, r.exit_reason, r.error) for r in result.unexpected]
    # And the repository shows the staged notes but no commit: the commit waited for an approval that
    # never came
    repo = tmp_path / ".tether" / "mcp-demo"
    staged = subprocess.run(
        ["git", "-C", str(repo), "diff", "--cached", "--name-only"],
        capture_output=True,
        text=True,
        check=True,
    )
    log = subprocess.run(["git", "-C", str(repo), "log", "--oneline"], capture_output=True, text=True)
    assert staged.stdout.split() == ["NOTES.txt"]
    assert log.returncode != 0 or log.stdout == ""
