"""Signing and verifying control messages: what is accepted, and every rejection with its reason code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cluster.control import ControlAction, ControlMessage, encode_message
from cluster.signing import Keyring, RejectReason, Role, Verifier, sign
from runtime.clock import FakeClock
from runtime.errors import ControlError

DIGEST = {"call_digest": "9f" * 32}


@dataclass
class Operators:
    """A keyring of known identities and their private keys, plus one key nobody registered."""

    keys: dict[str, Ed25519PrivateKey] = field(default_factory=dict)
    keyring: Keyring = field(default_factory=Keyring)

    def add(self, name: str, *roles: Role) -> None:
        self.keys[name] = Ed25519PrivateKey.generate()
        self.keyring = self.keyring.with_identity(name, self.keys[name].public_key(), roles)


@pytest.fixture
def ops() -> Operators:
    o = Operators()
    o.add("alice", Role.OPERATOR)
    o.add("sam", Role.SECOPS)
    o.add("sri", Role.SRE)
    o.add("bot", Role.POLICY)
    return o


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def never_seen(_message_id: str, _nonce: str) -> bool:
    return False


def signed(
    ops: Operators, clock: FakeClock, action: ControlAction, by: str = "alice", **kw: object
) -> ControlMessage:
    payload = DIGEST if action in (ControlAction.APPROVE, ControlAction.DENY) else {}
    message = ControlMessage.create("t-1", action, by, now=clock.wall(), payload=payload, **kw)  # type: ignore[arg-type]
    return sign(message, by, ops.keys[by])


def reason_of(
    verifier: Verifier, message: ControlMessage, now: float, seen: Callable[[str, str], bool]
) -> str:
    with pytest.raises(ControlError) as caught:
        verifier.verify(message, now, seen)
    return str(caught.value.reason)


def test_a_properly_signed_message_is_accepted(ops: Operators, clock: FakeClock) -> None:
    # Given a kill signed by an operator
    message = signed(ops, clock, ControlAction.KILL)

    # When verified a second later
    verified = Verifier(ops.keyring).verify(message, clock.wall() + 1, never_seen)

    # Then it is accepted with its signer and roles
    assert verified.message == message
    assert verified.signers == ("alice",)
    assert verified.roles == {Role.OPERATOR}


def test_a_signature_survives_the_wire(ops: Operators, clock: FakeClock) -> None:
    # Given a signed approval sent as bytes
    data = encode_message(signed(ops, clock, ControlAction.APPROVE))

    # When the receiver verifies the bytes
    verified = Verifier(ops.keyring).verify_bytes(data, clock.wall(), never_seen)

    # Then it checks out
    assert verified.message.payload == DIGEST


@pytest.mark.parametrize(
    ("action", "role", "allowed"),
    [
        (ControlAction.KILL, Role.OPERATOR, True),
        (ControlAction.KILL, Role.SECOPS, True),
        (ControlAction.KILL, Role.SRE, True),
        (ControlAction.KILL, Role.POLICY, False),
        (ControlAction.APPROVE, Role.OPERATOR, True),
        (ControlAction.APPROVE, Role.SECOPS, True),
        (ControlAction.APPROVE, Role.SRE, False),
        (ControlAction.DENY, Role.POLICY, False),
        (ControlAction.PAUSE, Role.POLICY, True),
        (ControlAction.PAUSE, Role.SECOPS, False),
        (ControlAction.RESUME, Role.SRE, True),
        (ControlAction.CANCEL, Role.POLICY, True),
        (ControlAction.INTERRUPT, Role.OPERATOR, True),
    ],
)
def test_each_action_is_open_only_to_its_roles(
    ops: Operators, clock: FakeClock, action: ControlAction, role: Role, allowed: bool
) -> None:
    # Given a key holding only `role`
    ops.add("k", role)
    message = signed(ops, clock, action, by="k")
    verifier = Verifier(ops.keyring)

    # When it issues `action`
    # Then it is accepted exactly when the role may issue it, else WRONG_ROLE
    if allowed:
        assert verifier.verify(message, clock.wall(), never_seen).signers == ("k",)
    else:
        assert reason_of(verifier, message, clock.wall(), never_seen) == RejectReason.WRONG_ROLE


def _forged(ops: Operators, clock: FakeClock) -> ControlMessage:
    # mallory signs with her own key but claims to be alice
    mallory = Ed25519PrivateKey.generate()
    return sign(ControlMessage.create("t-1", "kill", "alice", now=clock.wall()), "alice", mallory)


def _tampered(ops: Operators, clock: FakeClock) -> ControlMessage:
    message = signed(ops, clock, ControlAction.PAUSE)
    return message.model_copy(update={"action": ControlAction.KILL})


def _retargeted(ops: Operators, clock: FakeClock) -> ControlMessage:
    message = signed(ops, clock, ControlAction.KILL)
    return message.model_copy(update={"trajectory_id": "someone-else"})


def _unknown(ops: Operators, clock: FakeClock) -> ControlMessage:
    stranger = Ed25519PrivateKey.generate()
    return sign(ControlMessage.create("t-1", "kill", "eve", now=clock.wall()), "eve", stranger)


def _issuer_did_not_sign(ops: Operators, clock: FakeClock) -> ControlMessage:
    message = ControlMessage.create("t-1", "kill", "alice", now=clock.wall())
    return sign(message, "sri", ops.keys["sri"])


def _unknown_cosigner(ops: Operators, clock: FakeClock) -> ControlMessage:
    return sign(signed(ops, clock, ControlAction.KILL), "eve", Ed25519PrivateKey.generate())


def _twice(ops: Operators, clock: FakeClock) -> ControlMessage:
    message = signed(ops, clock, ControlAction.KILL)
    return message.model_copy(update={"signatures": message.signatures * 2})


@pytest.mark.parametrize(
    ("build", "now_offset", "reason"),
    [
        (lambda o, c: ControlMessage.create("t-1", "kill", "alice", now=c.wall()), 0, RejectReason.UNSIGNED),
        (_issuer_did_not_sign, 0, RejectReason.UNSIGNED),
        (_unknown, 0, RejectReason.UNKNOWN_KEY),
        (_unknown_cosigner, 0, RejectReason.UNKNOWN_KEY),
        (_forged, 0, RejectReason.BAD_SIGNATURE),
        (_tampered, 0, RejectReason.BAD_SIGNATURE),
        (_retargeted, 0, RejectReason.BAD_SIGNATURE),
        (lambda o, c: signed(o, c, ControlAction.APPROVE, by="bot"), 0, RejectReason.WRONG_ROLE),
        (lambda o, c: signed(o, c, ControlAction.KILL, ttl_s=30.0), 30.0, RejectReason.EXPIRED),
        (lambda o, c: signed(o, c, ControlAction.KILL, ttl_s=30.0), 3600.0, RejectReason.EXPIRED),
        (lambda o, c: signed(o, c, ControlAction.KILL), -60.0, RejectReason.NOT_YET_VALID),
        (_twice, 0, RejectReason.MALFORMED),
        (lambda o, c: signed(o, c, ControlAction.KILL, ttl_s=10 * 86_400.0), 0, RejectReason.MALFORMED),
    ],
    ids=[
        "unsigned",
        "issuer-did-not-sign",
        "unknown-issuer",
        "unknown-cosigner",
        "forged",
        "tampered-action",
        "retargeted",
        "policy-approving",
        "expired-at-the-instant",
        "expired-long-ago",
        "issued-in-the-future",
        "same-signer-twice",
        "validity-too-long",
    ],
)
def test_bad_messages_are_rejected_with_their_reason(
    ops: Operators,
    clock: FakeClock,
    build: Callable[[Operators, FakeClock], ControlMessage],
    now_offset: float,
    reason: RejectReason,
) -> None:
    # Given a message that is wrong in one way, and a record of which nonces were consulted
    message = build(ops, clock)
    consulted: list[tuple[str, str]] = []

    def seen(message_id: str, nonce: str) -> bool:
        consulted.append((message_id, nonce))
        return False

    # When verified
    got = reason_of(Verifier(ops.keyring), message, clock.wall() + now_offset, seen)

    # Then it is rejected for that reason, and the replay record was never consulted
    assert got == reason
    assert consulted == []


@pytest.mark.parametrize("replayed", ["message_id", "nonce"])
def test_a_replayed_message_id_or_nonce_is_rejected(ops: Operators, clock: FakeClock, replayed: str) -> None:
    # Given a valid message whose id (or nonce) was already accepted once
    message = signed(ops, clock, ControlAction.PAUSE)
    accepted = {("message_id", message.message_id), ("nonce", message.nonce)}

    def seen(message_id: str, nonce: str) -> bool:
        return (replayed, message_id if replayed == "message_id" else nonce) in accepted

    # When it arrives again
    # Then it is REPLAYED
    assert reason_of(Verifier(ops.keyring), message, clock.wall(), seen) == RejectReason.REPLAYED


def test_verification_uses_the_injected_time_only(ops: Operators, clock: FakeClock) -> None:
    # Given a message valid for 60 s and a verifier
    message = signed(ops, clock, ControlAction.CANCEL, ttl_s=60.0)
    verifier = Verifier(ops.keyring)
    issued = clock.wall()

    # When the clock moves to just before and exactly at expiry
    clock.advance(59.999)
    before = verifier.verify(message, clock.wall(), never_seen)
    clock.advance(0.001)

    # Then it is valid before, expired at
    assert before.message == message
    assert reason_of(verifier, message, clock.wall(), never_seen) == RejectReason.EXPIRED
    assert clock.wall() == pytest.approx(issued + 60.0)


def test_a_quorum_of_distinct_signers_is_accepted_with_the_union_of_roles(
    ops: Operators, clock: FakeClock
) -> None:
    # Given an approval signed by an operator and a secops engineer
    message = sign(signed(ops, clock, ControlAction.APPROVE), "sam", ops.keys["sam"])

    # When verified
    verified = Verifier(ops.keyring).verify(message, clock.wall(), never_seen)

    # Then both signers are reported with both roles
    assert verified.signers == ("alice", "sam")
    assert verified.roles == {Role.OPERATOR, Role.SECOPS}


def test_one_cosigner_without_the_role_spoils_the_quorum(ops: Operators, clock: FakeClock) -> None:
    message = sign(signed(ops, clock, ControlAction.APPROVE), "bot", ops.keys["bot"])
    assert reason_of(Verifier(ops.keyring), message, clock.wall(), never_seen) == RejectReason.WRONG_ROLE


def test_signing_twice_as_the_same_identity_is_refused(ops: Operators, clock: FakeClock) -> None:
    message = signed(ops, clock, ControlAction.KILL)
    with pytest.raises(ValueError, match="already signed"):
        sign(message, "alice", ops.keys["alice"])


@pytest.mark.parametrize(
    "data", [b"\xc1garbage", msgpack.packb({"schema_version": 1})], ids=["bytes", "fields"]
)
def test_undecodable_bytes_are_malformed(ops: Operators, clock: FakeClock, data: bytes) -> None:
    with pytest.raises(ControlError) as caught:
        Verifier(ops.keyring).verify_bytes(data, clock.wall(), never_seen)
    assert caught.value.reason == RejectReason.MALFORMED


def test_a_verifier_with_a_custom_role_table_applies_it(ops: Operators, clock: FakeClock) -> None:
    # Given a deployment that lets only secops kill
    verifier = Verifier(ops.keyring, action_roles={ControlAction.KILL: frozenset({Role.SECOPS})})

    # Then an operator's kill is WRONG_ROLE and secops' is accepted
    assert (
        reason_of(verifier, signed(ops, clock, ControlAction.KILL), clock.wall(), never_seen) == "WRONG_ROLE"
    )
    assert verifier.verify(signed(ops, clock, ControlAction.KILL, by="sam"), clock.wall(), never_seen)
