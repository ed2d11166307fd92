"""Conversions between runtime values and the wire messages of ``tether_tools.proto`` (pure).

Arguments travel as *canonical JSON* (sorted keys, no insignificant whitespace, no NaN) so that the
same intent always has the same bytes: effect keys and approval digests are computed over them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.tools_grpc import tether_tools_pb2 as pb
from runtime.errors import CodecError, InputError
from runtime.ports import Settlement, ToolInvocation

__all__ = [
    "ToolCall",
    "call_from_request",
    "canonical_json",
    "parse_json",
    "probe_state_from_settlement",
    "request_from_invocation",
    "settlement_from_probe_state",
]

_SETTLEMENT_TO_STATE = {
    Settlement.ESTABLISHED: pb.ESTABLISHED,
    Settlement.ESTABLISHED_ABSENT: pb.ESTABLISHED_ABSENT,
    Settlement.UNKNOWN: pb.UNKNOWN,
}
_STATE_TO_SETTLEMENT = {state: settlement for settlement, state in _SETTLEMENT_TO_STATE.items()}


def canonical_json(value: Any, *, where: str = "arguments") -> str:
    """``value`` as canonical JSON; ``InputError`` naming ``where`` if it is not plain JSON data."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InputError(f"not JSON-serialisable: {e}", where=where) from e


def parse_json(text: str, *, where: str) -> Any:
    """Decode JSON text from the wire; ``CodecError`` naming ``where`` when it does not parse."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise CodecError(f"malformed JSON payload: {e}", where=where) from e


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def request_from_invocation(invocation: ToolInvocation, *, fence: int = 0) -> pb.InvokeRequest:
    """The wire request for one attempt of ``invocation``."""
    if not math.isfinite(invocation.deadline):
        raise InputError("deadline must be a finite epoch time", where="invocation.deadline")
    return pb.InvokeRequest(
        tool=invocation.tool,
        arguments_json=canonical_json(dict(invocation.arguments), where=f"{invocation.tool}.arguments"),
        effect_key=invocation.effect_key,
        operation_id=invocation.operation_id,
        attempt_id=invocation.attempt_id,
        deadline_epoch_s=invocation.deadline,
        trajectory_id=invocation.trajectory_id,
        call_id=invocation.call_id,
        fence=fence,
    )


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One decoded Invoke as a hosted tool sees it (server side)."""

    tool: str
    arguments: Mapping[str, Any]
    effect_key: str
    operation_id: str
    attempt_id: str
    deadline_epoch_s: float
    trajectory_id: str
    call_id: str
    fence: int


def call_from_request(request: pb.InvokeRequest) -> ToolCall:
    """Validate and decode an ``InvokeRequest``; ``InputError`` names the offending field."""
    if not request.tool:
        raise InputError("tool name is empty", where="InvokeRequest.tool")
    if not request.effect_key:
        raise InputError("effect key is empty", where="InvokeRequest.effect_key")
    arguments = parse_json(request.arguments_json or "{}", where="InvokeRequest.arguments_json")
    if not isinstance(arguments, dict):
        raise InputError("arguments must be a JSON object", where="InvokeRequest.arguments_json")
    return ToolCall(
        tool=request.tool,
        arguments=arguments,
        effect_key=request.effect_key,
        operation_id=request.operation_id,
        attempt_id=request.attempt_id,
        deadline_epoch_s=request.deadline_epoch_s,
        trajectory_id=request.trajectory_id,
        call_id=request.call_id,
        fence=request.fence,
    )


def probe_state_from_settlement(settlement: Settlement) -> pb.ProbeState:
    """The wire ``ProbeState`` for a settlement."""
    return _SETTLEMENT_TO_STATE[settlement]


def settlement_from_probe_state(state: pb.ProbeState) -> Settlement:
    """A wire ``ProbeState`` as a settlement; an unspecified or unknown value settles nothing."""
    return _STATE_TO_SETTLEMENT.get(state, Settlement.UNKNOWN)
