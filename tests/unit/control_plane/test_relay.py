"""The relay loop over in-memory ports: ack only after an answer, audit every refusal and duplicate with a
precise reason, one lane per trajectory (a stuck trajectory never delays another), partitions read by one
relay each (one trajectory's messages arrive in publishing order even with many relays), takeover of a dead
relay's partitions, and a Redis outage waited out within the budget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgpack
import pytest

from actors.ports import RelayDelivery
from actors.relay import AuditReason, HandleResult, Relay, RelayConfig
from cluster.control import ControlAction, ControlMessage, partition_of
from runtime.clock import FakeClock
from tests.unit.control_plane.fakes import FakeAudit, FakeStream, FakeTargets

CONFIG = RelayConfig(lease_ms=5_000, lease_every_s=1.0, block_ms=100, retry_base_s=0.1, retry_max_s=5.0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def stream(clock: FakeClock) -> FakeStream:
    return FakeStream(clock)


@pytest.fixture
def targets() -> FakeTargets:
    return FakeTargets(known={"t-1", "t-2", "t-3", "t-live", "t-stuck"})


@pytest.fixture
def audit() -> FakeAudit:
    return FakeAudit()


def relay(
    name: str,
    stream: FakeStream,
    targets: FakeTargets,
    audit: FakeAudit,
    clock: FakeClock,
    config: RelayConfig = CONFIG,
    kind: type[Relay] = Relay,
) -> Relay:
    return kind(name, stream, targets, audit, config, clock)


def msg(tid: str = "t-1", action: ControlAction = ControlAction.PAUSE, n: int = 0) -> ControlMessage:
    return ControlMessage.create(tid, action, "alice", now=1_700_000_000.0 + n, reason=f"#{n}")


async def drive(
    relays: list[Relay],
    clock: FakeClock,
    until: Callable[[], bool],
    *,
    tick_s: float = 0.1,
    ticks: int = 3000,
) -> float:
    """Step every relay and advance the fake clock until ``until()``; returns the fake seconds it took."""
    started = clock.now()
    for _ in range(ticks):
        for r in relays:
            await r.step(block=False)
        for _ in range(10):  # let the lanes run what is runnable now
            await asyncio.sleep(0)
        if until():
            return clock.now() - started
        clock.advance(tick_s)
    raise AssertionError(f"not reached after {ticks * tick_s:.0f} fake seconds")


# --------------------------------------------------------------------------- answers and audits


@pytest.mark.parametrize(
    ("answer", "result", "audit_reason"),
    [
        ("recorded", HandleResult.DELIVERED, None),
        ("duplicate", HandleResult.DUPLICATE, "DUPLICATE"),
        ("rejected:BAD_SIGNATURE", HandleResult.AUDITED, "BAD_SIGNATURE"),
        (
            "rejected:UNKNOWN_KEY:message m: 'mallory' is not in the keyring",
            HandleResult.AUDITED,
            "UNKNOWN_KEY",
        ),
        ("rejected:REPLAYED", HandleResult.AUDITED, "REPLAYED"),
        ("unknown", HandleResult.AUDITED, AuditReason.UNKNOWN_TRAJECTORY.value),
        ("terminal", HandleResult.AUDITED, AuditReason.TRAJECTORY_TERMINAL.value),
    ],
)
async def test_each_answer_is_acked_and_everything_but_a_record_is_audited_with_its_reason(
    stream: FakeStream,
    targets: FakeTargets,
    audit: FakeAudit,
    clock: FakeClock,
    answer: str,
    result: HandleResult,
    audit_reason: str | None,
) -> None:
    # Given a message whose trajectory answers ``answer``
    targets.answer["t-1"] = answer
    message = msg()
    entry = stream.publish(message)
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()

    # When the relay reads and handles it
    await drive([r], clock, lambda: bool(stream.acked))

    # Then it is acked (nothing left pending), counted, and audited exactly when not recorded
    assert stream.acked == [entry] and stream.pending() == 0
    assert r.counts[result.value] == 1
    assert audit.reasons() == ([audit_reason] if audit_reason else [])
    if audit_reason:
        assert audit.entries[0].message_id == message.message_id
        assert audit.entries[0].trajectory_id == "t-1" and audit.entries[0].relay == "relay:0"


@pytest.mark.parametrize(
    ("data", "field_present", "reason"),
    [
        (b"not msgpack \xc1", True, "MALFORMED"),
        (msgpack.packb({"schema_version": 99}), True, "MALFORMED"),
        (msgpack.packb([1, 2, 3]), True, "MALFORMED"),
        (None, False, "MISSING_FIELD"),
    ],
    ids=["garbage", "future-version", "not-a-map", "no-message-field"],
)
async def test_entries_without_a_message_are_audited_with_why_and_acked_never_delivered(
    stream: FakeStream,
    targets: FakeTargets,
    audit: FakeAudit,
    clock: FakeClock,
    data: bytes | None,
    field_present: bool,
    reason: str,
) -> None:
    # Given an entry with no usable message in t-1's partition, followed by a good message
    p = partition_of("t-1", stream.partitions)
    bad = stream.add(data, p, field_present=field_present)
    good = stream.publish(msg())
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()

    # When the relay handles both
    await drive([r], clock, lambda: len(stream.acked) == 2)

    # Then the bad one is audited with the precise reason and acked, and the good one still got through
    assert audit.reasons() == [reason] and audit.entries[0].entry_id == bad
    assert sorted(stream.acked) == sorted([bad, good])
    assert len(targets.records["t-1"]) == 1


async def test_the_same_message_on_two_entries_is_recorded_once_and_the_repeat_audited_as_duplicate(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given one message published twice (an operator retry, a replay, or a redelivery)
    m = msg()
    stream.publish(m)
    stream.publish(m)
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()

    # When the relay delivers both entries
    await drive([r], clock, lambda: len(stream.acked) == 2)

    # Then the actor recorded it once; the repeat was acked and audited as a duplicate
    assert targets.records["t-1"] == [m.message_id]
    assert r.counts[HandleResult.DELIVERED.value] == 1 and r.counts[HandleResult.DUPLICATE.value] == 1
    assert [(a.reason, a.message_id) for a in audit.entries] == [("DUPLICATE", m.message_id)]


async def test_an_unknown_trajectory_is_audited_once_not_retried(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given a message for a trajectory nobody launched
    stream.publish(msg("ghost"))
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()

    # When the relay runs for a long (fake) while
    await drive([r], clock, lambda: clock.now() > 1_060.0)

    # Then it was offered once, audited once, and nothing is pending
    assert targets.calls == {"ghost": 1}
    assert audit.reasons() == [AuditReason.UNKNOWN_TRAJECTORY.value]
    assert stream.pending() == 0


# --------------------------------------------------------------------------- lanes


class OneLane(Relay):
    """Protection off: every entry in one lane, as if the relay served its entries one after another."""

    def _lane_of(self, delivery: RelayDelivery) -> str:
        return "everything"


@pytest.mark.parametrize("kind", [Relay, OneLane], ids=["per-trajectory-lanes", "protection-off"])
async def test_a_stuck_trajectory_never_delays_messages_to_another(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock, kind: type[Relay]
) -> None:
    # Given 20 messages for a trajectory that cannot be reached, published before three for a live one
    targets.fail = lambda tid: tid == "t-stuck"
    for i in range(20):
        stream.publish(msg("t-stuck", ControlAction.INTERRUPT, i))
    live = [stream.publish(msg("t-live", ControlAction.INTERRUPT, 100 + i)) for i in range(3)]
    r = relay("relay:0", stream, targets, audit, clock, kind=kind)
    await r.start()

    # When the relay runs for ten (fake) seconds
    await drive([r], clock, lambda: clock.now() >= 1_010.0)

    # Then the live trajectory got all three, in order, while the stuck one's are still pending (retried
    # in place with a growing backoff: a handful of attempts, not one per tick)
    if kind is OneLane:
        assert targets.records.get("t-live") is None  # control: queued behind the stuck trajectory
        return
    assert [e for e in live if e in stream.acked] == live
    assert len(targets.records["t-live"]) == 3
    assert "t-stuck" not in targets.records and stream.pending() == 20
    assert 3 <= targets.calls["t-stuck"] <= 40


async def test_a_failed_delivery_is_retried_in_place_so_its_trajectorys_order_holds(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given t-1's pause fails twice before it gets through, and its resume is queued behind it
    failures = {"left": 2}

    def fail(tid: str) -> bool:
        if tid == "t-1" and failures["left"]:
            failures["left"] -= 1
            return True
        return False

    targets.fail = fail
    stream.publish(msg("t-1", ControlAction.PAUSE, 1))
    stream.publish(msg("t-1", ControlAction.RESUME, 2))
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()

    # When the relay runs until both are acked
    await drive([r], clock, lambda: len(stream.acked) == 2)

    # Then the pause was recorded before the resume, and both were retried rather than reordered
    assert targets.delivered == [("t-1", "pause"), ("t-1", "resume")]
    assert r.counts[HandleResult.RETRY.value] == 2 and audit.entries == []


# --------------------------------------------------------------------------- partitions


class Unleased(Relay):
    """Protection off: reads every partition whether or not it holds its lease (one consumer group, many
    readers: how relays read before partitions had owners)."""

    async def _refresh(self) -> int:
        self.live = await self.stream.beat(self.name, self.config.lease_ms)
        for p in range(self.stream.partitions):
            self._held[p] = self.clock.now()
            self._reading.add(p)
        return 0


@pytest.mark.parametrize("kind", [Relay, Unleased], ids=["leased-partitions", "protection-off"])
async def test_two_relays_deliver_one_trajectorys_messages_in_publishing_order(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock, kind: type[Relay]
) -> None:
    # Given two relays reading one entry at a time, and a pause then a resume for t-1 published together,
    # the pause's delivery being slow
    config = CONFIG.model_copy(update={"batch": 1})
    relays = [relay(f"relay:{i}", stream, targets, audit, clock, config, kind) for i in range(2)]
    for r in relays:
        await r.start()
    await drive(relays, clock, lambda: all(r.live == ["relay:0", "relay:1"] for r in relays))
    pause, resume = msg("t-1", ControlAction.PAUSE, 1), msg("t-1", ControlAction.RESUME, 2)
    slow = asyncio.Event()
    targets.gate[pause.message_id] = slow
    reads_before = len(stream.reads)
    stream.publish(pause)
    stream.publish(resume)

    # When both relays run a while, and then the slow delivery completes
    await drive(relays, clock, lambda: clock.now() >= 1_020.0)
    slow.set()
    await drive(relays, clock, lambda: len(stream.acked) == 2)

    # Then t-1 heard pause before resume, and only one relay ever read its partition
    if kind is Unleased:
        assert targets.delivered == [("t-1", "resume"), ("t-1", "pause")]  # control: the race
        return
    assert targets.delivered == [("t-1", "pause"), ("t-1", "resume")]
    p = partition_of("t-1", stream.partitions)
    assert len({consumer for consumer, parts in stream.reads[reads_before:] if p in parts}) == 1
    held = [set(r.stats()["partitions"]) for r in relays]
    assert held[0] | held[1] == set(range(stream.partitions)) and not held[0] & held[1]


async def test_a_dead_relays_partitions_are_taken_over_pending_entries_first_in_order(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given relay:0 alone holds every partition and read three messages for t-1, then died before delivering
    dead = relay("relay:0", stream, targets, audit, clock)
    await dead.start()
    targets.gate["t-1"] = asyncio.Event()  # never set: relay:0's deliveries never complete
    sent = [msg("t-1", ControlAction.INTERRUPT, i) for i in range(3)]
    for m in sent:
        stream.publish(m)
    await drive([dead], clock, lambda: stream.pending() == 3)
    survivor = relay("relay:1", stream, FakeTargets(known={"t-1"}), audit, clock)
    await survivor.start()
    later = msg("t-1", ControlAction.INTERRUPT, 9)

    # When relay:1 runs alone (relay:0 stopped beating) and a fourth message arrives meanwhile
    stream.publish(later)
    took = await drive([survivor], clock, lambda: stream.pending() == 0 and len(stream.acked) == 4)

    # Then relay:1 waited for relay:0's lease to lapse, and t-1 got every message once, in publishing order
    assert took >= CONFIG.lease_ms / 1000
    assert isinstance(survivor.targets, FakeTargets)
    assert survivor.targets.records["t-1"] == [m.message_id for m in [*sent, later]]
    assert survivor.claimed == 3


async def test_a_joining_relay_takes_its_share_and_the_first_gives_it_up(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given relay:0 holds every partition
    first = relay("relay:0", stream, targets, audit, clock)
    await first.start()
    await drive([first], clock, lambda: len(first.stats()["partitions"]) == stream.partitions)

    # When relay:1 joins
    second = relay("relay:1", stream, targets, audit, clock)
    await second.start()
    await drive([first, second], clock, lambda: bool(second.stats()["partitions"]))
    await drive([first, second], clock, lambda: clock.now() >= 1_030.0)

    # Then the partitions are split between them, each held by exactly one, and messages still flow
    a, b = set(first.stats()["partitions"]), set(second.stats()["partitions"])
    assert a and b and not a & b and a | b == set(range(stream.partitions))
    for i, tid in enumerate(["t-1", "t-2", "t-3"]):
        stream.publish(msg(tid, ControlAction.PAUSE, i))
    await drive([first, second], clock, lambda: len(stream.acked) == 3)
    assert sorted(targets.records) == ["t-1", "t-2", "t-3"]


# --------------------------------------------------------------------------- Redis away


@pytest.mark.parametrize(
    ("budget_s", "survives"), [(300.0, True), (5.0, False)], ids=["budget", "protection-off"]
)
async def test_a_redis_outage_is_waited_out_within_the_budget(
    stream: FakeStream,
    targets: FakeTargets,
    audit: FakeAudit,
    clock: FakeClock,
    budget_s: float,
    survives: bool,
) -> None:
    # Given a running relay
    r = relay(
        "relay:0", stream, targets, audit, clock, CONFIG.model_copy(update={"outage_budget_s": budget_s})
    )
    task = asyncio.ensure_future(r.run_forever())
    try:
        await _advance_until(clock, lambda: bool(r.stats()["partitions"]))

        # When Redis is away for 30 (fake) seconds, during which a message is published
        stream.down = True
        await _advance_until(clock, lambda: clock.now() >= 1_040.0)
        stream.publish(msg("t-1"))
        stream.down = False

        # Then the relay rode it out and delivered the message; with a budget shorter than the outage it
        # gave up instead (the control)
        if survives:
            await _advance_until(clock, lambda: stream.acked != [])
            assert targets.records["t-1"] and r.failed is None and r.stats()["outages"] >= 1
        else:
            await _advance_until(clock, lambda: task.done())
            assert r.failed is not None and "outage budget" in r.failed and "t-1" not in targets.records
    finally:
        r.stop()
        await asyncio.wait_for(task, 5.0)


async def _advance_until(clock: FakeClock, until: Callable[[], bool], *, tick_s: float = 0.1) -> None:
    for _ in range(10_000):
        for _ in range(10):
            await asyncio.sleep(0)
        if until():
            return
        clock.advance(tick_s)
    raise AssertionError("condition not reached")


async def test_entries_dropped_while_a_lease_had_lapsed_are_taken_over_again_when_it_is_back(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given a relay holding every partition, with t-1's message read but not yet deliverable
    reachable = {"t-1": False}
    targets.fail = lambda tid: not reachable.get(tid, True)
    r = relay("relay:0", stream, targets, audit, clock)
    task = asyncio.ensure_future(r.run_forever())
    try:
        await _advance_until(clock, lambda: bool(r.stats()["partitions"]))
        entry = stream.publish(msg("t-1"))
        await _advance_until(clock, lambda: targets.calls.get("t-1", 0) >= 1)

        # When Redis is away longer than the lease (the relay can no longer vouch for its partitions and
        # lets go of what it queued), then comes back, and t-1 becomes reachable
        stream.down = True
        await _advance_until(clock, lambda: clock.now() >= 1_030.0)
        stream.down = False
        reachable["t-1"] = True

        # Then the relay takes its partitions over again, pending entries included: the message is delivered
        await _advance_until(clock, lambda: entry in stream.acked)
        assert targets.records["t-1"] and r.failed is None
    finally:
        r.stop()
        await asyncio.wait_for(task, 5.0)


async def test_the_time_a_message_was_read_travels_with_it_through_its_retries(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given a trajectory that cannot be reached for a minute after its message is read
    reachable_at = clock.now() + 60.0
    targets.fail = lambda tid: clock.now() < reachable_at
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()
    await drive([r], clock, lambda: bool(r.stats()["partitions"]))
    m = msg()
    stream.publish(m)
    read_at = clock.wall()

    # When the relay keeps retrying until it gets through
    await drive([r], clock, lambda: bool(stream.acked), tick_s=0.5)

    # Then every attempt carried the time it was read (the validity window is judged then, not a minute on)
    assert targets.records["t-1"] == [m.message_id]
    assert read_at <= targets.received_at[m.message_id] <= read_at + 0.2 < clock.wall() - 50.0
