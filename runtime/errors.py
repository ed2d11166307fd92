"""One rooted exception tree, grouped by who handles the error.

- ``InputError``: bad input from outside (workload files, wire messages, log bytes, model output,
  tool arguments). The caller fixes its input; the message says what was wrong and where.
- ``PolicyRefusal``: the runtime decided not to do something (illegal transition, admission denied,
  budget exhausted, approval refused). The trajectory records why and moves on.
- ``DependencyError``: something outside failed (provider, tool service, store). The single retry
  owner decides what happens next from ``retry_after`` and ``non_retryable``.
- ``ControlError``: a control message was rejected (forged, replayed, expired, wrong role).
"""

from __future__ import annotations

__all__ = [
    "AdmissionRefused",
    "BreakerOpen",
    "BulkheadFull",
    "CodecError",
    "ControlError",
    "DependencyError",
    "IllegalEvent",
    "IllegalTransition",
    "InputError",
    "InvalidLog",
    "ModelCallCancelled",
    "PolicyRefusal",
    "ProviderRateLimited",
    "TetherError",
]


class TetherError(Exception):
    """Root of every error Tether raises on purpose."""

    non_retryable: bool = True
    retry_after: float | None = None
    scope: str | None = None

    def __reduce__(self) -> tuple[object, ...]:
        # Subclasses take keyword attributes their ``__init__`` turns into a message, so the default
        # ``cls(*args)`` cannot rebuild them; rebuild from the message and the attributes instead. This
        # lets every error cross a process boundary (a Ray actor call) with its fields intact.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class InputError(TetherError, ValueError):
    """Input from outside the runtime was malformed. ``where`` names the place (file, field path)."""

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class PolicyRefusal(TetherError):
    """The runtime refused an action by its own rules."""


class DependencyError(TetherError):
    """A dependency outside the runtime failed or could not be reached."""

    def __init__(
        self,
        message: str,
        *,
        scope: str | None = None,
        retry_after: float | None = None,
        non_retryable: bool = False,
        usage: object = None,
    ) -> None:
        super().__init__(message)
        self.scope = scope
        self.retry_after = retry_after
        self.non_retryable = non_retryable
        # What the dependency billed before it failed, when it says (a model call's partial
        # ``runtime.ports.Usage``: streamed chunks before a break). None: nothing seen.
        self.usage = usage


class ControlError(TetherError):
    """A control message was rejected; ``reason`` is the audited reason code."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


# --------------------------------------------------------------------------- input


class CodecError(InputError):
    """Log or wire bytes could not be decoded into a valid event or message."""


class InvalidLog(InputError):
    """A trajectory log decodes but cannot be folded: it does not start with ``trajectory_created`` or
    holds an event its record refuses. ``where`` names the entry (``event[17]``); the refusal is the
    ``__cause__``."""


# --------------------------------------------------------------------------- policy


class AdmissionRefused(PolicyRefusal):
    """The scheduler or the admission check refused; ``predicate`` names the first failing rule."""

    def __init__(self, predicate: str, message: str) -> None:
        self.predicate = predicate
        super().__init__(f"{predicate}: {message}")


class BreakerOpen(PolicyRefusal):
    """The dependency's breaker withholds calls; ``cooldown_s`` estimates when a probe is allowed."""

    def __init__(self, scope: str, cooldown_s: float, generation: int) -> None:
        self.scope = scope
        self.cooldown_s = cooldown_s
        self.generation = generation
        self.retry_after = cooldown_s
        super().__init__(
            f"breaker for {scope!r} is open (generation {generation}); retry in ~{cooldown_s:.1f}s"
        )


class BulkheadFull(PolicyRefusal):
    """Both the concurrency cap and the queue of a dependency's bulkhead are full: fail fast."""

    def __init__(self, scope: str, in_flight: int, queued: int) -> None:
        self.scope = scope
        self.in_flight = in_flight
        self.queued = queued
        super().__init__(f"bulkhead for {scope!r} is full ({in_flight} in flight, {queued} queued)")


class IllegalEvent(PolicyRefusal):
    """An event cannot be applied to the trajectory record as it stands (its guard failed).

    ``kind`` is the event's kind tag, ``state`` the record's state when it was refused and ``rule`` a short
    reason code (for example ``"call_not_pending"``). Raised by ``runtime.fold.apply`` before anything is
    written, so a refused event never reaches the log.
    """

    def __init__(self, kind: str, state: str, rule: str, message: str) -> None:
        self.kind = kind
        self.state = state
        self.rule = rule
        super().__init__(f"{kind} refused in {state} ({rule}): {message}")


class IllegalTransition(IllegalEvent):
    """A state change outside the legal set, or one whose guard failed (harness chapter, Listing 2).

    ``from_state`` and ``to_state`` name the refused edge, ``event`` the reason the transition was asked
    for and ``rule`` which check refused it (``"not_legal"`` or the failing guard's name).
    """

    def __init__(self, from_state: str, to_state: str, event: str, rule: str = "not_legal") -> None:
        self.from_state = from_state
        self.to_state = to_state
        self.event = event
        super().__init__(
            "state_changed", from_state, rule, f"{from_state} -> {to_state} is not allowed (event {event!r})"
        )


# --------------------------------------------------------------------------- dependency


class ProviderRateLimited(DependencyError):
    """The model provider answered 429: admission feedback, never a model failure.

    ``rate_limit`` is the ``runtime.ports.RateLimitInfo`` parsed from the response's headers (None when the
    adapter saw none); ``retry_after`` repeats its ``retry_after_s``."""

    def __init__(
        self,
        message: str,
        *,
        scope: str | None = None,
        retry_after: float | None = None,
        rate_limit: object = None,
    ) -> None:
        super().__init__(message, scope=scope, retry_after=retry_after, non_retryable=False)
        self.rate_limit = rate_limit


class ModelCallCancelled(TetherError):
    """The harness aborted a model call mid-stream. ``usage`` is what was billed before the abort."""

    def __init__(self, reason: str, usage: object) -> None:
        self.reason = reason
        self.usage = usage
        super().__init__(f"model call cancelled: {reason}")


def _rebuild(cls: type[TetherError], args: tuple[object, ...], state: dict[str, object]) -> TetherError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error
