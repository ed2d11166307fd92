"""``tether pause|resume|cancel|kill|interrupt|approve|deny|pending|status|watch``: the operator's controls.

    tether pause TRAJECTORY [--reason TEXT] [--as OPERATOR]
    tether interrupt TRAJECTORY --message TEXT [--reason TEXT] [--as OPERATOR]
    tether approve TRAJECTORY [--call DIGEST] [--as OPERATOR]      (deny likewise)
    tether approve --all-pending [--tool TOOL]                     every held call (of TOOL), one message each
    tether approve - < ids.txt                                     ids (or "ID DIGEST" lines) from stdin
    tether pending | tether status [TRAJECTORY] | tether watch [--for SECONDS]

Redis: ``--redis URL``, else ``$TETHER_REDIS_URL``, else the URL the embedded server recorded in
``$TETHER_HOME/redis/embedded.lock`` while it runs (``tether run`` in local mode). In that embedded local mode
the default operator key is created on first use, so the demo needs no setup.

Errors are one line on stderr, no traceback: exit 2 for something the operator can fix in the command
(unknown trajectory, missing key, nothing held, bad URL), exit 1 when Redis cannot be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn, Protocol, TypeVar

import typer
from pydantic import JsonValue
from rich.console import Console
from rich.live import Live
from rich.table import Table

from cluster.control import ControlAction, LiveEvent
from cluster.control_client import (
    BulkSent,
    ControlClient,
    HeldCallView,
    Sent,
    TrajectoryStatus,
    UnknownTrajectory,
)
from cluster.embedded import REDIS_URL_ENV, check_redis_url, redact_url, tether_home
from cluster.signing import DEFAULT_OPERATOR, ensure_default_operator, keyring_path
from runtime.errors import DependencyError, InputError

__all__ = ["ControlCli", "NoRedis", "embedded_url", "register", "resolve_redis"]

T = TypeVar("T")


class NoRedis(DependencyError):
    """No Redis URL given and no embedded server running."""


def embedded_url(home: Path | None = None) -> str | None:
    """The URL of the embedded server running under ``home`` (``tether_home()``), or None.

    The server's owner holds an flock on ``redis/embedded.lock`` and writes ``pid N serving URL`` into it;
    a lock we can take ourselves means nobody is serving (a stale file from a finished run).
    """
    lock_path = (home or tether_home()) / "redis" / "embedded.lock"
    try:
        with lock_path.open("r") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = f.read().strip()
            else:
                return None  # not held: the server that wrote it is gone
    except FileNotFoundError:
        return None
    _, _, url = text.partition(" serving ")
    return url or None


@dataclass(frozen=True, slots=True)
class Target:
    """Where the CLI talks to: the Redis URL, and whether it is the embedded local server."""

    url: str
    embedded: bool


def resolve_redis(explicit: str | None, env: dict[str, str] | None = None) -> Target:
    """``--redis``, then ``$TETHER_REDIS_URL``, then the running embedded server; checked with PING."""
    env = dict(os.environ) if env is None else env
    url = explicit or env.get(REDIS_URL_ENV)
    if url:
        return Target(check_redis_url(url), embedded=False)
    found = embedded_url()
    if found is None:
        raise NoRedis(
            f"no Redis to talk to: pass --redis URL, set {REDIS_URL_ENV}, or start the local runtime "
            f"(no embedded server is running under {tether_home()})",
            scope="redis",
            non_retryable=True,
        )
    return Target(check_redis_url(found), embedded=True)


class ClientLike(Protocol):
    """What the commands use of ``ControlClient`` (a fake stands in for it in unit tests)."""

    async def send(
        self,
        trajectory_id: str,
        action: ControlAction | str,
        *,
        issuer: str,
        reason: str = "",
        payload: dict[str, JsonValue] | None = None,
        ttl_s: float | None = None,
        check_known: bool = True,
    ) -> Sent: ...

    async def approve(
        self, trajectory_id: str, *, issuer: str, call_digest: str | None = None, reason: str = ""
    ) -> Sent: ...

    async def deny(
        self, trajectory_id: str, *, issuer: str, call_digest: str | None = None, reason: str = ""
    ) -> Sent: ...

    async def status(self, trajectory_id: str) -> TrajectoryStatus | None: ...

    async def statuses(self) -> list[TrajectoryStatus]: ...

    async def pending(self) -> list[HeldCallView]: ...

    async def held_calls(self, *, tool: str | None = None) -> list[HeldCallView]: ...

    async def decide_many(
        self,
        action: ControlAction | str,
        decisions: Sequence[tuple[str, str | None]],
        *,
        issuer: str,
        reason: str = "",
    ) -> BulkSent: ...

    async def known(self, trajectory_id: str) -> bool: ...

    def watch(self, *, after: str = "$", block_ms: int = 1000) -> AsyncIterator[tuple[str, LiveEvent]]: ...

    async def close(self) -> None: ...


_RedisOpt = Annotated[
    str | None, typer.Option("--redis", help=f"Redis URL (default: ${REDIS_URL_ENV} or the embedded server).")
]
_AsOpt = Annotated[str, typer.Option("--as", help="Operator identity whose key signs the message.")]
_ReasonOpt = Annotated[str, typer.Option("--reason", help="Why (recorded in the trajectory's log).")]
_KeyringOpt = Annotated[
    Path | None,
    typer.Option("--keyring", help="Keyring file (default: $TETHER_KEYRING or .tether/keyring.yaml)."),
]
_TtlOpt = Annotated[float, typer.Option("--ttl", min=1.0, help="Seconds the message stays valid.")]
_Traj = Annotated[str, typer.Argument(help="Trajectory id.")]


class ControlCli:
    """The control commands, with how to find Redis and build a client injectable (unit tests)."""

    def __init__(
        self,
        resolve: Callable[[str | None], Target] = resolve_redis,
        make_client: Callable[[Target, Path, float], ClientLike] | None = None,
        ensure_operator: Callable[[Path], str] = ensure_default_operator,
    ) -> None:
        self.resolve = resolve
        self.make_client = make_client or _real_client
        self.ensure_operator = ensure_operator

    # ------------------------------------------------------------------ plumbing

    def _run(
        self,
        redis: str | None,
        keyring: Path | None,
        work: Callable[[ClientLike], Awaitable[T]],
        *,
        issuer: str | None = None,
        ttl: float = 300.0,
    ) -> T:
        """Resolve Redis, make the client, run ``work``; map errors to one line and an exit code."""
        try:
            target = self.resolve(redis)
            ring = keyring or keyring_path()
            if issuer == DEFAULT_OPERATOR and target.embedded:
                self.ensure_operator(ring)  # embedded local mode: the demo needs no key setup
            client = self.make_client(target, ring, ttl)

            async def go() -> T:
                try:
                    return await work(client)
                finally:
                    await client.close()

            return asyncio.run(go())
        except InputError as e:
            _fail(str(e), 2)
        except DependencyError as e:
            _fail(redact_url(str(e)), 1)
        except OSError as e:
            _fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "), 1)
        raise AssertionError("unreachable")  # _fail always exits

    def _send(
        self,
        redis: str | None,
        keyring: Path | None,
        ttl: float,
        issuer: str,
        call: Callable[[ClientLike], Awaitable[Sent]],
    ) -> None:
        sent = self._run(redis, keyring, call, issuer=issuer, ttl=ttl)
        m = sent.message
        typer.echo(f"sent {m.action} to {m.trajectory_id} as {m.issuer}: message {m.message_id}")
        typer.echo(f"  stream entry {sent.entry_id}; applied at the next turn boundary (kill: at once)")

    # ------------------------------------------------------------------ commands

    def register(self, app: typer.Typer) -> None:
        for action in (ControlAction.PAUSE, ControlAction.RESUME, ControlAction.CANCEL, ControlAction.KILL):
            app.command(action.value, help=_HELP[action])(self._simple(action))
        app.command("interrupt", help=_HELP[ControlAction.INTERRUPT])(self._interrupt)
        app.command("approve", help=_HELP[ControlAction.APPROVE])(self._decision(ControlAction.APPROVE))
        app.command("deny", help=_HELP[ControlAction.DENY])(self._decision(ControlAction.DENY))
        app.command("pending", help="List held calls awaiting an approve/deny decision.")(self._pending)
        app.command("status", help="One line per trajectory: state, turns, spend share, pending work.")(
            self._status
        )
        app.command("watch", help="Live table of trajectory state changes (from tether:events).")(self._watch)

    def _simple(self, action: ControlAction) -> Callable[..., None]:
        def command(
            trajectory: _Traj,
            reason: _ReasonOpt = "",
            issuer: _AsOpt = DEFAULT_OPERATOR,
            redis: _RedisOpt = None,
            keyring: _KeyringOpt = None,
            ttl: _TtlOpt = 300.0,
        ) -> None:
            self._send(
                redis,
                keyring,
                ttl,
                issuer,
                lambda c: c.send(trajectory, action, issuer=issuer, reason=reason),
            )

        command.__name__ = action.value
        return command

    def _interrupt(
        self,
        trajectory: _Traj,
        message: Annotated[str, typer.Option("--message", help="User message for the next turn.")] = "",
        reason: _ReasonOpt = "",
        issuer: _AsOpt = DEFAULT_OPERATOR,
        redis: _RedisOpt = None,
        keyring: _KeyringOpt = None,
        ttl: _TtlOpt = 300.0,
    ) -> None:
        text = message or reason
        if not text:
            _fail("interrupt needs --message TEXT (the user message delivered into the next turn)", 2)
        self._send(
            redis,
            keyring,
            ttl,
            issuer,
            lambda c: c.send(
                trajectory, ControlAction.INTERRUPT, issuer=issuer, reason=reason, payload={"message": text}
            ),
        )

    def _decision(self, action: ControlAction) -> Callable[..., None]:
        def command(
            trajectory: Annotated[
                str | None,
                typer.Argument(
                    help="Trajectory id, or - to read ids (one per line, optionally ID DIGEST) from stdin."
                ),
            ] = None,
            call: Annotated[
                str | None,
                typer.Option("--call", help="Digest of the held call (default: the one held now)."),
            ] = None,
            all_pending: Annotated[
                bool,
                typer.Option(
                    "--all-pending", help="Every call held for approval now (see `tether pending`)."
                ),
            ] = False,
            tool: Annotated[
                str | None, typer.Option("--tool", help="With --all-pending: only calls of this tool.")
            ] = None,
            reason: _ReasonOpt = "",
            issuer: _AsOpt = DEFAULT_OPERATOR,
            redis: _RedisOpt = None,
            keyring: _KeyringOpt = None,
            ttl: _TtlOpt = 300.0,
        ) -> None:
            bulk = all_pending or trajectory == "-"
            if all_pending and trajectory is not None:
                _fail(f"{action} takes a trajectory id, - (ids from stdin) or --all-pending, not both", 2)
            if not bulk and trajectory is None:
                _fail(f"{action} needs a trajectory id, - (ids from stdin) or --all-pending", 2)
            if tool is not None and not all_pending:
                _fail("--tool selects among --all-pending; it needs --all-pending", 2)
            if bulk and call is not None:
                _fail("--call names one held call; in bulk, give ID DIGEST lines on stdin instead", 2)
            if not bulk:
                assert trajectory is not None

                def go(c: ClientLike) -> Awaitable[Sent]:
                    decide = c.approve if action is ControlAction.APPROVE else c.deny
                    return decide(trajectory, issuer=issuer, call_digest=call, reason=reason)

                self._send(redis, keyring, ttl, issuer, go)
                return
            lines = None if all_pending else _stdin_decisions(sys.stdin.read())

            async def bulk_go(c: ClientLike) -> BulkSent:
                if lines is None:
                    held = await c.held_calls(tool=tool)
                    decisions: list[tuple[str, str | None]] = [(h.trajectory_id, h.digest) for h in held]
                else:
                    decisions = lines
                return await c.decide_many(action, decisions, issuer=issuer, reason=reason)

            result = self._run(redis, keyring, bulk_go, issuer=issuer, ttl=ttl)
            for sent in result.sent:
                m = sent.message
                typer.echo(f"{m.trajectory_id}  {m.payload.get('call_digest')}  message {m.message_id}")
            for tid, why in result.refused:
                typer.echo(f"error: {tid}: {why}", err=True)
            what = f" of {tool}" if tool else ""
            typer.echo(
                f"sent {action} for {len(result.sent)} held call(s){what} as {issuer}"
                + (f"; {len(result.refused)} refused" if result.refused else "")
            )
            if result.refused:
                raise typer.Exit(2)

        command.__name__ = action.value
        return command

    def _pending(self, redis: _RedisOpt = None) -> None:
        held = self._run(redis, None, lambda c: c.pending())
        if not held:
            typer.echo("no held calls awaiting a decision")
            return
        now = time.time()
        for h in held:
            left = f"expires in {h.expires_at - now:.0f}s" if h.expires_at is not None else "no expiry"
            typer.echo(f"{h.trajectory_id}  {h.digest}  {h.tool}({h.arguments})  {left}")

    def _status(
        self,
        trajectory: Annotated[str | None, typer.Argument(help="Only this trajectory.")] = None,
        redis: _RedisOpt = None,
    ) -> None:
        async def one(c: ClientLike) -> list[TrajectoryStatus]:
            if trajectory is None:
                return await c.statuses()
            status = await c.status(trajectory)
            if status is not None:
                return [status]
            if await c.known(trajectory):
                return [TrajectoryStatus(trajectory_id=trajectory)]  # launched, no snapshot yet
            raise UnknownTrajectory(trajectory)

        rows = self._run(redis, None, one)
        if not rows:
            typer.echo("no trajectories")
        for row in rows:
            typer.echo(row.line())

    def _watch(
        self,
        redis: _RedisOpt = None,
        seconds: Annotated[
            float | None,
            typer.Option("--for", min=0.0, help="Stop after this many seconds (default: Ctrl-C)."),
        ] = None,
    ) -> None:
        async def go(c: ClientLike) -> None:
            rows = {s.trajectory_id: _row_from_status(s) for s in await c.statuses()}
            with Live(_table(rows), console=Console(), refresh_per_second=4, transient=False) as live:
                try:
                    async with asyncio.timeout(seconds):
                        async for _, event in c.watch(block_ms=500):
                            rows[event.trajectory_id] = _row_from_event(rows.get(event.trajectory_id), event)
                            live.update(_table(rows))
                except TimeoutError:
                    pass

        with contextlib.suppress(KeyboardInterrupt):
            self._run(redis, None, go)


def _real_client(target: Target, keyring: Path, ttl: float) -> ClientLike:
    return ControlClient.from_url(target.url, keyring=keyring, ttl_s=ttl)


def _row_from_status(s: TrajectoryStatus) -> dict[str, str]:
    return {
        "state": s.state,
        "turns": str(s.turns),
        "rho": f"{s.rho:.2f}",
        "binding": s.binding_dimension,
        "pending": s.pending_work,
        "last": "",
        "at": "",
    }


def _row_from_event(row: dict[str, str] | None, event: LiveEvent) -> dict[str, str]:
    row = dict(row or {"state": "?", "turns": "0", "rho": "0.00", "binding": "", "pending": "-"})
    data = event.data
    for field, key in (("state", "state"), ("turns", "turns"), ("binding", "binding_dimension")):
        if key in data and data[key] is not None:
            row[field] = str(data[key])
    if isinstance(data.get("rho"), int | float):
        row["rho"] = f"{float(data['rho']):.2f}"  # type: ignore[arg-type]
    row["last"] = event.kind
    row["at"] = time.strftime("%H:%M:%S", time.localtime(event.at))
    return row


def _table(rows: dict[str, dict[str, str]]) -> Table:
    table = Table(title="tether trajectories", expand=False)
    for column in ("trajectory", "state", "turns", "rho", "binding", "pending", "last event", "at"):
        table.add_column(column)
    for tid in sorted(rows):
        r = rows[tid]
        table.add_row(
            tid,
            r["state"],
            r["turns"],
            r["rho"],
            r["binding"],
            r.get("pending", ""),
            r.get("last", ""),
            r.get("at", ""),
        )
    return table


def _stdin_decisions(text: str) -> list[tuple[str, str | None]]:
    """``ID`` or ``ID DIGEST`` per line (blank lines and ``#`` comments skipped)."""
    out: list[tuple[str, str | None]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            _fail(f"stdin line {number}: expected ID or ID DIGEST, got {line.strip()!r}", 2)
        out.append((fields[0], fields[1] if len(fields) == 2 else None))
    if not out:
        _fail("no trajectory ids on stdin", 2)
    return out


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


_HELP = {
    ControlAction.PAUSE: "Pause at the next turn boundary (entered only from READY; mid-turn waits).",
    ControlAction.RESUME: "Resume a paused trajectory (immediately; wakes a hibernated one).",
    ControlAction.CANCEL: "Cancel at the next turn boundary (aborts a streaming model call).",
    ControlAction.KILL: "Kill now: abort the model call, kill its processes, mark in-flight calls in doubt.",
    ControlAction.INTERRUPT: "Deliver a user message into the trajectory's next turn.",
    ControlAction.APPROVE: (
        "Approve the held call (bound to its digest; re-checked before dispatch). In bulk: --all-pending "
        "[--tool T], or - to read ids (or ID DIGEST lines) from stdin; each message is signed."
    ),
    ControlAction.DENY: (
        "Deny the held call (the model receives a REFUSED observation). In bulk: --all-pending [--tool T], "
        "or - to read ids (or ID DIGEST lines) from stdin."
    ),
}


def register(app: typer.Typer) -> None:
    """Add the control commands to the ``tether`` CLI."""
    ControlCli().register(app)
