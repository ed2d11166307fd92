"""MCP answers -> classified tool outcomes (pure).

Two questions per answer, as for gRPC (``actors.tools_grpc.status_map``), answered separately: what is known
about the effect (settlement) and how the answer counts for the server's breaker (outcome class).

- A result without ``isError``: established, a success.
- A result with ``isError``: the tool ran and reported failure (the MCP specification's "tool execution
  error", e.g. git's "nothing staged"). The server is healthy and said no, so it is a client rejection for
  the breaker, and by the server's own word the effect did not happen: established absent. (A tool that
  fails half-way and still answers ``isError`` breaks that word; the contract's repeat class is what protects
  against re-running it, never this mapping.)
- A JSON-RPC error the server answers before running anything (unknown tool, invalid params, malformed
  request): established absent, a client rejection.
- Our own read timeout, a closed connection, a server-side internal error: the request may have been
  applied, so the effect is unknown (settlement rule: a timeout settles nothing) and the server is
  unhealthy (an infrastructure failure).
- No connection at all (the server did not start, the URL refused): nothing was sent, so absence is
  established, and it is an infrastructure failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import mcp_types as types

from runtime.ports import OutcomeClass, Settlement, ToolOutcome

__all__ = ["ERROR_RULES", "not_sent", "outcome_of_error", "outcome_of_result", "result_payload"]

_REJECTED = (Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION)
_IN_DOUBT = (Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE)

# JSON-RPC error code -> (settlement, outcome class). Codes not listed are in doubt.
ERROR_RULES: Mapping[int, tuple[Settlement, OutcomeClass]] = MappingProxyType(
    {
        types.PARSE_ERROR: _REJECTED,
        types.INVALID_REQUEST: _REJECTED,
        types.METHOD_NOT_FOUND: _REJECTED,
        types.INVALID_PARAMS: _REJECTED,
        types.INTERNAL_ERROR: _IN_DOUBT,
        types.REQUEST_TIMEOUT: _IN_DOUBT,
        types.CONNECTION_CLOSED: _IN_DOUBT,
    }
)


def result_payload(result: types.CallToolResult) -> dict[str, Any]:
    """The JSON payload Tether keeps of a tool result: the structured content's fields (so a compensation
    can bind a created resource's id from it), ``text`` (the text blocks joined), and the kinds of any
    other content blocks."""
    payload: dict[str, Any] = {}
    structured = result.structured_content
    if isinstance(structured, Mapping):
        payload.update(structured)
    elif structured is not None:
        payload["structured"] = structured
    texts = [block.text for block in result.content if isinstance(block, types.TextContent)]
    if texts:
        payload["text"] = "\n".join(texts)
    others = [block.type for block in result.content if not isinstance(block, types.TextContent)]
    if others:
        payload["other_content"] = others
    return payload


def outcome_of_result(result: types.CallToolResult) -> ToolOutcome:
    """The outcome of a ``tools/call`` that answered with a result."""
    payload = result_payload(result)
    if result.is_error:
        return ToolOutcome(
            Settlement.ESTABLISHED_ABSENT,
            OutcomeClass.CLIENT_REJECTION,
            result=payload,
            error=f"tool error: {payload.get('text') or 'the tool reported an error'}",
        )
    return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, result=payload)


def outcome_of_error(code: int, message: str) -> ToolOutcome:
    """The outcome of a ``tools/call`` that ended with a JSON-RPC error (ours or the server's)."""
    settlement, outcome_class = ERROR_RULES.get(code, _IN_DOUBT)
    return ToolOutcome(settlement, outcome_class, error=f"MCP error {code}: {message}")


def not_sent(reason: str) -> ToolOutcome:
    """No connection: the request never left, and the server is unhealthy."""
    return ToolOutcome(
        Settlement.ESTABLISHED_ABSENT, OutcomeClass.INFRASTRUCTURE_FAILURE, error=f"not sent: {reason}"
    )
