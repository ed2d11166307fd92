"""Scheduler configuration: provider limits, class weights, sandbox pools, leases, feedback tuning.

Pydantic because it crosses a boundary (workload files, the actor's constructor). Everything is
validated once here so the pure algorithms can trust their inputs.
"""

from __future__ import annotations

import math
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

__all__ = [
    "DEFAULT_CLASS_WEIGHTS",
    "FeedbackConfig",
    "LeaseConfig",
    "ProviderLimits",
    "SandboxPoolConfig",
    "SchedulerConfig",
]

# "Scheduling Concurrent Trajectories", figure 7: interactive w=4, standard w=2, batch w=1.
DEFAULT_CLASS_WEIGHTS: dict[str, float] = {"interactive": 4.0, "standard": 2.0, "batch": 1.0}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProviderLimits(_Frozen):
    """What the provider allows one key (base URL + model) per minute, and how far below it we stay.

    The local buckets hold ``limit * (1 - headroom)`` and refill at that many per minute, so the
    runtime decides who waits instead of discovering the limit through 429s.

    What the headroom has to cover is time, not volume: our ledger counts a call when it is admitted, the
    provider when it arrives, so calls whose admission-to-arrival delays differ by ``d`` seconds can put up
    to ``d / window_s`` of the limit into one provider window above what our ledger saw. The default 2 %
    covers 1.2 s of such jitter on a one-minute window at full rate (a 5 % default covered 3 s and cost every
    saturated key 3 % of its limit for it: ``benchmarks/rate_limit``). A key that other clients spend as
    well needs more; the provider's ``remaining`` counts then also clamp the local levels.
    """

    tokens_per_minute: PositiveInt
    requests_per_minute: PositiveInt
    headroom: float = Field(default=0.02, ge=0.0, lt=1.0)
    # The provider's accounting window: 60 s for real providers ("per minute"); the limits above are
    # per window, so a time-compressed testbed (e.g. 5 s windows) is modelled exactly.
    window_s: PositiveFloat = 60.0
    # Providers also enforce their limits over shorter periods ("a 60 RPM limit may act as 1 request per
    # second"); the scheduler keeps each sub-window below the provider's share of it, ceil(limit * sub /
    # window). None: window_s / 60 (one second of a minute); 0: no sub-window. The margin here is time: the
    # share is counted over sub * (1 + sub_window_margin), so admissions a little early or late at the
    # provider still fit its sub-window (5 % of a 1 s sub-window is 50 ms of jitter; a sub-window is short,
    # so it needs a larger fraction than the window's headroom). Requests only, unless ``sub_window_tokens``
    # (for a provider that also meters tokens per sub-window: then a turn's high prompt estimate costs
    # throughput, see the bench).
    sub_window_s: float | None = Field(default=None, ge=0.0)
    sub_window_tokens: bool = False
    sub_window_margin: float = Field(default=0.05, ge=0.0, lt=1.0)
    # Pacing within the sub-window: admissions at once are at most this share of the sub-window's requests
    # (at least one); the rest are spaced evenly over it. Our ledgers date a call when it is granted, the
    # provider when it arrives: a burst granted at once reaches the provider spread out (its callers
    # queue for the CPU, the node's model client sends one call after another), and the calls granted the
    # moment its sub-window frees arrive promptly, into the same second of the provider as the burst's
    # tail. Spaced grants are sent as they come. None: no pacing (bursts of the whole share).
    sub_window_burst: float | None = Field(default=0.05, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _room_for_one_request(self) -> Self:
        if self.request_capacity < 1.0:
            raise ValueError(
                f"requests_per_minute={self.requests_per_minute} with headroom={self.headroom} "
                "leaves no room for a single request"
            )
        return self

    @model_validator(mode="after")
    def _sub_window_shorter(self) -> Self:
        if self.sub_window_s is not None and self.sub_window_s >= self.window_s:
            raise ValueError(
                f"sub_window_s ({self.sub_window_s}) must be shorter than window_s ({self.window_s})"
            )
        return self

    @property
    def sub_window(self) -> float:
        """The sub-window's length in seconds (0: none)."""
        return self.window_s / 60.0 if self.sub_window_s is None else self.sub_window_s

    def sub_share(self, per_window: int) -> int:
        """The provider's limit per sub-window for a per-window limit (at least 1)."""
        return max(1, math.ceil(per_window * self.sub_window / self.window_s))

    def sub_burst(self, share: int) -> int:
        """The most requests admitted at once under a sub-window share (``sub_window_burst``)."""
        if self.sub_window_burst is None:
            return share
        return max(1, math.floor(share * self.sub_window_burst))

    @property
    def token_capacity(self) -> float:
        return self.tokens_per_minute * (1.0 - self.headroom)

    @property
    def request_capacity(self) -> float:
        return self.requests_per_minute * (1.0 - self.headroom)


class FeedbackConfig(_Frozen):
    """How provider feedback moves the local rate (AIMD: multiplicative decrease, additive increase)."""

    decrease_factor: float = Field(default=0.5, gt=0.0, lt=1.0)  # rate *= this on each 429
    floor: float = Field(default=0.05, gt=0.0, le=1.0)  # never below this fraction of the (learned) rate
    recovery_per_s: PositiveFloat = 0.02  # fraction of the configured rate regained per quiet second
    default_retry_after_s: float = Field(default=1.0, ge=0.0)  # a 429 without Retry-After still pauses
    # A burst of in-flight requests rejected together is one signal, not many: decrease at most once per this.
    decrease_cooldown_s: float = Field(default=1.0, ge=0.0)
    # Learn the real limit from the provider's headers and 429s (scheduler.learning). Off: the configured
    # limit is trusted whatever the provider says (the control run of the tests that judge learning).
    learn_limits: bool = True
    # How long a 429's admission-to-report delay widens the key's windows (scheduler.bucket); 0: never.
    delay_memory_s: float = Field(default=600.0, ge=0.0)


class LeaseConfig(_Frozen):
    """Chunk leases (``scheduler.lease``): a process with several turns to admit at once takes a chunk
    of requests and tokens and admits from it locally, with no call to the scheduler per turn.

    Only while the key is uncontended: nobody queued in DRR, no 429 pause or slow-down, and the chunk
    takes at most ``1 - slack`` of what is left in every bucket and window. Otherwise each turn is
    admitted on its own, in DRR order.
    """

    max_requests: PositiveInt = 32  # the largest chunk, in requests
    use_s: PositiveFloat = 0.25  # a chunk's turns must be admitted within this; the rest goes back
    slack: float = Field(default=0.5, ge=0.0, lt=1.0)


class SandboxPoolConfig(_Frozen):
    """A pool of ``size`` sandboxes of which ``reserved`` only the reserved class may take."""

    size: PositiveInt
    reserved: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _reserve_fits(self) -> Self:
        if self.reserved > self.size:
            raise ValueError(f"reserved ({self.reserved}) exceeds pool size ({self.size})")
        return self


class SchedulerConfig(_Frozen):
    """Everything the scheduler core needs to know; nothing else is read from the environment."""

    providers: dict[str, ProviderLimits] = Field(default_factory=dict)
    # For a provider key not listed in ``providers``; None: an unknown key is an input error.
    default_provider: ProviderLimits | None = None
    class_weights: dict[str, PositiveFloat] = Field(default_factory=lambda: dict(DEFAULT_CLASS_WEIGHTS))
    # DRR quantum Q_base in tokens: a class of weight w earns w * Q_base per round. Small on purpose: a
    # class returning to an empty queue joins the back of the round, so a round's length (about
    # sum(w) * Q_base tokens of admissions) is the extra wait a returning interactive turn sees.
    quantum_tokens: PositiveInt = 256
    pools: dict[str, SandboxPoolConfig] = Field(default_factory=dict)
    reserved_class: str = "interactive"  # the class the sandbox reserve is kept for
    # The top class's reserve (the highest weight; off by default). While that class waits on a key or
    # asked for a turn there within the key's window, every other class's turn is admitted only if it
    # leaves this fraction of each of the key's buckets, windows and sub-windows free; a top-class turn
    # that fits may go before a head of the round that waits for room (paid from the top class's credit of
    # the round: the weights hold); and the top class, returning from an empty queue, is visited next
    # instead of at the back of the round. So lower classes keeping a key full do not make an arriving
    # interactive turn wait for room or for a round. It costs up to this fraction of the limit while the
    # top class leaves its reserve unused (docs/providers.md, "Room for interactive turns"). 0: off.
    top_class_reserve: float = Field(default=0.0, ge=0.0, lt=0.5)
    turn_lease_s: PositiveFloat = 600.0  # an unsettled grant older than this is reclaimed
    sandbox_lease_s: PositiveFloat = 1800.0  # an unreleased permit older than this is reclaimed
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
    # None: every turn is admitted by its own call (per-call mode).
    leasing: LeaseConfig | None = Field(default_factory=LeaseConfig)

    @model_validator(mode="after")
    def _classes_consistent(self) -> Self:
        if not self.class_weights:
            raise ValueError("class_weights must name at least one priority class")
        if self.pools and self.reserved_class not in self.class_weights:
            raise ValueError(f"reserved_class {self.reserved_class!r} is not in class_weights")
        return self

    def limits_for(self, provider_key: str) -> ProviderLimits | None:
        """The limits for ``provider_key``, falling back to ``default_provider``."""
        return self.providers.get(provider_key, self.default_provider)
