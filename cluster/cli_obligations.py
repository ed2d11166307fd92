"""What trajectories still owe the world, and the operators' commands that settle it (issue 11).

- ``tether obligations``: every unknown operation and every open or handed-off obligation across the
  trajectories Redis knows (from their status snapshots): id, trajectory, tool, target, evidence so far,
  owner, age.
- ``tether settle ID --established|--absent --evidence TEXT``: an operator's word about an operation
  (its effect happened, or did not) or an obligation (released by hand: accepted as residual risk, recorded
  as such, never as clean). A signed control message, role-checked and audited like every other.
- ``tether handoff TRAJECTORY --to NAME``: custody of everything the trajectory still owes moves to NAME.
- ``tether handoff show TRAJECTORY``: the handoff packet written when the trajectory ended (from its log).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any

import redis.asyncio as aioredis
import typer
from pydantic import JsonValue
from rich.console import Console
from rich.table import Table

from actors.status import STATUS_KEY_PREFIX
from cluster.cli_control import (
    ControlCli,
    _AsOpt,
    _fail,
    _KeyringOpt,
    _RedisOpt,
    _TtlOpt,
)
from cluster.embedded import redact_url
from cluster.run_report import handoff_packets
from cluster.signing import DEFAULT_OPERATOR
from runtime.errors import DependencyError, InputError
from runtime.record import ControlAction

__all__ = ["owed_rows", "register"]


async def owed_rows(url: str) -> list[dict[str, Any]]:
    """Every row of every trajectory's ``owed`` status field, with its trajectory id."""
    client = aioredis.Redis.from_url(url, socket_timeout=10.0)
    rows: list[dict[str, Any]] = []
    try:
        async for key in client.scan_iter(match=f"{STATUS_KEY_PREFIX}*", count=500):
            name = key.decode() if isinstance(key, bytes) else str(key)
            raw = await client.hget(name, "owed")
            if not raw:
                continue
            tid = name[len(STATUS_KEY_PREFIX) :]
            try:
                entries = json.loads(raw)
            except ValueError:
                continue  # a view, not the record: an unreadable one is skipped, never fatal
            rows.extend({"trajectory": tid, **entry} for entry in entries if isinstance(entry, dict))
    finally:
        await client.aclose()
    return sorted(rows, key=lambda r: (r["trajectory"], r.get("id", "")))


async def _handoff_packet(url: str, trajectory_id: str) -> dict[str, Any] | None:
    return (await handoff_packets(url, [trajectory_id])).get(trajectory_id)


def _age(since: Any, now: float) -> str:
    if not isinstance(since, int | float) or since <= 0:
        return "-"
    seconds = max(0.0, now - float(since))
    return (
        f"{seconds / 3600:.1f}h"
        if seconds >= 3600
        else f"{seconds / 60:.1f}m"
        if seconds >= 60
        else f"{seconds:.0f}s"
    )


class ObligationsCli:
    """``tether obligations``, ``tether settle``, ``tether handoff`` (signing reuses the control CLI)."""

    def __init__(self, control: ControlCli | None = None) -> None:
        self.control = control or ControlCli()

    def register(self, app: typer.Typer) -> None:
        app.command("obligations", help="Unknown operations and open obligations across trajectories.")(
            self._obligations
        )
        app.command("settle", help="Settle an operation or obligation with your evidence (signed, audited).")(
            self._settle
        )
        app.command(
            "handoff",
            help="'handoff TRAJECTORY --to NAME' takes custody; 'handoff show TRAJECTORY' prints the packet.",
        )(self._handoff)

    def _url(self, redis: str | None) -> str:
        try:
            return self.control.resolve(redis).url
        except InputError as e:
            _fail(str(e), 2)

    def _obligations(
        self,
        redis: _RedisOpt = None,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON array instead of a table.")] = False,
    ) -> None:
        url = self._url(redis)
        try:
            rows = asyncio.run(owed_rows(url))
        except DependencyError as e:
            _fail(redact_url(str(e)), 1)
        if as_json:
            typer.echo(json.dumps(rows, indent=2, sort_keys=True, default=str))
            return
        if not rows:
            typer.echo("nothing owed: no unknown operation, no open obligation")
            return
        now = time.time()
        table = Table(title="tether obligations", expand=False)
        for column in ("id", "trajectory", "kind", "tool", "target", "state", "evidence", "owner", "age"):
            table.add_column(column)
        for r in rows:
            target = json.dumps(r.get("target", {}), sort_keys=True, default=str)
            table.add_row(
                str(r.get("id", "")),
                str(r["trajectory"]),
                str(r.get("kind", "")),
                str(r.get("tool", "")),
                target if len(target) <= 60 else target[:57] + "...",
                str(r.get("state", "")),
                str(r.get("evidence", "")),
                str(r.get("owner", "")),
                _age(r.get("since"), now),
            )
        Console(width=200).print(table)

    def _settle(
        self,
        target: Annotated[str, typer.Argument(help="Operation id (op-...) or obligation id (obl-...).")],
        established: Annotated[bool, typer.Option("--established", help="The effect happened.")] = False,
        absent: Annotated[bool, typer.Option("--absent", help="The effect did not happen.")] = False,
        evidence: Annotated[str, typer.Option("--evidence", help="What you checked, in your words.")] = "",
        trajectory: Annotated[
            str | None,
            typer.Option("--trajectory", help="Its trajectory (found from the listing if left out)."),
        ] = None,
        issuer: _AsOpt = DEFAULT_OPERATOR,
        redis: _RedisOpt = None,
        keyring: _KeyringOpt = None,
        ttl: _TtlOpt = 300.0,
    ) -> None:
        if established == absent:
            _fail("say exactly one of --established or --absent", 2)
        if not evidence.strip():
            _fail("--evidence is required: an operator's settlement is recorded with what was checked", 2)
        if trajectory is None:
            rows = [r for r in asyncio.run(owed_rows(self._url(redis))) if r.get("id") == target]
            if len(rows) != 1:
                found = "nothing owed" if not rows else f"{len(rows)} trajectories"
                _fail(f"{target}: {found} by that id; name it with --trajectory", 2)
            trajectory = str(rows[0]["trajectory"])
        payload: dict[str, JsonValue] = {
            "target": target,
            "settlement": "established" if established else "absent",
            "evidence": evidence,
        }
        chosen = trajectory
        self.control._send(
            redis,
            keyring,
            ttl,
            issuer,
            lambda c: c.send(chosen, ControlAction.SETTLE, issuer=issuer, reason=evidence, payload=payload),
        )

    def _handoff(
        self,
        first: Annotated[str, typer.Argument(help="TRAJECTORY, or 'show'.")],
        second: Annotated[str | None, typer.Argument(help="TRAJECTORY after 'show'.")] = None,
        to: Annotated[str | None, typer.Option("--to", help="Who takes custody.")] = None,
        reason: Annotated[str, typer.Option("--reason", help="Why (recorded).")] = "",
        issuer: _AsOpt = DEFAULT_OPERATOR,
        redis: _RedisOpt = None,
        keyring: _KeyringOpt = None,
        ttl: _TtlOpt = 300.0,
    ) -> None:
        if first == "show":
            if second is None:
                _fail("usage: tether handoff show TRAJECTORY", 2)
            try:
                packet = asyncio.run(_handoff_packet(self._url(redis), second))
            except (DependencyError, InputError) as e:
                _fail(redact_url(str(e)), 1)
            if packet is None:
                _fail(f"{second}: no handoff packet (it completed cleanly, or has not ended)", 1)
            typer.echo(json.dumps(packet, indent=2, sort_keys=True, default=str))
            return
        if to is None:
            _fail("say who takes custody: tether handoff TRAJECTORY --to NAME", 2)
        chosen = first
        payload: dict[str, JsonValue] = {"to": to}
        self.control._send(
            redis,
            keyring,
            ttl,
            issuer,
            lambda c: c.send(
                chosen, ControlAction.HANDOFF, issuer=issuer, reason=reason or f"to {to}", payload=payload
            ),
        )


def register(app: typer.Typer) -> None:
    """Add the obligation commands to the ``tether`` CLI."""
    ObligationsCli().register(app)
