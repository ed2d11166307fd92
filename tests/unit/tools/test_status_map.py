"""Status code -> classified outcome: the table the breaker and the settlement rule rely on."""

from __future__ import annotations

import grpc
import pytest

from actors.tools_grpc.status_map import STATUS_RULES, classify_status, retry_after_from_metadata
from runtime.ports import OutcomeClass, Settlement

INFRA = OutcomeClass.INFRASTRUCTURE_FAILURE
REJECT = OutcomeClass.CLIENT_REJECTION
UNKNOWN = Settlement.UNKNOWN
ABSENT = Settlement.ESTABLISHED_ABSENT


@pytest.mark.parametrize(
    ("code", "settlement", "outcome_class"),
    [
        # a timeout settles nothing; neither does a lost connection after send or a crashed handler
        (grpc.StatusCode.DEADLINE_EXCEEDED, UNKNOWN, INFRA),
        (grpc.StatusCode.UNAVAILABLE, UNKNOWN, INFRA),
        (grpc.StatusCode.INTERNAL, UNKNOWN, INFRA),
        (grpc.StatusCode.UNKNOWN, UNKNOWN, INFRA),
        (grpc.StatusCode.CANCELLED, UNKNOWN, INFRA),
        (grpc.StatusCode.DATA_LOSS, UNKNOWN, INFRA),
        # load shedding: refused at the door, but the dependency is unhealthy
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ABSENT, INFRA),
        # client/domain rejections: healthy dependency said no, nothing applied
        (grpc.StatusCode.INVALID_ARGUMENT, ABSENT, REJECT),
        (grpc.StatusCode.NOT_FOUND, ABSENT, REJECT),
        (grpc.StatusCode.PERMISSION_DENIED, ABSENT, REJECT),
        (grpc.StatusCode.FAILED_PRECONDITION, ABSENT, REJECT),
        (grpc.StatusCode.ALREADY_EXISTS, ABSENT, REJECT),
        (grpc.StatusCode.OUT_OF_RANGE, ABSENT, REJECT),
        (grpc.StatusCode.UNAUTHENTICATED, ABSENT, REJECT),
        (grpc.StatusCode.ABORTED, ABSENT, REJECT),
        (grpc.StatusCode.UNIMPLEMENTED, ABSENT, REJECT),
    ],
)
def test_each_status_maps_to_its_settlement_and_class(
    code: grpc.StatusCode, settlement: Settlement, outcome_class: OutcomeClass
) -> None:
    # Given a call that failed with `code`
    # When it is classified
    outcome = classify_status(code, "details here", retry_after=1.5)
    # Then settlement and breaker class follow the table, and the advice is kept
    assert (outcome.settlement, outcome.outcome_class) == (settlement, outcome_class)
    assert outcome.error == f"{code.name}: details here"
    assert outcome.retry_after == 1.5
    assert outcome.result is None


def test_every_non_ok_status_has_a_rule() -> None:
    assert set(STATUS_RULES) == set(grpc.StatusCode) - {grpc.StatusCode.OK}


def test_ok_is_not_a_failure_status() -> None:
    with pytest.raises(ValueError, match="OK"):
        classify_status(grpc.StatusCode.OK)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ((("retry-after", "2.5"),), 2.5),
        ((("Retry-After", b"3"),), 3.0),
        ((("x-other", "1"), ("retry-after", "0")), 0.0),
        ((("retry-after", "soon"),), None),
        ((("retry-after", "-1"),), None),
        ((("retry-after", "nan"),), None),
        ((), None),
        (None, None),
    ],
)
def test_retry_after_is_read_from_trailing_metadata(metadata: object, expected: float | None) -> None:
    assert retry_after_from_metadata(metadata) == expected  # type: ignore[arg-type]
