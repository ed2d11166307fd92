"""A small MCP server over streamable HTTP, built with the official SDK's ``MCPServer``, for the tests that
need a server they can stop (not a test module). Run: ``python -m tests.integration.mcp_http_server PORT``.

Its one tool, ``echo``, is read-only and answers what it was given."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations


def build() -> MCPServer:
    server = MCPServer("tether-test-echo")

    @server.tool(
        name="echo",
        description="Answer the text back.",
        annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True),
    )
    def echo(text: str) -> str:
        return text

    return server


if __name__ == "__main__":
    build().run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
