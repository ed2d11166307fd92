"""gRPC status code -> classified tool outcome (pure).

Two questions per status, answered separately:

- *Outcome class* (what the dependency's breaker counts): infrastructure failures count against the
  dependency; client/domain rejections mean the dependency is healthy and said "no" (issue 6, recovery
  chapter §12.7 classification).
- *Settlement* (what is known about the effect): a status only establishes absence when the endpoint's
  contract says the call was refused before any effect. A timeout or a lost connection after send
  settles nothing (settlement rule: "a timeout settles nothing"), so those stay UNKNOWN.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import grpc

from runtime.ports import OutcomeClass, Settlement, ToolOutcome

__all__ = ["RETRY_AFTER_KEY", "STATUS_RULES", "StatusRule", "classify_status", "retry_after_from_metadata"]

RETRY_AFTER_KEY = "retry-after"  # trailing metadata, seconds as a decimal string


@dataclass(frozen=True, slots=True)
class StatusRule:
    """How one non-OK status settles the effect and counts for the breaker."""

    settlement: Settlement
    outcome_class: OutcomeClass


_INFRA_UNKNOWN = StatusRule(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE)
_INFRA_ABSENT = StatusRule(Settlement.ESTABLISHED_ABSENT, OutcomeClass.INFRASTRUCTURE_FAILURE)
_REJECTED = StatusRule(Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION)

STATUS_RULES: Mapping[grpc.StatusCode, StatusRule] = MappingProxyType(
    {
        # Infrastructure failures whose effect may or may not have happened: the request may have
        # been applied before the reply was lost or the handler crashed.
        grpc.StatusCode.DEADLINE_EXCEEDED: _INFRA_UNKNOWN,
        grpc.StatusCode.UNAVAILABLE: _INFRA_UNKNOWN,
        grpc.StatusCode.INTERNAL: _INFRA_UNKNOWN,
        grpc.StatusCode.UNKNOWN: _INFRA_UNKNOWN,
        grpc.StatusCode.CANCELLED: _INFRA_UNKNOWN,
        grpc.StatusCode.DATA_LOSS: _INFRA_UNKNOWN,
        # Load shedding: the dependency refused at its door (quota, overload) before any effect,
        # but it is a sign of an unhealthy dependency, so it counts as a failure.
        grpc.StatusCode.RESOURCE_EXHAUSTED: _INFRA_ABSENT,
        # Client/domain rejections: the dependency answered "no" and applied nothing.
        grpc.StatusCode.INVALID_ARGUMENT: _REJECTED,
        grpc.StatusCode.NOT_FOUND: _REJECTED,
        grpc.StatusCode.PERMISSION_DENIED: _REJECTED,
        grpc.StatusCode.FAILED_PRECONDITION: _REJECTED,
        grpc.StatusCode.ALREADY_EXISTS: _REJECTED,
        grpc.StatusCode.OUT_OF_RANGE: _REJECTED,
        grpc.StatusCode.UNAUTHENTICATED: _REJECTED,
        grpc.StatusCode.ABORTED: _REJECTED,
        grpc.StatusCode.UNIMPLEMENTED: _REJECTED,
    }
)


def classify_status(
    code: grpc.StatusCode, details: str | None = None, *, retry_after: float | None = None
) -> ToolOutcome:
    """The ``ToolOutcome`` for a call that ended with non-OK ``code``.

    ``retry_after`` is kept for every status (the retry owner treats it as a floor), but only
    RESOURCE_EXHAUSTED and UNAVAILABLE servers normally send it.
    """
    if code == grpc.StatusCode.OK:
        raise ValueError("classify_status is for failed calls; OK is settled from the reply")
    rule = STATUS_RULES.get(code, _INFRA_UNKNOWN)
    return ToolOutcome(
        settlement=rule.settlement,
        outcome_class=rule.outcome_class,
        error=f"{code.name}: {details}" if details else code.name,
        retry_after=retry_after,
    )


def retry_after_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """Seconds from a ``retry-after`` trailing metadata entry; ``None`` when absent or unreadable.

    An unreadable value is ignored rather than raised: it is advice from the dependency, and the
    retry owner has its own backoff floor anyway.
    """
    for key, value in metadata or ():
        if key.lower() != RETRY_AFTER_KEY:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        try:
            seconds = float(text)
        except ValueError:
            return None
        return seconds if seconds >= 0 and seconds == seconds else None
    return None
