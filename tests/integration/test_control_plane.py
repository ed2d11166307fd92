"""The control plane end to end on a real Redis and a local Ray: operator client -> ``tether:control`` ->
relay actor -> trajectory actor, judged by the trajectory's durable log (the record) and the simulated
provider's own counters.

Covers issue 4's tests: pause at a boundary then resume; cancel mid-stream (the partial reply is never
dispatched and its tokens are charged); kill while a sandboxed process runs; forged, unknown-issuer,
wrong-role, expired and replayed messages rejected and audited; stale-digest and expired approvals refused
with a REFUSED observation; hibernation woken by resume and by approve with budgets intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import ray
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from actors.launch import CheckLaunch, ProviderLaunch
from actors.relay import start_relays, stop_relays
from actors.trajectory import TrajectoryLaunch, ensure_actor, save_launch
from cluster.adapters import ClusterAdapters
from cluster.control import ControlAction, ControlMessage, ControlStream
from cluster.control_client import ControlClient, TrajectoryStatus
from cluster.log_store import RedisLogStore
from cluster.signing import Role, create_key, sign
from runtime.budget import Dimension
from runtime.events import (
    ApprovalDecided,
    ControlApplied,
    ControlRejected,
    ControlRequested,
    Event,
    ModelCallCancelled,
    ModelCallSettled,
    ObservationAppended,
    ObservationKind,
    StateChanged,
    ToolDispatchIntent,
    TrajectoryCreated,
)
from runtime.record import TrajectoryRecord
from runtime.snapshot import events_after_snapshot, fold_entries
from runtime.states import TrajectoryState
from testbed.provider.config import ProviderConfig
from testbed.provider.launch import ProviderThread, start_provider_thread

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

S = TrajectoryState
T = TypeVar("T")
RELAY_CONFIG = {"lease_ms": 1_000, "lease_every_s": 0.2, "block_ms": 100}


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def provider() -> Iterator[ProviderThread]:
    with start_provider_thread(ProviderConfig()) as p:
        yield p


@dataclass
class Keys:
    """A keyring with alice (operator), sam (secops), bot (policy), plus a key nobody registered."""

    path: Path
    stranger: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    path = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], path)
    create_key("sam", [Role.SECOPS], path)
    create_key("bot", [Role.POLICY], path)
    return Keys(path)


async def eventually(probe: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 120.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@dataclass
class Plane:
    """One test's control plane: Redis, relays, the operator client, and the trajectories it launched."""

    url: str
    keys: Keys
    provider: ProviderThread
    client: ControlClient
    relays: list[Any]
    launched: list[str] = field(default_factory=list)
    runs: dict[str, Any] = field(default_factory=dict)

    def launch(self, scenario: str, *, start: bool = True, **overrides: Any) -> str:
        """Save a launch record and (unless ``start`` is False) start its actor's run(); returns the id."""
        tid = f"t-{uuid.uuid4().hex[:10]}"
        fields: dict[str, Any] = {
            "trajectory_id": tid,
            "goal": "exercise the control plane",
            "ceilings": {"tokens": 200_000},
            "grants": ("sleep",),
            "local_tools": ("sleep",),
            "created_at": time.time(),
            "metadata": {"scenario": scenario},
            "provider": ProviderLaunch(base_url=self.provider.base_url, model="sim"),
            "redis_url": self.url,
            "use_scheduler": False,
            "guard": "local",
            "keyring_path": str(self.keys.path),
            "completion_check": CheckLaunch(name="always"),
            **overrides,
        }
        launch = TrajectoryLaunch(**fields)
        save_launch(self.url, launch)
        if start:
            self.runs[tid] = ensure_actor(launch, ClusterAdapters()).run.remote()
        self.launched.append(tid)
        return tid

    async def events(self, tid: str) -> list[Event]:
        async with RedisLogStore.from_url(self.url) as store:
            return events_after_snapshot(await store.read(tid))  # a hibernated log: after its snapshot

    async def record(self, tid: str) -> TrajectoryRecord:
        async with RedisLogStore.from_url(self.url) as store:
            return fold_entries(await store.read(tid))

    async def record_if_started(self, tid: str) -> TrajectoryRecord | None:
        """The record, or None while the actor has not written its first event yet."""
        async with RedisLogStore.from_url(self.url) as store:
            entries = await store.read(tid)
        return fold_entries(entries) if entries else None

    async def state(self, tid: str, *states: TrajectoryState, timeout_s: float = 120.0) -> TrajectoryRecord:
        """Wait until the record (the folded log, not a view) is in one of ``states``."""

        async def probe() -> TrajectoryRecord | None:
            rec = await self.record_if_started(tid)
            return rec if rec is not None and rec.state in states else None

        return await eventually(probe, f"{tid} in {[s.value for s in states]}", timeout_s)

    async def status(
        self, tid: str, check: Callable[[TrajectoryStatus], bool], what: str
    ) -> TrajectoryStatus:
        async def probe() -> TrajectoryStatus | None:
            s = await self.client.status(tid)
            return s if s is not None and check(s) else None

        return await eventually(probe, what)

    async def finished(self, tid: str, timeout_s: float = 180.0) -> dict[str, Any]:
        """The run() summary of a trajectory that ran to its end."""
        return await asyncio.wait_for(asyncio.wrap_future(self.runs[tid].future()), timeout_s)

    async def audit_reasons(self, tid: str) -> list[str]:
        return [a.reason for a in await self.client.audit(count=1000) if a.trajectory_id == tid]

    def actor_alive(self, tid: str) -> bool:
        try:
            ray.get_actor(f"traj:{tid}", namespace="tether")
        except ValueError:
            return False
        return True


@pytest.fixture
async def plane(redis_url: str, keys: Keys, provider: ProviderThread) -> AsyncIterator[Plane]:
    provider.reset()
    provider.configure(tokens_per_s=0.0, ttft_ms=0.0)
    relays = start_relays(redis_url, 2, adapters=ClusterAdapters(), config=RELAY_CONFIG)
    client = ControlClient.from_url(redis_url, keyring=keys.path)
    p = Plane(redis_url, keys, provider, client, relays)
    try:
        yield p
    finally:
        stop_relays(relays)
        for tid in p.launched:
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(f"traj:{tid}", namespace="tether"), no_restart=True)
        await client.close()


def kinds(events: list[Event], *types: type) -> list[Any]:
    return [e for e in events if isinstance(e, types)]


# --------------------------------------------------------------------------- boundary control


async def test_pause_takes_effect_at_a_boundary_and_resume_continues_to_completion(plane: Plane) -> None:
    # Given a trajectory that takes several tool turns
    tid = plane.launch("finish_after:3")
    await plane.status(tid, lambda s: s.turns >= 1, "the first turn")

    # When an operator pauses it
    sent = await plane.client.pause(tid, issuer="alice", reason="maintenance window")
    paused = await plane.state(tid, S.PAUSED)

    # Then the request was recorded, applied, and the trajectory entered PAUSED from READY (a boundary)
    events = await plane.events(tid)
    requested = kinds(events, ControlRequested)
    assert [(r.message_id, r.action.value, r.issuer) for r in requested] == [
        (sent.message.message_id, "pause", "alice")
    ]
    assert sent.message.message_id in {a.message_id for a in kinds(events, ControlApplied)}
    entered = [e for e in kinds(events, StateChanged) if e.to_state is S.PAUSED]
    assert [(e.from_state, e.to_state) for e in entered] == [(S.READY, S.PAUSED)]
    assert paused.pending_control == ()

    # And when it is resumed, it carries on from where it stopped and completes
    await plane.client.resume(tid, issuer="alice")
    summary = await plane.finished(tid)
    final = await plane.record(tid)
    assert summary["state"] == "COMPLETED" and final.state is S.COMPLETED
    assert final.turn_count > paused.turn_count
    resumed = [e for e in kinds(await plane.events(tid), StateChanged) if e.from_state is S.PAUSED]
    assert [(e.from_state, e.to_state) for e in resumed] == [(S.PAUSED, S.READY)]


async def test_cancel_mid_stream_discards_the_partial_reply_and_charges_its_tokens(plane: Plane) -> None:
    # Given a model that streams a tool call slowly (2 tokens/s: the reply takes ~10 s, so the cancel lands
    # inside it even on a busy machine; the stream is aborted, so the test does not wait that long)
    plane.provider.configure(tokens_per_s=2.0)
    tid = plane.launch("finish_after:1")

    async def streaming() -> bool:
        stats = plane.provider.stats()
        return bool(stats["in_flight"] >= 1 and stats["trajectories"].get(tid, {}).get("accepted", 0) >= 1)

    await eventually(streaming, "the model call to be streaming")
    await asyncio.sleep(0.6)  # let a few tokens out so there is a partial reply to discard and bill

    # When an operator cancels it
    await plane.client.cancel(tid, issuer="alice", reason="wrong task")
    summary = await plane.finished(tid)

    # Then the stream was aborted and the trajectory ended CANCELED through FINALIZING
    events = await plane.events(tid)
    assert summary["state"] == "CANCELED"
    cancelled = kinds(events, ModelCallCancelled)
    assert len(cancelled) == 1
    # the partial reply was never parsed into a tool call, never dispatched, never shown as an assistant turn
    assert kinds(events, ToolDispatchIntent) == []
    assert [e for e in kinds(events, ObservationAppended) if e.observation is ObservationKind.ASSISTANT] == []
    # and what was streamed is charged: the record bills output tokens, the provider billed an aborted call
    billed = plane.provider.stats()["trajectories"][tid]
    charged = cancelled[0].usage
    assert billed["aborted"] == 1 and billed["completion_tokens"] >= 1
    assert 1 <= charged.output <= billed["completion_tokens"]
    final = await plane.record(tid)
    assert final.spend.get(Dimension.TOKENS) >= charged.total
    assert [e.to_state for e in kinds(events, StateChanged)][-2:] == [S.FINALIZING, S.CANCELED]


# --------------------------------------------------------------------------- security


def forge(client: ControlClient, tid: str, keys: Keys, how: str) -> ControlMessage:
    """A message that must be refused, and why (``how`` is the expected reason code)."""
    now = time.time()
    if how == "BAD_SIGNATURE":
        good = client.build(tid, ControlAction.KILL, issuer="alice", reason="legit")
        # same signature, edited reason: the signature no longer covers the content
        return good.model_copy(update={"reason": "forged"})
    if how == "UNKNOWN_KEY":
        m = ControlMessage.create(tid, ControlAction.KILL, "mallory", now=now)
        return sign(m, "mallory", keys.stranger)
    if how == "WRONG_ROLE":
        return client.build(tid, ControlAction.KILL, issuer="bot", reason="a policy may not kill")
    if how == "EXPIRED":
        m = ControlMessage.create(tid, ControlAction.KILL, "alice", now=now - 120.0, ttl_s=60.0)
        return sign(m, "alice", client._key("alice"))
    raise ValueError(how)


@pytest.mark.parametrize("how", ["BAD_SIGNATURE", "UNKNOWN_KEY", "WRONG_ROLE", "EXPIRED", "REPLAYED"])
async def test_bad_messages_are_rejected_audited_and_change_nothing_else(plane: Plane, how: str) -> None:
    # Given a paused trajectory (nothing else will change its record)
    tid = plane.launch("finish_after:5")
    await plane.status(tid, lambda s: s.turns >= 1, "the first turn")
    await plane.client.pause(tid, issuer="alice")
    await plane.state(tid, S.PAUSED)
    before = await plane.events(tid)
    spent = (await plane.record(tid)).spend
    if how == "REPLAYED":
        # a validly signed message that reuses the nonce of one already accepted (pause above)
        first = next(e for e in kinds(before, ControlRequested))
        accepted_nonce = await _nonce_of(plane, tid, first.message_id)
        m = ControlMessage.create(tid, ControlAction.KILL, "alice", now=time.time())
        bad = sign(m.model_copy(update={"nonce": accepted_nonce}), "alice", plane.client._key("alice"))
    else:
        bad = forge(plane.client, tid, plane.keys, how)

    # When it is published straight onto the stream (bypassing the client's own checks)
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(bad)

    # Then the relay audited the actor's refusal with that reason on tether:audit ...
    assert await eventually(lambda: plane.audit_reasons(tid), "the relay audit") == [how]
    # ... and the only change to the record is the audit entry in the trajectory's own log
    after = await plane.events(tid)
    assert after[: len(before)] == before
    added = after[len(before) :]
    assert added == [ControlRejected(bad.message_id, how, added[0].detail)]  # type: ignore[union-attr]
    rec = await plane.record(tid)
    assert rec.state is S.PAUSED and rec.pending_control == () and rec.spend == spent


async def _nonce_of(plane: Plane, tid: str, message_id: str) -> str:
    """The nonce of an accepted message, read back from the control stream."""
    async with ControlStream.from_url(plane.url) as stream:
        raw: Any = await stream.client.xrange(stream.stream_of(tid))
    from cluster.control import decode_message

    for _, fields in raw:
        m = decode_message(fields[b"m"])
        if m.message_id == message_id:
            return m.nonce
    raise AssertionError(f"message {message_id} not on the stream")


async def test_an_exact_replay_is_a_duplicate_and_changes_nothing(plane: Plane) -> None:
    # Given an accepted pause
    tid = plane.launch("finish_after:5")
    await plane.status(tid, lambda s: s.turns >= 1, "the first turn")
    sent = await plane.client.pause(tid, issuer="alice")
    await plane.state(tid, S.PAUSED)
    before = await plane.events(tid)

    # When the very same signed message is published again
    async with ControlStream.from_url(plane.url) as stream:
        await stream.publish(sent.message)
        await eventually(lambda: _acked_all(stream), "the relays to ack the replay")

    # Then the record did not change at all (idempotent by message id), and the repeat is audited as one
    assert await plane.events(tid) == before
    assert await plane.audit_reasons(tid) == ["DUPLICATE"]


async def _acked_all(stream: ControlStream) -> bool:
    return await stream.lag("relays") == 0


# --------------------------------------------------------------------------- approvals


def approval_launch(**overrides: Any) -> dict[str, Any]:
    return {"approval_required": ("sleep",), "approval_timeout_s": 60.0, **overrides}


async def test_an_approval_for_a_stale_digest_is_refused_audited_and_leaves_the_call_held(
    plane: Plane,
) -> None:
    # Given a trajectory holding a sleep call for approval
    tid = plane.launch("irreversible:sleep", **approval_launch())
    held = await plane.status(tid, lambda s: s.held is not None, "a held call")
    assert held.held is not None
    # (which `tether pending` lists with its digest, tool, arguments from the log, and expiry)
    (listed,) = [h for h in await plane.client.pending() if h.trajectory_id == tid]
    assert (listed.digest, listed.tool) == (held.held.digest, "sleep")
    assert '"seconds"' in listed.arguments and listed.expires_at is not None

    # When an operator approves a different digest (the call changed since they looked)
    await plane.client.approve(tid, issuer="alice", call_digest="0" * 64)

    # Then the approval is refused and audited, and the held call keeps waiting, undispatched: only an
    # explicit deny or the expiry denies it (a stale approval must never deny the wrong call)
    async def audited() -> TrajectoryRecord | None:
        rec = await plane.record(tid)
        return rec if any(a.reason == "STALE_DIGEST" for a in rec.audit) else None

    rec = await eventually(audited, "the stale approval to be audited")
    assert rec.state is S.AWAITING_APPROVAL and rec.held is not None and rec.held.digest == held.held.digest
    assert kinds(await plane.events(tid), ToolDispatchIntent) == []
    # and the genuine approval still dispatches it, once
    await plane.client.approve(tid, issuer="alice", call_digest=held.held.digest)
    summary = await plane.finished(tid)
    events = await plane.events(tid)
    assert [d.decision.value for d in kinds(events, ApprovalDecided)] == ["approved"]
    assert len(kinds(events, ToolDispatchIntent)) == 1 and summary["state"] == "COMPLETED"


async def test_an_approval_after_expiry_is_refused_silence_is_denial(plane: Plane) -> None:
    # Given a held call whose approval window is 1.5 s
    tid = plane.launch("irreversible:sleep", **approval_launch(approval_timeout_s=1.5))
    held = await plane.status(tid, lambda s: s.held is not None, "a held call")
    assert held.held is not None
    digest = held.held.digest

    # When nobody decides in time, and then an approval for that digest arrives late
    await plane.state(tid, S.READY, S.CALLING_MODEL, S.FINALIZING, S.COMPLETED)
    await plane.client.approve(tid, issuer="alice", call_digest=digest)
    summary = await plane.finished(tid)

    # Then expiry refused the call (REFUSED / APPROVAL_EXPIRED to the model) and the late approval ran nothing
    events = await plane.events(tid)
    assert [d.reason for d in kinds(events, ApprovalDecided)] == ["APPROVAL_EXPIRED"]
    assert kinds(events, ToolDispatchIntent) == []
    refusals = [e for e in kinds(events, ObservationAppended) if e.observation is ObservationKind.REFUSAL]
    assert any('"reason": "APPROVAL_EXPIRED"' in e.content for e in refusals)
    assert summary["state"] == "COMPLETED"


# --------------------------------------------------------------------------- hibernation


@pytest.mark.parametrize("wake", ["resume", "approve"])
async def test_hibernated_trajectory_wakes_on_control_with_budgets_intact(plane: Plane, wake: str) -> None:
    # Given a trajectory that waits (paused, or holding a call) longer than its hibernation idle time
    if wake == "resume":
        tid = plane.launch("finish_after:3", hibernate_after_s=1.0)

        # (a turn counts from its admission request; wait for its reply to be charged before pausing, or the
        # pause withdraws the request and nothing was spent yet)
        async def first_reply() -> bool | None:
            return bool(kinds(await plane.events(tid), ModelCallSettled)) or None

        await eventually(first_reply, "the first model reply")
        await plane.client.pause(tid, issuer="alice")
    else:
        tid = plane.launch("irreversible:sleep", **approval_launch(hibernate_after_s=1.0))
    asleep = await plane.status(tid, lambda s: s.hibernated, "hibernation")
    await eventually(lambda: _async(not plane.actor_alive(tid)), "the actor to exit")
    # the hibernated actor compacted its log: the record is its snapshot, the events are those after it
    before, before_count = await plane.record(tid), len(await plane.events(tid))
    assert before.spend.get(Dimension.TOKENS) > 0
    if wake == "approve":
        # the held call survives compaction; `tether pending` still shows its arguments (from the snapshot)
        assert before.held is not None and asleep.held is not None
        assert before.held.digest == asleep.held.digest
        (listed,) = [h for h in await plane.client.pending() if h.trajectory_id == tid]
        assert '"seconds"' in listed.arguments

    # When the control message arrives (the relay re-creates the actor from its launch record)
    if wake == "resume":
        await plane.client.resume(tid, issuer="alice")
    else:
        assert asleep.held is not None
        await plane.client.approve(tid, issuer="alice", call_digest=asleep.held.digest)
    woken = await eventually(lambda: _async(plane.actor_alive(tid)), "the actor to be re-created")
    assert woken
    final_state = await plane.state(tid, S.COMPLETED, S.FAILED, S.CANCELED, timeout_s=300.0)

    # Then it continued from its log, not from scratch: one creation event, ceilings unchanged, and the spend
    # is what it had before hibernating plus exactly what was charged after waking
    events = await plane.events(tid)
    assert final_state.state is S.COMPLETED
    assert not kinds(events[before_count:], TrajectoryCreated)
    assert final_state.ceilings == before.ceilings
    later = kinds(events[before_count:], ModelCallSettled, ModelCallCancelled)
    assert later, "no model call after waking"
    tokens = Dimension.TOKENS
    assert final_state.spend.get(tokens) == pytest.approx(
        before.spend.get(tokens) + sum(e.usage.total for e in later)
    )
    assert final_state.turn_count > before.turn_count
    if wake == "approve":
        assert [d.decision.value for d in kinds(events, ApprovalDecided)] == ["approved"]
        assert len(kinds(events, ToolDispatchIntent)) == 1


async def _async(value: T) -> T:
    return value


# --------------------------------------------------------------------------- kill


async def test_kill_mid_tool_call_acts_at_once_and_leaves_the_call_in_doubt(plane: Plane) -> None:
    # Given a trajectory waiting on a dispatched tool call (the second sleep lasts 2 s)
    tid = plane.launch("finish_after:3")

    async def in_tool() -> TrajectoryRecord | None:
        rec = await plane.record_if_started(tid)
        if rec is None or rec.state is not S.WAITING_TOOL or rec.turn_count < 2:
            return None
        return rec if rec.pending_calls else None

    waiting = await eventually(in_tool, "a dispatched call in flight")
    (pending,) = waiting.pending_calls.values()

    # When an operator kills it (kill does not wait for the boundary)
    await plane.client.kill(tid, issuer="alice", reason="runaway")
    summary = await plane.finished(tid)

    # Then it went through FINALIZING with reason KILLED, and the unsettled call is in doubt, not failed
    final = await plane.record(tid)
    assert summary["exit_reason"] == "KILLED" and final.exit_reason is not None
    assert final.exit_reason.value == "KILLED" and final.is_terminal
    op = final.operations[pending.operation_id]
    # ... handed off with the packet: owned by the escalation owner once the trajectory stops acting
    assert op.in_doubt and op.owner == "operator"
    assert final.handoff is not None
    assert [u["operation_id"] for u in final.handoff["pending"]["unknown_operations"]] == [op.operation_id]
    states = [(e.from_state, e.to_state) for e in kinds(await plane.events(tid), StateChanged)]
    assert (S.WAITING_TOOL, S.READY) in states[-4:] and states[-2][1] is S.FINALIZING


async def test_kill_while_a_sandboxed_command_runs_leaves_no_process_and_the_call_in_doubt(
    plane: Plane, tmp_path: Path
) -> None:
    # Given a trajectory whose model calls run_command; the operator's default command (what the scripted
    # model's empty argv runs) is a shell with a child, so the sandbox holds a two-process group
    tid = plane.launch(
        "finish_after:1",
        grants=("run_command",),
        local_tools=("run_command",),
        workspace_root=str(tmp_path / "workspaces"),
        sandbox_default_argv=("sh", "-c", "sleep 30 & wait"),
    )
    actor = ray.get_actor(f"traj:{tid}", namespace="tether")

    async def running_group() -> int | None:
        status = await actor.status.remote()
        groups: list[int] = status["sandbox_groups"]
        return groups[0] if groups else None

    pgid = await eventually(running_group, "the sandboxed command to start")
    os.killpg(pgid, 0)  # the group exists now (raises otherwise)
    rec = await plane.state(tid, S.WAITING_TOOL)
    (pending,) = rec.pending_calls.values()

    # When an operator kills the trajectory
    await plane.client.kill(tid, issuer="alice", reason="runaway command")
    summary = await plane.finished(tid)

    # Then the process group is gone (every member, not just the leader) ...
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    # ... the trajectory ended KILLED through FINALIZING, and the command's call is in doubt, not failed
    final = await plane.record(tid)
    assert summary["exit_reason"] == "KILLED" and final.is_terminal
    op = final.operations[pending.operation_id]
    # ... handed off with the packet: owned by the escalation owner once the trajectory stops acting
    assert op.in_doubt and op.owner == "operator"
    assert final.handoff is not None
    assert [u["operation_id"] for u in final.handoff["pending"]["unknown_operations"]] == [op.operation_id]
    assert [e.tool for e in kinds(await plane.events(tid), ToolDispatchIntent)] == ["run_command"]
