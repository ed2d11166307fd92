"""``tether keys``: create and list the operator keys that sign control messages.

    tether keys new NAME --roles operator,sre [--keyring PATH]
    tether keys list [--keyring PATH]

The keyring path defaults to ``$TETHER_KEYRING`` or ``.tether/keyring.yaml``; private keys go to
``keys/NAME.key`` beside it with mode 0600 (see ``cluster.signing``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cluster.signing import Keyring, Role, create_key, key_path, keyring_path
from runtime.errors import InputError

__all__ = ["register"]

_KeyringOption = Annotated[
    Path | None,
    typer.Option("--keyring", help="Keyring file (default: $TETHER_KEYRING or .tether/keyring.yaml)."),
]

keys_app = typer.Typer(help="Operator keys for signing control messages.", no_args_is_help=True)


@keys_app.command("new")
def new_key(
    name: Annotated[str, typer.Argument(help="Identity of the new key, e.g. alice or ci-policy.")],
    roles: Annotated[
        str, typer.Option("--roles", help=f"Comma-separated roles: {', '.join(r.value for r in Role)}.")
    ],
    keyring: _KeyringOption = None,
) -> None:
    """Create a key pair: the public key joins the keyring, the private key is written with mode 0600."""
    path = keyring or keyring_path()
    try:
        info = create_key(name, roles, path)
    except InputError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    except OSError as e:
        where = e.filename or path
        typer.echo(f"error: cannot write {where}: {e.strerror or e}", err=True)
        raise typer.Exit(1) from e
    typer.echo(f"created {info.identity} with roles {', '.join(sorted(info.roles))}")
    typer.echo(f"  private key: {info.key_file} (mode 0600; keep it secret)")
    typer.echo(f"  keyring:     {info.keyring_file}")


@keys_app.command("list")
def list_keys(keyring: _KeyringOption = None) -> None:
    """List identities in the keyring with their roles and whether this machine holds the private key."""
    path = keyring or keyring_path()
    try:
        ring = Keyring.load(path)
    except InputError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    entries = list(ring)
    if not entries:
        typer.echo(f"no identities in {path}; create one with `tether keys new NAME --roles operator`")
        return
    width = max(len(name) for name, _ in entries)
    for name, entry in entries:
        local = "private key here" if key_path(name, path).exists() else "public only"
        typer.echo(f"{name:<{width}}  {','.join(sorted(entry.roles)):<28}  {local}")


def register(app: typer.Typer) -> None:
    """Add ``tether keys ...`` to the CLI."""
    app.add_typer(keys_app, name="keys")
