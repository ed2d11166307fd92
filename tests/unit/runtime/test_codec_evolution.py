"""Additive schema evolution within one version: a field added with a default may be absent in old entries."""

from __future__ import annotations

import msgpack
import pytest

from runtime.codec import decode, encode
from runtime.errors import CodecError
from runtime.events import ModelCallIntent


def _without(payload: bytes, field: str) -> bytes:
    raw = msgpack.unpackb(payload, raw=False)
    del raw["data"][field]
    return msgpack.packb(raw, use_bin_type=True)


def test_entry_written_before_a_defaulted_field_existed_still_decodes() -> None:
    # Given an intent encoded before prompt_tokens existed
    old = _without(encode(ModelCallIntent("g1", "m", 64, 1e9, prompt_tokens=40)), "prompt_tokens")
    # When it is decoded / Then the field takes its default
    assert decode(old) == ModelCallIntent("g1", "m", 64, 1e9)


def test_a_required_field_is_still_required() -> None:
    broken = _without(encode(ModelCallIntent("g1", "m", 64, 1e9)), "max_tokens")
    with pytest.raises(CodecError, match="max_tokens"):
        decode(broken)
