"""Key pairs and the keyring on disk, the default operator, and the `tether keys` commands."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cluster import cli_keys
from cluster.control import ControlMessage
from cluster.signing import (
    Keyring,
    RejectReason,
    Role,
    Verifier,
    create_key,
    ensure_default_operator,
    key_path,
    keyring_path,
    load_private_key,
    parse_roles,
    sign,
)
from runtime.errors import ControlError, InputError


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_key_is_private_to_its_owner_and_public_in_the_keyring(tmp_path: Path) -> None:
    # Given an empty keyring location
    ring_file = tmp_path / "ring" / "keyring.yaml"

    # When a key is created for alice
    info = create_key("alice", "operator,sre", ring_file)

    # Then the private key file is 0600 in a 0700 directory, and the keyring lists her public key and roles
    assert info.key_file == key_path("alice", ring_file) == tmp_path / "ring" / "keys" / "alice.key"
    assert mode(info.key_file) == 0o600
    assert mode(info.key_file.parent) == 0o700
    entry = Keyring.load(ring_file).get("alice")
    assert entry is not None and entry.roles == {Role.OPERATOR, Role.SRE}
    assert b"PRIVATE" not in ring_file.read_bytes()


def test_a_created_key_signs_messages_its_keyring_verifies(tmp_path: Path) -> None:
    # Given a key made on disk
    ring_file = tmp_path / "keyring.yaml"
    create_key("alice", "operator", ring_file)

    # When a message is signed with the loaded private key
    message = ControlMessage.create("t", "kill", "alice", now=100.0)
    signed = sign(message, "alice", load_private_key("alice", ring_file))

    # Then a verifier built from the keyring file accepts it, and a fresh key under her name does not
    assert Verifier(Keyring.load(ring_file)).verify(signed, 100.0, lambda *_: False).signers == ("alice",)
    create_key("mallory", "operator", ring_file)
    forged = sign(message, "alice", load_private_key("mallory", ring_file))
    with pytest.raises(ControlError) as caught:
        Verifier(Keyring.load(ring_file)).verify(forged, 100.0, lambda *_: False)
    assert caught.value.reason == RejectReason.BAD_SIGNATURE


@pytest.mark.parametrize(
    ("name", "roles", "expected"),
    [
        ("alice", "operator", "already exists"),
        ("bob", "operator,wizard", "unknown role(s) wizard"),
        ("bob", " , ", "no roles given"),
        ("-bob", "operator", "identity '-bob'"),
        ("bob/../../etc", "operator", "identity"),
    ],
    ids=["existing-name", "unknown-role", "no-roles", "bad-identity", "path-traversal"],
)
def test_bad_key_requests_are_refused_and_change_nothing(
    tmp_path: Path, name: str, roles: str, expected: str
) -> None:
    # Given a keyring holding alice
    ring_file = tmp_path / "keyring.yaml"
    create_key("alice", "operator", ring_file)
    before = ring_file.read_bytes()

    # When a bad request is made
    with pytest.raises(InputError) as caught:
        create_key(name, roles, ring_file)

    # Then the error says what was wrong and the keyring and key files are untouched
    assert expected in str(caught.value)
    assert ring_file.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == ["alice.key"]


def test_an_existing_key_file_is_never_overwritten(tmp_path: Path) -> None:
    # Given a key file for bob that the keyring does not know (e.g. restored from a backup)
    ring_file = tmp_path / "keyring.yaml"
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "bob.key").write_text("precious")

    # When a key for bob is created
    # Then it is refused and the file is intact
    with pytest.raises(InputError, match="already exists"):
        create_key("bob", "operator", ring_file)
    assert (tmp_path / "keys" / "bob.key").read_text() == "precious"


def test_an_unwritable_location_is_an_os_error_naming_the_path(tmp_path: Path) -> None:
    # Given a keyring path whose parent is a regular file (fails even for root, unlike permissions)
    blocker = tmp_path / "blocker"
    blocker.write_text("")

    # When a key is created there
    # Then the filesystem error names the path
    with pytest.raises(OSError) as caught:
        create_key("alice", "operator", blocker / "keyring.yaml")
    assert "blocker" in str(caught.value)


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ("identities: [\n", "keyring.yaml"),
        ("version: 2\n", "keyring.yaml: version"),
        (
            "identities:\n  alice:\n    public_key: bm90IGEga2V5\n    roles: [operator]\n",
            "identities.alice.public_key",
        ),
        ("identities:\n  alice:\n    public_key: %s\n    roles: [root]\n", "identities.alice.roles"),
        ("identities:\n  alice:\n    public_key: %s\n    roles: []\n", "identities.alice.roles"),
    ],
    ids=["bad-yaml", "bad-version", "bad-key", "unknown-role", "no-roles"],
)
def test_a_bad_keyring_file_names_the_file_and_field(tmp_path: Path, content: str, where: str) -> None:
    # Given a keyring file with one mistake (a real key where the case needs one)
    good = tmp_path / "good.yaml"
    create_key("x", "operator", good)
    entry = Keyring.load(good).get("x")
    assert entry is not None
    bad = tmp_path / "keyring.yaml"
    bad.write_text(content.replace("%s", entry.public_key))

    # When loaded
    # Then InputError names the file and the field
    with pytest.raises(InputError) as caught:
        Keyring.load(bad)
    assert where in str(caught.value)


def test_a_pem_public_key_is_accepted_in_the_keyring(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = load_private_key(create_key("alice", "operator", tmp_path / "k.yaml").identity, tmp_path / "k.yaml")
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    ring = tmp_path / "pem.yaml"
    block = "\n".join("      " + line for line in pem.decode().splitlines())
    ring.write_text(f"identities:\n  alice:\n    public_key: |\n{block}\n    roles: [operator]\n")
    message = sign(ControlMessage.create("t", "pause", "alice", now=1.0), "alice", key)
    assert Verifier(Keyring.load(ring)).verify(message, 1.0, lambda *_: False).signers == ("alice",)


def test_a_missing_keyring_is_empty_and_a_missing_private_key_says_how_to_make_one(tmp_path: Path) -> None:
    assert list(Keyring.load(tmp_path / "none.yaml")) == []
    with pytest.raises(InputError, match="tether keys new bob"):
        load_private_key("bob", tmp_path / "none.yaml")


def test_the_default_operator_is_created_once(tmp_path: Path) -> None:
    # Given no keys at all
    ring_file = tmp_path / "keyring.yaml"

    # When the default operator is ensured twice
    first = ensure_default_operator(ring_file)
    key_bytes = key_path(first, ring_file).read_bytes()
    second = ensure_default_operator(ring_file)

    # Then one operator key exists, unchanged by the second call
    assert first == second == "operator"
    assert key_path("operator", ring_file).read_bytes() == key_bytes
    entry = Keyring.load(ring_file).get("operator")
    assert entry is not None and entry.roles == {Role.OPERATOR}


def test_a_default_operator_half_present_is_reported_not_overwritten(tmp_path: Path) -> None:
    ring_file = tmp_path / "keyring.yaml"
    ensure_default_operator(ring_file)
    key_path("operator", ring_file).unlink()
    with pytest.raises(InputError, match="disagree"):
        ensure_default_operator(ring_file)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TETHER_KEYRING": "/etc/tether/ring.yaml"}, Path("/etc/tether/ring.yaml")),
        ({"TETHER_HOME": "/srv/t"}, Path("/srv/t/keyring.yaml")),
        ({}, Path(".tether/keyring.yaml")),
    ],
)
def test_where_the_keyring_lives(env: dict[str, str], expected: Path) -> None:
    assert keyring_path(env) == expected


def test_parse_roles_accepts_an_iterable() -> None:
    assert parse_roles(["secops", "sre"]) == {Role.SECOPS, Role.SRE}


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()
    cli_keys.register(app)

    @app.command("noop", hidden=True)
    def _noop() -> None:  # a second command keeps typer from collapsing the group
        pass

    return app


def test_cli_new_then_list(cli: typer.Typer, tmp_path: Path) -> None:
    # Given an empty keyring path
    ring = tmp_path / "keyring.yaml"
    runner = CliRunner()

    # When two keys are created and the keyring listed
    made = runner.invoke(cli, ["keys", "new", "alice", "--roles", "operator,sre", "--keyring", str(ring)])
    runner.invoke(cli, ["keys", "new", "bot", "--roles", "policy", "--keyring", str(ring)])
    key_path("bot", ring).unlink()  # bot's private key lives elsewhere
    listed = runner.invoke(cli, ["keys", "list", "--keyring", str(ring)])

    # Then both are listed with roles and where the private key is
    assert made.exit_code == 0 and "mode 0600" in made.output
    assert mode(key_path("alice", ring)) == 0o600
    lines = listed.output.splitlines()
    assert listed.exit_code == 0 and len(lines) == 2
    assert lines[0].split() == ["alice", "operator,sre", "private", "key", "here"]
    assert lines[1].split() == ["bot", "policy", "public", "only"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["keys", "new", "alice", "--roles", "operator"], 2, "already exists"),
        (["keys", "new", "bob", "--roles", "admin"], 2, "unknown role(s) admin"),
        (["keys", "new", "bob"], 2, "--roles"),
    ],
    ids=["existing", "bad-role", "roles-missing"],
)
def test_cli_errors_are_clear(
    cli: typer.Typer, tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    ring = tmp_path / "keyring.yaml"
    create_key("alice", "operator", ring)
    result = CliRunner().invoke(cli, [*args, "--keyring", str(ring)])
    assert result.exit_code == code
    assert message in result.output


def test_cli_reports_an_unwritable_keyring_path(cli: typer.Typer, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    result = CliRunner().invoke(
        cli, ["keys", "new", "a", "--roles", "sre", "--keyring", str(blocker / "k.yaml")]
    )
    assert result.exit_code == 1
    assert "cannot write" in result.output and str(blocker) in result.output


def test_cli_list_on_an_empty_keyring_says_how_to_start(cli: typer.Typer, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["keys", "list", "--keyring", str(tmp_path / "none.yaml")])
    assert result.exit_code == 0 and "tether keys new" in result.output
