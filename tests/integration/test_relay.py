"""Relay actors on a real Redis and a local Ray, delivering to real trajectory actors: a relay that dies
with entries it read but never delivered is taken over by another (each message recorded exactly once), a
message delivered twice changes the record once, and a message for an unknown trajectory is audited and
acked instead of looping."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import redis.asyncio as aioredis

from actors.relay import DEFAULT_GROUP, start_relays, stop_relays
from cluster.adapters import ClusterAdapters
from cluster.control import CONTROL_STREAM, ControlAction, ControlStream, encode_message
from cluster.control_client import ControlClient
from runtime.events import ControlRequested, ObservationAppended, ObservationKind
from runtime.states import TrajectoryState
from testbed.provider.config import ProviderConfig
from testbed.provider.launch import ProviderThread, start_provider_thread
from tests.integration.test_control_plane import Keys, Plane, eventually, kinds

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

S = TrajectoryState


@pytest.fixture(scope="module")
def provider() -> Iterator[ProviderThread]:
    with start_provider_thread(ProviderConfig()) as p:
        yield p


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    from cluster.signing import Role, create_key

    path = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], path)
    return Keys(path)


@pytest.fixture
async def plane(redis_url: str, keys: Keys, provider: ProviderThread) -> AsyncIterator[Plane]:
    """No relays yet: each test starts the ones it needs (and the fixture stops them)."""
    provider.reset()
    client = ControlClient.from_url(redis_url, keyring=keys.path)
    p = Plane(redis_url, keys, provider, client, relays=[])
    try:
        yield p
    finally:
        stop_relays(p.relays)
        for tid in p.launched:
            try:
                ray.kill(ray.get_actor(f"traj:{tid}", namespace="tether"), no_restart=True)
            except ValueError:
                continue
        await client.close()


async def _blocked_reader(url: str) -> bool:
    """True while some client is blocked in XREADGROUP (the relay waiting for new entries)."""
    client = aioredis.Redis.from_url(url)
    try:
        clients: list[dict[str, Any]] = await client.client_list()
    finally:
        await client.aclose()
    return any(c.get("cmd") == "xreadgroup" and "b" in str(c.get("flags", "")) for c in clients)


async def _settled(url: str) -> bool:
    async with ControlStream.from_url(url) as stream:
        groups = await stream._client.xinfo_groups(CONTROL_STREAM)
    return bool(groups) and all(g["pending"] == 0 and g["lag"] == 0 for g in groups)


async def test_a_dead_relays_undelivered_messages_are_delivered_once_by_another(plane: Plane) -> None:
    # Given a paused trajectory and one relay, blocked in its read of the control stream
    plane.relays += start_relays(
        plane.url, adapters=ClusterAdapters(), n=1, config={"block_ms": 10_000, "claim_idle_ms": 60_000}
    )
    tid = plane.launch("finish_after:2")
    await plane.status(tid, lambda s: s.turns >= 1, "the first turn")
    await plane.client.pause(tid, issuer="alice")
    await plane.state(tid, S.PAUSED)
    await eventually(lambda: _blocked_reader(plane.url), "relay:0 to block in XREADGROUP")

    # When the relay is frozen, three interrupts land in its pending list, and then it is killed
    dead = plane.relays[0]
    os.kill(ray.get(dead.pid.remote()), signal.SIGSTOP)
    texts = [f"note {i}" for i in range(3)]
    sent = [
        plane.client.build(tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": t})
        for t in texts
    ]
    raw = aioredis.Redis.from_url(plane.url)
    async with raw.pipeline(transaction=True) as tx:  # one MULTI: the blocked reader is served all three
        for m in sent:
            tx.xadd(CONTROL_STREAM, {"m": encode_message(m)})
        await tx.execute()
    pending = await raw.xpending_range(CONTROL_STREAM, DEFAULT_GROUP, min="-", max="+", count=10)
    await raw.aclose()
    assert [p["consumer"] for p in pending] == [b"relay:0"] * 3  # read by relay:0, never acked
    ray.kill(dead, no_restart=True)
    plane.relays += start_relays(
        plane.url,
        adapters=ClusterAdapters(),
        n=1,
        first=1,
        config={"claim_idle_ms": 500, "claim_every_s": 0.1},
    )
    await eventually(lambda: _settled(plane.url), "relay:1 to deliver and ack relay:0's entries")

    # Then each interrupt is recorded exactly once on the trajectory ...
    requested = [r.message_id for r in kinds(await plane.events(tid), ControlRequested)]
    assert sorted(requested[1:]) == sorted(m.message_id for m in sent)  # after the pause, once each
    # ... and, once resumed, each becomes exactly one user message in the next turn's context
    await plane.client.resume(tid, issuer="alice")
    await plane.finished(tid)
    users = [
        e.content
        for e in kinds(await plane.events(tid), ObservationAppended)
        if e.observation is ObservationKind.USER
    ]
    assert sorted(u for u in users if u.startswith("note ")) == texts


async def test_one_message_delivered_twice_changes_the_record_once(plane: Plane) -> None:
    # Given a paused trajectory and two relays
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=2, config={"block_ms": 100})
    tid = plane.launch("finish_after:2")
    await plane.status(tid, lambda s: s.turns >= 1, "the first turn")
    await plane.client.pause(tid, issuer="alice")
    await plane.state(tid, S.PAUSED)
    before = await plane.events(tid)

    # When the same signed interrupt appears twice on the stream (an operator retry, or a redelivery)
    m = plane.client.build(tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": "once"})
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(m)
        await stream.publish(m)
    await eventually(lambda: _settled(plane.url), "both entries acked")

    # Then the record gained exactly one request for it, and nothing was audited
    added = (await plane.events(tid))[len(before) :]
    assert [(type(e).__name__, getattr(e, "message_id", None)) for e in added] == [
        ("ControlRequested", m.message_id)
    ]
    assert await plane.audit_reasons(tid) == []


async def test_a_message_for_an_unknown_trajectory_is_audited_and_acked(plane: Plane) -> None:
    # Given a relay and no trajectory called "ghost"
    plane.relays += start_relays(
        plane.url,
        adapters=ClusterAdapters(),
        n=1,
        config={"block_ms": 100, "claim_idle_ms": 200, "claim_every_s": 0.05},
    )
    m = plane.client.build("ghost", ControlAction.KILL, issuer="alice", reason="who?")

    # When a kill for it is published
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(m)
    await eventually(lambda: _settled(plane.url), "the entry to be acked")
    await asyncio.sleep(0.5)  # several claim rounds: an un-acked entry would be picked up again

    # Then it was audited once and nothing is pending (no retry loop)
    audit = [a for a in await plane.client.audit() if a.message_id == m.message_id]
    assert [(a.reason, a.trajectory_id, a.action) for a in audit] == [("UNKNOWN_TRAJECTORY", "ghost", "kill")]
    assert await _settled(plane.url)
    assert ray.get(plane.relays[0].stats.remote())["audited"] == 1
