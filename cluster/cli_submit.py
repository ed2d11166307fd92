"""``tether submit``: run a workload as a Ray job on a cluster (see cluster/submit.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from cluster.submit import DEFAULT_ENTRYPOINT, JobSubmitter, SubmitRequest
from runtime.errors import DependencyError, InputError

__all__ = ["register"]


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InputError(f"--env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def submit(
    workload: Path = typer.Argument(..., help="Workload YAML, inside the working dir."),
    address: str = typer.Option(
        "http://127.0.0.1:8265",
        "--address",
        envvar="RAY_API_SERVER_ADDRESS",
        help="The head's job API (dashboard) URL, http://HEAD:8265.",
    ),
    wait: bool = typer.Option(False, "--wait", help="Stream the job's logs and exit with its status."),
    working_dir: Path = typer.Option(Path("."), "--working-dir", help="Directory shipped with the job."),
    entrypoint: str = typer.Option(
        DEFAULT_ENTRYPOINT, "--entrypoint", help="Command the job runs; {workload} is the workload path."
    ),
    env: list[str] = typer.Option([], "--env", help="NAME=VALUE set in the job's environment (repeatable)."),
    submission_id: str | None = typer.Option(
        None, "--submission-id", help="Job id to use (default: generated)."
    ),
) -> None:
    """Submit WORKLOAD as a Ray job and print its id.

    With --wait, follow its logs and exit 0 / 1 / 3 when it succeeded / failed / was stopped.
    Bad input exits 2, an unreachable cluster 4.
    """
    try:
        request = SubmitRequest(
            workload=workload,
            working_dir=working_dir,
            entrypoint=entrypoint,
            env_vars=_parse_env(env),
            submission_id=submission_id,
        )
        request.entrypoint_command()  # validate paths before contacting the cluster
        submitter = JobSubmitter(address)
        job_id = submitter.submit(request)
    except (InputError, DependencyError, ValueError) as e:
        typer.echo(f"tether submit: {e}", err=True)
        raise typer.Exit(4 if isinstance(e, DependencyError) else 2) from e
    typer.echo(job_id)
    if not wait:
        typer.echo(f"follow it with: ray job logs --address {address} --follow {job_id}", err=True)
        return
    try:
        outcome = submitter.wait(job_id, sink=lambda chunk: typer.echo(chunk, nl=False))
    except KeyboardInterrupt:
        typer.echo(
            f"\nstopped following; the job keeps running: ray job stop --address {address} {job_id}", err=True
        )
        raise typer.Exit(130) from None
    detail = f": {outcome.message}" if outcome.message else ""
    typer.echo(f"job {job_id} {outcome.status}{detail}", err=True)
    raise typer.Exit(outcome.exit_code)


def register(app: typer.Typer) -> None:
    """Add ``tether submit`` to the CLI."""
    app.command("submit")(submit)
