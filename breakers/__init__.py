"""Dependency protection: scoped breaker, bulkhead, the single retry owner, and the guard per scope.

The pure parts (``Breaker``, ``Bulkhead``, ``ScopeGuard``, ``RetryOwner``) and the in-process async shell
(``InProcessGuard``) import without Ray; ``GuardActor`` and ``GuardHandle`` live in ``breakers.guard`` and
are loaded on first access so that importing this package never imports Ray.
"""

from __future__ import annotations

from typing import Any

from .breaker import Breaker, BreakerPolicy, BreakerState, BreakerTicket, RecordEffect, should_trip
from .bulkhead import Bulkhead, BulkheadPolicy, Lease, Promotions, QueueTicket
from .errors import AttemptBudgetExhausted, QueuedPastDeadline
from .inprocess import InProcessGuard
from .retry import (
    Attempt,
    AttemptResult,
    OperationBudget,
    OperationReport,
    RetryAction,
    RetryDecision,
    RetryOwner,
    RetryPolicy,
    backoff_ceiling,
    full_jitter_delay,
)
from .scope_guard import GuardPolicy, GuardSnapshot, Resolution, ScopeGuard, Waiting

__all__ = [
    "Attempt",
    "AttemptBudgetExhausted",
    "AttemptResult",
    "Breaker",
    "BreakerPolicy",
    "BreakerState",
    "BreakerTicket",
    "Bulkhead",
    "BulkheadPolicy",
    "GuardActor",
    "GuardHandle",
    "GuardPolicy",
    "GuardSnapshot",
    "InProcessGuard",
    "Lease",
    "OperationBudget",
    "OperationReport",
    "Promotions",
    "QueueTicket",
    "QueuedPastDeadline",
    "RecordEffect",
    "Resolution",
    "RetryAction",
    "RetryDecision",
    "RetryOwner",
    "RetryPolicy",
    "ScopeGuard",
    "Waiting",
    "backoff_ceiling",
    "full_jitter_delay",
    "should_trip",
]


def __getattr__(name: str) -> Any:
    if name in ("GuardActor", "GuardHandle"):
        from . import guard

        return getattr(guard, name)
    raise AttributeError(f"module 'breakers' has no attribute {name!r}")
