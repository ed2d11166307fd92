"""The ``tether`` command line.

Each area registers its commands from its own module (``cluster/cli_<area>.py`` exposing
``register(app: typer.Typer) -> None``), so this file stays a table of contents.
"""

from __future__ import annotations

import importlib

import typer

__all__ = ["app", "main"]

app = typer.Typer(
    name="tether",
    help="Run and control long-running agent trajectories on a Ray cluster.",
    no_args_is_help=True,
    add_completion=False,
)

# Modules that contribute commands; a missing one is skipped so partial checkouts still run.
_COMMAND_MODULES = (
    "cluster.cli_run",
    "cluster.cli_control",
    "cluster.cli_obligations",
    "cluster.cli_keys",
    "cluster.cli_submit",
    "cluster.cli_supervise",  # issue 12: tether incident, tether escalations
)


def _register_all() -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(app)


def main() -> None:
    """Console-script entry point."""
    _register_all()
    app()
