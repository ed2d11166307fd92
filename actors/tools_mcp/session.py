"""``McpSession``: one live connection to one MCP server through the official SDK (``mcp.Client``), held
open across calls and reopened after it breaks.

- The SDK's ``Client`` is an async context manager whose task group must be entered and left by the same
  task, so one owner task holds it open while calls from any task use it.
- Every call carries its deadline: connecting (or starting the server) and the handshake count against it,
  and the rest is the SDK's read timeout, after which the SDK sends the server ``notifications/cancelled``.
  Cancelling a call's task (``cancel``) does the same (the SDK's courtesy cancel on an abandoned request).
- Nothing here retries: a failed call is answered with its classified outcome (``outcomes``) and the single
  retry owner decides. A broken connection is reopened on the next call, never by re-sending this one.
- A stdio server is a child process of whoever holds the session; in a Ray cluster that is the server's
  host actor (``actors.tools_mcp.host``), never a trajectory actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import mcp_types as types
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from actors.tools_mcp.config import McpServerConfig, resolve_command
from actors.tools_mcp.outcomes import not_sent, outcome_of_error, outcome_of_result
from runtime.clock import Clock, SystemClock
from runtime.errors import DependencyError
from runtime.ports import ToolOutcome

__all__ = ["McpSession", "ToolListing"]

_log = logging.getLogger(__name__)
_CANCEL_GRACE_S = 5.0  # past the deadline, how long the SDK's own timeout may take before we cut it off


@dataclass(frozen=True, slots=True)
class ToolListing:
    """One tool as its server listed it (plain values: it crosses Ray as a return value)."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    read_only: bool | None
    destructive: bool | None
    idempotent: bool | None

    @classmethod
    def of(cls, tool: types.Tool) -> ToolListing:
        notes = tool.annotations
        return cls(
            name=tool.name,
            description=tool.description,
            input_schema=dict(tool.input_schema),
            read_only=notes.read_only_hint if notes else None,
            destructive=notes.destructive_hint if notes else None,
            idempotent=notes.idempotent_hint if notes else None,
        )


class McpSession:
    """A reopenable session with the MCP server ``name`` described by ``config``."""

    def __init__(
        self,
        name: str,
        config: McpServerConfig,
        *,
        clock: Clock | None = None,
        errlog: TextIO | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self._clock: Clock = clock or SystemClock()
        self._errlog = errlog
        self._client: Client | None = None
        self._owner: asyncio.Task[None] | None = None
        self._close: asyncio.Event | None = None
        self._opening: asyncio.Lock | None = None
        self._calls: dict[str, asyncio.Task[ToolOutcome]] = {}  # call key -> the task carrying it out
        self._abandoned: dict[str, asyncio.Event] = {}  # call key -> set when ``cancel`` gave it up

    # ------------------------------------------------------------------ connection

    def _transport(self) -> Any:
        cfg = self.config
        if cfg.url is not None:
            http = create_mcp_http_client(headers=dict(cfg.headers) or None)
            return streamable_http_client(cfg.url, http_client=http)
        env = dict(cfg.env)
        # Tether's own environment first on PATH (unless the workload set PATH): a server installed beside
        # Tether is found by a wrapper script too, also when that environment was never activated.
        env.setdefault("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
        params = StdioServerParameters(
            command=resolve_command(cfg.command[0]), args=list(cfg.command[1:]), env=env, cwd=cfg.cwd
        )
        return stdio_client(params, errlog=self._errlog or sys.stderr)

    async def _own(self, ready: asyncio.Future[Client], close: asyncio.Event) -> None:
        """Hold the client open until ``close`` is set or the connection fails (runs as one task)."""
        try:
            async with Client(self._transport(), cache=None) as client:
                ready.set_result(client)
                await close.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else DependencyError(str(e)))
            if not isinstance(e, Exception | asyncio.CancelledError):
                raise
        finally:
            self._client = None

    async def open(self, timeout_s: float | None = None) -> Client:
        """The live client, connecting (and starting a stdio server) first when there is none.

        Raises ``DependencyError`` when the server cannot be reached within ``timeout_s`` (default: the
        server's ``connect_timeout_s``)."""
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._client is not None and self._owner is not None and not self._owner.done():
                return self._client
            limit = self.config.connect_timeout_s if timeout_s is None else min(timeout_s, 3600.0)
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[Client] = loop.create_future()
            self._close = asyncio.Event()
            self._owner = loop.create_task(self._own(ready, self._close), name=f"mcp-session:{self.name}")
            try:
                client = await asyncio.wait_for(asyncio.shield(ready), max(limit, 0.001))
            except TimeoutError:
                await self._stop_owner()
                raise DependencyError(
                    f"MCP server {self.name!r} ({self.config.describe()}) did not connect "
                    f"within {limit:.1f}s",
                    scope=self.name,
                ) from None
            except Exception as e:
                await self._stop_owner()
                raise DependencyError(
                    f"MCP server {self.name!r} ({self.config.describe()}) could not be reached: {e}",
                    scope=self.name,
                ) from e
            self._client = client
            return client

    async def _stop_owner(self) -> None:
        owner, self._owner = self._owner, None
        self._client = None
        if self._close is not None:
            self._close.set()
        if owner is not None and not owner.done():
            try:
                await asyncio.wait_for(asyncio.shield(owner), 10.0)
            except (TimeoutError, Exception):
                owner.cancel()
                with contextlib.suppress(BaseException):
                    await owner

    async def close(self) -> None:
        """Cancel what is in flight and close the connection (a stdio server is stopped)."""
        for task in list(self._calls.values()):
            task.cancel()
        await self._stop_owner()

    # ------------------------------------------------------------------ tools

    async def list_tools(self, timeout_s: float | None = None) -> list[ToolListing]:
        """Every tool the server lists (all pages)."""
        limit = self.config.connect_timeout_s if timeout_s is None else timeout_s
        client = await self.open(limit)
        listed: list[ToolListing] = []
        cursor: str | None = None
        for _ in range(1000):  # a server whose pages never end cannot hang the start
            try:
                page = await asyncio.wait_for(
                    client.session.list_tools(params=types.PaginatedRequestParams(cursor=cursor)), limit
                )
            except (MCPError, TimeoutError) as e:
                await self._stop_owner()
                raise DependencyError(
                    f"listing the tools of MCP server {self.name!r}: {e}", scope=self.name
                ) from e
            listed.extend(ToolListing.of(tool) for tool in page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        return listed

    async def call(
        self, remote: str, arguments: Mapping[str, Any], deadline: float, key: str = ""
    ) -> ToolOutcome:
        """One ``tools/call`` of ``remote`` with ``arguments``, settled by ``deadline`` (epoch seconds).

        ``key`` names the call for ``cancel`` (the effect key); a second call with the key of one still in
        flight waits for that one's outcome instead of sending again. The call goes on when this caller is
        cancelled (its outcome is then not heard); only ``cancel`` abandons it."""
        running = self._calls.get(key) if key else None
        if running is None or running.done():
            running = asyncio.get_running_loop().create_task(self._call(remote, dict(arguments), deadline))
            if key:
                self._calls[key] = running
                running.add_done_callback(lambda t: self._forget(key, t))
        abandoned = self._abandoned.setdefault(key, asyncio.Event()) if key else asyncio.Event()
        gave_up = asyncio.ensure_future(abandoned.wait())
        try:
            await asyncio.wait({running, gave_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gave_up.cancel()
        if running.done() and not running.cancelled():
            return running.result()
        # abandoned through ``cancel``: the server was told, and may have applied it all the same
        return outcome_of_error(types.REQUEST_TIMEOUT, f"{remote!r} was cancelled in flight")

    def _forget(self, key: str, task: asyncio.Task[ToolOutcome]) -> None:
        if self._calls.get(key) is task:
            del self._calls[key]
            self._abandoned.pop(key, None)

    def in_flight(self) -> int:
        """Calls with a key that are still being carried out."""
        return sum(1 for task in self._calls.values() if not task.done())

    async def cancel(self, key: str) -> bool:
        """Abandon the call named ``key``: its callers are answered at once (outcome unknown) and the SDK
        tells the server ``notifications/cancelled``. False when no such call is in flight."""
        task = self._calls.get(key)
        if task is None or task.done():
            return False
        self._abandoned.setdefault(key, asyncio.Event()).set()
        task.cancel()
        await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)  # the courtesy cancel goes out meanwhile
        return True

    async def _call(self, remote: str, arguments: dict[str, Any], deadline: float) -> ToolOutcome:
        remaining = deadline - self._clock.wall()
        if remaining <= 0:
            return not_sent(f"the deadline passed before {remote!r} was sent")
        try:
            client = await self.open(min(remaining, self.config.connect_timeout_s))
        except DependencyError as e:
            return not_sent(str(e))
        remaining = deadline - self._clock.wall()
        if remaining <= 0:
            return not_sent(f"connecting to {self.name!r} used the whole deadline of {remote!r}")
        try:
            result = await asyncio.wait_for(
                client.call_tool(remote, arguments, read_timeout_seconds=remaining),
                remaining + _CANCEL_GRACE_S,
            )
        except MCPError as e:
            if e.code == types.CONNECTION_CLOSED:
                await self._stop_owner()  # reopened by the next call, never by re-sending this one
            return outcome_of_error(e.code, e.message)
        except TimeoutError:
            return outcome_of_error(types.REQUEST_TIMEOUT, f"{remote!r} did not answer by its deadline")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a transport failure after send: the request may have been applied
            _log.warning("MCP server %s: %s failed: %r", self.name, remote, e)
            await self._stop_owner()
            return outcome_of_error(types.CONNECTION_CLOSED, f"{type(e).__name__}: {e}")
        return outcome_of_result(result)
