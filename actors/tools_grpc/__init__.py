"""gRPC tool protocol: the ``ToolService`` proto, a server framework to host tools, and the
``GrpcToolPort`` client adapter the trajectory actor dispatches through.

Regenerate the committed protobuf modules with ``python -m actors.tools_grpc.regen``.
"""

from actors.tools_grpc.client import CHANNEL_OPTIONS, CancelResult, CancelState, GrpcToolPort, ProbeResult
from actors.tools_grpc.codec import (
    ToolCall,
    call_from_request,
    canonical_json,
    parse_json,
    probe_state_from_settlement,
    request_from_invocation,
    settlement_from_probe_state,
)
from actors.tools_grpc.effects import EffectEntry, EffectOutcome, EffectState, EffectTable
from actors.tools_grpc.errors import DeadlinePassed, NoToolRoute, ToolError
from actors.tools_grpc.server import ServerHooks, ToolContext, ToolFn, ToolServer, ToolSpec
from actors.tools_grpc.status_map import (
    RETRY_AFTER_KEY,
    STATUS_RULES,
    StatusRule,
    classify_status,
    retry_after_from_metadata,
)

__all__ = [
    "CHANNEL_OPTIONS",
    "RETRY_AFTER_KEY",
    "STATUS_RULES",
    "CancelResult",
    "CancelState",
    "DeadlinePassed",
    "EffectEntry",
    "EffectOutcome",
    "EffectState",
    "EffectTable",
    "GrpcToolPort",
    "NoToolRoute",
    "ProbeResult",
    "ServerHooks",
    "StatusRule",
    "ToolCall",
    "ToolContext",
    "ToolError",
    "ToolFn",
    "ToolServer",
    "ToolSpec",
    "call_from_request",
    "canonical_json",
    "classify_status",
    "parse_json",
    "probe_state_from_settlement",
    "request_from_invocation",
    "retry_after_from_metadata",
    "settlement_from_probe_state",
]
