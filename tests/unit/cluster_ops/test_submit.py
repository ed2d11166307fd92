"""Job submission without a cluster: request validation, runtime env, and following a job (fake client)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.submit import DEFAULT_EXCLUDES, JobSubmitter, SubmitRequest, exit_code_for
from runtime.errors import InputError


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "quick start.yaml").write_text("name: q\n")
    (tmp_path / "other").mkdir()
    return tmp_path


@dataclass
class FakeJobClient:
    """Stands in for JobSubmissionClient: records submissions, replays logs and a status sequence."""

    chunks: list[str] = field(default_factory=list)
    statuses: list[str] = field(default_factory=lambda: ["SUCCEEDED"])
    message: str | None = None
    submitted: list[dict[str, Any]] = field(default_factory=list)

    def submit_job(
        self,
        *,
        entrypoint: str,
        runtime_env: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        submission_id: str | None = None,
    ) -> str:
        self.submitted.append(
            {"entrypoint": entrypoint, "runtime_env": runtime_env, "metadata": metadata, "id": submission_id}
        )
        return str(submission_id)

    def get_job_status(self, job_id: str) -> str:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def get_job_info(self, job_id: str) -> Any:
        return type("Info", (), {"message": self.message})()

    async def tail_job_logs(self, job_id: str) -> AsyncIterator[str]:
        for chunk in self.chunks:
            yield chunk


def test_entrypoint_gets_the_workload_path_relative_to_the_working_dir_and_quoted(project: Path) -> None:
    # Given: a workload (with a space in its name) inside the working dir
    request = SubmitRequest(workload=project / "examples" / "quick start.yaml", working_dir=project)

    # When / Then: the default entrypoint runs it by its shipped, relative, shell-quoted path
    assert request.entrypoint_command() == "tether run 'examples/quick start.yaml'"


def test_runtime_env_is_pinned_with_working_dir_excludes_and_env(project: Path) -> None:
    request = SubmitRequest(
        workload=project / "examples" / "quick start.yaml", working_dir=project, env_vars={"A_B": "1"}
    )

    env = request.runtime_env()

    assert env == {
        "working_dir": str(project.resolve()),
        "excludes": list(DEFAULT_EXCLUDES),
        "env_vars": {"A_B": "1"},
    }
    assert ".venv" in env["excludes"] and ".tether" in env["excludes"]


@pytest.mark.parametrize(
    ("workload", "working_dir", "fragment"),
    [
        ("missing.yaml", ".", "is not a file"),
        ("examples/quick start.yaml", "other", "outside the working dir"),
        ("examples/quick start.yaml", "nope", "is not a directory"),
    ],
)
def test_bad_paths_are_refused_naming_what_is_wrong(
    project: Path, workload: str, working_dir: str, fragment: str
) -> None:
    request = SubmitRequest(workload=project / workload, working_dir=project / working_dir)

    with pytest.raises(InputError, match=fragment):
        request.entrypoint_command()


@pytest.mark.parametrize(
    "kwargs",
    [{"entrypoint": ""}, {"env_vars": {"BAD-NAME": "x"}}, {"submission_id": "has space"}],
)
def test_invalid_request_fields_are_rejected(project: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SubmitRequest(workload=project / "examples" / "quick start.yaml", **kwargs)


def test_entrypoint_with_an_unknown_placeholder_is_an_input_error(project: Path) -> None:
    request = SubmitRequest(
        workload=project / "examples" / "quick start.yaml", working_dir=project, entrypoint="x {y}"
    )

    with pytest.raises(InputError, match="only \\{workload\\}"):
        request.entrypoint_command()


def test_address_must_be_an_http_url() -> None:
    with pytest.raises(InputError, match="http"):
        JobSubmitter("ray://head:10001", client=FakeJobClient())


def test_submit_sends_entrypoint_runtime_env_and_workload_metadata(project: Path) -> None:
    client = FakeJobClient()
    request = SubmitRequest(
        workload=project / "examples" / "quick start.yaml", working_dir=project, submission_id="job-1"
    )

    job_id = JobSubmitter("http://head:8265", client=client).submit(request)

    assert job_id == "job-1"
    (sent,) = client.submitted
    assert sent["entrypoint"] == "tether run 'examples/quick start.yaml'"
    assert sent["runtime_env"]["working_dir"] == str(project.resolve())
    assert sent["metadata"] == {"tether.workload": "examples/quick start.yaml"}


@pytest.mark.parametrize(
    ("statuses", "expected_status", "expected_code"),
    [
        (["SUCCEEDED"], "SUCCEEDED", 0),
        (["RUNNING", "FAILED"], "FAILED", 1),
        (["STOPPED"], "STOPPED", 3),
    ],
)
def test_wait_streams_every_chunk_then_reports_the_terminal_status(
    statuses: list[str], expected_status: str, expected_code: int
) -> None:
    # Given: a job whose logs arrive in chunks and whose record may lag the end of the logs
    client = FakeJobClient(chunks=["a\n", "b\n"], statuses=statuses, message="done")
    seen: list[str] = []

    # When: the submitter follows it
    outcome = JobSubmitter("http://head:8265", client=client).wait("job-1", seen.append, poll_interval=0)

    # Then: every chunk reached the sink in order and the outcome carries the terminal status and its code
    assert seen == ["a\n", "b\n"]
    assert (outcome.status, outcome.exit_code, outcome.message) == (expected_status, expected_code, "done")


@pytest.mark.parametrize(("status", "code"), [("SUCCEEDED", 0), ("FAILED", 1), ("STOPPED", 3)])
def test_exit_codes_for_terminal_statuses(status: str, code: int) -> None:
    assert exit_code_for(status) == code


def test_a_non_terminal_status_has_no_exit_code() -> None:
    with pytest.raises(InputError, match="not terminal"):
        exit_code_for("RUNNING")
