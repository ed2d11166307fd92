"""What a trajectory actor shows the outside world while it runs: a summary, a status snapshot in Redis,
and state-change events on ``tether:events``.

None of this is the durable record (the log is): the snapshot and the events are views for ``tether run``'s
progress bar and for ``tether watch``/``status``. They are therefore written off the critical path: the
harness's ``on_event`` hook only marks the latest snapshot dirty, and one writer task per actor flushes it
(coalescing bursts: ten appends in a millisecond are one write). A write goes out at once when the view was
idle; changes that come while the last write is younger than ``min_interval_s`` wait for it to pass and go
out together (the snapshot once, the live events in one pipelined round trip), so a running trajectory
costs Redis a few view writes per second, not several per turn.

Snapshot hash ``tether:status:<id>`` fields: ``state``, ``turns``, ``rho``, ``binding_dimension``,
``exit_reason``, ``tokens``, ``dollars``, ``hibernated`` (``0``/``1``), ``held_digest``, ``held_tool``,
``held_expires_at`` (only while AWAITING_APPROVAL), ``pid``, ``updated_at`` (epoch seconds); issue 12:
``hold`` (watchdog, control, incident or empty), ``hold_reason``, ``hold_incidents`` (comma list),
``rung``, ``escalations_open``, ``parent_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from typing import Any

import redis.asyncio as aioredis

from actors import aio
from actors.ports import LiveEventSink
from runtime.budget import Dimension
from runtime.clock import Clock
from runtime.degradation import result_of
from runtime.events import (
    ChildSettled,
    ChildSpawned,
    EscalationAcknowledged,
    EscalationOpened,
    EscalationResolved,
    Event,
    HoldPlaced,
    HoldReleased,
    ModelCallSettled,
    ObligationUpdated,
    OperationSettled,
    OperatorActed,
    RungChanged,
    StateChanged,
    ToolCallHeld,
)
from runtime.memstore import check_trajectory_id
from runtime.record import TrajectoryRecord
from runtime.states import TrajectoryState

__all__ = [
    "STATUS_KEY_PREFIX",
    "StatusPublisher",
    "status_fields",
    "status_key",
    "summarize",
]

STATUS_KEY_PREFIX = "tether:status:"
_log = logging.getLogger(__name__)

# Events that change what the snapshot shows; everything else is not worth a write.
_SHOWN = (
    StateChanged,
    ToolCallHeld,
    ModelCallSettled,
    OperationSettled,
    ObligationUpdated,
    OperatorActed,
    # issue 12: holds, rungs, escalations and children show in the snapshot too
    HoldPlaced,
    HoldReleased,
    RungChanged,
    EscalationOpened,
    EscalationAcknowledged,
    EscalationResolved,
    ChildSpawned,
    ChildSettled,
)


def status_key(trajectory_id: str) -> str:
    """The Redis hash holding a trajectory's status snapshot."""
    return STATUS_KEY_PREFIX + check_trajectory_id(trajectory_id)


def summarize(record: TrajectoryRecord, hibernated: bool = False) -> dict[str, Any]:
    """The run summary ``TrajectoryActor.run()`` returns (and the report's per-trajectory row)."""
    return {
        "id": record.trajectory_id,
        "state": record.state.value,
        "exit_reason": record.exit_reason.value if record.exit_reason is not None else None,
        "turns": record.turn_count,
        "tokens": int(record.spend.get(Dimension.TOKENS)),
        "dollars": round(record.spend.get(Dimension.DOLLARS), 6),
        "binding_dimension": record.binding_dimension,
        "rho": round(record.rho, 4),
        "hibernated": hibernated,
        # issue 12: the rung and machine-readable completeness of the result, holds, escalations, children
        "result": result_of(record),
        "rung": record.supervision.rung.value,
        "hold": None if record.hold is None else record.hold.kind.value,
        "escalations": {e.escalation_id: e.trigger.value for e in record.supervision.escalations.values()},
        "parent_id": record.parent_id,
        "children": {
            c.child_id: {"status": c.status, "verified": c.verified, "spent": dict(c.spent)}
            for c in record.supervision.children.values()
        },
        "spend": record.spend.as_dict(),
    }


def owed(record: TrajectoryRecord) -> list[dict[str, Any]]:
    """What the trajectory still owes the world (``tether obligations``): unknown operations and open or
    handed-off obligations, each with its target, the evidence so far, its owner and since when."""
    rows: list[dict[str, Any]] = []
    for op in record.operations.values():
        if op.settled or op.cleanup_of is not None:
            continue
        awaited = any(p.operation_id == op.operation_id for p in record.pending_calls.values())
        rows.append(
            {
                "id": op.operation_id,
                "kind": "operation",
                "tool": op.tool,
                "target": dict(op.arguments),
                "state": "in flight" if awaited else "unknown",
                "evidence": f"{op.attempts} attempt(s), outcome unknown",
                "owner": op.owner or record.trajectory_id,
                "since": op.dispatched_at,
            }
        )
    for ob in record.obligations.values():
        if ob.state.value in ("discharged", "committed"):
            continue
        rows.append(
            {
                "id": ob.obligation_id,
                "kind": ob.duty,
                "tool": ob.tool,
                "target": dict(ob.arguments),
                "state": ob.state.value,
                "evidence": ob.evidence[-1] if ob.evidence else "",
                "owner": ob.owner,
                "since": ob.registered_at,
            }
        )
    return rows


def status_fields(record: TrajectoryRecord, *, hibernated: bool, now: float) -> dict[str, str]:
    """The snapshot hash of ``record`` (all values strings; empty string for "none")."""
    held = record.held if record.state is TrajectoryState.AWAITING_APPROVAL else None
    owes = owed(record)
    return {
        "owed": json.dumps(owes, sort_keys=True, default=str) if owes else "",
        "handoff": "1" if record.handoff is not None else "0",
        "state": record.state.value,
        "turns": str(record.turn_count),
        "rho": f"{record.rho:.4f}",
        "binding_dimension": record.binding_dimension or "",
        "exit_reason": record.exit_reason.value if record.exit_reason is not None else "",
        "tokens": str(int(record.spend.get(Dimension.TOKENS))),
        "dollars": f"{record.spend.get(Dimension.DOLLARS):.6f}",
        "hibernated": "1" if hibernated else "0",
        "held_digest": held.digest if held is not None else "",
        "held_tool": held.tool if held is not None else "",
        "held_expires_at": f"{held.expires_at:.3f}" if held is not None else "",
        "pid": str(os.getpid()),
        "updated_at": f"{now:.3f}",
        # issue 12
        "hold": record.hold.kind.value if record.hold is not None else "",
        "hold_reason": record.hold.reason[:200] if record.hold is not None else "",
        "hold_incidents": ",".join(record.hold.incident_ids) if record.hold is not None else "",
        "rung": record.supervision.rung.value,
        "escalations_open": str(len(record.supervision.open_escalations())),
        "parent_id": record.parent_id or "",
    }


class StatusPublisher:
    """Coalescing writer of one trajectory's snapshot and live events (a ``TrajectoryHooks`` event sink)."""

    def __init__(
        self,
        client: aioredis.Redis,
        events: LiveEventSink,
        trajectory_id: str,
        clock: Clock,
        *,
        min_interval_s: float = 0.05,
    ) -> None:
        self.min_interval_s = min_interval_s
        self._written_at = -math.inf
        self._client = client
        self._events = events
        self._key = status_key(trajectory_id)
        self._trajectory_id = trajectory_id
        self._clock = clock
        self._latest: TrajectoryRecord | None = None
        self._hibernated = False
        self._live: list[tuple[float, dict[str, Any]]] = []  # (at, data) of state changes not yet published
        self._dirty = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False

    def on_event(self, record: TrajectoryRecord, event: Event) -> None:
        if not isinstance(event, _SHOWN):
            return
        if isinstance(event, StateChanged):
            self._live.append(
                (
                    self._clock.wall(),
                    {
                        "from": event.from_state.value,
                        "to": event.to_state.value,
                        "reason": event.reason,
                        "turns": record.turn_count,
                        "exit_reason": event.exit_reason.value if event.exit_reason is not None else None,
                    },
                )
            )
        self.show(record)

    def show(self, record: TrajectoryRecord, *, hibernated: bool = False) -> None:
        """Mark ``record`` as the snapshot to write next."""
        self._latest = record
        self._hibernated = hibernated
        self._idle.clear()
        self._dirty.set()
        if not self._closing and (self._writer is None or self._writer.done()):
            self._writer = asyncio.ensure_future(self._write_forever())

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until everything shown so far is written (bounded: a view must not hold up the actor)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop the writer and close the live-event sink (this publisher owns it).

        The writer is told to stop as well as cancelled, and waited for only ``timeout_s``: the Redis client
        can turn a cancel that races its own socket timeout into a ``TimeoutError``, which the writer logs
        like any failed write — without the flag it would then wait for the next snapshot forever (an
        actor's shutdown hung that way under load)."""
        self._closing = True
        self._dirty.set()
        if self._writer is not None:
            await aio.stop(self._writer, what=f"status writer of {self._trajectory_id}", within_s=timeout_s)
        with contextlib.suppress(Exception):  # best effort: the process may be exiting
            await self._events.close()

    async def _write_forever(self) -> None:
        while not self._closing:
            await self._dirty.wait()
            if self._closing:
                return
            # a turn is several batches a few ms apart: what they show goes out as one write
            wait = self._written_at + self.min_interval_s - self._clock.now()
            if wait > 0:
                await self._clock.sleep(wait)
                if self._closing:
                    return
            self._dirty.clear()
            record, hibernated = self._latest, self._hibernated
            live, self._live = self._live, []
            try:
                if record is not None:
                    fields = status_fields(record, hibernated=hibernated, now=self._clock.wall())
                    await self._client.hset(self._key, mapping=dict[Any, Any](fields))
                await self._events.publish_many(self._trajectory_id, "state", live)
            except Exception as e:  # a view that cannot be written is logged, never fatal
                _log.warning("status of %s not written: %r", self._trajectory_id, e)
            self._written_at = self._clock.now()
            if not self._dirty.is_set():
                self._idle.set()
