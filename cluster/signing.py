"""Who may steer a trajectory: Ed25519 keys, the keyring, signing and verifying control messages.

The keyring (YAML at ``$TETHER_KEYRING``, default ``$TETHER_HOME/keyring.yaml`` i.e. ``.tether/keyring.yaml``)
maps each identity to its public key and roles. Private keys live beside it in ``keys/<identity>.key``
(PKCS#8 PEM, file mode 0600, directory 0700) and never enter the keyring.

A signature covers ``canonical_bytes(message)``: a domain tag followed by msgpack of the message without its
signatures, map keys sorted at every level, so signer and verifier agree byte for byte. Several identities
may sign the same message (quorum approvals, harness chapter Table 10: each signer distinct).

``Verifier.verify`` checks, in this order, and raises ``ControlError`` with the reason code of the first
failure (``RejectReason``): shape (MALFORMED), a signature from the issuer (UNSIGNED), every signer known
(UNKNOWN_KEY), every signature valid (BAD_SIGNATURE), every signer holding a role allowed for the action
(WRONG_ROLE), the validity window (NOT_YET_VALID, EXPIRED), then replay (REPLAYED). Replay is checked last
so a forged message can never mark a genuine nonce as used.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, cast

import msgpack
import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cluster.control import ControlAction, ControlMessage, Identity, decode_message
from cluster.embedded import tether_home
from runtime.errors import CodecError, ControlError, InputError

__all__ = [
    "ACTION_ROLES",
    "DEFAULT_OPERATOR",
    "KEYRING_ENV",
    "KeyInfo",
    "Keyring",
    "KeyringEntry",
    "RejectReason",
    "Role",
    "VerifiedMessage",
    "Verifier",
    "canonical_bytes",
    "create_key",
    "ensure_default_operator",
    "key_path",
    "keyring_path",
    "load_private_key",
    "parse_roles",
    "sign",
]

KEYRING_ENV = "TETHER_KEYRING"
DEFAULT_OPERATOR = "operator"
_DOMAIN = b"tether-control-v1\x00"  # a signature over a control message is never valid for anything else


class Role(StrEnum):
    """Organisational roles a key can hold (harness chapter: operators, security, SRE, automated policy)."""

    OPERATOR = "operator"
    SECOPS = "secops"
    SRE = "sre"
    POLICY = "policy"


# Who may issue what (harness chapter, Table 6, "Typically issued by"): kill is for operators and security
# or reliability staff; approvals are human decisions (operator, secops), never an automated policy; the
# boundary actions are also open to automated policies (e.g. a scheduler pausing a batch class).
ACTION_ROLES: Mapping[ControlAction, frozenset[Role]] = MappingProxyType(
    {
        ControlAction.KILL: frozenset({Role.OPERATOR, Role.SECOPS, Role.SRE}),
        ControlAction.APPROVE: frozenset({Role.OPERATOR, Role.SECOPS}),
        ControlAction.DENY: frozenset({Role.OPERATOR, Role.SECOPS}),
        ControlAction.PAUSE: frozenset({Role.OPERATOR, Role.SRE, Role.POLICY}),
        ControlAction.RESUME: frozenset({Role.OPERATOR, Role.SRE, Role.POLICY}),
        ControlAction.CANCEL: frozenset({Role.OPERATOR, Role.SRE, Role.POLICY}),
        ControlAction.INTERRUPT: frozenset({Role.OPERATOR, Role.SRE, Role.POLICY}),
        # what a trajectory owes the world: a person's word, never a policy's
        ControlAction.SETTLE: frozenset({Role.OPERATOR, Role.SECOPS, Role.SRE}),
        ControlAction.HANDOFF: frozenset({Role.OPERATOR, Role.SECOPS, Role.SRE}),
        # issue 12: an incident hold is containment (security and reliability staff, or an automated
        # policy); lifting it and taking custody of an escalation are a person's decisions
        ControlAction.HOLD: frozenset({Role.OPERATOR, Role.SECOPS, Role.SRE, Role.POLICY}),
        ControlAction.RELEASE: frozenset({Role.OPERATOR, Role.SECOPS}),
        ControlAction.ACKNOWLEDGE: frozenset({Role.OPERATOR, Role.SECOPS, Role.SRE}),
    }
)


class RejectReason(StrEnum):
    """Audited reason codes carried by ``ControlError.reason``."""

    MALFORMED = "MALFORMED"
    UNSIGNED = "UNSIGNED"
    UNKNOWN_KEY = "UNKNOWN_KEY"  # a signer whose key is not in the keyring
    BAD_SIGNATURE = "BAD_SIGNATURE"
    WRONG_ROLE = "WRONG_ROLE"
    NOT_YET_VALID = "NOT_YET_VALID"
    EXPIRED = "EXPIRED"
    REPLAYED = "REPLAYED"


def parse_roles(text: str | Iterable[str]) -> frozenset[Role]:
    """``"operator,sre"`` (or an iterable) as roles; ``InputError`` naming the unknown ones."""
    items = [r.strip() for r in (text.split(",") if isinstance(text, str) else text) if r.strip()]
    known = {r.value for r in Role}
    unknown = sorted(set(items) - known)
    if unknown or not items:
        what = f"unknown role(s) {', '.join(unknown)}" if unknown else "no roles given"
        raise InputError(f"{what}; choose from {', '.join(sorted(known))}", where="roles")
    return frozenset(Role(r) for r in items)


# --------------------------------------------------------------------------- keyring


class KeyringEntry(BaseModel):
    """One identity: its Ed25519 public key (base64 of the 32 raw bytes, or PEM) and roles."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    public_key: str
    roles: frozenset[Role] = Field(min_length=1)

    @field_validator("public_key")
    @classmethod
    def _valid_key(cls, value: str) -> str:
        _load_public_key(value)
        return value

    @property
    def key(self) -> Ed25519PublicKey:
        return _load_public_key(self.public_key)


class _KeyringDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    identities: dict[Identity, KeyringEntry] = Field(default_factory=dict)


class Keyring:
    """Identities and their public keys and roles, as loaded from (and saved to) the keyring file."""

    def __init__(self, entries: Mapping[str, KeyringEntry] | None = None) -> None:
        self._entries = dict(entries or {})

    @classmethod
    def load(cls, path: Path) -> Keyring:
        """Read ``path``; a missing file is an empty keyring. Bad content names the file and field."""
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls()
        try:
            raw = yaml.safe_load(text) or {}
            return cls(_KeyringDocument.model_validate(raw).identities)
        except yaml.YAMLError as e:
            raise InputError(f"not valid YAML: {e}", where=str(path)) from e
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise InputError(first["msg"], where=f"{path}: {field}") from e

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename) so a reader never sees half a keyring."""
        doc = {
            "version": 1,
            "identities": {
                name: {"public_key": e.public_key, "roles": sorted(r.value for r in e.roles)}
                for name, e in sorted(self._entries.items())
            },
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        header = "# Tether keyring: identity -> Ed25519 public key + roles.\n"
        tmp.write_text(header + yaml.safe_dump(doc, sort_keys=False))
        tmp.replace(path)

    def get(self, identity: str) -> KeyringEntry | None:
        return self._entries.get(identity)

    def __contains__(self, identity: object) -> bool:
        return identity in self._entries

    def __iter__(self) -> Iterator[tuple[str, KeyringEntry]]:
        return iter(sorted(self._entries.items()))

    def with_identity(self, identity: str, public_key: Ed25519PublicKey, roles: Iterable[Role]) -> Keyring:
        """A new keyring that also holds ``identity``."""
        raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        entry = KeyringEntry(public_key=base64.b64encode(raw).decode(), roles=frozenset(roles))
        return Keyring({**self._entries, identity: entry})


def _load_public_key(text: str) -> Ed25519PublicKey:
    try:
        if text.lstrip().startswith("-----BEGIN"):
            key = serialization.load_pem_public_key(text.encode())
            if not isinstance(key, Ed25519PublicKey):
                raise ValueError(f"expected an Ed25519 public key, got {type(key).__name__}")
            return key
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, binascii.Error) as e:
        raise ValueError(f"not an Ed25519 public key (base64 of 32 bytes or PEM): {e}") from e


def keyring_path(env: Mapping[str, str] | None = None) -> Path:
    """``$TETHER_KEYRING``, else ``tether_home()/keyring.yaml``."""
    env = os.environ if env is None else env
    return Path(env[KEYRING_ENV]) if env.get(KEYRING_ENV) else tether_home(env) / "keyring.yaml"


def key_path(identity: str, keyring: Path) -> Path:
    """Where ``identity``'s private key lives: ``keys/<identity>.key`` beside the keyring."""
    return keyring.parent / "keys" / f"{identity}.key"


@dataclass(frozen=True, slots=True)
class KeyInfo:
    identity: str
    roles: frozenset[Role]
    key_file: Path
    keyring_file: Path


@contextmanager
def _keyring_lock(keyring: Path) -> Iterator[None]:
    """Serialise keyring edits across processes (two CLIs, or two workers making the default key)."""
    keyring.parent.mkdir(parents=True, exist_ok=True)
    with (keyring.parent / f".{keyring.name}.lock").open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield


def create_key(identity: str, roles: Iterable[Role] | str, keyring: Path | None = None) -> KeyInfo:
    """Generate a key pair for ``identity``: private key to a new 0600 file, public key into the keyring.

    Refuses (``InputError``) an invalid or existing identity and unknown roles; an unwritable location
    surfaces as ``OSError`` from the filesystem, naming the path.
    """
    keyring = keyring or keyring_path()
    role_set = parse_roles(roles) if isinstance(roles, str) else parse_roles([str(r) for r in roles])
    try:
        identity = _IdentityCheck(identity=identity).identity
    except ValidationError as e:
        raise InputError(
            "must start with a letter or digit, then letters, digits, '.', '_', '@' or '-' (at most 64)",
            where=f"identity {identity!r}",
        ) from e
    with _keyring_lock(keyring):
        ring = Keyring.load(keyring)
        target = key_path(identity, keyring)
        if identity in ring or target.exists():
            raise InputError(
                f"identity already exists (in {keyring} or at {target})", where=f"identity {identity!r}"
            )
        private = Ed25519PrivateKey.generate()
        _write_private_key(target, private)
        ring.with_identity(identity, private.public_key(), role_set).save(keyring)
    return KeyInfo(identity, role_set, target, keyring)


class _IdentityCheck(BaseModel):
    identity: Identity


def _write_private_key(path: Path, key: Ed25519PrivateKey) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # O_EXCL: never overwrite a key; mode 0600 from creation, so the secret is never world-readable.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only remove bits, but be explicit
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)


def load_private_key(identity: str, keyring: Path | None = None) -> Ed25519PrivateKey:
    """``identity``'s private key, or an ``InputError`` saying where it was looked for and how to make one."""
    keyring = keyring or keyring_path()
    path = key_path(identity, keyring)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError as e:
        raise InputError(
            f"no private key at {path}; create one with `tether keys new {identity} --roles operator`",
            where=f"identity {identity!r}",
        ) from e
    except ValueError as e:
        raise InputError(f"not a PEM private key: {e}", where=str(path)) from e
    if not isinstance(key, Ed25519PrivateKey):
        raise InputError(f"expected an Ed25519 key, found {type(key).__name__}", where=str(path))
    return key


def ensure_default_operator(keyring: Path | None = None, identity: str = DEFAULT_OPERATOR) -> str:
    """Make sure the local default operator key exists (embedded mode: the demo needs no setup).

    Creates it with role ``operator`` on first use; returns the identity. A keyring entry without its
    private key (or the reverse) is left alone and reported, since overwriting either would lock someone out.
    """
    keyring = keyring or keyring_path()
    with _keyring_lock(keyring):
        in_ring = identity in Keyring.load(keyring)
        has_key = key_path(identity, keyring).exists()
    if in_ring and has_key:
        return identity
    if in_ring != has_key:
        raise InputError(
            f"the keyring {keyring} and the key file {key_path(identity, keyring)} disagree about "
            f"{identity!r}: restore the missing one or remove both",
            where=f"identity {identity!r}",
        )
    try:
        create_key(identity, [Role.OPERATOR], keyring)
    except InputError:
        if not (identity in Keyring.load(keyring) and key_path(identity, keyring).exists()):
            raise  # not the harmless race where another process created it first
    return identity


# --------------------------------------------------------------------------- sign / verify


def canonical_bytes(message: ControlMessage) -> bytes:
    """The exact bytes every signature on ``message`` covers."""
    return _DOMAIN + cast(bytes, msgpack.packb(_sorted(message.signing_document()), use_bin_type=True))


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value


def sign(message: ControlMessage, identity: str, private_key: Ed25519PrivateKey) -> ControlMessage:
    """A copy of ``message`` with ``identity``'s signature appended (ValueError if it already signed)."""
    if identity in message.signers:
        raise ValueError(f"{identity!r} already signed message {message.message_id}")
    signature = private_key.sign(canonical_bytes(message))
    return message.model_copy(update={"signatures": (*message.signatures, (identity, signature))})


@dataclass(frozen=True, slots=True)
class VerifiedMessage:
    """A message whose signatures, roles, validity window and freshness all checked out."""

    message: ControlMessage
    signers: tuple[str, ...]
    roles: frozenset[Role]  # union of the signers' roles (for quorum policies)
    signer_roles: Mapping[str, frozenset[Role]] = field(default_factory=dict)  # each signer's own roles


class Verifier:
    """Checks control messages against a keyring. ``now`` is epoch seconds (``Clock.wall()``).

    ``seen(message_id, nonce)`` answers whether either was already accepted; the caller records both once
    the request is durably logged (verification itself has no side effects).
    """

    def __init__(
        self,
        keyring: Keyring,
        *,
        action_roles: Mapping[ControlAction, frozenset[Role]] = ACTION_ROLES,
        clock_skew_s: float = 5.0,
        max_ttl_s: float = 86_400.0,
    ) -> None:
        self.keyring = keyring
        self.action_roles = action_roles
        self.clock_skew_s = clock_skew_s
        self.max_ttl_s = max_ttl_s  # a message valid "forever" would make replay protection unbounded

    def verify_bytes(self, data: bytes, now: float, seen: Callable[[str, str], bool]) -> VerifiedMessage:
        """Decode then verify; undecodable bytes are MALFORMED (the CodecError text names the field)."""
        try:
            message = decode_message(data)
        except CodecError as e:
            raise ControlError(RejectReason.MALFORMED, str(e)) from e
        return self.verify(message, now, seen)

    def verify(
        self, message: ControlMessage, now: float, seen: Callable[[str, str], bool]
    ) -> VerifiedMessage:
        """The verified message, or ``ControlError`` with the first failing check's ``RejectReason``."""

        def reject(reason: RejectReason, text: str) -> ControlError:
            return ControlError(reason, f"message {message.message_id}: {text}")

        signers = message.signers
        if len(set(signers)) != len(signers):
            raise reject(RejectReason.MALFORMED, "an identity signed more than once")
        if message.expires_at - message.issued_at > self.max_ttl_s:
            raise reject(RejectReason.MALFORMED, f"validity window exceeds {self.max_ttl_s:.0f}s")
        if message.issuer not in signers:
            raise reject(RejectReason.UNSIGNED, f"no signature from issuer {message.issuer!r}")
        entries: dict[str, KeyringEntry] = {}
        for identity in signers:
            entry = self.keyring.get(identity)
            if entry is None:
                raise reject(RejectReason.UNKNOWN_KEY, f"{identity!r} is not in the keyring")
            entries[identity] = entry
        signed = canonical_bytes(message)
        for identity, signature in message.signatures:
            try:
                entries[identity].key.verify(signature, signed)
            except InvalidSignature as e:
                raise reject(RejectReason.BAD_SIGNATURE, f"signature of {identity!r} does not verify") from e
        allowed = self.action_roles.get(message.action, frozenset())
        for identity, entry in entries.items():
            if not entry.roles & allowed:
                held, needed = sorted(entry.roles), sorted(allowed)
                raise reject(
                    RejectReason.WRONG_ROLE,
                    f"{identity!r} has roles {held}; {message.action} needs one of {needed}",
                )
        if message.issued_at > now + self.clock_skew_s:
            raise reject(
                RejectReason.NOT_YET_VALID, f"issued in the future ({message.issued_at} > now {now})"
            )
        if now >= message.expires_at:
            raise reject(RejectReason.EXPIRED, f"expired at {message.expires_at} (now {now})")
        if seen(message.message_id, message.nonce):
            raise reject(RejectReason.REPLAYED, "message id or nonce already used")
        roles = frozenset().union(*(e.roles for e in entries.values()))
        return VerifiedMessage(message, signers, roles, {name: e.roles for name, e in entries.items()})
