"""Rate-limit headers as OpenAI, LiteLLM and other gateways send them, read into ``RateLimitInfo``."""

from __future__ import annotations

import email.utils

import pytest

from actors.provider_headers import parse_duration, parse_rate_limit

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("6m0s", 360.0),
        ("1s", 1.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5", 0.5),
        ("17", 17.0),
        (str(NOW + 42), 42.0),  # an epoch timestamp
        (email.utils.formatdate(NOW + 30, usegmt=True), 30.0),  # an HTTP date
        ("2023-11-14T22:13:50Z", 30.0),  # ISO 8601 (NOW is 22:13:20Z)
    ],
)
def test_durations_in_every_form_servers_use(text: str, seconds: float) -> None:
    assert parse_duration(text, NOW) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["soon", "-3", "5 minutes", "nan", "1x"])
def test_what_is_not_a_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text, NOW)


@pytest.mark.parametrize(
    ("headers", "retry_after", "source"),
    [
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5, "retry-after-ms"),  # the precise one wins
        ({"retry-after": "9"}, 9.0, "retry-after"),
        ({"retry-after": email.utils.formatdate(NOW + 12, usegmt=True)}, 12.0, "retry-after"),
        ({"llm_provider-retry-after": "60"}, 60.0, "llm_provider-retry-after"),  # LiteLLM's router 429
        ({"llm_provider-retry-after-ms": "250"}, 0.25, "llm_provider-retry-after-ms"),
        ({"retry-after": "whenever", "llm_provider-retry-after": "7"}, 7.0, "llm_provider-retry-after"),
    ],
)
def test_retry_hints_and_the_header_that_carried_them(
    headers: dict[str, str], retry_after: float, source: str
) -> None:
    info = parse_rate_limit(headers, NOW).info
    assert info is not None
    assert (info.retry_after_s, info.hint_source) == (pytest.approx(retry_after), source)


def test_openai_limit_headers_are_read_in_full() -> None:
    headers = {
        "x-ratelimit-limit-requests": "10000",
        "x-ratelimit-limit-tokens": "2000000",
        "x-ratelimit-remaining-requests": "9999",
        "x-ratelimit-remaining-tokens": "1999950",
        "x-ratelimit-reset-requests": "6ms",
        "x-ratelimit-reset-tokens": "1m30s",
    }
    info = parse_rate_limit(headers, NOW).info
    assert info is not None
    assert (info.limit_requests, info.limit_tokens) == (10_000, 2_000_000)
    assert (info.remaining_requests, info.remaining_tokens) == (9_999, 1_999_950)
    assert (info.reset_requests_s, info.reset_tokens_s) == (pytest.approx(0.006), pytest.approx(90.0))
    assert info.retry_after_s is None and info.hint_source is None


def test_litellm_success_headers_and_forwarded_upstream_ones() -> None:
    # LiteLLM states its router's limit bare, and forwards the upstream provider's under llm_provider-
    headers = {
        "x-ratelimit-limit-requests": "4",
        "x-ratelimit-remaining-requests": "3",
        "llm_provider-x-ratelimit-limit-tokens": "30000",
        "llm_provider-x-ratelimit-remaining-tokens": "29000",
    }
    info = parse_rate_limit(headers, NOW).info
    assert info is not None
    assert (info.limit_requests, info.remaining_requests) == (4, 3)
    assert (info.limit_tokens, info.remaining_tokens) == (30_000, 29_000)


def test_unreadable_values_are_named_and_left_out_never_guessed() -> None:
    parsed = parse_rate_limit(
        {"x-ratelimit-remaining-requests": "lots", "x-ratelimit-limit-requests": "100", "retry-after": "-1"},
        NOW,
    )
    assert parsed.info is not None
    assert (parsed.info.limit_requests, parsed.info.remaining_requests) == (100, None)
    assert parsed.info.retry_after_s is None
    assert set(parsed.unreadable) == {("x-ratelimit-remaining-requests", "lots"), ("retry-after", "-1")}


def test_no_limit_headers_is_no_info() -> None:
    parsed = parse_rate_limit({"content-type": "text/event-stream"}, NOW)
    assert parsed.info is None and parsed.unreadable == ()
