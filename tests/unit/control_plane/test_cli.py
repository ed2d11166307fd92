"""The control commands with a fake client: what they send, what they print, and their one-line errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from cluster.cli_control import ControlCli, NoRedis, Target, embedded_url
from cluster.control import ControlAction, ControlMessage, LiveEvent
from cluster.control_client import BulkSent, HeldCallView, Sent, TrajectoryStatus, UnknownTrajectory
from runtime.errors import DependencyError, InputError


@dataclass
class FakeClient:
    known_ids: set[str] = field(default_factory=lambda: {"t-1"})
    sent: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)
    rows: list[TrajectoryStatus] = field(default_factory=list)
    fail_with: Exception | None = None
    closed: bool = False

    async def send(self, trajectory_id: str, action: ControlAction | str, **kw: Any) -> Sent:
        if self.fail_with is not None:
            raise self.fail_with
        if trajectory_id not in self.known_ids:
            raise UnknownTrajectory(trajectory_id)
        self.sent.append((trajectory_id, str(action), kw["issuer"], dict(kw.get("payload") or {})))
        payload = kw.get("payload") or {}
        m = ControlMessage.create(trajectory_id, action, kw["issuer"], now=1.0, payload=payload)
        return Sent("1-0", m)

    async def approve(self, trajectory_id: str, **kw: Any) -> Sent:
        digest = kw.get("call_digest") or "held-digest"
        return await self.send(
            trajectory_id, ControlAction.APPROVE, issuer=kw["issuer"], payload={"call_digest": digest}
        )

    async def deny(self, trajectory_id: str, **kw: Any) -> Sent:
        digest = kw.get("call_digest") or "held-digest"
        return await self.send(
            trajectory_id, ControlAction.DENY, issuer=kw["issuer"], payload={"call_digest": digest}
        )

    async def status(self, trajectory_id: str) -> TrajectoryStatus | None:
        return next((r for r in self.rows if r.trajectory_id == trajectory_id), None)

    async def statuses(self) -> list[TrajectoryStatus]:
        return list(self.rows)

    async def pending(self) -> list[HeldCallView]:
        return [r.held for r in self.rows if r.held is not None]

    async def held_calls(self, *, tool: str | None = None) -> list[HeldCallView]:
        return [h for h in await self.pending() if tool is None or h.tool == tool]

    async def decide_many(
        self, action: ControlAction | str, decisions: Sequence[tuple[str, str | None]], **kw: Any
    ) -> BulkSent:
        held = {h.trajectory_id: h.digest for h in await self.pending()}
        sent, refused = [], []
        for tid, digest in decisions:
            chosen = digest or held.get(tid)
            if chosen is None:
                refused.append((tid, "holds no call for approval"))
                continue
            sent.append(await self.send(tid, action, issuer=kw["issuer"], payload={"call_digest": chosen}))
        return BulkSent(sent, refused)

    async def known(self, trajectory_id: str) -> bool:
        return trajectory_id in self.known_ids

    async def watch(self, *, after: str = "$", block_ms: int = 1000) -> AsyncIterator[tuple[str, LiveEvent]]:
        yield (
            "1-0",
            LiveEvent(trajectory_id="t-1", kind="state", at=1.0, data={"state": "PAUSED", "turns": 4}),
        )

    async def close(self) -> None:
        self.closed = True


@dataclass
class Harness:
    client: FakeClient
    target: Target
    ensured: list[Path]
    app: typer.Typer

    def run(self, *args: str, stdin: str | None = None) -> Any:
        return CliRunner().invoke(self.app, list(args), input=stdin)


def make(target: Target | Exception = Target("redis://x", embedded=False)) -> Harness:
    client = FakeClient()
    ensured: list[Path] = []

    def resolve(_explicit: str | None) -> Target:
        if isinstance(target, Exception):
            raise target
        return target

    def ensure(path: Path) -> str:
        ensured.append(path)
        return "operator"

    app = typer.Typer()
    ControlCli(resolve, lambda _t, _k, _ttl: client, ensure).register(app)
    return Harness(client, target if isinstance(target, Target) else Target("", False), ensured, app)


@pytest.mark.parametrize("action", ["pause", "resume", "cancel", "kill"])
def test_boundary_actions_send_one_signed_request(action: str) -> None:
    h = make()
    result = h.run(action, "t-1", "--reason", "maintenance", "--as", "alice")
    assert result.exit_code == 0, result.output
    assert h.client.sent == [("t-1", action, "alice", {})]
    assert f"sent {action} to t-1 as alice" in result.output
    assert h.client.closed


def test_interrupt_carries_the_message_and_needs_one() -> None:
    h = make()
    ok = h.run("interrupt", "t-1", "--message", "also run the linter")
    missing = h.run("interrupt", "t-1")
    assert ok.exit_code == 0 and h.client.sent == [
        ("t-1", "interrupt", "operator", {"message": "also run the linter"})
    ]
    assert missing.exit_code == 2 and "needs --message" in missing.output


@pytest.mark.parametrize(("command", "action"), [("approve", "approve"), ("deny", "deny")])
def test_decisions_bind_to_the_given_or_held_digest(command: str, action: str) -> None:
    h = make()
    h.run(command, "t-1", "--call", "abc123")
    h.run(command, "t-1")
    assert [s[3]["call_digest"] for s in h.client.sent] == ["abc123", "held-digest"]
    assert {s[1] for s in h.client.sent} == {action}


@pytest.mark.parametrize(
    ("error", "code", "text"),
    [
        (UnknownTrajectory("nope"), 2, "no such trajectory"),
        (InputError("no private key at /k/alice.key", where="identity 'alice'"), 2, "no private key"),
        (DependencyError("publishing: Redis at redis://h:1 is unreachable", scope="redis"), 1, "unreachable"),
    ],
)
def test_errors_are_one_line_with_an_exit_code_and_no_traceback(
    error: Exception, code: int, text: str
) -> None:
    h = make()
    h.client.fail_with = error
    result = h.run("pause", "t-1")
    assert result.exit_code == code
    assert text in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_no_redis_anywhere_exits_1_and_says_how_to_fix_it() -> None:
    h = make(NoRedis("no Redis to talk to: pass --redis URL", scope="redis"))
    result = h.run("status")
    assert result.exit_code == 1 and "pass --redis URL" in result.output


@pytest.mark.parametrize(
    ("embedded", "issuer", "ensured"), [(True, "operator", 1), (True, "alice", 0), (False, "operator", 0)]
)
def test_the_default_operator_key_is_created_only_in_embedded_local_mode(
    embedded: bool, issuer: str, ensured: int
) -> None:
    h = make(Target("redis://x", embedded=embedded))
    h.run("pause", "t-1", "--as", issuer)
    assert len(h.ensured) == ensured


def test_status_prints_one_line_per_trajectory_and_rejects_unknown_ids() -> None:
    h = make()
    h.client.rows = [
        TrajectoryStatus(trajectory_id="t-1", state="READY", turns=2, rho=0.5, binding_dimension="tokens"),
        TrajectoryStatus(trajectory_id="t-2", state="PAUSED", turns=7),
    ]
    everything = h.run("status")
    unknown = h.run("status", "zzz")
    assert everything.output.splitlines() == [
        "t-1  READY  turns=2  rho=0.50 (tokens)  pending: -",
        "t-2  PAUSED  turns=7  rho=0.00  pending: -",
    ]
    assert unknown.exit_code == 2 and "no such trajectory" in unknown.output


def test_pending_lists_held_calls_with_digest_tool_and_expiry() -> None:
    h = make()
    held = HeldCallView(
        trajectory_id="t-1", digest="d1g", tool="deploy", arguments='{"env":"prod"}', expires_at=None
    )
    h.client.rows = [TrajectoryStatus(trajectory_id="t-1", state="AWAITING_APPROVAL", held=held)]
    result = h.run("pending")
    assert result.output.strip() == 't-1  d1g  deploy({"env":"prod"})  no expiry'


def test_watch_renders_the_latest_state_from_events() -> None:
    h = make()
    h.client.rows = [TrajectoryStatus(trajectory_id="t-1", state="READY", turns=3)]
    result = h.run("watch", "--for", "1")
    assert result.exit_code == 0, result.output
    assert "PAUSED" in result.output and "state" in result.output


def test_embedded_url_is_read_only_while_its_owner_holds_the_lock(tmp_path: Path) -> None:
    import fcntl

    lock = tmp_path / "redis" / "embedded.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("pid 42 serving redis://127.0.0.1:7777/0\n")
    assert embedded_url(tmp_path) is None  # nobody holds it: stale
    with lock.open("a") as owner:
        fcntl.flock(owner.fileno(), fcntl.LOCK_EX)
        assert embedded_url(tmp_path) == "redis://127.0.0.1:7777/0"


def _held(*rows: tuple[str, str, str]) -> list[TrajectoryStatus]:
    return [
        TrajectoryStatus(
            trajectory_id=tid,
            state="AWAITING_APPROVAL",
            held=HeldCallView(trajectory_id=tid, digest=d, tool=tool),
        )
        for tid, d, tool in rows
    ]


@pytest.mark.parametrize("command", ["approve", "deny"])
def test_all_pending_decides_every_held_call_one_signed_message_each(command: str) -> None:
    # Given three held calls, two of them deploys
    h = make()
    h.client.known_ids = {"t-1", "t-2", "t-3"}
    h.client.rows = _held(("t-1", "d1", "deploy"), ("t-2", "d2", "notify"), ("t-3", "d3", "deploy"))

    # When an operator decides all pending deploys, then everything pending
    deploys = h.run(command, "--all-pending", "--tool", "deploy", "--as", "alice")
    everything = h.run(command, "--all-pending")

    # Then one message per held call was sent, each bound to that call's digest and signed as the operator
    assert deploys.exit_code == 0 and everything.exit_code == 0, deploys.output + everything.output
    assert [(t, a, i, p["call_digest"]) for t, a, i, p in h.client.sent] == [
        ("t-1", command, "alice", "d1"),
        ("t-3", command, "alice", "d3"),
        ("t-1", command, "operator", "d1"),
        ("t-2", command, "operator", "d2"),
        ("t-3", command, "operator", "d3"),
    ]
    assert f"sent {command} for 2 held call(s) of deploy as alice" in deploys.output


def test_ids_from_stdin_with_or_without_digests_and_refusals_reported() -> None:
    # Given two held calls and a trajectory holding nothing
    h = make()
    h.client.known_ids = {"t-1", "t-2", "t-9"}
    h.client.rows = _held(("t-1", "d1", "deploy"), ("t-2", "d2", "deploy"))

    # When ids come on stdin (one with an explicit digest, a comment, a blank line, one holding nothing)
    result = h.run("approve", "-", stdin="t-1\n# reviewed\n\nt-2 explicit-digest\nt-9\n")

    # Then the held ones were approved (the explicit digest wins), the other refused by name, exit code 2
    assert [(t, p["call_digest"]) for t, _, _, p in h.client.sent] == [
        ("t-1", "d1"),
        ("t-2", "explicit-digest"),
    ]
    assert result.exit_code == 2
    assert "t-9: holds no call for approval" in result.output and "1 refused" in result.output


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["approve"], "needs a trajectory id"),
        (["approve", "t-1", "--all-pending"], "not both"),
        (["approve", "t-1", "--tool", "deploy"], "needs --all-pending"),
        (["deny", "--all-pending", "--call", "d1"], "--call names one held call"),
    ],
)
def test_bulk_options_that_do_not_fit_together_are_refused(args: list[str], text: str) -> None:
    h = make()
    result = h.run(*args)
    assert result.exit_code == 2 and text in result.output and h.client.sent == []


def test_an_empty_or_malformed_stdin_is_refused_by_line() -> None:
    h = make()
    assert "no trajectory ids on stdin" in h.run("approve", "-", stdin="\n# nothing\n").output
    bad = h.run("approve", "-", stdin="t-1 d1 extra\n")
    assert bad.exit_code == 2 and "stdin line 1" in bad.output and h.client.sent == []
