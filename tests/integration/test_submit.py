"""``tether submit --wait`` against a real ``ray start --head`` with the job API (dashboard) on a free port.

Two kinds of job: a stub script that checks what was shipped (working dir, excludes, pinned environment),
and the real thing, ``tether run examples/submit.yaml`` as the job's entrypoint (its own embedded Redis,
simulated provider and testbed tools next to the job's driver; trajectory actors on the cluster), submitted
both through ``tether submit --wait`` and through the plain ``ray job submit --working-dir DIR -- ...``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cluster.cli_submit import register
from cluster.fake_cluster import RayHead

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "submit.yaml"
# Inside a Ray job RAY_ADDRESS names the cluster; `--address auto` makes tether run join it.
JOINING_ENTRYPOINT = "tether run --address auto {workload}"

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


def _submit(
    head: RayHead, project: Path, entrypoint: str | None, *extra: str, workload: str = "workload.yaml"
) -> tuple[int, str, str]:
    chosen = [] if entrypoint is None else ["--entrypoint", entrypoint]
    result = CliRunner().invoke(
        _cli(),
        [
            "submit",
            str(project / workload),
            "--address",
            head.dashboard_url,
            "--working-dir",
            str(project),
            *chosen,
            "--env",
            "TETHER_MARK=pinned",
            "--wait",
            *extra,
        ],
    )
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def real_project(tmp_path: Path) -> Path:
    """A working dir holding the three-trajectory example workload (the code is installed on the cluster)."""
    shutil.copy(EXAMPLE, tmp_path / "submit.yaml")
    return tmp_path


def assert_summary(logs: str) -> None:
    """The job's own output: tether run's summary table of the example, every trajectory as expected."""
    assert "submit-smoke: 3 trajectories in" in logs
    for name in ("fix-bug", "find-package", "over-budget"):
        assert name in logs
    assert "states {'COMPLETED': 2, 'FAILED': 1}" in logs
    assert "BUDGET_EXCEEDED" in logs


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


def test_submit_wait_runs_a_real_workload_through_tether_run(ray_head: RayHead, real_project: Path) -> None:
    # Given: a head and a working dir with the three-trajectory example
    # When: it is submitted with --wait, the job running tether run on the cluster
    code, out, err = _submit(ray_head, real_project, JOINING_ENTRYPOINT, workload="submit.yaml")

    # Then: the job succeeded (every trajectory ended as expected) and its logs carry the summary
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert out.splitlines()[0].startswith("tether-submit-")
    assert_summary(out)
    assert "SUCCEEDED" in err


@pytest.mark.long  # a third job submission (~30 s); make test keeps the explicit-entrypoint and failing ones
def test_submit_wait_with_the_default_entrypoint_runs_the_workload(
    ray_head: RayHead, real_project: Path
) -> None:
    # Given / When: the example submitted with tether submit's own default entrypoint
    code, out, err = _submit(ray_head, real_project, None, workload="submit.yaml")

    # Then: it succeeds like the explicit one
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert_summary(out)


@pytest.mark.long  # the same workload through plain `ray job submit` (~30 s)
def test_plain_ray_job_submit_runs_the_workload(ray_head: RayHead, real_project: Path) -> None:
    # Given: Ray's own CLI, next to this Python
    ray_cli = Path(sys.executable).parent / "ray"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    # When: `ray job submit --working-dir DIR -- tether run --address auto submit.yaml` (waits by default)
    done = subprocess.run(
        [
            str(ray_cli),
            "job",
            "submit",
            "--address",
            ray_head.dashboard_url,
            "--working-dir",
            str(real_project),
            "--",
            *JOINING_ENTRYPOINT.format(workload="submit.yaml").split(),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )

    # Then: it exits 0 and the followed logs carry tether run's summary
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert_summary(done.stdout)
    assert "succeeded" in (done.stdout + done.stderr).lower()
