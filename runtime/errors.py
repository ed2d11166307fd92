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
    "ControlError",
    "DependencyError",
    "InputError",
    "PolicyRefusal",
    "TetherError",
]


class TetherError(Exception):
    """Root of every error Tether raises on purpose."""

    non_retryable: bool = True
    retry_after: float | None = None
    scope: str | None = None


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
    ) -> None:
        super().__init__(message)
        self.scope = scope
        self.retry_after = retry_after
        self.non_retryable = non_retryable


class ControlError(TetherError):
    """A control message was rejected; ``reason`` is the audited reason code."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")
