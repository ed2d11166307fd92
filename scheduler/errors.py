"""Errors the scheduler raises, rooted in ``runtime.errors`` so callers handle them by kind."""

from __future__ import annotations

from runtime.errors import AdmissionRefused, InputError

__all__ = ["AdmissionRefused", "Predicate", "SchedulerInputError"]


class SchedulerInputError(InputError):
    """A request named something the scheduler was not configured for (class, pool, provider key),
    or carried a value outside its domain (negative tokens)."""


class Predicate:
    """The ``AdmissionRefused.predicate`` codes the scheduler uses; the trajectory records them."""

    DEADLINE = "deadline"  # the requester's absolute deadline passed before admission
    EXCEEDS_CAPACITY = "exceeds_capacity"  # the turn can never fit the bucket, waiting would be forever
    HOLDER_GONE = "holder_gone"  # the requesting trajectory's actor is no longer alive
    CANCELLED = "cancelled"  # the requester withdrew (its coroutine was cancelled)
    SHUTDOWN = "shutdown"  # the scheduler is closing
