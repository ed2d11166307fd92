"""Incident containment across the cluster (recovery chapter §12.8, issue 12): what ``tether incident`` does.

``open``: every trajectory matching the selector (``--trajectory``, ``--tool``: granted that tool,
``--tenant``) becomes a member. The incident record is written first (no restriction may destroy it, and a
crash half-way leaves a record of what was planned), with the symptom and the suspected cause kept apart,
each member's metadata read from its own log (grants, operations with their attempts, owners of unresolved
side effects, spend) and the capture omissions (a log that is missing or does not decode is said, never
assumed clean). Then the restrictions are issued in order of exposure removed per minute of confirmation
(``runtime.incident.order_restrictions``): artifacts the members produced are quarantined, and every live
member is held at once by a signed ``hold`` message (model-directed work stops; registered cleanup keeps
running under its own grant). A ``--tool`` incident also revokes that tool from the members' grants, except
where a registered cleanup needs it: that revocation is kept back and the record says why.

``show`` adds what is confirmed: a hold is confirmed once the member's status snapshot shows it held by this
incident, uncertain while the member cannot be seen; a quarantine is confirmed by the quarantine itself.
``release`` lifts the holds (signed ``release`` messages) and the quarantine, recording the evidence and who
released; ``close`` ends the incident once nothing is held (or says what still is).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from actors.launch import LAUNCH_KEY_PREFIX, TrajectoryLaunch
from cluster.control import ControlAction
from cluster.control_client import ControlClient, TrajectoryStatus, UnknownTrajectory
from cluster.embedded import redis_errors
from cluster.log_store import RedisLogStore
from cluster.supervision_store import RedisSupervisionStore
from runtime.codec import decode
from runtime.errors import CodecError, InputError
from runtime.incident import (
    Restriction,
    RestrictionKind,
    cleanup_tools,
    member_metadata,
    order_restrictions,
)
from runtime.policy import TrajectoryPolicy
from runtime.record import TrajectoryRecord
from runtime.snapshot import fold_entries, is_snapshot

__all__ = ["IncidentError", "Incidents", "Member", "Selector", "new_incident_id"]

HOLD_CONFIRM_MIN = 0.05  # a hold travels the control stream and is recorded within seconds
QUARANTINE_CONFIRM_MIN = 0.01  # a quarantine is one Redis write, read by every dispatch boundary
ARTIFACT_EXPOSURE_PER_MIN = 1.0  # readers of an artifact are unknown: assume one a minute


class IncidentError(InputError):
    """An incident command cannot do what was asked (names the incident)."""


@dataclass(frozen=True, slots=True)
class Selector:
    trajectories: tuple[str, ...] = ()
    tool: str | None = None
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not (self.trajectories or self.tool or self.tenant):
            raise InputError(
                "name what the incident covers: --trajectory ID, --tool T or --tenant X", where="selector"
            )

    def matches(self, launch: TrajectoryLaunch) -> bool:
        if launch.trajectory_id in self.trajectories:
            return True
        if self.tool is not None and self.tool in launch.grants:
            return True
        return self.tenant is not None and launch.tenant == self.tenant

    def as_json(self) -> dict[str, Any]:
        return {"trajectories": list(self.trajectories), "tool": self.tool, "tenant": self.tenant}


@dataclass(frozen=True)
class Member:
    """A member trajectory as the incident sees it (read from its own log)."""

    trajectory_id: str
    record: TrajectoryRecord | None
    omissions: tuple[str, ...]
    artifacts: tuple[str, ...]

    @property
    def live(self) -> bool:
        return self.record is not None and not self.record.is_terminal

    def rate(self, tool: str | None = None) -> float:
        """Tool operations per minute of its life so far: the exposure its hold removes."""
        rec = self.record
        if rec is None:
            return 0.0
        ops = [op for op in rec.operations.values() if tool is None or op.tool == tool]
        minutes = max(rec.spend.get("wall_seconds") / 60.0, 1.0)
        return max(len(ops) / minutes, 0.1)


def new_incident_id(now: float) -> str:
    return time.strftime("inc-%Y%m%d-%H%M%S", time.gmtime(now)) + f"-{int(now * 1000) % 1000:03d}"


class Incidents:
    """The incident commands over one Redis: the control client signs and publishes, the store records."""

    def __init__(self, client: ControlClient, redis: aioredis.Redis, store: RedisSupervisionStore) -> None:
        self.client = client
        self.redis = redis
        self.store = store
        self.logs = RedisLogStore(redis)

    # ------------------------------------------------------------------ membership

    async def _launches(self) -> list[TrajectoryLaunch]:
        out = []
        with redis_errors("redis", "listing trajectory launches"):
            keys = [k async for k in self.redis.scan_iter(match=f"{LAUNCH_KEY_PREFIX}*", count=500)]
            raws = await self.redis.mget(keys) if keys else []
        for raw in raws:
            if raw:
                try:
                    out.append(TrajectoryLaunch.from_json(raw))
                except CodecError:
                    continue
        return sorted(out, key=lambda lt: lt.trajectory_id)

    async def member(self, trajectory_id: str, launch: TrajectoryLaunch | None) -> Member:
        """Read a member's log and fold it; what could not be read is a capture omission."""
        omissions: list[str] = []
        entries = await self.logs.read(trajectory_id)
        if not entries:
            omissions.append(f"{trajectory_id}: no durable log")
        readable: list[tuple[str, bytes]] = []
        for entry_id, payload in entries:
            try:
                if not is_snapshot(payload):
                    decode(payload)
                readable.append((entry_id, payload))
            except CodecError as e:
                omissions.append(f"{trajectory_id}: log entry {entry_id} does not decode ({e})")
        record = None
        if readable:
            policy = TrajectoryPolicy()
            if launch is not None:
                from actors.wiring import build_policy, build_registry

                try:
                    policy = build_policy(launch, build_registry(launch))
                except InputError as e:
                    omissions.append(f"{trajectory_id}: its tools could not be rebuilt ({e})")
            try:
                record = fold_entries(readable, policy)
            except InputError as e:
                omissions.append(f"{trajectory_id}: its log does not fold ({e})")
        if await self.client.status(trajectory_id) is None:
            omissions.append(f"{trajectory_id}: no status snapshot (its live view is unknown)")
        from runtime._decide_supervise import artifacts_of

        artifacts = artifacts_of(record) if record is not None else ()
        return Member(trajectory_id, record, tuple(omissions), artifacts)

    async def members(self, selector: Selector) -> list[Member]:
        launches = {lt.trajectory_id: lt for lt in await self._launches()}
        chosen = [tid for tid, lt in launches.items() if selector.matches(lt)]
        for tid in selector.trajectories:
            if tid not in launches:
                if not await self.client.known(tid):
                    raise UnknownTrajectory(tid)
                chosen.append(tid)
        return [await self.member(tid, launches.get(tid)) for tid in sorted(set(chosen))]

    # ------------------------------------------------------------------ open

    async def open(
        self,
        selector: Selector,
        *,
        symptom: str,
        suspected_cause: str,
        issuer: str,
        revoke: bool = True,
        incident_id: str | None = None,
    ) -> dict[str, Any]:
        """Open an incident: record it, then issue its restrictions in order (see the module docstring)."""
        if not symptom:
            raise InputError("an incident needs its symptom (--reason)", where="reason")
        now = time.time()
        incident_id = incident_id or new_incident_id(now)
        members = await self.members(selector)
        if not members:
            raise IncidentError(f"nothing matches {selector.as_json()}", where=f"incident {incident_id}")
        restrictions: list[Restriction] = []
        cleanup_needs: dict[str, frozenset[str]] = {}
        for m in members:
            rec = m.record
            if rec is not None:
                cleanup_needs[m.trajectory_id] = cleanup_tools(rec)
            if m.live:
                restrictions.append(
                    Restriction(RestrictionKind.HOLD, m.trajectory_id, m.rate(), HOLD_CONFIRM_MIN)
                )
                if (
                    revoke
                    and selector.tool is not None
                    and rec is not None
                    and selector.tool in rec.grants.tools
                ):
                    target = f"{m.trajectory_id}:{selector.tool}"
                    restrictions.append(
                        Restriction(
                            RestrictionKind.REVOKE_GRANT, target, m.rate(selector.tool), HOLD_CONFIRM_MIN
                        )
                    )
            for artifact in m.artifacts:
                restrictions.append(
                    Restriction(
                        RestrictionKind.QUARANTINE,
                        artifact,
                        ARTIFACT_EXPOSURE_PER_MIN,
                        QUARANTINE_CONFIRM_MIN,
                    )
                )
        issue, kept = order_restrictions(restrictions, cleanup_needs)
        doc: dict[str, Any] = {
            "incident_id": incident_id,
            "opened_at": now,
            "opened_by": issuer,
            "owner": issuer,
            "status": "open",
            "selector": selector.as_json(),
            "symptom": symptom,
            "suspected_cause": suspected_cause or "not established",
            "members": {
                m.trajectory_id: member_metadata(m.record)
                if m.record is not None
                else {"trajectory_id": m.trajectory_id}
                for m in members
            },
            "artifacts": sorted({a for m in members for a in m.artifacts}),
            "restrictions": [r.as_json() for r in issue],
            "kept": [r.as_json() for r in kept],
            "capture_omissions": [o for m in members for o in m.omissions],
            "releases": [],
            "notes": ["blocking further work is no evidence that no earlier effect or disclosure occurred"],
        }
        await self.store.update_incident(incident_id, lambda _current: doc)
        # Issue in order. Quarantine writes are the enforcement itself; holds go out together at once.
        revoked_by_member: dict[str, list[str]] = {}
        for r in issue:
            if r.kind is RestrictionKind.REVOKE_GRANT:
                tid, _, tool = r.target.rpartition(":")
                revoked_by_member.setdefault(tid, []).append(tool)
        states: dict[tuple[str, str], tuple[str, str]] = {}
        for r in issue:
            if r.kind is RestrictionKind.QUARANTINE:
                await self.store.quarantine([r.target], incident_id)
                states[(r.kind.value, r.target)] = ("confirmed", "in the quarantine")
            elif r.kind is RestrictionKind.HOLD:
                payload: dict[str, Any] = {"incident_id": incident_id}
                if revoked_by_member.get(r.target):
                    payload["revoke"] = revoked_by_member[r.target]
                sent = await self.client.send(
                    r.target, ControlAction.HOLD, issuer=issuer, reason=symptom[:500], payload=payload
                )
                states[(r.kind.value, r.target)] = ("requested", f"message {sent.message.message_id}")
            else:
                states[(r.kind.value, r.target)] = ("requested", "with the member's hold")

        def issued(current: dict[str, Any] | None) -> dict[str, Any]:
            out = dict(current or doc)
            rows = []
            for row in out["restrictions"]:
                state, note = states.get((row["kind"], row["target"]), (row["state"], row.get("note", "")))
                rows.append({**row, "state": state, "note": note})
            out["restrictions"] = rows
            return out

        return await self.store.update_incident(incident_id, issued)

    # ------------------------------------------------------------------ show / list

    async def _get(self, incident_id: str) -> dict[str, Any]:
        doc = await self.store.incident(incident_id)
        if doc is None:
            raise IncidentError("no such incident", where=f"incident {incident_id!r}")
        return doc

    async def show(self, incident_id: str) -> dict[str, Any]:
        """The incident with each restriction's confirmation read from where it is enforced."""
        doc = await self._get(incident_id)
        held = await self.store.quarantined(list(doc.get("artifacts", [])))
        rows = []
        for row in doc.get("restrictions", []):
            kind, target = row["kind"], row["target"]
            if kind == RestrictionKind.QUARANTINE.value:
                state = "confirmed" if target in held else "released"
            elif kind == RestrictionKind.HOLD.value:
                state = _hold_state(await self.client.status(target), incident_id, row["state"])
            else:
                state = row["state"]
            rows.append({**row, "state": state})
        members_held = {}
        for tid in doc.get("members", {}):
            members_held[tid] = _hold_state(await self.client.status(tid), incident_id, "unknown")
        return {**doc, "restrictions": rows, "quarantined_now": sorted(held), "member_holds": members_held}

    async def all(self) -> list[dict[str, Any]]:
        return await self.store.incidents()

    # ------------------------------------------------------------------ release / close

    async def release(
        self, incident_id: str, *, issuer: str, evidence: str, artifacts: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Lift the incident's holds (signed) and release its artifacts (all, or the ones named), recording
        who released what on which evidence (§12.8.2: a release names its evidence)."""
        if not evidence:
            raise InputError("a release names its evidence (--evidence)", where="evidence")
        doc = await self._get(incident_id)
        if doc.get("status") == "closed":
            raise IncidentError("the incident is closed", where=f"incident {incident_id!r}")
        named = list(artifacts) or list(doc.get("artifacts", []))
        unknown = sorted(set(named) - set(doc.get("artifacts", [])))
        if unknown:
            raise IncidentError(
                f"not artifacts of this incident: {unknown}", where=f"incident {incident_id!r}"
            )
        released = await self.store.release(named, incident_id)
        messages = []
        if not artifacts:  # a full release lifts the holds too
            for tid in sorted(doc.get("members", {})):
                status = await self.client.status(tid)
                if status is not None and status.state in ("COMPLETED", "FAILED", "CANCELED"):
                    continue
                sent = await self.client.send(
                    tid,
                    ControlAction.RELEASE,
                    issuer=issuer,
                    reason=evidence[:500],
                    payload={"incident_id": incident_id},
                )
                messages.append(sent.message.message_id)
        still = await self.store.quarantined(list(doc.get("artifacts", [])))

        def record(current: dict[str, Any] | None) -> dict[str, Any]:
            out = dict(current or doc)
            out["releases"] = [
                *out.get("releases", []),
                {
                    "by": issuer,
                    "at": time.time(),
                    "evidence": evidence,
                    "artifacts": released,
                    "holds_released": not artifacts,
                    "messages": messages,
                },
            ]
            if not still and not artifacts:
                out["status"] = "released"
            return out

        return await self.store.update_incident(incident_id, record)

    async def close(
        self, incident_id: str, *, issuer: str, resolution: str, force: bool = False
    ) -> dict[str, Any]:
        """Close an incident once nothing of it is held; ``force`` closes it anyway, saying what remains."""
        if not resolution:
            raise InputError("closing names the resolution (--resolution)", where="resolution")
        doc = await self.show(incident_id)
        remaining = [f"artifact {a}" for a in doc["quarantined_now"]]
        remaining += [f"hold on {tid}" for tid, state in doc["member_holds"].items() if state == "confirmed"]
        if remaining and not force:
            raise IncidentError(
                f"still in force: {', '.join(remaining)}; release it first (or --force)",
                where=f"incident {incident_id!r}",
            )

        def closed(current: dict[str, Any] | None) -> dict[str, Any]:
            out = dict(current or doc)
            out.update(status="closed", closed_at=time.time(), closed_by=issuer, resolution=resolution)
            out["still_in_force_at_close"] = remaining
            return out

        return await self.store.update_incident(incident_id, closed)


def _hold_state(status: TrajectoryStatus | None, incident_id: str, recorded: str) -> str:
    """confirmed (the member shows this incident's hold), moot (it ended), uncertain (it cannot be seen),
    or the recorded state (requested, not yet visible)."""
    if status is None:
        return "uncertain"
    if status.state in ("COMPLETED", "FAILED", "CANCELED"):
        return f"moot (ended {status.state})"
    if incident_id in status.hold_incidents:
        return "confirmed"
    if status.hibernated:
        return "uncertain"
    return "released" if recorded == "released" else recorded
