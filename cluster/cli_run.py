"""``tether run WORKLOAD.yaml``: run every trajectory of a workload to its end (see cluster/runner.py).

Exit codes: 0 every trajectory ended as expected; 1 some ended in another state than its
``expected_state`` (or its actor failed); 2 bad workload or options; 4 a dependency (Redis, Ray, the
provider) could not be reached; 130 interrupted by Ctrl-C or SIGTERM (everything started was stopped).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cluster.runner import RunOptions, RunResult, Services, run_driver, write_timeline_png
from cluster.workload import Workload, WorkloadError, load_workload
from runtime.errors import DependencyError, InputError

__all__ = ["register"]

_TERMINAL = ("COMPLETED", "FAILED", "CANCELED")
_STYLE = {"COMPLETED": "green", "FAILED": "red", "CANCELED": "yellow"}


def run(
    workload: Path = typer.Argument(..., help="Workload YAML (see examples/quickstart.yaml)."),
    address: str | None = typer.Option(
        None,
        "--address",
        envvar="RAY_ADDRESS",
        help="Ray cluster to run on (ray://HOST:10001 or auto); default: $RAY_ADDRESS (set inside a Ray "
        "job), else a local Ray.",
    ),
    report: Path | None = typer.Option(
        None, "--report", help="Write the JSON report here (and a PNG of states over time beside it)."
    ),
    prewarm: int = typer.Option(
        0,
        "--prewarm",
        min=0,
        max=10_000,
        help="Capacity before the actors exist: a local Ray starts N worker processes; a cluster joined with "
        "--address asks its autoscaler for room for N trajectories (withdrawn when the run ends).",
    ),
    relays: int = typer.Option(
        1, "--relays", min=1, max=64, help="Control relays to run (tether pause/approve/... during the run)."
    ),
    run_id: str | None = typer.Option(
        None, "--run-id", help="Trajectory ids are RUN_ID.<id>; reuse a run id to resume that run."
    ),
    dashboard: bool = typer.Option(False, "--dashboard", help="Start the Ray dashboard (local Ray)."),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        min=0,
        help="Serve the driver's Prometheus /metrics here (0: any port).",
    ),
) -> None:
    """Run WORKLOAD: one actor per trajectory, a progress bar, a summary table and an optional report."""
    console = Console(stderr=True)
    try:
        wl = load_workload(workload)
    except WorkloadError as e:
        typer.echo(f"tether run: {e}", err=True)
        raise typer.Exit(2) from None
    options = RunOptions(
        address=address,
        report=report,
        prewarm=prewarm,
        dashboard=dashboard,
        run_id=run_id,
        relays=relays,
        metrics_port=metrics_port,
    )
    previous = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        result = _run(wl, options, console)
    except KeyboardInterrupt:
        typer.echo("tether run: interrupted; everything it started was stopped", err=True)
        raise typer.Exit(130) from None
    except InputError as e:
        typer.echo(f"tether run: {e}", err=True)
        raise typer.Exit(2) from None
    except DependencyError as e:
        typer.echo(f"tether run: {e}", err=True)
        raise typer.Exit(4) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    Console(width=None if sys.stdout.isatty() else 140).print(_table(wl, result))
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(result.report(), indent=2) + "\n")
        png = write_timeline_png(result, report.with_suffix(".png"), f"{wl.name}: trajectories by state")
        console.print(f"report: {report}  timeline: {png}")
    unexpected = result.unexpected
    if unexpected:
        for r in unexpected:
            why = r.error or f"ended {r.state}, expected {r.expected_state}"
            console.print(f"[red]{r.name}[/red]: {why}")
        raise typer.Exit(1)


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    """SIGTERM (``kill``, ``timeout``, a service manager) stops the run as Ctrl-C does: through asyncio's own
    SIGINT handling, which cancels the driver so it stops what it started. Where SIGINT is ignored (a
    shell's background job), asyncio does not handle it, so the interrupt is raised here."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGINT)


def _run(wl: Workload, options: RunOptions, console: Console) -> RunResult:
    with Services(wl, options) as services:
        # again: ``ray.init`` installs its own SIGTERM handler (``sys.exit(15)``), which skipped the stop
        signal.signal(signal.SIGTERM, _terminate_as_interrupt)
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[states]}"),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task(wl.name, total=len(wl.expanded()), states="starting")

            def update(counts: dict[str, int], total: int) -> None:
                done = sum(n for s, n in counts.items() if s in _TERMINAL)
                shown = "  ".join(f"{s.lower()} {n}" for s, n in sorted(counts.items()))
                progress.update(task, completed=done, total=total, states=shown)

            return run_driver(wl, services, options, update)


def _table(wl: Workload, result: RunResult) -> Table:
    table = Table(title=f"{wl.name}: {len(result.results)} trajectories in {result.elapsed_s:.1f}s")
    for column in ("trajectory", "class", "state", "expected", "exit reason", "turns", "tokens", "$"):
        table.add_column(column, justify="right" if column in ("turns", "tokens", "$") else "left")
    for r in result.results:
        style = _STYLE.get(r.state, "")
        expected = "" if r.expected_state is None else ("✓" if r.as_expected else f"✗ {r.expected_state}")
        table.add_row(
            r.name,
            r.priority_class,
            f"[{style}]{r.state}[/{style}]" if style else r.state,
            expected,
            r.exit_reason or "",
            str(r.turns),
            str(r.tokens),
            f"{r.dollars:.4f}",
        )
    summary = result.report()["summary"]
    provider = result.provider
    table.caption = (
        f"states {summary['states']}  tokens {summary['tokens']}  ${summary['dollars']:.4f}  "
        f"provider requests {provider['requests']}, rate-limited {provider['rate_limited']}"
    )
    return table


def register(app: typer.Typer) -> None:
    """Add ``tether run`` to the CLI."""
    app.command("run")(run)
