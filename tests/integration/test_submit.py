"""``tether submit --wait`` against a real ``ray start --head`` with the job API (dashboard) on a free port.

The entrypoint is a parameter: today a stub script that checks what was shipped; once ``tether run``
exists the same test runs ``tether run examples/quickstart.yaml`` by passing ``DEFAULT_ENTRYPOINT``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cluster.cli_submit import register
from cluster.fake_cluster import RayHead

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

# Checks, on the cluster, that the working dir arrived without the excluded local state and that the pinned
# environment variable is set; then prints a marker the test looks for in the streamed logs.
_CHECK_JOB = textwrap.dedent(
    """
    import os, pathlib, sys
    workload = pathlib.Path(sys.argv[1])
    assert workload.read_text().startswith("name: shipped"), "workload not shipped"
    assert not pathlib.Path(".tether").exists(), "excluded .tether was shipped"
    assert os.environ["TETHER_MARK"] == "pinned", "env var not pinned"
    print("STUB-WORKLOAD-RAN", workload.name, flush=True)
    """
)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    head = RayHead(num_cpus=1, include_dashboard=True).start()
    try:
        yield head
    finally:
        head.stop()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A tiny working dir: a workload, the stub entrypoint, and local state that must not be shipped."""
    (tmp_path / "workload.yaml").write_text("name: shipped\n")
    (tmp_path / "check_job.py").write_text(_CHECK_JOB)
    (tmp_path / ".tether").mkdir()
    (tmp_path / ".tether" / "local-state.json").write_text("{}")
    return tmp_path


def _cli() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # keeps `submit` a named subcommand, as in the real CLI
        pass

    return app


def _submit(head: RayHead, project: Path, entrypoint: str, *extra: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        _cli(),
        [
            "submit",
            str(project / "workload.yaml"),
            "--address",
            head.dashboard_url,
            "--working-dir",
            str(project),
            "--entrypoint",
            entrypoint,
            "--env",
            "TETHER_MARK=pinned",
            "--wait",
            *extra,
        ],
    )
    return result.exit_code, result.stdout, result.stderr


def test_submit_wait_streams_logs_and_exits_zero_when_the_job_succeeds(
    ray_head: RayHead, project: Path
) -> None:
    # Given: a running head and a working dir with a workload
    # When: the workload is submitted with --wait
    code, out, err = _submit(ray_head, project, "python check_job.py {workload}")

    # Then: the job id is printed first, the job's own output is streamed, and the exit code is success
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    job_id = out.splitlines()[0]
    assert job_id.startswith("tether-workload-")
    assert "STUB-WORKLOAD-RAN workload.yaml" in out
    assert f"job {job_id} SUCCEEDED" in err


def test_submit_wait_exits_one_when_the_job_fails(ray_head: RayHead, project: Path) -> None:
    # Given: an entrypoint that fails on the cluster
    # When: it is submitted with --wait
    code, out, err = _submit(ray_head, project, "python -c 'import sys; print(\"FAILING\"); sys.exit(7)'")

    # Then: the failure is streamed and reported, and the exit code says failed
    assert code == 1, f"stdout:\n{out}\nstderr:\n{err}"
    assert "FAILING" in out
    assert "FAILED" in err
