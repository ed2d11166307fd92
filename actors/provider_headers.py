"""What an OpenAI-compatible server says about its rate limits, read from its response headers.

Pure: a mapping of headers (and the wall clock, for an HTTP-date ``Retry-After``) in, a
``runtime.ports.RateLimitInfo`` out. The adapter calls it on every response, 429 or not.

Read, in this order of preference:

- the retry hint (the server's minimum wait before the next request): ``retry-after-ms`` (milliseconds),
  ``Retry-After`` (seconds, or an HTTP date), and the same two forwarded by a gateway under its prefix
  (LiteLLM sends the upstream provider's headers as ``llm_provider-<name>``, and on its own router's 429s
  only ``llm_provider-retry-after``). ``hint_source`` is the header name that carried it;
- ``x-ratelimit-limit-{requests,tokens}``, ``x-ratelimit-remaining-{requests,tokens}``,
  ``x-ratelimit-reset-{requests,tokens}`` (bare first, then gateway-prefixed). A reset is a duration in
  OpenAI's format (``6m0s``, ``1s``, ``20ms``, ``1h2m3.5s``), plain seconds, or an epoch timestamp
  (seconds, a value past 10^9), or an HTTP/ISO date; it is turned into seconds from now.

A header whose value cannot be read is left out (the reply it came with is never lost over it) and named in
``unreadable`` so the caller can log what and where.
"""

from __future__ import annotations

import contextlib
import email.utils
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from runtime.ports import RateLimitInfo

__all__ = ["GATEWAY_PREFIXES", "ParsedLimits", "parse_duration", "parse_rate_limit"]

# Prefixes under which gateways forward the upstream provider's headers (LiteLLM: ``llm_provider-``).
GATEWAY_PREFIXES: tuple[str, ...] = ("llm_provider-",)
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_EPOCH_FLOOR = 1e9  # a "reset" this large is a timestamp, not a duration (2001-09-09)


@dataclass(frozen=True, slots=True)
class ParsedLimits:
    """``info`` (None when no limit header was present) and the headers that were present but unreadable."""

    info: RateLimitInfo | None
    unreadable: tuple[tuple[str, str], ...] = field(default=())


def parse_duration(value: str, now_wall: float) -> float:
    """Seconds from now until ``value``: a Go-style duration (``6m0s``, ``20ms``), plain seconds, an epoch
    timestamp, or an HTTP/ISO-8601 date. Raises ``ValueError`` for anything else."""
    text = value.strip()
    with contextlib.suppress(ValueError):
        number = float(text)
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"not a duration: {value!r}")
        return max(0.0, number - now_wall) if number >= _EPOCH_FLOOR else number
    parts = _DURATION_PART.findall(text)
    if parts and "".join(f"{n}{u}" for n, u in parts) == text:
        return sum(float(n) * _UNITS[u] for n, u in parts)
    when = _parse_date(text)
    if when is None:
        raise ValueError(f"not a duration, timestamp or date: {value!r}")
    return max(0.0, when - now_wall)


def _parse_date(text: str) -> float | None:
    with contextlib.suppress(TypeError, ValueError, IndexError):
        return email.utils.parsedate_to_datetime(text).timestamp()
    with contextlib.suppress(ValueError):
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if parsed.tzinfo is not None:
            return parsed.timestamp()
    return None


def _candidates(headers: Mapping[str, str], name: str) -> list[tuple[str, str]]:
    """``(header name as found, value)`` for ``name``: bare first, then under each gateway prefix."""
    found = []
    for candidate in (name, *(prefix + name for prefix in GATEWAY_PREFIXES)):
        value = headers.get(candidate)
        if value is not None:
            found.append((candidate, value))
    return found


def _seconds(raw: str, millis: bool, now_wall: float) -> float:
    value = float(raw) / 1000.0 if millis else parse_duration(raw, now_wall)
    if not math.isfinite(value) or value < 0:
        raise ValueError(raw)
    return value


def _count(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or value < 0:
        raise ValueError(raw)
    return value


def parse_rate_limit(headers: Mapping[str, str], now_wall: float) -> ParsedLimits:
    """Everything the response's headers say about the server's limits (see the module docstring).

    ``headers`` must be case-insensitive (httpx's ``Headers``) or already lower-cased. For each value the
    first readable header wins (bare before gateway-prefixed; for the retry hint, milliseconds first)."""
    unreadable: list[tuple[str, str]] = []

    def first(names: list[tuple[str, str]], read: Callable[[str], float]) -> tuple[str, float] | None:
        for header, raw in names:
            try:
                return header, read(raw)
            except ValueError:
                unreadable.append((header, raw))
        return None

    hint: tuple[str, float] | None = None
    for prefix in ("", *GATEWAY_PREFIXES):
        for name in ("retry-after-ms", "retry-after"):
            raw = headers.get(prefix + name)
            if raw is None or hint is not None:
                continue
            try:
                hint = prefix + name, _seconds(raw, name.endswith("-ms"), now_wall)
            except ValueError:
                unreadable.append((prefix + name, raw))
    values: dict[str, float] = {}
    for field_name, header_name, is_duration in _LIMIT_HEADERS:
        found = first(
            _candidates(headers, header_name),
            (lambda raw: _seconds(raw, False, now_wall)) if is_duration else _count,
        )
        if found is not None:
            values[field_name] = found[1]
    if hint is None and not values:
        return ParsedLimits(None, tuple(unreadable))
    info = RateLimitInfo(
        retry_after_s=hint[1] if hint else None, hint_source=hint[0] if hint else None, **values
    )
    return ParsedLimits(info, tuple(unreadable))


_LIMIT_HEADERS: tuple[tuple[str, str, bool], ...] = (
    ("limit_requests", "x-ratelimit-limit-requests", False),
    ("limit_tokens", "x-ratelimit-limit-tokens", False),
    ("remaining_requests", "x-ratelimit-remaining-requests", False),
    ("remaining_tokens", "x-ratelimit-remaining-tokens", False),
    ("reset_requests_s", "x-ratelimit-reset-requests", True),
    ("reset_tokens_s", "x-ratelimit-reset-tokens", True),
)
