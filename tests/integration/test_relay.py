"""Relays on a real Redis and a local Ray, delivering to real trajectory actors (issue 16):

- a tampered copy published before the genuine message does not cancel it: applied once, the copy audited;
- a trajectory reached only through relays takes their verdict and never maps the signature code;
- an unsigned message to a hibernated trajectory is refused and audited, and no actor is created;
- a trajectory whose exited actor is still pinned under its name (someone holds a handle) is woken anyway;
- undeliverable entries for other trajectories do not hold up an interrupt to a running one;
- a dead relay's partitions are taken over, each message delivered once, in order;
- an operator's handoff reaches a trajectory that ended (woken from its log), a resume does not;
- a repeated message is recorded once and audited ``DUPLICATE``; an unknown trajectory is audited once;
- a Redis outage (the server stopped and restarted on the same port and data) is waited out.

Each protection has its control: the same scenario with the protection off, asserting the failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import redis.asyncio as aioredis

from actors.incarnation import Incarnations, Reach, TargetGone
from actors.incarnation_ray import RayActors, RedisTrajectories, ray_wake_gate
from actors.ports import RelayDelivery
from actors.relay import DEFAULT_GROUP, Relay, RelayConfig, TrajectoryTargets, start_relays, stop_relays
from actors.trajectory import ensure_actor, load_launch
from cluster.adapters import ClusterAdapters, RedisAudit
from cluster.control import ControlAction, ControlMessage, ControlStream, encode_message, partition_of
from cluster.control_client import ControlClient
from cluster.redis_server import RedisServer
from runtime.events import (
    ControlRejected,
    ControlRequested,
    ObservationAppended,
    ObservationKind,
    OperatorActed,
)
from runtime.states import TrajectoryState
from testbed.provider.config import ProviderConfig
from testbed.provider.launch import ProviderThread, start_provider_thread
from tests.integration.test_control_plane import Keys, Plane, eventually, kinds

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

S = TrajectoryState
FAST = {"block_ms": 100, "lease_ms": 1_000, "lease_every_s": 0.2}


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
    provider.configure(tokens_per_s=0.0, ttft_ms=0.0)
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


async def settled(url: str) -> bool:
    """True when every control partition is fully delivered and acked."""
    async with ControlStream.from_url(url) as stream:
        return await stream.lag(DEFAULT_GROUP) == 0


async def parked(plane: Plane, scenario: str = "finish_after:3", **launch: Any) -> str:
    """A trajectory paused after its first turn (nothing else changes its record)."""
    tid = plane.launch(scenario, **launch)
    await plane.status(tid, lambda s: s.turns >= 1, "the first turn")
    await plane.client.pause(tid, issuer="alice")
    await plane.state(tid, S.PAUSED)
    return tid


def running(plane: Plane, workspaces: Path) -> str:
    """A trajectory live in WAITING_TOOL: its sandboxed command runs for ten minutes."""
    return plane.launch(
        "finish_after:1",
        grants=("run_command",),
        local_tools=("run_command",),
        workspace_root=str(workspaces),
        sandbox_default_argv=("sh", "-c", "sleep 600 & wait"),
    )


async def hibernated(plane: Plane) -> str:
    """A paused trajectory whose actor has exited (hibernation)."""
    tid = await parked(plane, hibernate_after_s=0.5)
    await plane.status(tid, lambda s: s.hibernated, "hibernation")
    await eventually(lambda: _value(not plane.actor_alive(tid)), "the actor to exit")
    return tid


async def _value(v: Any) -> Any:
    return v


# --------------------------------------------------------------------------- verify before dedupe


async def test_a_tampered_copy_first_does_not_cancel_the_genuine_message(plane: Plane) -> None:
    # Given a paused trajectory and its relays
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=2, config=FAST)
    tid = await parked(plane)
    before = await plane.events(tid)

    # When an attacker with write access to the stream publishes a tampered copy of an operator's interrupt
    # (same message id, edited text, the genuine signature), and the genuine message follows
    genuine = plane.client.build(tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": "genuine"})
    tampered = genuine.model_copy(update={"payload": {"message": "rm -rf /"}})
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(tampered)
        await stream.publish(genuine)
    await eventually(lambda: settled(plane.url), "both entries to be acked")

    # Then the genuine message was recorded exactly once, with its own content ...
    added = (await plane.events(tid))[len(before) :]
    requested = kinds(added, ControlRequested)
    assert [(r.message_id, r.payload.get("message")) for r in requested] == [(genuine.message_id, "genuine")]
    # ... the copy was refused as BAD_SIGNATURE in the trajectory's log (an unverified refusal) and on
    # tether:audit, and nothing was called a duplicate
    assert [(e.message_id, e.reason, e.verified) for e in kinds(added, ControlRejected)] == [
        (genuine.message_id, "BAD_SIGNATURE", False)
    ]
    assert await plane.audit_reasons(tid) == ["BAD_SIGNATURE"]
    # ... and once resumed, the model sees the genuine text as a user message, never the tampered one
    await plane.client.resume(tid, issuer="alice")
    await plane.finished(tid)
    users = [
        e.content
        for e in kinds(await plane.events(tid), ObservationAppended)
        if e.observation is ObservationKind.USER
    ]
    assert "genuine" in users and "rm -rf /" not in users


# Ed25519's native library, as /proc/<pid>/maps names it
SIGNATURE_CODE = "cryptography/hazmat/bindings/_rust"


def mapped_signature_code(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.split()[-1] for line in f if SIGNATURE_CODE in line]


async def test_a_trajectory_reached_through_relays_never_loads_the_signature_code(plane: Plane) -> None:
    # Given a relay, and a trajectory an operator paused through it (a signed message the relay verified)
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=1, config=FAST)
    tid = await parked(plane)

    # When the operator's signed interrupt follows the same way
    await plane.client.send(tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": "a"})
    await eventually(lambda: settled(plane.url), "the entries to be acked")

    # Then the trajectory recorded both with the relay's verdicts to go by, and its process never mapped
    # cryptography's native bindings
    requested = [r.action for r in kinds(await plane.events(tid), ControlRequested)]
    assert requested == [ControlAction.PAUSE, ControlAction.INTERRUPT]
    assert ray.get(plane.relays[0].stats.remote())["delivered"] == 2
    handle = ray.get_actor(f"traj:{tid}", namespace="tether")
    pid = (await handle.status.remote())["pid"]
    assert mapped_signature_code(pid) == [], f"traj:{tid} (pid {pid}) mapped the signature code"

    # And (the control) the same actor, handed one signed message directly with no verdict, verifies it
    # itself: the library is mapped now, so the judge above can fail
    direct = plane.client.build(tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": "b"})
    assert await handle.deliver.remote(encode_message(direct)) == "recorded"
    assert mapped_signature_code(pid) != []


async def test_an_unsigned_message_to_a_hibernated_trajectory_creates_no_actor(plane: Plane) -> None:
    # Given a hibernated trajectory (its actor exited; its launch and log remain) and a relay
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=1, config=FAST)
    tid = await hibernated(plane)
    before = await plane.events(tid)

    # When an unsigned resume for it is published straight onto its partition
    unsigned = ControlMessage.create(tid, ControlAction.RESUME, "alice", now=time.time())
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(unsigned)
    await eventually(lambda: settled(plane.url), "the entry to be acked")

    # Then it was refused and audited as UNSIGNED, no actor was created, and its log is untouched
    assert await plane.audit_reasons(tid) == ["UNSIGNED"]
    assert not plane.actor_alive(tid)
    stats = ray.get(plane.relays[0].stats.remote())
    assert stats["woken"] == 0 and stats["audited"] == 1
    assert await plane.events(tid) == before


async def test_control_delivering_without_verifying_first_creates_the_actor(plane: Plane) -> None:
    # Given the same hibernated trajectory and the same unsigned message
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=1, config=FAST)
    tid = await hibernated(plane)
    unsigned = ControlMessage.create(tid, ControlAction.RESUME, "alice", now=time.time())
    incarnations, store = _incarnations(plane.url)
    try:
        # When it is delivered the way a relay that does not verify first would (straight to the trajectory)
        reached = await incarnations.call(tid, "deliver", encode_message(unsigned))
        # Then the actor refuses it, but only after a process was created for it: the judge above fails
        assert reached.reach is Reach.CALLED and reached.woke and str(reached.value) == "rejected:UNSIGNED"
        assert plane.actor_alive(tid)
    finally:
        await incarnations.close()
        await store.close()


def _incarnations(
    url: str, runtime: RayActors | None = None, **kw: Any
) -> tuple[Incarnations, RedisTrajectories]:
    store = RedisTrajectories(url)
    runtime = runtime or RayActors(lambda launch: ensure_actor(launch, ClusterAdapters()))
    return Incarnations(runtime, store.info, gate=ray_wake_gate(), **kw), store


# --------------------------------------------------------------------------- waking


class KeepsDeadActors(RayActors):
    """Protection off: a dead incarnation is not killed, so its name stays pinned by whoever holds it."""

    async def kill(self, handle: Any) -> None:
        return None


@pytest.mark.parametrize("runtime", [RayActors, KeepsDeadActors], ids=["replaced", "protection-off"])
async def test_a_trajectory_whose_dead_actor_is_pinned_under_its_name_is_woken(
    plane: Plane, runtime: type[RayActors]
) -> None:
    # Given a paused trajectory that hibernates while this process, its actor's owner, holds a handle to it
    # (as the tether run driver used to): the exited actor stays registered under traj:<id>
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=1, config=FAST)
    tid = plane.launch("finish_after:3", start=False, hibernate_after_s=0.5)
    launch = load_launch(plane.url, tid)
    assert launch is not None
    pinned = ensure_actor(launch, ClusterAdapters())  # the creator's handle, kept
    plane.runs[tid] = pinned.run.remote()
    await plane.status(tid, lambda s: s.turns >= 1, "the first turn")
    await plane.client.pause(tid, issuer="alice")
    await plane.status(tid, lambda s: s.hibernated, "hibernation")

    async def exited(handle: Any = pinned) -> bool:
        # the status says "hibernated" just before the actor exits: ask until the actor is really gone
        try:
            await asyncio.wait_for(handle.pid.remote(), 10.0)
        except ray.exceptions.RayActorError:
            return True
        return False

    await eventually(exited, "the hibernated actor to exit")
    assert plane.actor_alive(tid)  # the dead actor is still found by name

    # When a resume is delivered to it
    incarnations, store = _incarnations(
        plane.url, runtime(lambda launch: ensure_actor(launch, ClusterAdapters()))
    )
    resume = plane.client.build(tid, ControlAction.RESUME, issuer="alice")
    try:
        if runtime is KeepsDeadActors:
            # Then (control) the lookup keeps finding the dead actor: the trajectory is never woken
            with pytest.raises(TargetGone, match="died"):
                await incarnations.call(tid, "deliver", encode_message(resume))
            return
        reached = await incarnations.call(tid, "deliver", encode_message(resume))

        # Then the dead incarnation was replaced, the resume recorded, and the trajectory runs to its end
        assert reached.woke and reached.value == "recorded" and incarnations.replaced == 1
        await plane.state(tid, S.COMPLETED, timeout_s=180.0)
    finally:
        await incarnations.close()
        await store.close()
        del pinned


async def test_an_operators_handoff_reaches_a_trajectory_that_ended(plane: Plane) -> None:
    # Given a trajectory that ran to its end and whose actor is gone
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), config=FAST)
    tid = plane.launch("finish_after:0")
    await plane.state(tid, S.COMPLETED)
    await plane.status(tid, lambda s: s.state == S.COMPLETED.value, "the terminal status snapshot")
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(f"traj:{tid}", namespace="tether"), no_restart=True)
    await eventually(lambda: _value(not plane.actor_alive(tid)), "the actor to be gone")

    # When an operator hands what it owes to bob (tether handoff), and someone tries to resume it
    handoff = await plane.client.send(tid, ControlAction.HANDOFF, issuer="alice", payload={"to": "bob"})
    resume = await plane.client.send(tid, ControlAction.RESUME, issuer="alice")
    await eventually(lambda: settled(plane.url), "both entries acked")

    # Then the ended trajectory was woken from its log for the handoff, which it recorded (settle and handoff
    # apply in any state); the resume met an ended trajectory and was refused
    acted = kinds(await plane.events(tid), OperatorActed)
    assert [(e.message_id, e.action) for e in acted] == [(handoff.message.message_id, ControlAction.HANDOFF)]
    audited = [(a.message_id, a.reason) for a in await plane.client.audit() if a.trajectory_id == tid]
    assert audited == [(resume.message.message_id, "TRAJECTORY_TERMINAL")]


# --------------------------------------------------------------------------- head-of-line


class OneLane(Relay):
    """Protection off: one lane for every entry (the relay serves its entries one after another)."""

    def _lane_of(self, delivery: RelayDelivery) -> str:
        return "everything"


@pytest.mark.parametrize("kind", [Relay, OneLane], ids=["per-trajectory-lanes", "protection-off"])
async def test_stuck_entries_do_not_hold_up_an_interrupt_to_a_running_trajectory(
    plane: Plane, kind: type[Relay], tmp_path: Path
) -> None:
    # Given 51 parked trajectories that cannot be woken (their actors need a resource no node has, so they
    # wait for placement forever), each with a message pending, and one trajectory running a tool call
    tid = running(plane, tmp_path / "workspaces")
    await plane.state(tid, S.WAITING_TOOL)
    stuck = [plane.launch("finish_after:1", resources={"nowhere": 1.0}, start=False) for _ in range(51)]
    async with ControlStream.from_url(plane.url) as stream:
        for sid in stuck:
            await stream.publish(plane.client.build(sid, ControlAction.RESUME, issuer="alice"))
        interrupt = plane.client.build(
            tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": "now"}
        )
    relay, closers = _relay_here(plane.url, kind)
    task = asyncio.ensure_future(relay.run_forever())
    try:
        await eventually(
            lambda: _value(relay.stats()["queued"] >= 51), "the stuck entries to be in the relay"
        )
        async with ControlStream.from_url(plane.url) as stream:
            await stream.publish(interrupt)

        # When the relay runs, its stuck entries still pending
        async def recorded() -> bool:
            return any(
                isinstance(e, ControlRequested) and e.message_id == interrupt.message_id
                for e in await plane.events(tid)
            )

        # Then the interrupt is recorded while every stuck entry is still pending (the control: queued behind
        # them, it is not recorded even after a generous wait)
        if kind is OneLane:
            with pytest.raises(AssertionError, match="timed out"):
                await eventually(recorded, "the interrupt to be recorded", timeout_s=20.0)
            return
        await eventually(recorded, "the interrupt to be recorded", timeout_s=60.0)
        async with ControlStream.from_url(plane.url) as stream:
            assert await stream.pending_count(DEFAULT_GROUP) >= 51
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10.0)
        await relay.shutdown()
        for close in closers:
            await close()
        for sid in stuck:
            try:
                ray.kill(ray.get_actor(f"traj:{sid}", namespace="tether"), no_restart=True)
            except ValueError:
                continue


def _relay_here(url: str, kind: type[Relay]) -> tuple[Relay, list[Any]]:
    """A relay loop in this process over the real transport and the real trajectory side."""
    adapters = ClusterAdapters()
    stream = adapters.relay_stream(url)
    audit: RedisAudit = adapters.audit_sink(url, 10_000)
    incarnations, store = _incarnations(url, wake_wait_s=3600.0)
    targets = TrajectoryTargets(incarnations, store, adapters)
    relay = kind("relay:here", stream, targets, audit, RelayConfig(**FAST))
    return relay, [incarnations.close, store.close, stream.close, audit.close]


# --------------------------------------------------------------------------- takeover, duplicates, unknown


async def _blocked_reader(url: str) -> bool:
    """True while some client is blocked in XREADGROUP (the relay waiting for new entries)."""
    client = aioredis.Redis.from_url(url)
    try:
        clients: list[dict[str, Any]] = await client.client_list()
    finally:
        await client.aclose()
    return any(c.get("cmd") == "xreadgroup" and "b" in str(c.get("flags", "")) for c in clients)


async def test_a_dead_relays_partitions_are_taken_over_and_each_message_delivered_once_in_order(
    plane: Plane,
) -> None:
    # Given a paused trajectory and one relay, blocked in its read of the control partitions
    config = {"block_ms": 2_000, "lease_ms": 8_000, "lease_every_s": 1.0}
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=1, config=config)
    tid = await parked(plane)

    # When the relay is frozen in its blocked read (caught there: frozen between two reads, it would read
    # nothing), three interrupts land in its pending list, and then it is killed
    dead = plane.relays[0]
    pid = ray.get(dead.pid.remote())
    for _ in range(20):
        await eventually(lambda: _blocked_reader(plane.url), "relay:0 to block in XREADGROUP")
        os.kill(pid, signal.SIGSTOP)
        if await _blocked_reader(plane.url):
            break
        os.kill(pid, signal.SIGCONT)
    else:
        raise AssertionError("never caught relay:0 blocked in its read")
    texts = [f"note {i}" for i in range(3)]
    sent = [
        plane.client.build(tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": t})
        for t in texts
    ]
    part = f"tether:control:{partition_of(tid)}"
    raw = aioredis.Redis.from_url(plane.url)
    async with raw.pipeline(transaction=True) as tx:  # one MULTI: the blocked reader is served all three
        for m in sent:
            tx.xadd(part, {"m": encode_message(m)})
        await tx.execute()
    pending = await raw.xpending_range(part, DEFAULT_GROUP, min="-", max="+", count=10)
    await raw.aclose()
    assert [p["consumer"] for p in pending] == [b"relay:0"] * 3  # read by relay:0, never acked
    ray.kill(dead, no_restart=True)
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=1, first=1, config=FAST)
    await eventually(lambda: settled(plane.url), "relay:1 to take over and ack relay:0's entries")

    # Then each interrupt is recorded exactly once, in publishing order
    requested = [r.message_id for r in kinds(await plane.events(tid), ControlRequested)]
    assert requested[1:] == [m.message_id for m in sent]  # after the pause, once each, in order
    assert ray.get(plane.relays[1].stats.remote())["claimed"] == 3


async def test_one_message_delivered_twice_changes_the_record_once_and_the_repeat_is_audited(
    plane: Plane,
) -> None:
    # Given a paused trajectory and two relays
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=2, config=FAST)
    tid = await parked(plane)
    before = await plane.events(tid)

    # When the same signed interrupt appears twice on the stream (an operator retry, or a replay)
    m = plane.client.build(tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": "once"})
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(m)
        await stream.publish(m)
    await eventually(lambda: settled(plane.url), "both entries acked")

    # Then the record gained exactly one request for it, and the repeat is on tether:audit as a duplicate
    added = (await plane.events(tid))[len(before) :]
    assert [(type(e).__name__, getattr(e, "message_id", None)) for e in added] == [
        ("ControlRequested", m.message_id)
    ]
    assert await plane.audit_reasons(tid) == ["DUPLICATE"]
    # and the two relays split the partitions between them, each held by one
    held = [set(ray.get(r.stats.remote())["partitions"]) for r in plane.relays]
    assert not held[0] & held[1] and held[0] | held[1] == set(range(16))


async def test_a_message_for_an_unknown_trajectory_is_audited_and_acked(plane: Plane) -> None:
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=1, config=FAST)
    m = plane.client.build("ghost", ControlAction.KILL, issuer="alice", reason="who?")
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(m)
    await eventually(lambda: settled(plane.url), "the entry to be acked")
    audit = [a for a in await plane.client.audit() if a.message_id == m.message_id]
    assert [(a.reason, a.trajectory_id, a.action) for a in audit] == [("UNKNOWN_TRAJECTORY", "ghost", "kill")]
    assert ray.get(plane.relays[0].stats.remote())["audited"] == 1


# --------------------------------------------------------------------------- Redis away


@pytest.mark.parametrize(
    ("budget_s", "survives"), [(300.0, True), (1.0, False)], ids=["budget", "protection-off"]
)
async def test_relays_ride_out_a_redis_restart(
    redis_server: RedisServer, plane: Plane, budget_s: float, survives: bool
) -> None:
    # Given a paused trajectory and a relay
    config = {**FAST, "outage_budget_s": budget_s}
    plane.relays += start_relays(plane.url, adapters=ClusterAdapters(), n=1, config=config)
    tid = await parked(plane)
    relay = plane.relays[0]

    # When redis-server stops for a few seconds and comes back on the same port with the same data
    redis_server.stop()
    if survives:
        await eventually(lambda: _value(_stats(relay)["outage_s"] >= 3.0), "a 3 s outage", timeout_s=60.0)
    else:
        await eventually(lambda: _value(_stats(relay)["failed"]), "the relay to give up", timeout_s=60.0)
    redis_server.start()
    m = plane.client.build(tid, ControlAction.INTERRUPT, issuer="alice", payload={"message": "after"})
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(m)

    # Then the relay carried on and the message was recorded (the control: with a budget shorter than the
    # outage the relay gave up, its loop ended, and the message stays undelivered)
    if not survives:
        stats = _stats(relay)
        assert "outage budget" in stats["failed"] and not stats["running"]
        async with ControlStream.from_url(plane.url) as stream:
            assert await stream.lag(DEFAULT_GROUP) == 1
        return

    async def recorded() -> bool:
        return any(
            isinstance(e, ControlRequested) and e.message_id == m.message_id for e in await plane.events(tid)
        )

    await eventually(recorded, "the interrupt to be recorded after the restart", timeout_s=60.0)
    stats = _stats(relay)
    assert stats["failed"] is None and stats["running"] and stats["outages"] >= 1


def _stats(relay: Any) -> dict[str, Any]:
    return dict(ray.get(relay.stats.remote()))
