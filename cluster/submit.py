"""Submit a Tether workload to a Ray cluster as a Ray job, and optionally follow it to the end.

The job is an ordinary Ray job: the working directory is zipped and shipped with it, the entrypoint runs
the workload (``tether run WORKLOAD.yaml`` by default) on the head, and the job's driver connects to the
cluster it runs on. The runtime environment is pinned explicitly (working dir, excludes, environment
variables) rather than inherited from whatever the submitting shell has; no ``pip`` section is set because
the cluster's Python environment already has Tether installed (the image, or here the same venv).
See docs/operations.md.
"""

from __future__ import annotations

import asyncio
import shlex
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime.errors import DependencyError, InputError

__all__ = [
    "DEFAULT_ENTRYPOINT",
    "DEFAULT_EXCLUDES",
    "JobClient",
    "JobOutcome",
    "JobSubmitter",
    "SubmitRequest",
    "exit_code_for",
]

DEFAULT_ENTRYPOINT = "tether run {workload}"
"""Entrypoint template; ``{workload}`` becomes the workload path relative to the working dir, shell-quoted."""

DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".venv",
    ".git",
    ".tether",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    "*.egg-info",
    "benchmarks/results",
)
"""Paths never shipped with a job (gitignore syntax): environments, caches, local state and results.

Ray refuses working dirs over its package size limit, and ``.venv`` alone is far over it.
"""

_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
_EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 3}  # 2 is a usage error, as in typer/click


def _status_name(status: Any) -> str:
    # JobStatus is a (str, Enum): str() of it is "JobStatus.SUCCEEDED", its value is the name we want.
    return str(getattr(status, "value", status))


def exit_code_for(status: str) -> int:
    """Process exit code for a terminal job status: 0 succeeded, 1 failed, 3 stopped."""
    try:
        return _EXIT_CODES[str(status)]
    except KeyError:
        raise InputError(
            f"job status {status!r} is not terminal (expected one of {', '.join(_TERMINAL)})"
        ) from None


class SubmitRequest(BaseModel):
    """What to submit: a workload file inside a working dir, and how to run it."""

    model_config = ConfigDict(frozen=True)

    workload: Path
    working_dir: Path = Path(".")
    entrypoint: str = Field(default=DEFAULT_ENTRYPOINT, min_length=1)
    env_vars: dict[str, str] = Field(default_factory=dict)
    excludes: tuple[str, ...] = DEFAULT_EXCLUDES
    submission_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")

    @field_validator("env_vars")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not name or "=" in name or not name.replace("_", "a").isalnum():
                raise ValueError(
                    f"environment variable name {name!r} must be letters, digits and underscores"
                )
        return value

    def workload_in_working_dir(self) -> str:
        """The workload's path relative to the working dir, as the job will see it."""
        root = self.working_dir.resolve()
        if not root.is_dir():
            raise InputError(f"working dir {self.working_dir} is not a directory")
        workload = (self.workload if self.workload.is_absolute() else Path.cwd() / self.workload).resolve()
        if not workload.is_file():
            raise InputError(f"workload {self.workload} is not a file")
        try:
            return workload.relative_to(root).as_posix()
        except ValueError:
            raise InputError(
                f"workload {self.workload} is outside the working dir {root}: "
                "only the working dir is shipped with the job (pass --working-dir)"
            ) from None

    def entrypoint_command(self) -> str:
        """The shell command the job runs, with the workload path filled in."""
        try:
            return self.entrypoint.format(workload=shlex.quote(self.workload_in_working_dir()))
        except (KeyError, IndexError) as e:
            raise InputError(f"entrypoint {self.entrypoint!r}: only {{workload}} may be substituted") from e

    def runtime_env(self) -> dict[str, Any]:
        """The pinned Ray runtime environment shipped with the job."""
        return {
            "working_dir": str(self.working_dir.resolve()),
            "excludes": list(self.excludes),
            "env_vars": dict(self.env_vars),
        }


class JobClient(Protocol):
    """The slice of ``ray.job_submission.JobSubmissionClient`` this module uses (a fake can stand in)."""

    def submit_job(
        self,
        *,
        entrypoint: str,
        runtime_env: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        submission_id: str | None = None,
    ) -> str: ...

    def get_job_status(self, job_id: str) -> Any: ...

    def get_job_info(self, job_id: str) -> Any: ...

    def tail_job_logs(self, job_id: str) -> Any: ...


class JobOutcome(BaseModel):
    """How a followed job ended."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    status: str
    message: str | None = None

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.status)


def _connect(address: str) -> JobClient:
    from ray.job_submission import JobSubmissionClient

    try:
        client: JobClient = JobSubmissionClient(address)
    except (ConnectionError, RuntimeError) as e:
        raise DependencyError(
            f"cannot reach the Ray job API at {address}: {e} (is the head's dashboard running? "
            "`ray start --head --include-dashboard=true`)"
        ) from e
    return client


class JobSubmitter:
    """Submits workloads to one cluster's job API and follows them."""

    def __init__(self, address: str, client: JobClient | None = None) -> None:
        if not address.startswith(("http://", "https://")):
            raise InputError(f"job API address {address!r} must be an http(s):// URL, e.g. http://HEAD:8265")
        self.address = address
        self._client = client if client is not None else _connect(address)

    def submit(self, request: SubmitRequest, metadata: Mapping[str, str] | None = None) -> str:
        """Submit ``request`` and return the job's submission id."""
        submission_id = request.submission_id or f"tether-{request.workload.stem}-{uuid.uuid4().hex[:8]}"
        return self._client.submit_job(
            entrypoint=request.entrypoint_command(),
            submission_id=submission_id,
            runtime_env=request.runtime_env(),
            metadata={"tether.workload": request.workload_in_working_dir(), **(metadata or {})},
        )

    async def stream_logs(self, job_id: str, sink: Callable[[str], None]) -> None:
        """Pass each chunk of the job's logs to ``sink`` until the job ends."""
        async for chunk in self._client.tail_job_logs(job_id):
            sink(chunk)

    def wait(
        self,
        job_id: str,
        sink: Callable[[str], None],
        settle_timeout: float = 30.0,
        poll_interval: float = 0.5,
    ) -> JobOutcome:
        """Stream the logs until the job ends, then return its terminal status.

        The log stream closes when the job's driver exits; the job record may lag that by a moment, so the
        status is polled for up to ``settle_timeout`` seconds.
        """
        asyncio.run(self.stream_logs(job_id, sink))
        deadline = time.monotonic() + settle_timeout
        status = _status_name(self._client.get_job_status(job_id))
        while status not in _TERMINAL and time.monotonic() < deadline:
            time.sleep(poll_interval)
            status = _status_name(self._client.get_job_status(job_id))
        if status not in _TERMINAL:
            raise DependencyError(
                f"job {job_id}: logs ended but the job is still {status} after {settle_timeout}s"
            )
        info = self._client.get_job_info(job_id)
        return JobOutcome(job_id=job_id, status=status, message=getattr(info, "message", None))
