"""The simulated provider's tokenizer: deterministic, dependency-free, and documented.

Rule: **a token is at most four consecutive non-whitespace characters together with the whitespace
that precedes them.** ``"hello world"`` is ``["hell", "o", " worl", "d"]`` (4 tokens). Whitespace at
the very end of a text is glued to the last token, so ``"".join(split_tokens(t)) == t`` always holds
and a streamed reply re-assembles to exactly the planned text.

A prompt is rendered to a token sequence by :func:`prompt_blocks`: one block for the tool
specifications (their canonical JSON), then one block per message made of a framing token for the
role, the content's tokens, and for each tool call its name and its argument text. The prefix cache
matches whole blocks, so "cached" means "every token of the earlier messages, unchanged".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["REPLY_PRIMING_TOKENS", "content_text", "count_tokens", "prompt_blocks", "split_tokens"]

_TOKEN = re.compile(r"\s*\S{1,4}")
# Every prompt ends with a few tokens that prime the assistant's reply (as real chat templates do);
# they are never part of the cached prefix.
REPLY_PRIMING_TOKENS = 3


def split_tokens(text: str) -> list[str]:
    """Split ``text`` into tokens whose concatenation is ``text``."""
    pieces = _TOKEN.findall(text)
    consumed = sum(len(p) for p in pieces)
    if consumed < len(text):  # trailing whitespace (or a text that is only whitespace)
        tail = text[consumed:]
        if pieces:
            pieces[-1] += tail
        else:
            pieces.append(tail)
    return pieces


def count_tokens(text: str) -> int:
    """How many tokens :func:`split_tokens` yields, without building the list."""
    n = sum(1 for _ in _TOKEN.finditer(text))
    return n if n or not text else 1


def content_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string, a list of parts, or ``None``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = [str(p.get("text", "")) for p in content if isinstance(p, Mapping)]
        return "\n".join(texts)
    return str(content)


def prompt_blocks(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The prompt as blocks of text whose token counts add up to the prompt (minus the priming).

    Each block starts with a framing marker (``<|tools|>``, ``<|user|>``, ...) so two blocks with equal
    text but different roles never match in the prefix cache; the marker's tokens count like any other.
    """
    blocks: list[str] = []
    if tools:
        blocks.append("<|tools|> " + json.dumps(list(tools), sort_keys=True))
    for message in messages:
        role = str(message.get("role", "user"))
        parts = [f"<|{role}|>", content_text(message.get("content"))]
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            parts.append(f"{function.get('name', '')} {function.get('arguments', '')}")
        if role == "tool":
            parts.append(str(message.get("tool_call_id", "")))
        blocks.append(" ".join(p for p in parts if p))
    return blocks
