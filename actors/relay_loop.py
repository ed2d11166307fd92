"""The relay loop: carry signed control messages from the control partitions to the trajectory actors.

Issues 4 and 16, "Transport" (and ARCHITECTURE.md, "Control protocol"):

- **One reader per partition.** The control stream is split into partitions by trajectory
  (``tether:control:<n>``). Each relay (``relay:<n>`` in namespace ``tether``) beats into a membership set,
  computes which partitions are its own (highest-random-weight hashing over the live relays, so every relay
  agrees and a change moves only the dead or new relay's share) and holds a lease on each. It reads only the
  partitions it holds, so one trajectory's messages reach it, and only it, in publishing order.
- **Takeover.** A relay that dies stops beating and its leases lapse (``lease_ms``); the relays that now own
  its partitions take each over by claiming every entry still pending there (``XAUTOCLAIM``, any idle time)
  before reading new ones, so nothing is lost and the order holds.
- **Per-trajectory lanes.** Entries go into one FIFO lane per trajectory, each served by its own task: a
  slow, unplaced or dead trajectory delays only its own later messages, never another's; a failed delivery
  is retried with that lane's own backoff (exponential, full jitter), in place, so the order still holds.
- **Valid when received.** A message's validity window is judged at the moment the relay read it, not
  when its lane finally delivers it: an approval that waits minutes for a free trajectory slot (300 parked
  trajectories approved at once) does not expire in the queue; a message read after its window is expired.
- **Ack after the answer.** An entry is ``XACK``ed only once the trajectory actor answered (recorded, a
  duplicate, or refused) or the relay itself refused it; every answer other than "recorded" is audited on
  ``tether:audit`` with a precise reason (``MALFORMED``, ``MISSING_FIELD``, ``TRIMMED``,
  ``UNKNOWN_TRAJECTORY``, ``TRAJECTORY_TERMINAL``, ``DUPLICATE``, or the verifier's code such as
  ``BAD_SIGNATURE``, ``UNKNOWN_KEY``, ``EXPIRED``).
- **Redis away.** The loop rides out a Redis outage within ``outage_budget_s`` (issue 13): it backs off and
  tries again, and only a longer outage ends it.

``Relay`` is the loop with its ports injected (unit-tested without Ray or Redis). ``actors.relay`` holds
what it delivers through (verify first, then resolve or wake the trajectory: ``actors.incarnation``), the
thin Ray shell ``RelayActor`` and ``start_relays``, the helper the runner calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors import aio
from actors.outage import Backoff, Outage, OutageExceeded, is_outage, pause
from actors.ports import AuditEntry, AuditSink, ControlEnvelope, RelayDelivery, RelayStream
from runtime.clock import Clock, SystemClock

__all__ = [
    "AUDIT_STREAM",
    "DEFAULT_GROUP",
    "NAMESPACE",
    "TERMINAL",
    "UNKNOWN",
    "AuditEntry",
    "AuditReason",
    "AuditSink",
    "DeliveryPort",
    "HandleResult",
    "Relay",
    "RelayConfig",
    "StreamPort",
    "owner_of",
    "relay_name",
]

log = logging.getLogger(__name__)

NAMESPACE = "tether"
DEFAULT_GROUP = "relays"
AUDIT_STREAM = "tether:audit"
UNKNOWN = "unknown"  # what a DeliveryPort answers for a trajectory nobody ever launched
TERMINAL = "terminal"  # ... for a trajectory that ended (its actor is gone and is not woken for this)


def relay_name(n: int) -> str:
    """The Ray actor name of relay number ``n``."""
    return f"relay:{n}"


class RelayConfig(BaseModel):
    """How relays read the control partitions. All relays of a cluster share ``group``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group: str = Field(default=DEFAULT_GROUP, min_length=1, max_length=64)
    batch: int = Field(default=64, ge=1, le=1000)
    block_ms: int = Field(default=200, ge=1, le=10_000)  # bounds how long stop() waits for the loop
    lease_ms: int = Field(default=5_000, ge=100)  # a relay silent this long is presumed dead
    lease_every_s: float = Field(default=1.0, gt=0.0)  # how often leases and membership are renewed
    deliver_timeout_s: float = Field(default=30.0, gt=0.0)  # one call to a placed actor
    wake_wait_s: float = Field(default=600.0, gt=0.0)  # a woken actor waiting for a free trajectory slot
    retry_base_s: float = Field(default=0.05, gt=0.0)  # a lane's first retry delay (then doubling)
    retry_max_s: float = Field(default=5.0, gt=0.0)  # ... up to this
    max_queued: int = Field(default=10_000, ge=1)  # entries held in lanes before reading pauses
    outage_budget_s: float = Field(default=300.0, ge=0.0)  # Redis away this long: the relay gives up
    audit_maxlen: int = Field(default=100_000, ge=1)

    @model_validator(mode="after")
    def _inside_the_lease(self) -> Self:
        # A blocked read must end well inside the lease, or a relay could read a partition it just lost;
        # and a lease must be renewed at least twice per lifetime, or one late renewal loses it.
        if self.block_ms * 4 > self.lease_ms:
            raise ValueError(
                f"block_ms ({self.block_ms}) must be at most a quarter of lease_ms ({self.lease_ms})"
            )
        if self.lease_every_s * 1000 * 2 > self.lease_ms:
            raise ValueError(
                f"lease_every_s ({self.lease_every_s} s) must be at most half of lease_ms ({self.lease_ms})"
            )
        return self


class AuditReason(StrEnum):
    """Why a relay wrote an audit entry. An actor's or the relay's refusal carries the verifier's reason
    code itself (``BAD_SIGNATURE``, ``UNKNOWN_KEY``, ``WRONG_ROLE``, ``EXPIRED``, ``REPLAYED``, ...)."""

    UNKNOWN_TRAJECTORY = "UNKNOWN_TRAJECTORY"
    TRAJECTORY_TERMINAL = "TRAJECTORY_TERMINAL"
    MALFORMED = "MALFORMED"
    MISSING_FIELD = "MISSING_FIELD"  # an entry without the message field (a foreign writer)
    TRIMMED = "TRIMMED"  # a pending entry whose message Redis trimmed away before anyone delivered it
    DUPLICATE = "DUPLICATE"  # a message the trajectory had already recorded: acked, nothing changed


class HandleResult(StrEnum):
    """What the relay did with one entry."""

    DELIVERED = "delivered"  # the actor recorded it: acked
    DUPLICATE = "duplicate"  # the actor already had it: audited and acked
    AUDITED = "audited"  # refused (unknown, terminal, malformed, unverified...): audited and acked
    RETRY = "retry"  # the trajectory could not be reached: retried by its lane after a backoff


# --------------------------------------------------------------------------- ports


StreamPort = RelayStream  # the control partitions as a relay reads them (``actors.ports``)


class DeliveryPort(Protocol):
    """Hands one decoded message to its trajectory.

    Returns the actor's answer (``"recorded"``, ``"duplicate"``, ``"rejected:<REASON>"``), ``"unknown"``
    when no such trajectory was ever launched, or ``"terminal"`` when it ended. Raises (``TargetGone`` or
    anything else) when the trajectory could not answer this time: the relay retries after a backoff.
    """

    async def deliver(self, envelope: ControlEnvelope, received_at: float) -> str:
        """``received_at``: when the relay read the entry (epoch seconds), the time its validity window is
        judged at, so a message that waited in a lane for a slot does not expire on the way."""
        ...


def owner_of(partition: int, live: Sequence[str]) -> str | None:
    """The relay that should read ``partition`` among ``live`` (highest random weight; None if none)."""
    if not live:
        return None
    return max(live, key=lambda name: (zlib.crc32(f"{name}|{partition}".encode()), name))


# --------------------------------------------------------------------------- the loop


@dataclass(slots=True)
class _Lane:
    items: collections.deque[RelayDelivery] = field(default_factory=collections.deque)
    backoff: Backoff = field(default_factory=Backoff)
    task: asyncio.Task[None] | None = None


class Relay:
    """One relay's loop over injected ports: membership and leases, reading, lanes, acks, audits."""

    def __init__(
        self,
        name: str,
        stream: StreamPort,
        targets: DeliveryPort,
        audit: AuditSink,
        config: RelayConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.stream = stream
        self.targets = targets
        self.audit = audit
        self.config = config or RelayConfig()
        self.clock = clock or SystemClock()
        self.counts: dict[str, int] = {r.value: 0 for r in HandleResult}
        self.claimed = 0  # entries taken over from partitions that were another relay's (or ours, earlier)
        self.live: list[str] = []  # the live relays at the last beat
        self.failed: str | None = None  # why the loop gave up (an outage longer than the budget)
        self._held: dict[int, float] = {}  # partition -> when its lease was last confirmed (clock.now())
        self._reading: set[int] = set()  # held partitions whose pending entries were taken over
        self._lanes: dict[str, _Lane] = {}
        self._queued = 0
        self._received: dict[tuple[int, str], float] = {}  # (partition, entry id) -> when we read it
        self._next_lease = 0.0  # renew on the first step
        self._stopping = asyncio.Event()
        self._outage = Outage(f"relay {name}", budget_s=self.config.outage_budget_s, clock=self.clock)

    # ------------------------------------------------------------------ loop

    async def start(self) -> None:
        """Create the group on every partition if needed."""
        await self._outage.call(lambda: self.stream.ensure_group(self.config.group))

    async def step(self, *, block: bool = True) -> int:
        """One pass: renew membership and leases when due, then read new entries into the lanes.
        Returns how many entries were queued."""
        queued = 0
        if self.clock.now() >= self._next_lease:
            queued += await self._refresh()
            self._next_lease = self.clock.now() + self.config.lease_every_s
        parts = sorted(p for p in self._reading if self.owns(p))
        if not parts or self._queued >= self.config.max_queued:
            if block:
                await self._pause(self.config.block_ms / 1000)
            return queued
        fresh = await self.stream.read(
            self.config.group,
            self.name,
            partitions=parts,
            count=self.config.batch,
            block_ms=self.config.block_ms if block else None,
        )
        self._enqueue(fresh)
        return queued + len(fresh)

    async def run_forever(self) -> None:
        """Loop until ``stop()``; a failing step (Redis away) backs off and retries within the outage
        budget. Past it the relay gives its partitions up and ends (``failed`` says why)."""
        try:
            await self.start()
            while not self._stopping.is_set():
                try:
                    await self.step()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if not is_outage(e):
                        log.exception("%s: relay step failed; retrying", self.name)
                    else:
                        log.warning("%s: Redis unreachable, waiting: %s", self.name, e)
                    await self._outage.failed(e)
                else:
                    self._outage.ok()
        except OutageExceeded as e:
            self.failed = str(e)
            log.error("%s: giving up: %s", self.name, e)
            self._drop_all()

    def stop(self) -> None:
        self._stopping.set()

    async def shutdown(self) -> None:
        """Cancel the lanes and give the leases back, so another relay takes over at once."""
        lanes = [lane.task for lane in self._lanes.values() if lane.task is not None]
        await asyncio.gather(
            *(aio.stop(task, what=f"{self.name}: a delivery lane", again_s=aio.ASK_AGAIN_S) for task in lanes)
        )
        self._drop_all()
        held = sorted(self._held)
        self._held.clear()
        with contextlib.suppress(Exception):  # best effort: unreleased leases lapse on their own
            await self.stream.release(self.name, held)

    async def idle(self) -> None:
        """Wait until every lane has emptied (tests and benchmarks; bounded by the caller)."""
        while True:
            tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
            if not tasks:
                return
            await asyncio.gather(*tasks, return_exceptions=True)

    def owns(self, partition: int) -> bool:
        """Whether this relay may still act on ``partition``: its lease was confirmed recently enough that
        it cannot have lapsed (a margin of a fifth of the lease for the time a read or a call takes)."""
        confirmed = self._held.get(partition)
        return confirmed is not None and self.clock.now() - confirmed < self.config.lease_ms * 0.8 / 1000

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "claimed": self.claimed,
            "partitions": sorted(self._held),
            "live": list(self.live),
            "lanes": len(self._lanes),
            "queued": self._queued,
            "outages": self._outage.outages,
            "outage_s": round(self._outage.lasted_s, 3),
            "failed": self.failed,
            **self.counts,
        }

    # ------------------------------------------------------------------ leases

    async def _refresh(self) -> int:
        """Beat, work out our partitions, hold their leases, give back the others, take over new ones."""
        ttl = self.config.lease_ms
        asked_at = self.clock.now()
        # A lease we could not renew in time (Redis away, the process stalled) may have lapsed and been
        # held by another relay meanwhile, and its lanes have let its entries go: whatever we hold again
        # is taken over afresh, pending entries first.
        for p in [p for p in self._held if not self.owns(p)]:
            self._forget(p)
        self.live = await self.stream.beat(self.name, ttl)
        wanted = [p for p in range(self.stream.partitions) if owner_of(p, self.live) == self.name]
        held = await self.stream.hold(self.name, wanted, ttl)
        unwanted = sorted(set(self._held) - set(wanted))
        lost = sorted(set(self._held) - held)
        for p in set(unwanted) | set(lost):
            self._forget(p)
        if unwanted:
            await self.stream.release(self.name, unwanted)
        queued = 0
        for p in sorted(held):
            self._held[p] = asked_at  # confirmed as of when we asked (conservative)
            if p not in self._reading:
                queued += await self._take_over(p)
                self._reading.add(p)
        return queued

    async def _take_over(self, partition: int) -> int:
        """Claim every entry still pending on ``partition`` (a dead relay's, or our own from before a
        restart) and queue them, in stream order, before any new entry of it is read."""
        cursor = "0-0"
        taken = 0
        while True:
            claimed = await self.stream.claim_stale(
                self.config.group,
                self.name,
                partition=partition,
                min_idle_ms=0,
                count=self.config.batch,
                start_id=cursor,
            )
            for entry_id in claimed.deleted_ids:
                # Redis dropped these from the PEL itself: nothing to deliver or ack, but say so
                await self._audit(AuditReason.TRIMMED, "pending entry was trimmed before delivery", entry_id)
            self._enqueue(claimed.deliveries)
            taken += len(claimed.deliveries)
            cursor = claimed.next_start_id
            if cursor == "0-0":  # the scan wrapped: every pending entry was seen
                break
        self.claimed += taken
        return taken

    def _forget(self, partition: int) -> None:
        """Stop acting on a partition we no longer hold: its queued entries are the next holder's now."""
        self._held.pop(partition, None)
        self._reading.discard(partition)
        for lane in self._lanes.values():
            self._drop(lane, partition)

    def _drop(self, lane: _Lane, partition: int, *, keep_head: bool = True) -> None:
        # The head may be mid-delivery; its lane drops it after the call if the partition is gone.
        head = lane.items[0] if keep_head and lane.items and lane.task is not None else None
        kept = [d for d in lane.items if d is head or d.partition != partition]
        for d in lane.items:
            if d is not head and d.partition == partition:
                self._received.pop((d.partition, d.entry_id), None)
        self._queued -= len(lane.items) - len(kept)
        lane.items = collections.deque(kept)

    def _drop_all(self) -> None:
        for p in list(self._held):
            self._forget(p)

    # ------------------------------------------------------------------ lanes

    def _enqueue(self, deliveries: list[RelayDelivery]) -> None:
        for d in deliveries:
            key = self._lane_of(d)
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(
                    backoff=Backoff(self.config.retry_base_s, self.config.retry_max_s)
                )
            if any(item.entry_id == d.entry_id and item.partition == d.partition for item in lane.items):
                continue  # already queued (claimed again after a brief lease gap)
            lane.items.append(d)
            self._received.setdefault((d.partition, d.entry_id), self.clock.wall())
            self._queued += 1
            if lane.task is None or lane.task.done():
                lane.task = asyncio.ensure_future(self._serve(key, lane))

    def _lane_of(self, delivery: RelayDelivery) -> str:
        """One lane per trajectory (an entry without a message gets a lane of its own)."""
        if delivery.envelope is not None:
            return delivery.envelope.trajectory_id
        return f"(entry {delivery.partition}/{delivery.entry_id})"

    async def _serve(self, key: str, lane: _Lane) -> None:
        """Deliver a lane's entries one at a time, in order; a failed one is retried in place."""
        handled: RelayDelivery | None = None  # the head, once answered (only its ack is left to retry)
        try:
            while lane.items and not self._stopping.is_set():
                item = lane.items[0]
                if not self.owns(item.partition):
                    lane.items.popleft()
                    self._received.pop((item.partition, item.entry_id), None)
                    self._queued -= 1
                    continue
                if handled is not item:
                    result = await self._handle(item)
                    self.counts[result.value] += 1
                    if result is HandleResult.RETRY:
                        await self._pause(lane.backoff.next())
                        continue
                    handled = item
                if not await self._ack(item):
                    await self._pause(lane.backoff.next())
                    continue
                lane.backoff.reset()
                if lane.items and lane.items[0] is item:
                    lane.items.popleft()
                    self._received.pop((item.partition, item.entry_id), None)
                    self._queued -= 1
        finally:
            if self._lanes.get(key) is lane and (not lane.items or self._stopping.is_set()):
                del self._lanes[key]

    async def _ack(self, item: RelayDelivery) -> bool:
        try:
            await self.stream.ack(self.config.group, item.partition, item.entry_id)
        except Exception as e:  # Redis away: keep the entry and ack it after the lane's backoff
            log.warning("%s: acking %s failed: %r", self.name, item.entry_id, e)
            return False
        return True

    async def _handle(self, item: RelayDelivery) -> HandleResult:
        """Deliver one entry and audit anything but a recorded message; RETRY when the trajectory (or the
        audit stream) could not be reached."""
        message = item.envelope
        try:
            if message is None:
                reason = item.problem or AuditReason.MALFORMED
                await self._audit(reason, str(item.error), item.entry_id)
                return HandleResult.AUDITED
            try:
                received_at = self._received.get((item.partition, item.entry_id), self.clock.wall())
                answer = await self.targets.deliver(message, received_at)
            except Exception as e:
                log.warning(
                    "%s: delivering %s to %s failed: %r", self.name, item.entry_id, message.trajectory_id, e
                )
                return HandleResult.RETRY
            if answer == "recorded":
                return HandleResult.DELIVERED
            if answer == "duplicate":
                await self._audit(AuditReason.DUPLICATE, "already recorded", item.entry_id, message)
                return HandleResult.DUPLICATE
            if answer == UNKNOWN:
                await self._audit(
                    AuditReason.UNKNOWN_TRAJECTORY, "no such trajectory", item.entry_id, message
                )
            elif answer == TERMINAL:
                await self._audit(
                    AuditReason.TRAJECTORY_TERMINAL, "the trajectory has ended", item.entry_id, message
                )
            else:  # "rejected:<REASON>[:detail]" (or any answer we do not know): keep the reason on file
                _, _, rest = answer.partition(":")
                reason = rest.partition(":")[0] or answer
                await self._audit(reason, answer, item.entry_id, message)
            return HandleResult.AUDITED
        except Exception as e:  # the audit could not be written (Redis away): try the entry again later
            log.warning("%s: auditing %s failed: %r", self.name, item.entry_id, e)
            return HandleResult.RETRY

    async def _audit(
        self, reason: str, detail: str, entry_id: str, message: ControlEnvelope | None = None
    ) -> None:
        entry = AuditEntry(
            reason=str(reason),
            detail=detail[:500],
            entry_id=entry_id,
            relay=self.name,
            at=self.clock.wall(),
            message_id=message.message_id if message else "",
            trajectory_id=message.trajectory_id if message else "",
            action=message.action if message else "",
            issuer=message.issuer if message else "",
        )
        await self.audit.write(entry)

    async def _pause(self, seconds: float) -> None:
        """Sleep on the injected clock, but wake at once on ``stop()``."""
        await pause(self.clock, seconds, self._stopping)
