"""The trajectory actor's delivery path (``TrajectoryActor.deliver``) run in this process, on a real Redis,
with a real keyring: verify before dedupe.

A tampered copy of a message and the genuine one arriving together (two deliveries in flight at once: a
redelivery racing the first, or a copy injected on the stream) must not cost the genuine message: the copy is
refused and audited, the genuine one recorded. The control is the delivery order this replaced (dedupe by
message id first, verify afterwards): the genuine message is then answered with the copy's refusal, acked by
the relay, and lost. The same holds when the relay's verdict comes with each message (the actor then
verifies nothing itself), and the verdict spares none of the trajectory's own checks (addressed to it,
duplicate, replayed nonce).

The actor object runs here rather than in a Ray worker so the control can swap its ``deliver``; Ray is up
only because the actor's metrics use Ray's backend.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.launch import CheckLaunch, ProviderLaunch, TrajectoryLaunch
from actors.ports import (
    MALFORMED,
    ControlEnvelope,
    ControlVerdict,
    VerifiedControl,
    read_verdict,
    refused_verdict,
    verified_verdict,
)
from actors.trajectory import TrajectoryActor
from cluster.adapters import ClusterAdapters, envelope_of
from cluster.control import ControlAction, ControlMessage, encode_message
from cluster.log_store import RedisLogStore
from cluster.signing import Role, create_key, load_private_key, sign
from runtime.codec import decode
from runtime.errors import CodecError, ControlError
from runtime.events import ControlRejected, ControlRequested
from testbed.provider.config import ProviderConfig
from testbed.provider.launch import ProviderThread, start_provider_thread

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]


class DedupeFirst(TrajectoryActor):
    """Protection off: the order ``deliver`` had before issue 16 (dedupe by id, then verify)."""

    async def deliver(
        self, message: bytes, received_at: float | None = None, verdict: ControlVerdict | None = None
    ) -> str:
        harness = await self._started()
        try:
            msg = self._adapters.decode_control(message)
        except CodecError:
            return f"rejected:{MALFORMED}"
        if msg.message_id in harness.record.seen_control_ids:
            return "duplicate"
        inflight = self._inflight.get(msg.message_id)
        if inflight is not None:
            first = await asyncio.shield(inflight)
            return "duplicate" if first in ("recorded", "duplicate") else first
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._inflight[msg.message_id] = future
        try:
            await self._client().sismember(self._nonce_key, msg.nonce)  # the old code's first await
            answer = await super().deliver(message, received_at, verdict)
        finally:
            del self._inflight[msg.message_id]
        future.set_result(answer)
        return answer


@pytest.fixture(scope="module")
def provider() -> Iterator[ProviderThread]:
    with start_provider_thread(ProviderConfig(ttft_ms=0.0, tokens_per_s=0.0)) as p:
        yield p


@pytest.fixture
def keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], path)
    return path


# A trajectory that stays live while messages are delivered: it proposes a sleep call held for approval
# (the decider starts running as soon as the actor creates the record, so one that finished at once would
# meet every message as TRAJECTORY_TERMINAL).
HELD: dict[str, Any] = {
    "metadata": {"scenario": "irreversible:sleep"},
    "grants": ("sleep",),
    "local_tools": ("sleep",),
    "approval_required": ("sleep",),
    "approval_timeout_s": 600.0,
}


def _actor(
    kind: type[TrajectoryActor], redis_url: str, keyring: Path, provider: ProviderThread, **overrides: Any
) -> TrajectoryActor:
    fields: dict[str, Any] = {
        "trajectory_id": f"t-{uuid.uuid4().hex[:10]}",
        "goal": "be interrupted",
        "ceilings": {"tokens": 100_000},
        "created_at": time.time(),
        "provider": ProviderLaunch(base_url=provider.base_url, model="sim"),
        "redis_url": redis_url,
        "use_scheduler": False,
        "guard": "local",
        "keyring_path": str(keyring),
        "completion_check": CheckLaunch(name="always"),
        **(overrides or HELD),
    }
    return kind(TrajectoryLaunch(**fields).to_json(), ClusterAdapters())


async def _close(a: TrajectoryActor) -> None:
    task = a._loop_task
    if task is not None and not task.done():
        task.cancel()  # a held trajectory waits for its approval: nothing more to see
        # bounded: a run loop cancelled mid-start may still be unwinding its effects; the shutdown below
        # cancels what it started either way (an in-process actor here; on Ray the worker just exits)
        await asyncio.wait({task}, timeout=10.0)
    await a._shutdown()


@pytest.fixture(params=[TrajectoryActor, DedupeFirst], ids=["verify-first", "protection-off"])
async def actor(
    request: pytest.FixtureRequest, redis_url: str, keyring: Path, provider: ProviderThread
) -> AsyncIterator[TrajectoryActor]:
    a = _actor(request.param, redis_url, keyring, provider)
    try:
        yield a
    finally:
        await _close(a)


async def test_a_tampered_copy_in_flight_with_the_genuine_message_does_not_cost_it(
    actor: TrajectoryActor, keyring: Path, redis_url: str
) -> None:
    # Given an operator's signed interrupt and a tampered copy of it (same id, edited text, same signature)
    tid = actor.launch.trajectory_id
    genuine = sign(
        ControlMessage.create(
            tid, ControlAction.INTERRUPT, "alice", now=time.time(), payload={"message": "hi"}
        ),
        "alice",
        load_private_key("alice", keyring),
    )
    tampered = genuine.model_copy(update={"payload": {"message": "exfiltrate"}})

    # When the copy and the genuine message are delivered at the same moment, the copy first
    answers = await asyncio.gather(
        actor.deliver(encode_message(tampered)), actor.deliver(encode_message(genuine))
    )

    # Then the copy is refused as BAD_SIGNATURE and the genuine one recorded, once
    if not await _copy_refused_genuine_recorded(actor, redis_url, list(answers), genuine.message_id):
        return
    # and delivering the genuine message again is a duplicate, the copy again a refusal
    assert await actor.deliver(encode_message(genuine)) == "duplicate"
    assert await actor.deliver(encode_message(tampered)) == "rejected:BAD_SIGNATURE"


async def _copy_refused_genuine_recorded(
    actor: TrajectoryActor, redis_url: str, answers: list[str], genuine_id: str
) -> bool:
    """The judge of a tampered copy delivered first, beside the genuine message: the copy refused as
    BAD_SIGNATURE (audited unverified, so it took no id) and the genuine one recorded once. False for the
    dedupe-first control, whose genuine delivery waited on the copy's and got its refusal."""
    events = await _events(redis_url, actor.launch.trajectory_id)
    requested = [(e.message_id, e.payload.get("message")) for e in events if isinstance(e, ControlRequested)]
    if type(actor) is DedupeFirst:
        assert answers == ["rejected:BAD_SIGNATURE", "rejected:BAD_SIGNATURE"] and requested == []
        return False
    assert answers == ["rejected:BAD_SIGNATURE", "recorded"]
    assert requested == [(genuine_id, "hi")]
    rejected = [(e.message_id, e.reason, e.verified) for e in events if isinstance(e, ControlRejected)]
    assert rejected == [(genuine_id, "BAD_SIGNATURE", False)]
    return True


def relay_verdict(keyring: Path, message: ControlMessage, when: float) -> ControlVerdict:
    """What a relay (``actors.relay.TrajectoryTargets``) hands the actor with ``message`` read at ``when``."""
    verifier = ClusterAdapters().control_verifier(str(keyring))
    try:
        return verified_verdict(verifier.verify(envelope_of(message), when, lambda _m, _n: False))
    except ControlError as e:
        return refused_verdict(e.reason, str(e))


async def test_a_tampered_copy_with_the_relays_refusal_does_not_cost_the_genuine_message(
    actor: TrajectoryActor, keyring: Path, redis_url: str
) -> None:
    # Given an operator's signed interrupt and a tampered copy of it, each with the relay's verdict
    tid = actor.launch.trajectory_id
    key = load_private_key("alice", keyring)
    m = ControlMessage.create(
        tid, ControlAction.INTERRUPT, "alice", now=time.time(), payload={"message": "hi"}
    )
    genuine = sign(m, "alice", key)
    tampered = genuine.model_copy(update={"payload": {"message": "exfiltrate"}})
    now = time.time()
    refused, verified = relay_verdict(keyring, tampered, now), relay_verdict(keyring, genuine, now)
    assert (refused[:2], verified[0]) == (("refused", "BAD_SIGNATURE"), "verified")

    # When both are delivered at the same moment, the copy first
    answers = list(
        await asyncio.gather(
            actor.deliver(encode_message(tampered), now, refused),
            actor.deliver(encode_message(genuine), now, verified),
        )
    )

    # Then the copy is audited as an unverified refusal and the genuine one recorded, once; the actor
    # verified neither itself
    if not await _copy_refused_genuine_recorded(actor, redis_url, answers, genuine.message_id):
        return
    assert actor._verifier is None
    assert await actor.deliver(encode_message(genuine), now, verified) == "duplicate"


async def test_the_relays_verdict_spares_none_of_the_trajectorys_own_checks(
    redis_url: str, keyring: Path, provider: ProviderThread
) -> None:
    # Given a live trajectory, and messages the relay verified
    a = _actor(TrajectoryActor, redis_url, keyring, provider)
    tid = a.launch.trajectory_id
    key = load_private_key("alice", keyring)

    def relayed(m: ControlMessage) -> tuple[bytes, float, ControlVerdict]:
        now = time.time()
        message = sign(m, "alice", key)
        return encode_message(message), now, relay_verdict(keyring, message, now)

    first = ControlMessage.create(tid, ControlAction.INTERRUPT, "alice", now=time.time())
    reuses_nonce = ControlMessage.create(tid, ControlAction.INTERRUPT, "alice", now=time.time())
    reuses_nonce = reuses_nonce.model_copy(update={"nonce": first.nonce})
    elsewhere = ControlMessage.create("t-someone-else", ControlAction.KILL, "alice", now=time.time())
    try:
        # When each is delivered with its verdict
        answers = [
            await a.deliver(*relayed(first)),
            await a.deliver(*relayed(first)),
            await a.deliver(*relayed(reuses_nonce)),
            await a.deliver(*relayed(elsewhere)),
        ]
        # Then the trajectory still judges what only it can: a duplicate by id, a replay by nonce, a message
        # addressed to another trajectory; and it never made a verifier of its own
        assert answers == ["recorded", "duplicate", "rejected:REPLAYED", "rejected:WRONG_TRAJECTORY"]
        recorded = [e.message_id for e in await _events(redis_url, tid) if isinstance(e, ControlRequested)]
        assert recorded == [first.message_id]
        assert a._verifier is None

        # And without a verdict (a caller other than a relay) it verifies for itself, as before
        unsigned = ControlMessage.create(tid, ControlAction.KILL, "alice", now=time.time())
        assert await a.deliver(encode_message(unsigned)) == "rejected:UNSIGNED"
        assert a._verifier is not None
    finally:
        await _close(a)


class TakesAnyVerdict(TrajectoryActor):
    """Protection off: the relay's verdict taken however long ago the relay read the message."""

    def _judge(
        self, msg: ControlEnvelope, received_at: float | None, verdict: ControlVerdict | None
    ) -> VerifiedControl | tuple[str, str]:
        return super()._judge(msg, None, verdict) if verdict is None else read_verdict(msg, verdict)


@pytest.mark.parametrize("kind", [TrajectoryActor, TakesAnyVerdict], ids=["bounded", "protection-off"])
async def test_a_verdict_on_a_receipt_older_than_a_day_is_checked_again(
    redis_url: str, keyring: Path, provider: ProviderThread, kind: type[TrajectoryActor]
) -> None:
    # Given an interrupt issued three days ago, valid for a day, that a relay read (and verified) two days
    # ago: a window this actor judges at most a day back, where the message has expired
    a = _actor(kind, redis_url, keyring, provider)
    tid = a.launch.trajectory_id
    issued = time.time() - 3 * 86_400.0
    m = ControlMessage.create(tid, ControlAction.INTERRUPT, "alice", now=issued, ttl_s=86_400.0)
    message = sign(m, "alice", load_private_key("alice", keyring))
    read_at = issued + 86_400.0 - 60.0
    verdict = relay_verdict(keyring, message, read_at)
    assert verdict[0] == "verified"
    try:
        # When it is delivered with that verdict
        answer = await a.deliver(encode_message(message), read_at, verdict)
        # Then the actor verifies it itself, at a day back, and refuses it (control: recorded)
        if kind is TakesAnyVerdict:
            assert answer == "recorded"
            return
        assert answer == "rejected:EXPIRED"
        assert not [e for e in await _events(redis_url, tid) if isinstance(e, ControlRequested)]
    finally:
        await _close(a)


async def _events(url: str, tid: str) -> list[Any]:
    async with RedisLogStore.from_url(url) as store:
        return [decode(payload) for _, payload in await store.read(tid)]


@pytest.mark.parametrize("judged", ["when-received", "protection-off"])
async def test_a_message_read_in_its_window_is_valid_however_late_it_is_delivered(
    redis_url: str, keyring: Path, provider: ProviderThread, judged: str
) -> None:
    # Given an interrupt valid for 60 s, read by a relay 10 s after it was issued, delivered two minutes later
    a = _actor(TrajectoryActor, redis_url, keyring, provider)
    tid = a.launch.trajectory_id
    issued = time.time() - 120.0
    m = ControlMessage.create(
        tid, ControlAction.INTERRUPT, "alice", now=issued, ttl_s=60.0, payload={"message": "hi"}
    )
    message = encode_message(sign(m, "alice", load_private_key("alice", keyring)))
    try:
        # When it is delivered with the time it was read (protection off: without it)
        answer = await a.deliver(message, issued + 10.0 if judged == "when-received" else None)
        # Then it is recorded; judged at delivery time it would have expired
        events = await _events(redis_url, tid)
        if judged == "protection-off":
            assert answer == "rejected:EXPIRED"
            assert not [e for e in events if isinstance(e, ControlRequested)]
            return
        assert answer == "recorded"
        assert [e.message_id for e in events if isinstance(e, ControlRequested)] == [m.message_id]
        # and a relay cannot stretch a window into the future: a receipt "later than now" is judged now
        late = sign(
            ControlMessage.create(tid, ControlAction.INTERRUPT, "alice", now=issued, ttl_s=60.0),
            "alice",
            load_private_key("alice", keyring),
        )
        assert await a.deliver(encode_message(late), time.time() + 3600.0) == "rejected:EXPIRED"
    finally:
        await _close(a)


async def test_a_refusal_names_the_deciders_reason(
    redis_url: str, keyring: Path, provider: ProviderThread
) -> None:
    # Given a trajectory that runs to its end (the simulated model finishes at once)
    a = _actor(TrajectoryActor, redis_url, keyring, provider, metadata={"scenario": "finish_after:0"})
    tid = a.launch.trajectory_id
    key = load_private_key("alice", keyring)

    def signed(action: ControlAction, payload: dict[str, Any] | None = None) -> bytes:
        return encode_message(
            sign(ControlMessage.create(tid, action, "alice", now=time.time(), payload=payload), "alice", key)
        )

    try:
        summary = await asyncio.wait_for(a.run(), 60.0)
        assert summary["state"] == "COMPLETED"
        # When an operator settles something it never owed, and someone resumes the ended trajectory
        settle = await a.deliver(signed(ControlAction.SETTLE, {"target": "op-none", "settlement": "absent"}))
        resume = await a.deliver(signed(ControlAction.RESUME))
        # Then each refusal carries the reason the decider audited (a settle applies in any state, so it is
        # judged on what it names; anything else meets an ended trajectory)
        assert settle == "rejected:UNKNOWN_TARGET"
        assert resume == "rejected:TRAJECTORY_TERMINAL"
    finally:
        await _close(a)


class ForgetsUsedNonces(TrajectoryActor):
    """Protection off: the used nonces prepared ahead without reading what earlier incarnations recorded."""

    async def _warm_control(self) -> None:
        self._nonces = set(self._nonces_added)


@pytest.mark.parametrize("kind", [TrajectoryActor, ForgetsUsedNonces], ids=["read", "protection-off"])
async def test_a_later_incarnation_refuses_a_nonce_an_earlier_one_recorded(
    redis_url: str, keyring: Path, provider: ProviderThread, kind: type[TrajectoryActor]
) -> None:
    # Given an interrupt recorded by one incarnation of a trajectory, which then goes away
    first = _actor(TrajectoryActor, redis_url, keyring, provider)
    tid = first.launch.trajectory_id
    key = load_private_key("alice", keyring)
    m1 = sign(ControlMessage.create(tid, ControlAction.INTERRUPT, "alice", now=time.time()), "alice", key)
    try:
        assert await first.deliver(encode_message(m1)) == "recorded"
    finally:
        await _close(first)

    # When the next incarnation has prepared its control path (the nonces read ahead of any message) and
    # is sent a new, validly signed message that reuses the recorded one's nonce
    later = kind(first.launch.to_json(), ClusterAdapters())
    try:
        await later._started()
        assert later._warming is not None
        await asyncio.wait_for(later._warming, 30.0)
        assert later._nonces is not None  # the check below is answered from the copy, not from Redis
        m2 = ControlMessage.create(tid, ControlAction.INTERRUPT, "alice", now=time.time())
        replay = sign(m2.model_copy(update={"nonce": m1.nonce}), "alice", key)
        answer = await later.deliver(encode_message(replay))
    finally:
        await _close(later)

    # Then it is refused as a replay (protection off: recorded)
    recorded = [e.message_id for e in await _events(redis_url, tid) if isinstance(e, ControlRequested)]
    if kind is ForgetsUsedNonces:
        assert answer == "recorded" and recorded == [m1.message_id, m2.message_id]
        return
    assert answer == "rejected:REPLAYED"
    assert recorded == [m1.message_id]
