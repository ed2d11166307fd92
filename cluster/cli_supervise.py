"""``tether incident ...`` and ``tether escalations ...``: containment and the escalation queue (issue 12).

    tether incident open (--trajectory ID ... | --tool T | --tenant X) --reason SYMPTOM [--cause TEXT]
                         [--no-revoke] [--as OPERATOR]
    tether incident show ID | tether incident list
    tether incident release ID --evidence TEXT [--artifact A ...] [--as OPERATOR]
    tether incident close ID --resolution TEXT [--force] [--as OPERATOR]
    tether escalations [--all] [--trigger T]
    tether escalations show ID
    tether escalations ack ID [--as OPERATOR]

Holds, releases and acknowledgements are signed control messages (``cluster.signing``: hold is open to
operators, security, reliability staff and automated policies; release and acknowledge to people), so the
trajectory records who did it. Errors are one line on stderr: exit 2 for what the operator can fix in the
command, exit 1 when Redis cannot be reached (as ``tether pause`` and the rest).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import redis.asyncio as aioredis
import typer

from cluster.cli_control import Target, _fail, resolve_redis
from cluster.control import ControlAction
from cluster.control_client import ControlClient
from cluster.embedded import redact_url
from cluster.incidents import Incidents, Selector
from cluster.signing import DEFAULT_OPERATOR, ensure_default_operator, keyring_path
from cluster.supervision_store import RedisSupervisionStore
from runtime.errors import DependencyError, InputError

__all__ = ["SupervisionCli", "register"]

T = TypeVar("T")

_RedisOpt = Annotated[
    str | None, typer.Option("--redis", help="Redis URL (default: $TETHER_REDIS_URL or embedded).")
]
_AsOpt = Annotated[str, typer.Option("--as", help="Operator identity whose key signs the messages.")]
_KeyringOpt = Annotated[
    Path | None, typer.Option("--keyring", help="Keyring file (default: $TETHER_KEYRING).")
]


class Session:
    """One command's Redis client, control client and supervision store."""

    def __init__(self, target: Target, keyring: Path) -> None:
        self.redis = aioredis.Redis.from_url(target.url, socket_timeout=10.0, socket_connect_timeout=5.0)
        self.control = ControlClient(self.redis, url=target.url, keyring=keyring)
        self.store = RedisSupervisionStore(self.redis, url=target.url)
        self.incidents = Incidents(self.control, self.redis, self.store)

    async def close(self) -> None:
        await self.redis.aclose()


class SupervisionCli:
    """The commands, with how to find Redis injectable (tests)."""

    def __init__(
        self,
        resolve: Callable[[str | None], Target] = resolve_redis,
        ensure_operator: Callable[[Path], str] = ensure_default_operator,
    ) -> None:
        self.resolve = resolve
        self.ensure_operator = ensure_operator

    def _run(
        self,
        redis: str | None,
        keyring: Path | None,
        work: Callable[[Session], Awaitable[T]],
        *,
        issuer: str | None = None,
    ) -> T:
        try:
            target = self.resolve(redis)
            ring = keyring or keyring_path()
            if issuer == DEFAULT_OPERATOR and target.embedded:
                self.ensure_operator(ring)

            async def go() -> T:
                session = Session(target, ring)
                try:
                    return await work(session)
                finally:
                    await session.close()

            return asyncio.run(go())
        except InputError as e:
            _fail(str(e), 2)
        except DependencyError as e:
            _fail(redact_url(str(e)), 1)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ registration

    def register(self, app: typer.Typer) -> None:
        incident = typer.Typer(
            help="Incident containment: hold, quarantine, release, close.", no_args_is_help=True
        )
        incident.command("open", help="Hold every matching trajectory and quarantine what they produced.")(
            self.open
        )
        incident.command("show", help="One incident with what is confirmed in force now.")(self.show)
        incident.command("list", help="Every incident, oldest first.")(self.list_incidents)
        incident.command("release", help="Lift an incident's holds and quarantine, with evidence.")(
            self.release
        )
        incident.command("close", help="Close an incident once nothing of it is in force.")(self.close)
        app.add_typer(incident, name="incident")
        escalations = typer.Typer(
            help="The escalation queue: owner, SLA, evidence, custody.", invoke_without_command=True
        )
        escalations.callback()(self.escalations)
        escalations.command("show", help="One escalation with its evidence and handoff packet.")(
            self.show_escalation
        )
        escalations.command("ack", help="Take custody of an escalation (a signed acknowledgement).")(self.ack)
        app.add_typer(escalations, name="escalations")

    # ------------------------------------------------------------------ incidents

    def open(
        self,
        reason: Annotated[str, typer.Option("--reason", help="The symptom: what was observed.")] = "",
        trajectory: Annotated[list[str] | None, typer.Option("--trajectory", help="A trajectory id.")] = None,
        tool: Annotated[
            str | None, typer.Option("--tool", help="Every trajectory granted this tool.")
        ] = None,
        tenant: Annotated[
            str | None, typer.Option("--tenant", help="Every trajectory of this tenant.")
        ] = None,
        cause: Annotated[str, typer.Option("--cause", help="The suspected cause, kept apart.")] = "",
        no_revoke: Annotated[bool, typer.Option("--no-revoke", help="Hold without revoking --tool.")] = False,
        issuer: _AsOpt = DEFAULT_OPERATOR,
        redis: _RedisOpt = None,
        keyring: _KeyringOpt = None,
    ) -> None:
        if not reason:
            _fail("incident open needs --reason SYMPTOM (what was observed)", 2)

        async def go(s: Session) -> dict[str, Any]:
            selector = Selector(tuple(trajectory or ()), tool, tenant)
            return await s.incidents.open(
                selector, symptom=reason, suspected_cause=cause, issuer=issuer, revoke=not no_revoke
            )

        doc = self._run(redis, keyring, go, issuer=issuer)
        held = [r for r in doc["restrictions"] if r["kind"] == "hold"]
        typer.echo(f"opened {doc['incident_id']}: {len(doc['members'])} member(s), {len(held)} held at once")
        for row in doc["restrictions"]:
            typer.echo(f"  {row['kind']:<13} {row['target']:<48} {row['state']:<10} rank {row['rank']:g}")
        for row in doc["kept"]:
            typer.echo(f"  kept back     {row['target']:<48} {row['note']}")
        for omission in doc["capture_omissions"]:
            typer.echo(f"  capture omission: {omission}")

    def show(
        self, incident_id: Annotated[str, typer.Argument(help="Incident id.")], redis: _RedisOpt = None
    ) -> None:
        doc = self._run(redis, None, lambda s: s.incidents.show(incident_id))
        typer.echo(json.dumps(doc, indent=2, sort_keys=True, default=str))

    def list_incidents(self, redis: _RedisOpt = None) -> None:
        docs = self._run(redis, None, lambda s: s.incidents.all())
        if not docs:
            typer.echo("no incidents")
        for d in docs:
            opened = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.get("opened_at", 0)))
            who = d.get("opened_by", "?")
            sizes = f"members={len(d.get('members', {}))} artifacts={len(d.get('artifacts', []))}"
            symptom = str(d.get("symptom", ""))[:60]
            typer.echo(
                f"{d['incident_id']}  {d.get('status', '?'):<9} opened {opened} by {who}  {sizes}  {symptom}"
            )

    def release(
        self,
        incident_id: Annotated[str, typer.Argument(help="Incident id.")],
        evidence: Annotated[str, typer.Option("--evidence", help="Why it is safe to release.")] = "",
        artifact: Annotated[list[str] | None, typer.Option("--artifact", help="Release only these.")] = None,
        issuer: _AsOpt = DEFAULT_OPERATOR,
        redis: _RedisOpt = None,
        keyring: _KeyringOpt = None,
    ) -> None:
        doc = self._run(
            redis,
            keyring,
            lambda s: s.incidents.release(
                incident_id, issuer=issuer, evidence=evidence, artifacts=artifact or ()
            ),
            issuer=issuer,
        )
        last = doc["releases"][-1]
        typer.echo(
            f"released {incident_id}: {len(last['artifacts'])} artifact(s), "
            f"{len(last['messages'])} hold(s) lifted; status {doc['status']}"
        )

    def close(
        self,
        incident_id: Annotated[str, typer.Argument(help="Incident id.")],
        resolution: Annotated[str, typer.Option("--resolution", help="What was found and done.")] = "",
        force: Annotated[bool, typer.Option("--force", help="Close although something is in force.")] = False,
        issuer: _AsOpt = DEFAULT_OPERATOR,
        redis: _RedisOpt = None,
    ) -> None:
        doc = self._run(
            redis,
            None,
            lambda s: s.incidents.close(incident_id, issuer=issuer, resolution=resolution, force=force),
        )
        typer.echo(f"closed {incident_id} ({doc['resolution']})")

    # ------------------------------------------------------------------ escalations

    def escalations(
        self,
        ctx: typer.Context,
        all_: Annotated[bool, typer.Option("--all", help="Resolved ones too.")] = False,
        trigger: Annotated[str | None, typer.Option("--trigger", help="Only this trigger.")] = None,
        redis: _RedisOpt = None,
    ) -> None:
        """List the escalation queue (open and acknowledged ones unless --all), oldest first."""
        if ctx.invoked_subcommand is not None:
            return
        docs = self._run(redis, None, lambda s: s.store.escalations())
        now = time.time()
        shown = [
            d
            for d in docs
            if (all_ or d.get("status") != "resolved") and (trigger is None or d.get("trigger") == trigger)
        ]
        if not shown:
            typer.echo("no escalations")
        for d in shown:
            typer.echo(escalation_line(d, now))

    def show_escalation(
        self, escalation_id: Annotated[str, typer.Argument(help="Escalation id.")], redis: _RedisOpt = None
    ) -> None:
        async def go(s: Session) -> dict[str, Any]:
            doc = await s.store.escalation(escalation_id)
            if doc is None:
                raise InputError("no such escalation", where=f"escalation {escalation_id!r}")
            return doc

        typer.echo(json.dumps(self._run(redis, None, go), indent=2, sort_keys=True, default=str))

    def ack(
        self,
        escalation_id: Annotated[str, typer.Argument(help="Escalation id.")],
        issuer: _AsOpt = DEFAULT_OPERATOR,
        redis: _RedisOpt = None,
        keyring: _KeyringOpt = None,
    ) -> None:
        async def go(s: Session) -> str:
            doc = await s.store.escalation(escalation_id)
            if doc is None:
                raise InputError("no such escalation", where=f"escalation {escalation_id!r}")
            sent = await s.control.send(
                doc["trajectory_id"],
                ControlAction.ACKNOWLEDGE,
                issuer=issuer,
                reason=f"custody of {escalation_id}",
                payload={"escalation_id": escalation_id},
            )
            return sent.message.message_id

        message_id = self._run(redis, keyring, go, issuer=issuer)
        typer.echo(f"acknowledged {escalation_id} as {issuer}: message {message_id} (custody once recorded)")


def escalation_line(d: dict[str, Any], now: float) -> str:
    """One escalation as ``tether escalations`` lists it."""
    due = float(d.get("due_at") or 0.0)
    status = str(d.get("status"))
    overdue = status == "open" and now > due
    left = (
        f"OVERDUE by {now - due:.0f}s"
        if overdue
        else (f"due in {due - now:.0f}s" if status == "open" else status)
    )
    custody = f" custody {d['custodian']}" if d.get("custodian") else ""
    evidence = d.get("evidence") or {}
    what = evidence.get("guard") or evidence.get("incident") or evidence.get("tool") or ""
    return (
        f"{d['escalation_id']}  {d.get('trigger')}  owner {d.get('owner')}{custody}  {left}  "
        f"{d.get('trajectory_id')}  {what}  {str(d.get('summary', ''))[:90]}"
    )


def register(app: typer.Typer) -> None:
    """Add the incident and escalation commands to the ``tether`` CLI."""
    SupervisionCli().register(app)
