"""What a relay delivers through (``actors.relay.TrajectoryTargets``) with a real keyring and an in-memory
actor runtime: a message that does not verify never wakes anything (a live incarnation still hears it, to
audit it in its own log); a verified one wakes a hibernated trajectory; ended and unknown ones are answered
without a process, except an operator's settle or handoff, which applies to an ended trajectory too."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from actors.incarnation import Incarnations
from actors.ports import ControlEnvelope
from actors.relay import TERMINAL, UNKNOWN, TrajectoryTargets
from cluster.adapters import ClusterAdapters, envelope_of
from cluster.control import ControlAction, ControlMessage
from cluster.signing import Role, create_key, load_private_key, sign
from runtime.clock import FakeClock
from runtime.errors import ControlError
from tests.unit.control_plane.fakes import FakeRuntime, Launches


@dataclass
class _Launch:
    keyring_path: str


class Store:
    """The launch side of ``RedisTrajectories`` over ``Launches``."""

    def __init__(self, launches: Launches, keyring: Path) -> None:
        self.launches = launches
        self.keyring = str(keyring)

    async def launch(self, tid: str) -> Any | None:
        return _Launch(self.keyring) if tid in self.launches.infos else None


class Trusting(TrajectoryTargets):
    """Protection off: delivers (and wakes) without verifying first."""

    async def deliver(self, envelope: ControlEnvelope, received_at: float | None = None) -> str:
        reached = await self.incarnations.call(envelope.trajectory_id, "deliver", envelope.data)
        return str(reached.value)


@pytest.fixture
def keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], path)
    return path


def setup(
    keyring: Path, kind: type[TrajectoryTargets] = TrajectoryTargets
) -> tuple[TrajectoryTargets, FakeRuntime, Launches]:
    runtime, launches = FakeRuntime(), Launches()
    clock = FakeClock(wall_start=time.time())
    incarnations = Incarnations(runtime, launches, clock=clock)
    targets = kind(incarnations, Store(launches, keyring), ClusterAdapters(), clock)  # type: ignore[arg-type]
    return targets, runtime, launches


def signed(keyring: Path, tid: str, action: ControlAction = ControlAction.RESUME) -> ControlMessage:
    m = ControlMessage.create(tid, action, "alice", now=time.time())
    return sign(m, "alice", load_private_key("alice", keyring))


@pytest.mark.parametrize("kind", [TrajectoryTargets, Trusting], ids=["verify-first", "protection-off"])
async def test_an_unsigned_message_to_a_hibernated_trajectory_never_creates_an_actor(
    keyring: Path, kind: type[TrajectoryTargets]
) -> None:
    # Given a hibernated trajectory (a launch, no actor)
    targets, runtime, launches = setup(keyring, kind)
    launches.add("t-1")
    unsigned = ControlMessage.create("t-1", ControlAction.RESUME, "alice", now=time.time())

    # When an unsigned resume arrives
    answer = await targets.deliver(envelope_of(unsigned))

    # Then it is refused as UNSIGNED and no actor was created (control: delivered blindly, it woke one)
    if kind is Trusting:
        assert len(runtime.created) == 1
        return
    assert answer.startswith("rejected:UNSIGNED") and runtime.created == []


@pytest.mark.parametrize("how", ["BAD_SIGNATURE", "UNKNOWN_KEY", "EXPIRED"])
async def test_a_message_that_does_not_verify_reaches_only_a_live_incarnation(
    keyring: Path, how: str
) -> None:
    # Given one live trajectory and one hibernated one
    targets, runtime, launches = setup(keyring)
    launches.add("t-live")
    launches.add("t-asleep")
    live = await runtime.create({"id": "t-live"})
    runtime.created.clear()

    def bad(tid: str) -> ControlMessage:
        if how == "BAD_SIGNATURE":
            return signed(keyring, tid).model_copy(update={"reason": "edited after signing"})
        if how == "UNKNOWN_KEY":
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

            m = ControlMessage.create(tid, ControlAction.KILL, "mallory", now=time.time())
            return sign(m, "mallory", Ed25519PrivateKey.generate())
        m = ControlMessage.create(tid, ControlAction.KILL, "alice", now=time.time() - 120, ttl_s=60)
        return sign(m, "alice", load_private_key("alice", keyring))

    # When each gets a message that does not verify
    to_live = await targets.deliver(envelope_of(bad("t-live")))
    to_asleep = await targets.deliver(envelope_of(bad("t-asleep")))

    # Then the live one heard it (it audits the refusal in its own log); the hibernated one was not woken,
    # and the relay refused it with the verifier's reason
    assert to_live == "recorded" and [m for m, _ in live.calls] == ["deliver"]
    assert to_asleep.startswith(f"rejected:{how}:") and runtime.created == []


class VerdictFree(TrajectoryTargets):
    """Protection off: the relay as it was before it passed its verdict on (it verified, then handed the
    actor the bare message, which the actor had to verify again)."""

    async def deliver(self, envelope: ControlEnvelope, received_at: float | None = None) -> str:
        when = self.clock.wall() if received_at is None else received_at
        launch = await self.store.launch(envelope.trajectory_id)
        assert launch is not None
        try:
            self._verifier(launch.keyring_path).verify(envelope, when, lambda _id, _nonce: False)
            verified = True
        except ControlError:
            verified = False
        tid = envelope.trajectory_id
        reached = await self.incarnations.call(tid, "deliver", envelope.data, when, wake=verified)
        return str(reached.value)


@pytest.mark.parametrize("kind", [TrajectoryTargets, VerdictFree], ids=["verdict", "protection-off"])
async def test_the_relay_hands_its_verdict_to_a_live_incarnation(
    keyring: Path, kind: type[TrajectoryTargets]
) -> None:
    # Given a live trajectory, and a keyring where alice is an operator
    targets, runtime, launches = setup(keyring, kind)
    launches.add("t-live")
    live = await runtime.create({"id": "t-live"})
    good = signed(keyring, "t-live", ControlAction.KILL)
    forged = signed(keyring, "t-live", ControlAction.KILL).model_copy(update={"reason": "edited"})

    # When the relay delivers a genuine kill and a forged one (edited after signing)
    await targets.deliver(envelope_of(good))
    await targets.deliver(envelope_of(forged))

    # Then the actor got each message's bytes with the relay's verdict in plain values: who signed the good
    # one with their roles, and the verifier's reason for refusing the forgery (control: no verdict, so the
    # actor would verify each message again)
    verdicts = [args[2] if len(args) > 2 else None for _, args in live.calls]
    if kind is VerdictFree:
        assert verdicts == [None, None]
        return
    verified, refused = verdicts
    assert refused is not None
    assert verified == ("verified", ("alice",), {"alice": ("operator",)})
    assert refused[:2] == ("refused", "BAD_SIGNATURE") and "does not verify" in refused[2]
    assert [args[0] for _, args in live.calls] == [message_bytes(good), message_bytes(forged)]
    assert runtime.created == [live]


async def test_without_a_launch_the_relay_gives_a_live_incarnation_no_verdict(keyring: Path) -> None:
    # Given a live actor whose trajectory has no launch record (so no keyring the relay could judge by)
    targets, runtime, _ = setup(keyring)
    live = await runtime.create({"id": "t-orphan"})

    # When a message for it arrives
    await targets.deliver(envelope_of(signed(keyring, "t-orphan")))

    # Then it is handed on with no verdict: the actor verifies it for itself
    [(method, args)] = live.calls
    assert method == "deliver" and args[2:] == (None,)


async def test_a_verified_message_wakes_a_hibernated_trajectory(keyring: Path) -> None:
    targets, runtime, launches = setup(keyring)
    launches.add("t-1")
    answer = await targets.deliver(envelope_of(signed(keyring, "t-1")))
    assert answer == "recorded" and len(runtime.created) == 1
    assert runtime.created[0].calls[0][0] == "deliver"


async def test_ended_and_unknown_trajectories_are_answered_without_a_process(keyring: Path) -> None:
    targets, runtime, launches = setup(keyring)
    launches.add("t-done", "CANCELED")
    assert await targets.deliver(envelope_of(signed(keyring, "t-done"))) == TERMINAL
    assert await targets.deliver(envelope_of(signed(keyring, "ghost"))) == UNKNOWN
    assert runtime.created == []


class RefusesEnded(TrajectoryTargets):
    """Protection off: no action is delivered to an ended trajectory (the relay before the exemption)."""

    any_state_actions: frozenset[str] = frozenset()


@pytest.mark.parametrize("action", [ControlAction.SETTLE, ControlAction.HANDOFF])
@pytest.mark.parametrize("kind", [TrajectoryTargets, RefusesEnded], ids=["any-state", "protection-off"])
async def test_an_operators_settle_or_handoff_reaches_an_ended_trajectory(
    keyring: Path, action: ControlAction, kind: type[TrajectoryTargets]
) -> None:
    # Given a trajectory that ended (CANCELED) while it still owes something (its actor is gone)
    targets, runtime, launches = setup(keyring, kind)
    launches.add("t-done", "CANCELED")
    payload = {"target": "op-1", "settlement": "absent"} if action is ControlAction.SETTLE else {"to": "bob"}
    m = ControlMessage.create("t-done", action, "alice", payload=payload, now=time.time())
    message = sign(m, "alice", load_private_key("alice", keyring))

    # When an operator settles (or hands off) what it owes
    answer = await targets.deliver(envelope_of(message))

    # Then the ended trajectory is woken from its log and takes the message (the decider applies these in
    # any state); the control refuses it as TRAJECTORY_TERMINAL and the obligation stays owed
    if kind is RefusesEnded:
        assert answer == TERMINAL and runtime.created == []
        return
    assert answer == "recorded" and len(runtime.created) == 1
    assert runtime.created[0].calls[0][0] == "deliver"


@pytest.mark.parametrize("judged", ["when-received", "protection-off"])
async def test_a_message_read_in_its_window_does_not_expire_waiting_for_a_slot(
    keyring: Path, judged: str
) -> None:
    # Given an approval valid for 60 s that the relay read 10 s after it was issued, and that reaches the
    # trajectory only two minutes later (it waited in its lane for a free trajectory slot)
    targets, runtime, launches = setup(keyring)
    launches.add("t-1")
    issued = time.time() - 120.0
    m = ControlMessage.create("t-1", ControlAction.RESUME, "alice", now=issued, ttl_s=60.0)
    message = sign(m, "alice", load_private_key("alice", keyring))

    # When it is delivered, judged at the time it was read (or, protection off, at delivery)
    answer = await targets.deliver(envelope_of(message), issued + 10.0 if judged == "when-received" else None)

    # Then it is delivered (the trajectory is woken); judged at delivery it would have expired in the queue
    if judged == "protection-off":
        assert answer.startswith("rejected:EXPIRED") and runtime.created == []
        return
    assert answer == "recorded" and runtime.created[0].calls == [
        (
            "deliver",
            (message_bytes(message), issued + 10.0, ("verified", ("alice",), {"alice": ("operator",)})),
        )
    ]


def message_bytes(message: ControlMessage) -> bytes:
    from cluster.control import encode_message

    return encode_message(message)
