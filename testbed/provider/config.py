"""Configuration of the simulated provider: limits, latency, and fault knobs (pydantic, validated)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from testbed.provider.limits import LimiterMode

__all__ = ["ConfigPatch", "Fault", "ProviderConfig"]


class ProviderConfig(BaseModel):
    """How the simulated provider behaves. A limit of 0 means unlimited; a latency of 0 means none."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rpm: int = Field(0, ge=0, description="requests per minute (per window), 0 = unlimited")
    tpm: int = Field(0, ge=0, description="tokens per minute (per window), 0 = unlimited")
    ttft_ms: float = Field(0.0, ge=0, description="time to first token")
    tokens_per_s: float = Field(0.0, ge=0, description="output speed after the first token, 0 = instant")
    window_s: float = Field(60.0, gt=0, description="length of the rate-limit window (the 'minute')")
    limiter: LimiterMode = Field(
        LimiterMode.SLIDING_WINDOW,
        description="sliding_window (OpenAI-like, default) or token_bucket (Anthropic-like); see limits.py",
    )
    sub_window_s: float | None = Field(
        None,
        ge=0,
        description="sliding_window only: the shorter period the limits are also enforced over, scaled "
        "to its length; None = window_s / 60 (a 60 RPM key acts as 1 request per second), 0 = off",
    )
    sub_window_tokens: bool = Field(
        False, description="sliding_window only: enforce the token limit per sub-window too (off by default)"
    )
    count_rejected: bool = Field(
        True, description="a 429 still costs one request and the prompt's tokens (as OpenAI documents)"
    )
    default_max_tokens: int = Field(1024, ge=1, description="output ceiling when a request sets none")
    models: tuple[str, ...] = Field(("tether-sim",), min_length=1, description="listed by GET /v1/models")
    api_key: str | None = Field(None, description="when set, requests must send 'Authorization: Bearer KEY'")
    cache_max_trajectories: int = Field(100_000, ge=1)

    @model_validator(mode="after")
    def _sub_window_shorter(self) -> ProviderConfig:
        if self.sub_window_s is not None and self.sub_window_s >= self.window_s:
            raise ValueError(f"sub_window_s ({self.sub_window_s}) must be shorter than window_s")
        return self


class Fault(BaseModel):
    """Force every chat request to fail with ``status`` for ``for_s`` seconds and/or ``count`` requests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: Literal[429, 500, 502, 503, 504]
    for_s: float | None = Field(None, gt=0)
    count: int | None = Field(None, ge=1)
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After sent with a forced 429")

    @model_validator(mode="after")
    def _bounded(self) -> Fault:
        if self.for_s is None and self.count is None:
            raise ValueError("a fault needs for_s or count (or both), so it ends by itself")
        return self


class ConfigPatch(BaseModel):
    """Body of ``POST /testbed/config``: every field optional.

    ``fault`` starts a fault (replacing any active one); ``clear_fault`` ends the active one. Changing
    ``limiter``, ``sub_window_s``, ``sub_window_tokens`` or ``count_rejected`` starts a fresh limiter
    (charges so far are forgotten); changing ``rpm``/``tpm`` keeps them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rpm: int | None = Field(None, ge=0)
    tpm: int | None = Field(None, ge=0)
    ttft_ms: float | None = Field(None, ge=0)
    tokens_per_s: float | None = Field(None, ge=0)
    default_max_tokens: int | None = Field(None, ge=1)
    limiter: LimiterMode | None = None
    sub_window_s: float | None = Field(None, ge=0)
    sub_window_tokens: bool | None = None
    count_rejected: bool | None = None
    fault: Fault | None = None
    clear_fault: bool = False

    def apply(self, config: ProviderConfig) -> ProviderConfig:
        """The config with this patch's set fields replaced."""
        changes = self.model_dump(exclude_none=True, exclude={"fault", "clear_fault"})
        return ProviderConfig.model_validate({**config.model_dump(), **changes})

    @property
    def rebuilds_limiter(self) -> bool:
        """True when the patch changes how limits are metered, not only their values."""
        return any(
            v is not None
            for v in (self.limiter, self.sub_window_s, self.sub_window_tokens, self.count_rejected)
        )
