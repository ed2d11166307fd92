"""``McpToolPort``: the trajectory's ``runtime.ports.ToolPort`` over MCP servers, by tool name.

Each Tether tool name routes to one server and the tool name that server lists (``McpRoute``); the calls go
to the server's host (``actors.tools_mcp.host``). An invocation's effect key names the call, so a cancel
reaches the call that is in flight for it. MCP has no result-recovery protocol, so a probe settles nothing
(a workload cannot declare ``probe`` for an MCP tool).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from actors.tools_mcp.config import McpRoute
from runtime.clock import Clock, SystemClock
from runtime.errors import InputError, PolicyRefusal
from runtime.ports import ProbeResult, Settlement, ToolInvocation, ToolOutcome

if TYPE_CHECKING:  # the hosts import the SDK and Ray; the port itself needs neither
    from actors.tools_mcp.host import McpHosts

__all__ = ["McpDeadlinePassed", "McpToolPort", "NoMcpRoute"]


class NoMcpRoute(InputError):
    """The port has no MCP server for the named tool."""

    def __init__(self, tool: str, known: Mapping[str, McpRoute]) -> None:
        super().__init__(f"no MCP route for tool {tool!r}; routed: {', '.join(sorted(known))}", where="tool")


class McpDeadlinePassed(PolicyRefusal):
    """The invocation's deadline passed before it was sent: nothing left this process."""

    def __init__(self, tool: str, late_by_s: float) -> None:
        self.tool = tool
        super().__init__(f"deadline for {tool!r} passed {late_by_s:.3f}s before dispatch; not sent")


class McpToolPort:
    """``ToolPort`` over MCP hosts. ``routes`` maps Tether tool name -> (server, remote tool name)."""

    def __init__(self, routes: Mapping[str, McpRoute], hosts: McpHosts, clock: Clock | None = None) -> None:
        self._routes = dict(routes)
        self._hosts = hosts
        self._clock: Clock = clock or SystemClock()

    def route(self, tool: str) -> McpRoute:
        found = self._routes.get(tool)
        if found is None:
            raise NoMcpRoute(tool, self._routes)
        return found

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        """One attempt; never retried here."""
        route = self.route(invocation.tool)
        late_by = self._clock.wall() - invocation.deadline
        if late_by >= 0:
            raise McpDeadlinePassed(invocation.tool, late_by)
        return await self._hosts.call(
            route.server, route.remote, invocation.arguments, invocation.deadline, invocation.effect_key
        )

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        self.route(tool)
        return ProbeResult(Settlement.UNKNOWN, detail="MCP has no result recovery: nothing can be probed")

    async def cancel(self, tool: str, effect_key: str) -> None:
        route = self.route(tool)
        await self._hosts.cancel(route.server, effect_key)

    async def close(self) -> None:
        await self._hosts.close()
