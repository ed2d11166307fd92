"""The control transport on a real redis-server: partitions by trajectory, consumer groups, acks, takeover of
a dead consumer's pending messages with XAUTOCLAIM, partition leases and relay membership, bulk publishing
from the operator client, and the trimmed live-events stream."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from actors import aio
from cluster.control import (
    ControlAction,
    ControlMessage,
    ControlStream,
    EntryProblem,
    LiveEvent,
    partition_of,
)
from cluster.control_client import ControlClient
from cluster.control_leases import PartitionLeases
from cluster.signing import Keyring, Role, Verifier, create_key, sign

pytestmark = pytest.mark.integration

GROUP = "relays"


@pytest.fixture
async def stream(redis_url: str) -> AsyncIterator[ControlStream]:
    """One partition, so every message below lands in the same stream (``tether:control:0``)."""
    async with ControlStream.from_url(redis_url, partitions=1, events_maxlen=10) as s:
        yield s


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def message(n: int, action: ControlAction = ControlAction.PAUSE, tid: str | None = None) -> ControlMessage:
    return ControlMessage.create(tid or f"t-{n}", action, "alice", now=1_700_000_000.0 + n, reason=f"#{n}")


async def test_published_messages_reach_a_group_consumer_and_are_acked(stream: ControlStream) -> None:
    # Given a consumer group and three published messages
    assert await stream.ensure_group(GROUP) is True
    sent = [message(i) for i in range(3)]
    entry_ids = [await stream.publish(m) for m in sent]

    # When a relay reads them
    got = await stream.read(GROUP, "relay-1", count=10)

    # Then it gets all three, decoded, in order, and they stay pending until acked
    assert [d.entry_id for d in got] == entry_ids
    assert [d.message for d in got] == sent and all(d.error is None and d.partition == 0 for d in got)
    assert await stream.pending_count(GROUP) == 3
    assert await stream.ack(GROUP, 0, *entry_ids) == 3
    assert await stream.pending_count(GROUP) == 0
    assert await stream.read(GROUP, "relay-1") == []


async def test_one_trajectorys_messages_share_a_partition_in_publishing_order(redis_url: str) -> None:
    # Given the default sixteen partitions and many trajectories
    async with ControlStream.from_url(redis_url) as stream:
        await stream.ensure_group(GROUP)
        tids = [f"run.t-{i}" for i in range(40)]
        sent = [message(n, ControlAction.INTERRUPT, tid) for n in range(3) for tid in tids]
        ids = await stream.publish_many(sent)

        # When every partition is read
        got = await stream.read(GROUP, "relay-1", count=1000)

    # Then each trajectory's three messages are in its own partition (CRC-32 of the id), in order, and the
    # trajectories are spread over several partitions
    assert len(ids) == len(sent) == len(got)
    for tid in tids:
        mine = [d for d in got if d.message is not None and d.message.trajectory_id == tid]
        assert {d.partition for d in mine} == {partition_of(tid)}
        assert [d.message.reason for d in mine if d.message] == ["#0", "#1", "#2"]
    assert len({d.partition for d in got}) > 8


async def test_creating_the_group_is_idempotent_and_sees_earlier_messages(stream: ControlStream) -> None:
    # Given a message published before any relay existed
    first = message(1)
    await stream.publish(first)

    # When two relays both ensure the group
    created = [await stream.ensure_group(GROUP), await stream.ensure_group(GROUP)]

    # Then it was created once and the early message is delivered
    assert created == [True, False]
    assert [d.message for d in await stream.read(GROUP, "relay-1")] == [first]


async def test_a_dead_consumers_pending_messages_are_claimed_by_another(stream: ControlStream) -> None:
    # Given relay-1 read two messages and died before acking them
    await stream.ensure_group(GROUP)
    sent = [message(1), message(2)]
    for m in sent:
        await stream.publish(m)
    taken_by_dead = await stream.read(GROUP, "relay-1", count=10)
    assert len(taken_by_dead) == 2

    # When relay-2 asks for entries idle longer than a minute, nothing is taken from a live-looking owner
    assert (await stream.claim_stale(GROUP, "relay-2", partition=0, min_idle_ms=60_000)).deliveries == []

    # And when it takes the partition over (any idle time, as a relay holding its lease does)
    claimed = (await stream.claim_stale(GROUP, "relay-2", partition=0, min_idle_ms=0)).deliveries

    # Then relay-2 owns both messages exactly once and, after acking, nothing is pending
    assert [d.message for d in claimed] == sent
    assert (await stream.claim_stale(GROUP, "relay-3", partition=0, min_idle_ms=60_000)).deliveries == []
    assert await stream.ack(GROUP, 0, *[d.entry_id for d in claimed]) == 2
    assert await stream.pending_count(GROUP) == 0
    assert await stream.read(GROUP, "relay-1", pending=True) == []


async def test_a_blocking_read_wakes_on_publish(stream: ControlStream, redis_url: str) -> None:
    # Given a relay blocked on the group
    await stream.ensure_group(GROUP)
    reader = asyncio.create_task(stream.read(GROUP, "relay-1", block_ms=5_000))

    # When an operator publishes from another connection
    async with ControlStream.from_url(redis_url, partitions=1) as operator:
        sent = message(3, ControlAction.CANCEL)
        await operator.publish(sent)

    # Then the blocked read returns it
    got = await asyncio.wait_for(reader, timeout=10)
    assert [d.message for d in got] == [sent]


async def test_a_foreign_or_corrupt_entry_is_delivered_with_why_not_an_exception(
    stream: ControlStream, redis_url: str
) -> None:
    # Given a garbage entry, an entry without the message field, and a good message on the stream
    await stream.ensure_group(GROUP)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        bad_id = as_text(await raw.xadd("tether:control:0", {b"m": b"\xc1not msgpack"}))
        no_field_id = as_text(await raw.xadd("tether:control:0", {b"x": b"1"}))
    finally:
        await raw.aclose()
    good = message(4)
    await stream.publish(good)

    # When the relay reads
    got = await stream.read(GROUP, "relay-1", count=10)

    # Then the bad entries carry the precise problem (so they can be audited and acked), the good one decodes
    assert [d.entry_id for d in got][:2] == [bad_id, no_field_id]
    assert (got[0].message, got[0].problem) == (None, EntryProblem.MALFORMED) and "msgpack" in str(
        got[0].error
    )
    assert (got[1].message, got[1].problem) == (None, EntryProblem.MISSING_FIELD) and "fields: x" in str(
        got[1].error
    )
    assert got[2].message == good and got[2].problem is None
    assert await stream.ack(GROUP, 0, *[d.entry_id for d in got]) == 3


async def test_claiming_entries_that_were_trimmed_reports_them_as_deleted(
    stream: ControlStream, redis_url: str
) -> None:
    # Given a pending message whose entry was then trimmed from the stream
    await stream.ensure_group(GROUP)
    entry_id = await stream.publish(message(5))
    await stream.read(GROUP, "relay-1")
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.xtrim("tether:control:0", maxlen=0)
    finally:
        await raw.aclose()

    # When another relay claims stale entries
    result = await stream.claim_stale(GROUP, "relay-2", partition=0, min_idle_ms=0)

    # Then the lost entry is reported, not delivered, and no longer pending
    assert result.deliveries == [] and result.deleted_ids == [entry_id]
    assert await stream.pending_count(GROUP) == 0


async def test_a_signed_message_verifies_after_crossing_redis(stream: ControlStream) -> None:
    # Given an operator key in a keyring and a signed approval
    key = Ed25519PrivateKey.generate()
    keyring = Keyring().with_identity("alice", key.public_key(), [Role.OPERATOR])
    sent = sign(
        ControlMessage.create("t-1", "approve", "alice", now=1000.0, payload={"call_digest": "c0ffee"}),
        "alice",
        key,
    )
    await stream.ensure_group(GROUP)
    await stream.publish(sent)

    # When a relay reads it back
    (delivery,) = await stream.read(GROUP, "relay-1")

    # Then the signature still verifies
    assert delivery.message is not None
    verified = Verifier(keyring).verify(delivery.message, 1001.0, lambda *_: False)
    assert verified.signers == ("alice",)


async def test_trimming_drops_only_what_was_delivered_and_acked(stream: ControlStream) -> None:
    # Given five messages: all delivered, the first three acked, the last two still pending
    await stream.ensure_group(GROUP)
    ids = [await stream.publish(message(i)) for i in range(5)]
    await stream.read(GROUP, "relay-1", count=10)
    await stream.ack(GROUP, 0, *ids[:3])

    # When the stream is trimmed, and again after a new undelivered message arrives and the rest are acked
    first = await stream.trim_delivered()
    undelivered = message(9)
    await stream.publish(undelivered)
    await stream.ack(GROUP, 0, *ids[3:])
    second = await stream.trim_delivered()

    # Then the acked ones went, pending ones survived the first trim and a crashed relay could still
    # claim them; the undelivered one is still delivered afterwards
    assert first == 3
    assert second == 1  # ids[3]; the last delivered entry (ids[4]) is kept as the floor
    assert [d.message for d in await stream.read(GROUP, "relay-2")] == [undelivered]


async def test_trimming_without_groups_or_stream_removes_nothing(stream: ControlStream) -> None:
    assert await stream.trim_delivered() == 0
    await stream.publish(message(1))
    assert await stream.trim_delivered() == 0


# --------------------------------------------------------------------------- leases and membership


async def test_a_partition_lease_has_one_holder_until_it_lapses_or_is_released(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    leases = PartitionLeases(client, url=redis_url)
    try:
        # Given relay:0 holds partitions 0-3 for 300 ms
        assert await leases.hold("relay:0", [0, 1, 2, 3], 300) == {0, 1, 2, 3}
        # When relay:1 asks for 2-5 while they are held, it gets only the free ones
        assert await leases.hold("relay:1", [2, 3, 4, 5], 300) == {4, 5}
        # And renewing keeps relay:0's; releasing gives one back (and only the holder can)
        assert await leases.hold("relay:0", [0, 1, 2, 3], 60_000) == {0, 1, 2, 3}
        assert await leases.release("relay:1", [0]) == 0
        assert await leases.release("relay:0", [3]) == 1
        assert await leases.hold("relay:1", [3], 60_000) == {3}
        # Then once relay:1 stops renewing, its leases lapse and relay:0 can take them
        deadline = time.monotonic() + 10.0
        while (await leases.holders([4, 5])) != {4: None, 5: None}:
            assert time.monotonic() < deadline, "relay:1's leases never lapsed"
            await asyncio.sleep(0.05)
        assert await leases.hold("relay:0", [4, 5], 60_000) == {4, 5}
        assert await leases.holders([0, 3, 4]) == {0: "relay:0", 3: "relay:1", 4: "relay:0"}
    finally:
        await client.aclose()


async def test_relays_that_stop_beating_drop_out_of_the_membership(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    leases = PartitionLeases(client, url=redis_url)
    try:
        assert await leases.beat("relay:0", 60_000) == ["relay:0"]
        assert await leases.beat("relay:1", 200) == ["relay:0", "relay:1"]
        deadline = time.monotonic() + 10.0
        while await leases.beat("relay:0", 60_000) != ["relay:0"]:
            assert time.monotonic() < deadline, "relay:1 never dropped out"
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- bulk decisions


async def test_bulk_decisions_sign_each_message_and_refuse_what_holds_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    # Given two trajectories holding calls and one holding nothing
    keyring = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], keyring)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        for tid, digest in (("r.a", "d-a"), ("r.b", "d-b")):
            await raw.hset(
                f"tether:status:{tid}",
                mapping={"state": "AWAITING_APPROVAL", "held_digest": digest, "held_tool": "deploy"},
            )
        await raw.hset("tether:status:r.c", mapping={"state": "READY"})
    finally:
        await raw.aclose()
    async with ControlClient.from_url(redis_url, keyring=keyring) as client:
        # When all pending calls are approved, plus one named on stdin that holds nothing
        held = await client.held_calls(tool="deploy")
        result = await client.decide_many(
            ControlAction.APPROVE,
            [(h.trajectory_id, None) for h in held] + [("r.c", None), ("r.zz", None)],
            issuer="alice",
        )
        # Then one signed approval per held call went to its trajectory's partition, bound to its digest
        verifier = Verifier(Keyring.load(keyring))
        assert sorted((s.message.trajectory_id, s.message.payload["call_digest"]) for s in result.sent) == [
            ("r.a", "d-a"),
            ("r.b", "d-b"),
        ]
        for s in result.sent:
            assert verifier.verify(s.message, time.time(), lambda *_: False).signers == ("alice",)
        await client.stream.ensure_group(GROUP)
        read = await client.stream.read(GROUP, "relay-1", count=10)
        assert {(d.partition, d.message.trajectory_id) for d in read if d.message} == {
            (partition_of("r.a"), "r.a"),
            (partition_of("r.b"), "r.b"),
        }
        assert dict(result.refused) == {
            "r.c": "holds no call for approval (state READY)",
            "r.zz": "no such trajectory",
        }


# --------------------------------------------------------------------------- tether:events


async def test_the_events_stream_is_trimmed_to_about_maxlen(stream: ControlStream, redis_url: str) -> None:
    # Given a stream capped at about 10 events, and the server's trimming granularity
    raw = aioredis.Redis.from_url(redis_url)
    try:
        config = await raw.config_get("stream-node-max-entries")
        node = int(config["stream-node-max-entries"] or 100)
    finally:
        await raw.aclose()

    # When 1000 state changes are published
    for i in range(1000):
        await stream.publish_event(
            LiveEvent(trajectory_id=f"t-{i % 7}", kind="state", at=float(i), data={"n": i})
        )

    # Then the stream holds at least the last 10 and at most one trimming unit more, newest last
    length = await stream.events_length()
    assert 10 <= length <= 10 + node
    recent = await stream.read_events(after="0", count=2000)
    assert len(recent) == length
    assert [e.data["n"] for _, e in recent] == list(range(1000 - length, 1000))


async def test_a_live_view_sees_events_published_after_it_started(
    stream: ControlStream, redis_url: str
) -> None:
    # Given a view waiting for new events only
    await stream.publish_event(LiveEvent(trajectory_id="old", kind="state", at=1.0))
    view = asyncio.create_task(stream.read_events("$", block_ms=5_000))

    # When a trajectory publishes a state change from another connection
    async with ControlStream.from_url(redis_url) as actor_side:
        event = LiveEvent(trajectory_id="t-1", kind="state", at=2.0, data={"state": "PAUSED"})
        entry_id = await actor_side.publish_event(event)

    # Then the view gets exactly that event, and can continue from its id
    got = await asyncio.wait_for(view, timeout=10)
    assert got == [(entry_id, event)]
    assert await stream.read_events(after=entry_id) == []


async def test_undecodable_events_are_skipped_by_a_view(stream: ControlStream, redis_url: str) -> None:
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.xadd("tether:events", {b"m": b"\xc1"})
    finally:
        await raw.aclose()
    good = LiveEvent(trajectory_id="t", kind="state", at=3.0)
    await stream.publish_event(good)
    assert [e for _, e in await stream.read_events(after="0")] == [good]


async def test_a_live_view_with_a_time_limit_ends_although_a_read_returned_in_place_of_the_timeout(
    stream: ControlStream, redis_url: str
) -> None:
    # Given a full events stream, so every read of a view returns at once and a timeout lands inside a Redis
    # read (redis-py sends each command through Python 3.11's wait_for, which returns the reply when the
    # cancel lands just as it arrived: the timeout's cancel is then lost and, unnoticed, never fires again)
    await stream.publish_events(
        [LiveEvent(trajectory_id=f"t-{i % 7}", kind="state", at=float(i)) for i in range(5_000)]
    )
    rng = random.Random(11)
    still_watching: list[int] = []
    async with ControlClient.from_url(redis_url) as client:

        async def view(limit_s: float) -> None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit_s):  # as `tether watch --for N` bounds it
                    while True:  # from the start again whenever it has read everything
                        async for _ in client.watch(after="0", block_ms=50):
                            pass

        # When views with a time limit run 60 times, their limits falling at random moments
        for trial in range(60):
            task = asyncio.ensure_future(view(rng.uniform(0.002, 0.03)))
            done, _ = await asyncio.wait({task}, timeout=3.0)
            if not done:
                still_watching.append(trial)
                await aio.stop(task, what="the view (after the trial)")
    # Then every view ended at its limit (before the fix, a few of 60 read on past it, with no end in sight)
    assert still_watching == []
