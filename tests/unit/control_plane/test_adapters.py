"""The composition root (``cluster.adapters``): the actors' control verifier caches the keyring until the
file changes, envelopes carry what the actor reads, and transport deliveries map onto the relay's view."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from cluster.adapters import ClusterAdapters, relay_delivery
from cluster.control import ControlAction, ControlMessage, Delivery, EntryProblem, encode_message
from cluster.signing import Role, create_key, load_private_key, sign
from runtime.errors import CodecError, ControlError

NOW = 1_700_000_000.0


def signed(path: Path, issuer: str, action: ControlAction = ControlAction.PAUSE, **payload: str) -> bytes:
    message = ControlMessage.create("t-1", action, issuer, now=NOW, payload=dict(payload))
    return encode_message(sign(message, issuer, load_private_key(issuer, path)))


def never_seen(_message_id: str, _nonce: str) -> bool:
    return False


def test_the_keyring_is_read_once_and_again_only_when_the_file_changes(tmp_path: Path) -> None:
    # Given a keyring with one operator and the verifier an actor holds for its whole incarnation
    path = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], path)
    verifier = ClusterAdapters().control_verifier(str(path))

    # When three messages are verified
    for _ in range(3):
        envelope = verifier.decode(signed(path, "alice"))
        verified = verifier.verify(envelope, NOW, never_seen)
        assert verified.signers == ("alice",) and verified.roles == frozenset({"operator"})

    # Then the file was read once
    assert verifier.loads == 1

    # And when a key is added during the run, the next delivery sees it without a restart
    create_key("sam", [Role.SECOPS], path)
    verified = verifier.verify(verifier.decode(signed(path, "sam", ControlAction.KILL)), NOW, never_seen)
    assert verified.signers == ("sam",)
    assert verifier.loads == 2


def test_the_envelope_carries_what_the_actor_reads_and_verification_reasons_survive(tmp_path: Path) -> None:
    path = tmp_path / "keyring.yaml"
    create_key("bot", [Role.POLICY], path)
    verifier = ClusterAdapters().control_verifier(str(path))

    envelope = verifier.decode(signed(path, "bot", ControlAction.APPROVE, call_digest="d" * 64))
    assert (envelope.trajectory_id, envelope.action, envelope.issuer) == ("t-1", "approve", "bot")
    assert envelope.payload == {"call_digest": "d" * 64}

    # a policy may not approve: the verifier's reason code reaches the actor unchanged
    with pytest.raises(ControlError) as refused:
        verifier.verify(envelope, NOW, never_seen)
    assert refused.value.reason == "WRONG_ROLE"
    with pytest.raises(CodecError):
        verifier.decode(b"\x81\xa1x\x01")


def test_transport_deliveries_map_onto_the_relay_view() -> None:
    message = ControlMessage.create("t-9", ControlAction.KILL, "alice", now=NOW)
    good = relay_delivery(Delivery("1-0", message, None, partition=3))
    assert good.envelope is not None and good.envelope.message_id == message.message_id
    assert good.envelope.data == encode_message(message) and (good.partition, good.problem) == (3, "")

    cases = {
        EntryProblem.TRIMMED: "the pending entry was trimmed before delivery",
        EntryProblem.MISSING_FIELD: "the entry has no message field 'm'",
        EntryProblem.MALFORMED: "not valid msgpack",
    }
    for problem, text in cases.items():
        seen = relay_delivery(Delivery("2-0", None, CodecError(text), partition=5, problem=problem))
        assert (seen.envelope, seen.partition, seen.problem) == (None, 5, problem.value)
        assert text in str(seen.error)


def test_the_root_pickles_by_reference_so_ray_can_ship_it_to_workers() -> None:
    root = ClusterAdapters()
    assert pickle.loads(pickle.dumps(root)) == root
