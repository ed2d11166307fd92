"""Where MCP sessions live: a host per server, in this process or as a Ray actor.

A stdio MCP server is a child process of whoever holds its session. If a trajectory actor held it, killing
that actor would kill the server mid-call (and with it, say, a commit it was writing). So in a cluster each
server has one host actor (``mcp:<server>`` in namespace ``tether``, the guard-actor pattern): it holds the
session and carries out the calls of every trajectory; a trajectory actor only asks it. A call keeps running
when its caller dies, and its outcome is then simply not heard (the restarted trajectory finds the operation
in doubt and its repeat contract decides: a never-repeat tool is not sent again).

- ``McpHosts`` is what the tool port needs: list, call, cancel, per server.
- ``InProcessMcpHosts`` keeps ``McpSession`` objects in this process (tests, tools outside Ray).
- ``RayMcpHosts`` talks to the host actors, creating a missing one from the launch's server config
  (``get_if_exists``); ``tether run``'s driver creates them first so that they belong to the run, not to a
  trajectory. Host actors restart after a crash (``max_restarts=-1``) but never re-run a call
  (``max_task_retries=0``): the runtime is the single retry owner.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any, Protocol

import ray
import ray.exceptions

from actors.tools_mcp.config import McpServerConfig
from actors.tools_mcp.outcomes import not_sent, outcome_of_error
from actors.tools_mcp.session import McpSession, ToolListing
from runtime.errors import DependencyError, InputError
from runtime.ports import ToolOutcome

__all__ = ["NAMESPACE", "InProcessMcpHosts", "McpHostActor", "McpHosts", "RayMcpHosts", "host_actor_name"]

NAMESPACE = "tether"
CONNECTION_CLOSED = -32000


def host_actor_name(server: str) -> str:
    """The Ray actor name of an MCP server's host."""
    if not server or server.strip() != server:
        raise ValueError(f"an MCP server name must be non-empty without surrounding spaces, got {server!r}")
    return f"mcp:{server}"


class McpHosts(Protocol):
    """The MCP servers as the tool port reaches them."""

    async def list_tools(self, server: str, timeout_s: float | None = None) -> list[ToolListing]: ...

    async def call(
        self, server: str, remote: str, arguments: Mapping[str, Any], deadline: float, key: str
    ) -> ToolOutcome: ...

    async def cancel(self, server: str, key: str) -> bool: ...

    async def close(self) -> None: ...


def _unknown_server(server: str, known: Mapping[str, Any]) -> InputError:
    return InputError(f"no MCP server {server!r}; configured: {', '.join(sorted(known))}", where="mcp")


class InProcessMcpHosts:
    """Sessions held in this process (a stdio server is this process's child)."""

    def __init__(self, servers: Mapping[str, McpServerConfig]) -> None:
        self._configs = dict(servers)
        self._sessions: dict[str, McpSession] = {}

    def session(self, server: str) -> McpSession:
        found = self._sessions.get(server)
        if found is None:
            if server not in self._configs:
                raise _unknown_server(server, self._configs)
            found = self._sessions[server] = McpSession(server, self._configs[server])
        return found

    async def list_tools(self, server: str, timeout_s: float | None = None) -> list[ToolListing]:
        return await self.session(server).list_tools(timeout_s)

    async def call(
        self, server: str, remote: str, arguments: Mapping[str, Any], deadline: float, key: str
    ) -> ToolOutcome:
        return await self.session(server).call(remote, arguments, deadline, key)

    async def cancel(self, server: str, key: str) -> bool:
        return await self.session(server).cancel(key)

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class McpHostActor:
    """Holds the session with one MCP server and carries out every trajectory's calls to it."""

    def __init__(self, server: str, config_json: str) -> None:
        self._session = McpSession(server, McpServerConfig.model_validate_json(config_json))

    async def list_tools(self, timeout_s: float | None = None) -> list[ToolListing]:
        return await self._session.list_tools(timeout_s)

    async def call(self, remote: str, arguments: dict[str, Any], deadline: float, key: str) -> ToolOutcome:
        return await self._session.call(remote, arguments, deadline, key)

    async def cancel(self, key: str) -> bool:
        return await self._session.cancel(key)

    async def pid(self) -> int:
        return os.getpid()

    async def in_flight(self) -> int:
        """How many calls are being carried out now (a caller that died does not end its call)."""
        return self._session.in_flight()

    async def shutdown(self) -> None:
        """Close the session (a stdio server is stopped); the actor stays and reopens on the next call."""
        await self._session.close()


class RayMcpHosts:
    """``McpHosts`` over the host actors (one per server, found or created by name)."""

    def __init__(self, servers: Mapping[str, McpServerConfig]) -> None:
        self._configs = dict(servers)
        self._actors: dict[str, Any] = {}

    def actor(self, server: str) -> Any:
        """The server's host actor (created if nobody has yet; the first creator's config wins)."""
        handle = self._actors.get(server)
        if handle is None:
            if server not in self._configs:
                raise _unknown_server(server, self._configs)
            actor_class: Any = McpHostActor
            handle = actor_class.options(
                name=host_actor_name(server), namespace=NAMESPACE, get_if_exists=True
            ).remote(server, self._configs[server].model_dump_json())
            self._actors[server] = handle
        return handle

    async def list_tools(self, server: str, timeout_s: float | None = None) -> list[ToolListing]:
        try:
            listed: list[ToolListing] = await self.actor(server).list_tools.remote(timeout_s)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else e
            raise DependencyError(f"listing the tools of MCP server {server!r}: {cause}", scope=server) from e
        except ray.exceptions.RayActorError as e:
            raise DependencyError(f"the host of MCP server {server!r} died: {e}", scope=server) from e
        return listed

    async def call(
        self, server: str, remote: str, arguments: Mapping[str, Any], deadline: float, key: str
    ) -> ToolOutcome:
        try:
            ref = self.actor(server).call.remote(remote, dict(arguments), deadline, key)
            outcome: ToolOutcome = await ref
        except ray.exceptions.ActorUnavailableError as e:
            return not_sent(f"the host of MCP server {server!r} is unavailable: {e}")
        except ray.exceptions.RayActorError as e:
            # the host died with the call in it: the server may have applied it
            return outcome_of_error(CONNECTION_CLOSED, f"the host of MCP server {server!r} died: {e}")
        return outcome

    async def cancel(self, server: str, key: str) -> bool:
        try:
            cancelled: bool = await asyncio.wait_for(self.actor(server).cancel.remote(key), 10.0)
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise DependencyError(f"cancel on MCP server {server!r} failed: {e}", scope=server) from e
        return cancelled

    async def close(self) -> None:
        """Nothing to close: the host actors belong to the run, not to this caller."""
