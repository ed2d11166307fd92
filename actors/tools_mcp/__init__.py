"""MCP servers as tool dependencies, through the official ``mcp`` Python SDK.

- ``config``: a server's stdio command or streamable-HTTP URL (``McpServerConfig``) and a tool's route;
- ``session``: ``McpSession``, one reopenable SDK session with deadlines and cancellation, no retries;
- ``outcomes``: MCP results and errors -> settlement and outcome class (pure);
- ``host``: where sessions live (``InProcessMcpHosts``, or one ``McpHostActor`` per server on Ray);
- ``port``: ``McpToolPort``, the trajectory's ``ToolPort`` by tool name.

Importing this package imports neither the SDK nor Ray; the submodules do.
"""

from __future__ import annotations

from actors.tools_mcp.config import McpRoute, McpServerConfig, resolve_command

__all__ = ["McpRoute", "McpServerConfig", "resolve_command"]
