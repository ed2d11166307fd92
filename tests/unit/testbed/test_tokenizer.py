"""The testbed tokenizer: deterministic, lossless, and the rule the docs state."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.provider.tokenizer import content_text, count_tokens, prompt_blocks, split_tokens


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", []),
        ("hi", ["hi"]),
        ("hello world", ["hell", "o", " worl", "d"]),
        ("a  b ", ["a", "  b "]),
        ("   ", ["   "]),
        ('{"step": 1}', ['{"st', 'ep":', " 1}"]),
    ],
)
def test_split_follows_the_four_character_rule(text: str, tokens: list[str]) -> None:
    # Given a text / When it is split / Then the tokens are as the rule says and the count agrees
    assert split_tokens(text) == tokens
    assert count_tokens(text) == len(tokens)


@given(st.text())
def test_split_is_lossless_and_counts_agree(text: str) -> None:
    pieces = split_tokens(text)
    assert "".join(pieces) == text
    assert count_tokens(text) == len(pieces)
    assert all(p for p in pieces)


def test_content_text_accepts_strings_parts_and_none() -> None:
    assert content_text(None) == ""
    assert content_text("abc") == "abc"
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"


def test_prompt_blocks_frame_roles_and_include_tools_and_calls() -> None:
    # Given a conversation with a tool spec, an assistant tool call and its result
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    # When rendered
    blocks = prompt_blocks(messages, tools)
    # Then there is one block for tools and one per message, each framed by its role
    assert len(blocks) == 4
    assert blocks[0].startswith("<|tools|>")
    assert blocks[1] == "<|user|> go"
    assert blocks[2] == "<|assistant|> f {}"
    assert blocks[3] == "<|tool|> ok c1"
