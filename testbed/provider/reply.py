"""Turn a :class:`~testbed.provider.scenarios.Plan` into output tokens, and cut it at ``max_tokens`` (pure).

Every output token is one SSE chunk on the wire, so a client that read N content-bearing chunks saw
exactly N billed output tokens. A tool call's header (id, type, name) is one token; its argument
text is split by the tokenizer like any other text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from testbed.provider.scenarios import FinishReason, Plan
from testbed.provider.tokenizer import split_tokens

__all__ = ["ArgsPiece", "CallStart", "Piece", "RenderedReply", "TextPiece", "call_id_for", "render"]


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgsPiece:
    index: int
    text: str


Piece = TextPiece | CallStart | ArgsPiece


@dataclass(frozen=True, slots=True)
class RenderedReply:
    """The tokens the model emits and the finish reason after any cut."""

    pieces: tuple[Piece, ...]
    finish: FinishReason

    @property
    def completion_tokens(self) -> int:
        return len(self.pieces)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces if isinstance(p, TextPiece))

    def calls(self) -> list[tuple[str, str, str]]:
        """``(call_id, name, arguments)`` per call, arguments as emitted (possibly cut)."""
        out: dict[int, list[str]] = {}
        for piece in self.pieces:
            if isinstance(piece, CallStart):
                out[piece.index] = [piece.call_id, piece.name, ""]
            elif isinstance(piece, ArgsPiece):
                out[piece.index][2] += piece.text
        return [(c[0], c[1], c[2]) for _, c in sorted(out.items())]


def call_id_for(trajectory_id: str | None, turn: int, index: int) -> str:
    """A call id derived from the conversation, so a resent request gets the same ids."""
    seed = f"{trajectory_id or '-'}|{turn}|{index}".encode()
    return "call_" + hashlib.sha256(seed).hexdigest()[:24]


def render(plan: Plan, *, max_tokens: int, trajectory_id: str | None, turn: int) -> RenderedReply:
    """Emit the plan's tokens; stop with ``length`` at ``max_tokens`` or at the plan's forced cut."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    pieces: list[Piece] = [TextPiece(t) for t in split_tokens(plan.text)]
    for index, call in enumerate(plan.calls):
        pieces.append(CallStart(index, call_id_for(trajectory_id, turn, index), call.tool))
        pieces.extend(ArgsPiece(index, t) for t in split_tokens(call.arguments))
    limit = max_tokens if plan.cut_after is None else min(max_tokens, plan.cut_after)
    if len(pieces) > limit:
        return RenderedReply(tuple(pieces[:limit]), FinishReason.LENGTH)
    return RenderedReply(tuple(pieces), plan.finish)
