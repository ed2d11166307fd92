"""The operator client's pure parts: signed messages the verifier accepts, and status snapshot parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.control import ControlAction
from cluster.control_client import ControlClient, TrajectoryStatus
from cluster.signing import Keyring, Role, Verifier, create_key
from runtime.clock import FakeClock
from runtime.errors import InputError


class _NoRedis:
    """Building and signing never touch Redis; anything that does fails loudly."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"unexpected Redis call {name}")


@pytest.fixture
def keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], path)
    create_key("bot", [Role.POLICY], path)
    return path


@pytest.fixture
def client(keyring: Path) -> ControlClient:
    return ControlClient(_NoRedis(), keyring=keyring, clock=FakeClock(), ttl_s=60.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("action", "payload"),
    [
        (ControlAction.PAUSE, None),
        (ControlAction.KILL, None),
        (ControlAction.INTERRUPT, {"message": "also check the tests"}),
        (ControlAction.APPROVE, {"call_digest": "ab" * 32}),
        (ControlAction.DENY, {"call_digest": "cd" * 32}),
    ],
)
def test_built_messages_verify_against_the_keyring(
    client: ControlClient, keyring: Path, action: ControlAction, payload: dict[str, str] | None
) -> None:
    # Given a message built and signed as alice
    message = client.build("t-1", action, issuer="alice", reason="ops", payload=payload)  # type: ignore[arg-type]

    # When the trajectory side verifies it
    verified = Verifier(Keyring.load(keyring)).verify(message, client.clock.wall(), lambda _m, _n: False)

    # Then it is accepted, valid for the client's ttl, and carries the payload
    assert verified.signers == ("alice",)
    assert message.expires_at - message.issued_at == pytest.approx(60.0)
    assert message.payload == (payload or {})


def test_a_missing_private_key_names_the_path_and_the_fix(client: ControlClient) -> None:
    # Given an identity with no key on this machine
    # When building a message as it / Then the error says where it looked and how to create one
    with pytest.raises(InputError, match=r"no private key at .*mallory\.key.*tether keys new mallory"):
        client.build("t-1", ControlAction.PAUSE, issuer="mallory")


def test_approve_without_a_digest_is_a_clear_input_error(client: ControlClient) -> None:
    with pytest.raises(InputError, match="call_digest"):
        client.build("t-1", ControlAction.APPROVE, issuer="alice")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {b"state": b"READY", b"turns": b"3", b"rho": b"0.4213", b"binding_dimension": b"tokens"},
            "t-1  READY  turns=3  rho=0.42 (tokens)  pending: -",
        ),
        (
            {
                "state": "AWAITING_APPROVAL",
                "turns": "5",
                "rho": "0.1",
                "held_digest": "0123456789abcdef",
                "held_tool": "deploy",
                "held_expires_at": "1700000300",
            },
            "t-1  AWAITING_APPROVAL  turns=5  rho=0.10  pending: approval of deploy 0123456789ab",
        ),
        (
            {"state": "PAUSED", "turns": "2", "hibernated": "true", "pending_control": "1"},
            "t-1  PAUSED  turns=2  rho=0.00  pending: 1 control request(s), hibernated",
        ),
        (
            {"state": "CANCELED", "exit_reason": "canceled", "turns": "x", "rho": ""},
            "t-1  CANCELED exit=canceled  turns=0  rho=0.00  pending: -",
        ),
    ],
    ids=["ready", "held", "hibernated", "odd-fields"],
)
def test_status_lines_from_snapshot_hashes(raw: dict[bytes | str, bytes | str], expected: str) -> None:
    assert TrajectoryStatus.from_hash("t-1", raw).line() == expected


def test_held_call_arguments_are_summarised_on_one_short_line() -> None:
    args = '{"b": 2,\n "a": "' + "x" * 200 + '"}'
    status = TrajectoryStatus.from_hash("t-1", {"held_digest": "d", "held_tool": "rm", "held_args": args})
    assert status.held is not None
    assert status.held.arguments.startswith('{"a":"xxx') and len(status.held.arguments) == 80
    assert "\n" not in status.held.arguments
