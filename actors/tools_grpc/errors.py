"""Errors of the gRPC tool layer, as subclasses of the rooted tree in ``runtime.errors``."""

from __future__ import annotations

import grpc

from runtime.errors import InputError, PolicyRefusal, TetherError

__all__ = ["DeadlinePassed", "NoToolRoute", "ToolError"]


class NoToolRoute(InputError):
    """The client adapter has no service address for the named tool."""

    def __init__(self, tool: str, known: list[str]) -> None:
        super().__init__(f"no gRPC route for tool {tool!r}; routed tools: {sorted(known)}", where="tool")


class DeadlinePassed(PolicyRefusal):
    """The invocation's absolute deadline passed before dispatch: nothing was sent."""

    def __init__(self, tool: str, late_by_s: float) -> None:
        self.tool = tool
        self.late_by_s = late_by_s
        super().__init__(f"deadline for {tool!r} passed {late_by_s:.3f}s before dispatch; not sent")


class ToolError(TetherError):
    """Raised by a hosted tool function to answer with a gRPC status instead of a result.

    The server's contract: a tool that raises ``ToolError`` has applied **no** effect, so the effect
    table records the key as absent. ``retry_after`` (seconds) travels in trailing metadata.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, retry_after: float | None = None) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("ToolError needs a non-OK status code")
        self.code = code
        self.retry_after = retry_after
        super().__init__(f"{code.name}: {message}")
        self.message = message
