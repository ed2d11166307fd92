"""The OpenAI chat-completions wire format: the request model and the response/chunk builders."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runtime.errors import InputError
from testbed.provider.reply import ArgsPiece, CallStart, Piece, RenderedReply, TextPiece

__all__ = [
    "ChatRequest",
    "StreamOptions",
    "chunk",
    "completion_body",
    "error_body",
    "parse_chat_request",
    "sse",
    "usage_body",
]

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The fields of ``POST /v1/chat/completions`` the simulator uses; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = None
    n: Literal[1] = 1

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(messages):
            if message.get("role") not in _ROLES:
                raise ValueError(
                    f"messages[{i}].role must be one of {sorted(_ROLES)}, got {message.get('role')!r}"
                )
        return messages


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body; raise ``InputError`` naming the first bad field."""
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InputError(first["msg"], where=where) from e


def error_body(
    message: str, *, kind: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage_body(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    }


def completion_body(
    *, completion_id: str, created: int, model: str, reply: RenderedReply, usage: Mapping[str, Any]
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object."""
    calls = [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        for call_id, name, arguments in reply.calls()
    ]
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None, "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish.value, "logprobs": None}],
        "usage": dict(usage),
    }


def chunk(
    *,
    completion_id: str,
    created: int,
    model: str,
    piece: Piece | None,
    first: bool,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``: one token (``piece``), or the finishing delta when ``piece`` is None."""
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if isinstance(piece, TextPiece):
        delta["content"] = piece.text
    elif isinstance(piece, CallStart):
        if first:
            delta["content"] = None
        delta["tool_calls"] = [
            {
                "index": piece.index,
                "id": piece.call_id,
                "type": "function",
                "function": {"name": piece.name, "arguments": ""},
            }
        ]
    elif isinstance(piece, ArgsPiece):
        delta["tool_calls"] = [{"index": piece.index, "function": {"arguments": piece.text}}]
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event carrying ``data`` (JSON-encoded unless already a string)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
