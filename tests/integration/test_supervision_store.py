"""Incident containment and the escalation queue on a real redis-server, without Ray (issue 12).

Trajectories are decided by the in-memory interpreter (``tests/unit/trajectory/sim.py``) and their logs,
launches and status snapshots written to Redis as the actors would; ``tether incident`` and ``tether
escalations`` then run against that Redis, and what they sign is verified against the keyring and fed
back to the trajectories as the relays would. Judges: the control stream (what was signed and sent), the
quarantine and the dispatch boundary that reads it, and the trajectories' own records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import typer
from typer.testing import CliRunner

from actors.launch import ProviderLaunch, TrajectoryLaunch, launch_key
from actors.quarantine import ArtifactQuarantined, QuarantineGate
from actors.status import status_fields, status_key
from cluster.cli_control import Target
from cluster.cli_supervise import SupervisionCli
from cluster.control import CONTROL_PARTITIONS, ControlMessage, decode_message, partition_stream
from cluster.control_client import ControlClient
from cluster.incidents import IncidentError, Incidents, Selector
from cluster.log_store import RedisLogStore
from cluster.signing import Keyring, Verifier, create_key
from cluster.supervision_store import RedisSupervisionStore
from runtime.codec import encode
from runtime.escalation import EscalationTrigger
from runtime.incident import HoldKind
from runtime.inputs import ControlReceived
from runtime.ports import ModelReply, OutcomeClass, Settlement, ToolInvocation, ToolOutcome
from runtime.record import ControlAction
from runtime.states import TrajectoryState
from tests.unit.trajectory.sim import Sim, done
from tests.unit.trajectory.supervised import calls, reply, sim_for, supervised

pytestmark = pytest.mark.integration
S = TrajectoryState


def provisioner(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    """Provisions an environment, then keeps working (its next reply is held by the test)."""
    n = calls(messages)
    return (
        reply(("provision_env", {"name": f"e{n}"}), n=n)
        if n == 0
        else reply(("run_tests", {"suite": "u"}), n=n)
    )


def env_result(inv: ToolInvocation) -> ToolOutcome:
    return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"env_id": f"env-{inv.call_id}"})


class World:
    """Trajectories in Sims, mirrored into Redis as the actors would write them."""

    def __init__(self, redis: aioredis.Redis, url: str) -> None:
        self.redis = redis
        self.url = url
        self.sims: dict[str, Sim] = {}
        self.logs = RedisLogStore(redis)

    async def add(self, tid: str, sim: Sim, grants: tuple[str, ...]) -> None:
        self.sims[tid] = sim
        launch = TrajectoryLaunch(
            trajectory_id=tid,
            goal="g",
            ceilings={"turns": 20},
            grants=grants,
            created_at=time.time(),
            provider=ProviderLaunch(base_url="http://sim/v1", model="sim-small"),
            redis_url=self.url,
            tool_routes={t: "127.0.0.1:9" for t in grants if t not in ("notify",)},
        )
        await self.redis.set(launch_key(tid), launch.to_json())
        await self.sync(tid)

    async def sync(self, tid: str) -> None:
        """Write what the trajectory's log holds now, and its status snapshot."""
        sim = self.sims[tid]
        await self.redis.delete(f"tether:log:{tid}")
        await self.logs.append_many(tid, [encode(e) for e in sim.log])
        fields = status_fields(sim.rec, hibernated=False, now=time.time())
        await self.redis.hset(status_key(tid), mapping=dict[Any, Any](fields))

    async def deliver(self, verifier: Verifier) -> list[ControlMessage]:
        """What a relay does: read the control partitions, verify each message, hand it to its trajectory."""
        delivered = []
        streams = [partition_stream(p) for p in range(CONTROL_PARTITIONS)]
        entries = [entry for stream in streams for entry in await self.redis.xrange(stream)]
        entries.sort(key=lambda entry: tuple(int(n) for n in entry[0].split(b"-")))  # publishing order
        for _, fields in entries:
            message = decode_message(fields[b"m"])
            verified = verifier.verify(message, time.time(), lambda mid, nonce: False)
            sim = self.sims[message.trajectory_id]
            if message.message_id in sim.rec.seen_control_ids:
                continue
            roles = {name: frozenset(r.value for r in roles) for name, roles in verified.signer_roles.items()}
            action = ControlAction(message.action.value)
            sim.feed(
                ControlReceived(
                    message.message_id, action, message.issuer, message.reason, message.payload, roles
                )
            )
            sim.run(until=sim.clock.wall() + 1)
            await self.sync(message.trajectory_id)
            delivered.append(message)
        await self.redis.delete(*streams)
        return delivered


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.yaml"
    create_key("alice", "operator,secops", keyring=path)
    return path


async def _world(redis: aioredis.Redis, url: str) -> World:
    world = World(redis, url)
    tools = frozenset({"provision_env", "release_env", "run_tests"})
    for tid in ("w-a", "w-b"):  # two provisioners, live (their second model call is in flight)
        sim = sim_for(provisioner, supervised(), tools=tools, hold_model=True)
        sim.tools.behaviour["provision_env"] = env_result
        sim.run()
        sim.release_model()
        sim.run()
        assert sim.rec.state is S.CALLING_MODEL and sim.rec.operations
        await world.add(tid, sim, ("provision_env", "release_env", "run_tests"))
    reader = sim_for(lambda m: done(), supervised(), tools=frozenset({"run_tests"}), hold_model=True)
    reader.run()
    await world.add("r-1", reader, ("run_tests",))
    return world


async def test_an_incident_on_a_tool_holds_its_users_at_once_and_quarantines_what_they_made(
    redis: aioredis.Redis, redis_url: str, keyring: Path
) -> None:
    world = await _world(redis, redis_url)
    client = ControlClient(redis, url=redis_url, keyring=keyring)
    store = RedisSupervisionStore(redis, url=redis_url)
    incidents = Incidents(client, redis, store)
    # When an incident is opened on provision_env
    doc = await incidents.open(
        Selector(tool="provision_env"), symptom="envs leak fixture data", suspected_cause="a poisoned README",
        issuer="alice",
    )  # fmt: skip
    # Then the record names both users (not the reader), symptom and cause apart, with their metadata
    assert sorted(doc["members"]) == ["w-a", "w-b"]
    assert doc["symptom"] != doc["suspected_cause"]
    assert all(m["operations"] and m["unresolved"] == [] for m in doc["members"].values())
    # their artifacts are quarantined, and a call naming one is refused at the dispatch boundary
    assert sorted(doc["artifacts"]) == ["env-call-0-0"]
    with pytest.raises(ArtifactQuarantined):
        gate = QuarantineGate(world_tools(), store)
        await gate.invoke(
            ToolInvocation("r-1", "c9", "run_tests", {"suite": "env-call-0-0"}, "k", "o", "o#1", 9e9)
        )
    # restrictions were issued highest exposure per minute of confirmation first
    ranks = [r["rank"] for r in doc["restrictions"]]
    assert ranks == sorted(ranks, reverse=True)
    # the holds were signed by alice and, delivered as a relay would, hold both at once
    delivered = await world.deliver(Verifier(Keyring.load(keyring)))
    assert {(m.trajectory_id, m.action.value, m.issuer) for m in delivered} == {
        ("w-a", "hold", "alice"),
        ("w-b", "hold", "alice"),
    }
    for tid in ("w-a", "w-b"):
        rec = world.sims[tid].rec
        assert rec.state is S.PAUSED and rec.hold is not None and rec.hold.kind is HoldKind.INCIDENT
        granted = {t for t in rec.grants.tools if rec.grants.allows(t)}
        assert "provision_env" not in granted and "release_env" in granted  # cleanup keeps its grant
    assert world.sims["r-1"].rec.hold is None
    # show reports each hold confirmed where it is enforced
    shown = await incidents.show(doc["incident_id"])
    assert shown["member_holds"] == {"w-a": "confirmed", "w-b": "confirmed"}
    # close is refused while anything is in force, naming it
    with pytest.raises(IncidentError) as info:
        await incidents.close(doc["incident_id"], issuer="alice", resolution="done")
    assert "artifact env-call-0-0" in str(info.value)
    # release lifts holds and quarantine with its evidence; then it closes
    released = await incidents.release(
        doc["incident_id"], issuer="alice", evidence="fixture scrubbed; reviewed"
    )
    assert released["status"] == "released" and released["releases"][0]["evidence"].startswith("fixture")
    await world.deliver(Verifier(Keyring.load(keyring)))
    assert all(
        world.sims[t].rec.hold is None and world.sims[t].rec.state is not S.PAUSED for t in ("w-a", "w-b")
    )
    assert await store.quarantined(["env-call-0-0"]) == {}
    closed = await incidents.close(doc["incident_id"], issuer="alice", resolution="no leak found")
    assert closed["status"] == "closed"


def world_tools() -> Any:
    class Sent:
        async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
            raise AssertionError("a quarantined artifact reached the tool")

        async def probe(self, tool: str, effect_key: str, deadline: float) -> Any:
            raise AssertionError

        async def cancel(self, tool: str, effect_key: str) -> None:
            return None

    return Sent()


async def test_revoking_a_tool_that_registered_cleanup_needs_is_kept_back(
    redis: aioredis.Redis, redis_url: str, keyring: Path
) -> None:
    world = await _world(redis, redis_url)
    incidents = Incidents(
        ControlClient(redis, url=redis_url, keyring=keyring), redis, RedisSupervisionStore(redis)
    )
    doc = await incidents.open(
        Selector(tool="release_env"), symptom="release misbehaves", suspected_cause="", issuer="alice"
    )
    assert not [r for r in doc["restrictions"] if r["kind"] == "revoke_grant"]
    assert {(r["target"], r["note"]) for r in doc["kept"]} == {
        ("w-a:release_env", "registered cleanup of w-a needs release_env"),
        ("w-b:release_env", "registered cleanup of w-b needs release_env"),
    }
    await world.deliver(Verifier(Keyring.load(keyring)))
    assert all("release_env" in world.sims[t].rec.grants.tools for t in ("w-a", "w-b"))


async def test_a_member_whose_log_is_missing_is_a_capture_omission(
    redis: aioredis.Redis, redis_url: str, keyring: Path
) -> None:
    world = await _world(redis, redis_url)
    await redis.delete("tether:log:w-b")
    incidents = Incidents(
        ControlClient(redis, url=redis_url, keyring=keyring), redis, RedisSupervisionStore(redis)
    )
    doc = await incidents.open(
        Selector(trajectories=("w-b",)), symptom="s", suspected_cause="", issuer="alice"
    )
    assert any("w-b: no durable log" in o for o in doc["capture_omissions"])
    assert world.sims["w-b"].rec.hold is None  # nothing could be read: no hold was guessed


def test_the_escalation_queue_lists_overdue_ones_and_ack_transfers_custody(
    redis_url: str, keyring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a looping trajectory held by its watchdog, its escalations published as the actor would
    sim = sim_for(lambda m: reply(("read_log", {"query": "same"}), n=calls(m)), supervised())
    sim.run(until=sim.clock.wall() + 60)
    (esc,) = [e for e in sim.escalations.values() if e.trigger is EscalationTrigger.GUARD]

    async def publish() -> None:
        client = aioredis.Redis.from_url(redis_url)
        for e in sim.escalations.values():
            await RedisSupervisionStore(client).publish_escalation(e.as_json())
        fields = status_fields(sim.rec, hibernated=False, now=time.time())
        await client.hset(status_key("t1"), mapping=dict[Any, Any](fields))
        await client.aclose()

    async def deliver() -> list[ControlMessage]:
        client = aioredis.Redis.from_url(redis_url)
        world = World(client, redis_url)
        world.sims["t1"] = sim
        world.sync = _no_sync  # type: ignore[method-assign]
        try:
            return await world.deliver(Verifier(Keyring.load(keyring)))
        finally:
            await client.aclose()

    asyncio.run(publish())
    # When an operator lists the queue (its fake clock is long past the SLA: overdue), shows one, acks it
    monkeypatch.setenv("TETHER_KEYRING", str(keyring))
    cli = SupervisionCli(resolve=lambda url: Target(redis_url, embedded=False))
    app = typer.Typer()
    cli.register(app)
    runner = CliRunner()
    listed = runner.invoke(app, ["escalations"])
    assert listed.exit_code == 0, listed.output
    assert esc.escalation_id in listed.output and "guard" in listed.output and "OVERDUE" in listed.output
    shown = runner.invoke(app, ["escalations", "show", esc.escalation_id])
    assert '"guard": "exact_repeat"' in shown.output
    acked = runner.invoke(app, ["escalations", "ack", esc.escalation_id, "--as", "alice"])
    assert acked.exit_code == 0, acked.output
    # Then the signed acknowledgement reaches the trajectory, which records alice's custody and publishes it
    (message,) = asyncio.run(deliver())
    assert (message.action.value, message.issuer) == ("acknowledge", "alice")
    assert sim.escalations[esc.escalation_id].custodian == "alice"
    missing = runner.invoke(app, ["escalations", "ack", "esc-nope", "--as", "alice"])
    assert missing.exit_code == 2 and "no such escalation" in missing.output


async def _no_sync(tid: str) -> None:
    return None


async def test_the_driver_exports_open_and_overdue_escalations_sla_misses_incidents_and_the_quarantine(
    redis: aioredis.Redis, redis_url: str
) -> None:
    from cluster.observe import RunObserver
    from runtime.metrics import InMemoryBackend, Metrics

    # Given an overdue guard escalation, one in time, an incident and two quarantined artifacts
    store = RedisSupervisionStore(redis)
    now = time.time()
    for eid, trigger, due in (("e1", "guard", now - 60), ("e2", "novelty", now + 600)):
        await store.publish_escalation(
            {"escalation_id": eid, "trajectory_id": "t", "trigger": trigger, "status": "open",
             "opened_at": now - 120, "due_at": due}
        )  # fmt: skip
    await store.update_incident(
        "inc-1", lambda _: {"incident_id": "inc-1", "status": "open", "opened_at": now}
    )
    await store.quarantine(["note-1", "env-1"], "inc-1")
    backend = InMemoryBackend()
    observer = RunObserver(Metrics(backend), redis_url, trajectory_ids=[])
    # When the driver polls twice
    await observer.poll_once(redis)
    await observer.poll_once(redis)
    # Then the gauges say what is open and overdue, the SLA miss is counted once, and the store is visible
    assert backend.value("tether_escalations_open", trigger="guard") == 1.0
    assert backend.value("tether_escalations_overdue", trigger="guard") == 1.0
    assert backend.value("tether_escalations_overdue", trigger="novelty") == 0.0
    assert backend.value("tether_escalation_sla_missed", trigger="guard") == 1.0
    assert backend.value("tether_incidents", status="open") == 1.0
    assert backend.value("tether_quarantined_artifacts") == 2.0
