"""The relay loop over in-memory ports: ack only after the actor answered, audit instead of looping,
take over a dead relay's entries after the idle timeout, at-least-once with the actor deduping."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from actors.relay import AuditReason, HandleResult, Relay, RelayConfig
from cluster.control import ControlAction, ControlMessage, decode_message
from runtime.clock import FakeClock
from tests.unit.control_plane.fakes import FakeAudit, FakeStream, FakeTargets

CONFIG = RelayConfig(claim_idle_ms=5_000, claim_every_s=1.0, deliver_timeout_s=5.0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def stream(clock: FakeClock) -> FakeStream:
    return FakeStream(clock)


@pytest.fixture
def targets() -> FakeTargets:
    return FakeTargets(known={"t-1", "t-2"})


@pytest.fixture
def audit() -> FakeAudit:
    return FakeAudit()


def relay(name: str, stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock) -> Relay:
    return Relay(name, stream, targets, audit, CONFIG, clock)


def msg(tid: str = "t-1", action: ControlAction = ControlAction.PAUSE, n: int = 0) -> ControlMessage:
    return ControlMessage.create(tid, action, "alice", now=1_700_000_000.0 + n, reason=f"#{n}")


@pytest.mark.parametrize(
    ("answer", "result", "audit_reason"),
    [
        ("recorded", HandleResult.DELIVERED, None),
        ("duplicate", HandleResult.DELIVERED, None),
        ("rejected:BAD_SIGNATURE", HandleResult.AUDITED, "REJECTED:BAD_SIGNATURE"),
        ("rejected:REPLAYED", HandleResult.AUDITED, "REJECTED:REPLAYED"),
        ("unknown", HandleResult.AUDITED, AuditReason.UNKNOWN_TRAJECTORY.value),
    ],
)
async def test_each_actor_answer_is_acked_and_refusals_are_audited(
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
    await r.step(block=False)

    # Then it is acked (nothing left pending), counted, and audited exactly when refused
    assert stream.acked == [entry] and stream.pel == {}
    assert r.counts[result.value] == 1
    assert [a.reason for a in audit.entries] == ([audit_reason] if audit_reason else [])
    if audit_reason:
        assert audit.entries[0].message_id == message.message_id
        assert audit.entries[0].trajectory_id == "t-1" and audit.entries[0].relay == "relay:0"


@pytest.mark.parametrize(
    "data",
    [b"not msgpack \xc1", msgpack.packb({"schema_version": 99}), msgpack.packb([1, 2, 3])],
    ids=["garbage", "future-version", "not-a-map"],
)
async def test_malformed_entries_are_audited_and_acked_never_delivered(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock, data: bytes
) -> None:
    # Given an entry that does not decode, followed by a good one
    bad = stream.add(data)
    good = stream.publish(msg())
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()

    # When the relay handles both
    await r.step(block=False)

    # Then the bad one is audited MALFORMED and acked, and the good one still got through
    assert [a.reason for a in audit.entries] == [AuditReason.MALFORMED.value]
    assert audit.entries[0].entry_id == bad
    assert stream.acked == [bad, good]
    assert len(targets.records["t-1"]) == 1


async def test_unknown_trajectory_is_audited_once_not_retried(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given a message for a trajectory nobody launched
    stream.publish(msg("ghost"))
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()

    # When the relay runs several passes, long past the claim timeout
    for _ in range(5):
        await r.step(block=False)
        clock.advance(10.0)

    # Then it was offered to the directory once, audited once, and nothing is pending
    assert targets.calls == 1
    assert [a.reason for a in audit.entries] == [AuditReason.UNKNOWN_TRAJECTORY.value]
    assert stream.pel == {}


async def test_a_failed_delivery_stays_pending_and_is_retried_after_the_idle_timeout(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given the target actor dies during the first delivery
    dying = {"t-1"}
    targets.fail = lambda tid: tid in dying
    entry = stream.publish(msg())
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()
    await r.step(block=False)
    assert stream.acked == [] and entry in stream.pel  # not acked: the actor never answered

    # When the actor is back and the entry has been idle past claim_idle_ms
    dying.clear()
    clock.advance(CONFIG.claim_idle_ms / 1000 + CONFIG.claim_every_s)
    await r.step(block=False)

    # Then the retry delivered it, once, and it is acked
    assert targets.records["t-1"] == [stream._delivery(entry).envelope.message_id]  # type: ignore[union-attr]
    assert stream.acked == [entry] and stream.pel == {}
    assert r.counts[HandleResult.RETRY.value] == 1 and r.counts[HandleResult.DELIVERED.value] == 1


async def test_a_dead_relays_entries_are_taken_over_only_after_the_idle_timeout(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given relay:0 read three messages and died before delivering any
    sent = [msg("t-1", n=i) for i in range(3)]
    for m in sent:
        stream.publish(m)
    dead = relay("relay:0", stream, targets, audit, clock)
    await dead.start()
    taken = await stream.read(CONFIG.group, "relay:0", count=10)
    assert len(taken) == 3
    survivor = relay("relay:1", stream, targets, audit, clock)
    await survivor.start()

    # When relay:1 polls before the timeout, then after it
    await survivor.step(block=False)
    before = dict(targets.records)
    clock.advance(CONFIG.claim_idle_ms / 1000 + CONFIG.claim_every_s)
    await survivor.step(block=False)

    # Then nothing was stolen from a live-looking owner, and afterwards each message is recorded once
    assert before == {}
    assert targets.records["t-1"] == [m.message_id for m in sent]
    assert survivor.claimed == 3 and stream.pel == {}


async def test_the_same_message_on_two_entries_changes_the_record_once(
    stream: FakeStream, targets: FakeTargets, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given one message published twice (an operator retry, or a redelivery)
    m = msg()
    stream.publish(m)
    stream.publish(m)
    r = relay("relay:0", stream, targets, audit, clock)
    await r.start()

    # When the relay delivers both entries
    await r.step(block=False)

    # Then the actor recorded it once, the second answer was "duplicate", and both entries are acked
    assert targets.records["t-1"] == [m.message_id]
    assert r.counts[HandleResult.DELIVERED.value] == 2 and len(stream.acked) == 2
    assert audit.entries == []


async def test_trajectories_are_served_concurrently_each_in_stream_order(
    stream: FakeStream, audit: FakeAudit, clock: FakeClock
) -> None:
    # Given t-1's actor answers only once t-2's actor has been reached (a slow actor must not stall others)
    reached_t2 = asyncio.Event()
    order: list[tuple[str, str]] = []

    class Gated(FakeTargets):
        async def deliver(self, trajectory_id: str, data: bytes) -> str:
            if trajectory_id == "t-1":
                await reached_t2.wait()
            else:
                reached_t2.set()
            order.append((trajectory_id, decode_message(data).action.value))
            return "recorded"

    first, second = msg("t-1", ControlAction.PAUSE, 1), msg("t-1", ControlAction.RESUME, 2)
    for m in (first, msg("t-2", ControlAction.KILL, 3), second):
        stream.publish(m)
    r = relay("relay:0", stream, Gated(known={"t-1", "t-2"}), audit, clock)
    await r.start()

    # When one batch holds messages for both
    await r.step(block=False)

    # Then t-2 was served while t-1 waited, and t-1's pause still came before its resume
    assert order == [("t-2", "kill"), ("t-1", "pause"), ("t-1", "resume")]
    assert r.counts[HandleResult.DELIVERED.value] == 3 and stream.pel == {}
