"""A small MCP server over streamable HTTP, built with the official SDK's ``MCPServer``, for the tests that
need a server they can stop (not a test module). Run: ``python -m tests.integration.mcp_http_server``.

It binds a free port itself and prints ``listening PORT`` once it accepts connections, so the parent never
hands it a port that another process could take first. Its one tool, ``echo``, is read-only and answers
what it was given."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
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


async def serve() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = build().streamable_http_app(host="127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    print(f"listening {sock.getsockname()[1]}", flush=True)
    await serving


if __name__ == "__main__":
    asyncio.run(serve())
