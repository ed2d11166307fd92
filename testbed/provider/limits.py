"""Rate-limit rules of the simulated provider: the shared vocabulary and the factory (pure; clock injected).

Two limiter modes, one per documented real-provider behaviour:

- ``sliding_window`` (default, mimics OpenAI): per-minute RPM and TPM over an exact sliding window, and
  the request limit scaled down to a *sub-window* (by default 1/60 of the window: a 60 RPM key acts as
  1 request per second). OpenAI's 429 guidance says limits "can be applied over shorter periods" and gives
  exactly that example. The token limit can be enforced per sub-window too (``sub_window_tokens``, off by
  default). See :mod:`.sliding_window`.
- ``token_bucket`` (mimics Anthropic): a bucket per dimension holding one minute's limit, refilled
  continuously at ``limit / window`` per second, full at start. See :mod:`.token_bucket`.

Rules common to both modes:

- **Charge.** Admission charges ``prompt_tokens + max_tokens`` (the most the request can use); when it ends
  (or its client goes away) the charge is corrected to ``prompt + completion`` actually produced. A
  correction never raises a charge (output stops at ``max_tokens``).
- **Rejected requests count.** With ``count_rejected`` (default on) a 429 still costs one request and the
  request's prompt tokens (it was received and read; nothing was generated), as OpenAI documents
  ("unsuccessful requests contribute to your per-minute limit, so continuously resending a request won't
  work"). A client that hammers a saturated key keeps it saturated.
- **Too large.** A request whose charge alone exceeds the TPM limit is reported ``too_large`` (the server
  answers 400; a 429 would invite retries forever). It costs nothing.
- **Truthful headers.** ``limit_*`` is the per-window limit; ``remaining_*`` what is left of it now (the
  sliding window's count, or the bucket's level), as real providers report it, so a client or scheduler
  learning limits from headers reads what it would read from them; ``reset_*`` is the time until that
  dimension is back at its initial state (nothing in the window / bucket full), OpenAI's meaning of
  ``x-ratelimit-reset-*``. The sliding window's sub-window does not show in ``remaining`` (OpenAI warns that
  bursts may be refused although the minute has room). A 429's ``retry_after_s`` is the exact time after
  which *the same* request would be admitted if nothing else arrived, sub-window and its own rejected
  charge included; the server rounds it up into ``Retry-After`` and ``retry-after-ms``. Corrections only
  lower charges, so every value stays on the safe side while requests in flight finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

__all__ = [
    "Admitted",
    "LimitDimension",
    "LimitSnapshot",
    "LimiterMode",
    "RateLimiter",
    "Rejected",
]


class LimiterMode(StrEnum):
    """How the provider meters its per-minute limits."""

    SLIDING_WINDOW = "sliding_window"  # OpenAI-like: minute window plus a sub-minute window
    TOKEN_BUCKET = "token_bucket"  # Anthropic-like: continuously refilling bucket


class LimitDimension(StrEnum):
    """Which limit refused a request."""

    REQUESTS = "requests"
    TOKENS = "tokens"


@dataclass(frozen=True, slots=True)
class LimitSnapshot:
    """The limit state as the ``x-ratelimit-*`` headers report it. ``None`` means unlimited."""

    limit_requests: int | None
    limit_tokens: int | None
    remaining_requests: int | None
    remaining_tokens: int | None
    reset_requests_s: float
    reset_tokens_s: float

    def headers(self) -> dict[str, str]:
        """OpenAI-style headers; reset times are seconds with an ``s`` suffix (e.g. ``"1.250s"``)."""
        out: dict[str, str] = {}
        if self.limit_requests is not None and self.remaining_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            out["x-ratelimit-reset-requests"] = f"{self.reset_requests_s:.3f}s"
        if self.limit_tokens is not None and self.remaining_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            out["x-ratelimit-reset-tokens"] = f"{self.reset_tokens_s:.3f}s"
        return out


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request fits; ``ticket`` identifies its charge for ``settle``."""

    ticket: int
    snapshot: LimitSnapshot


@dataclass(frozen=True, slots=True)
class Rejected:
    """The request does not fit now. ``retry_after_s`` is when it would fit if nothing else arrives."""

    dimension: LimitDimension
    retry_after_s: float
    snapshot: LimitSnapshot
    too_large: bool = False


class RateLimiter(Protocol):
    """What the server needs from a limiter, whichever mode."""

    rpm: int | None
    tpm: int | None

    def set_limits(self, *, rpm: int | None, tpm: int | None) -> None: ...

    def try_admit(self, tokens: int, *, rejected_tokens: int = 0) -> Admitted | Rejected:
        """Admit a request charging ``tokens``; if refused, charge ``rejected_tokens`` (when counted)."""
        ...

    def settle(self, ticket: int, actual_tokens: int) -> None: ...

    def snapshot(self) -> LimitSnapshot: ...

    def reset(self) -> None: ...


def check_limits(rpm: int | None, tpm: int | None) -> None:
    """Raise ``ValueError`` for a limit below 1 (``None`` is unlimited)."""
    for name, value in (("rpm", rpm), ("tpm", tpm)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 or None (unlimited), got {value}")


def check_charge(tokens: int, what: str = "a token charge") -> None:
    if tokens < 0:
        raise ValueError(f"{what} cannot be negative, got {tokens}")
