"""Metrics hooks: a small extension point with a no-op default (Prometheus is wired in later).

The scheduler calls these synchronously from its decision loop, so an implementation must be cheap
and must not raise.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["NoopMetrics", "SchedulerMetrics"]


@runtime_checkable
class SchedulerMetrics(Protocol):
    """What the scheduler reports about itself."""

    def bucket_level(self, provider_key: str, resource: str, level: float, capacity: float) -> None:
        """A bucket's level after a decision; ``resource`` is ``"tokens"`` or ``"requests"``."""
        ...

    def admission_wait(self, priority_class: str, seconds: float) -> None:
        """How long an admitted turn waited in the scheduler, by priority class."""
        ...

    def rate_limited(self, provider_key: str) -> None:
        """The provider answered 429 on this key."""
        ...

    def delay_margin(self, provider_key: str, seconds: float) -> None:
        """How much longer than the provider's window the key's ledgers count now (calls arriving late)."""
        ...

    def refused(self, kind: str, priority_class: str, predicate: str) -> None:
        """A request (``kind`` ``"turn"`` or ``"sandbox"``) was refused; ``predicate`` says why."""
        ...


class NoopMetrics:
    """The default: records nothing."""

    def bucket_level(self, provider_key: str, resource: str, level: float, capacity: float) -> None:
        pass

    def admission_wait(self, priority_class: str, seconds: float) -> None:
        pass

    def rate_limited(self, provider_key: str) -> None:
        pass

    def delay_margin(self, provider_key: str, seconds: float) -> None:
        pass

    def refused(self, kind: str, priority_class: str, predicate: str) -> None:
        pass
