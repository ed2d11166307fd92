"""Every Tether error crosses a process boundary (pickle, as Ray does) with its message and fields intact."""

from __future__ import annotations

import pickle

import pytest

from runtime import errors as E
from runtime.states import TrajectoryState

CASES = [
    E.InputError("bad", where="file.yaml:3"),
    E.CodecError("missing field", where="data.x"),
    E.AdmissionRefused("deadline", "too late"),
    E.BreakerOpen("svc/tenant-a", 4.5, 3),
    E.BulkheadFull("svc", 64, 32),
    E.ProviderRateLimited("429", scope="sim", retry_after=1.5),
    E.DependencyError("down", scope="redis", retry_after=2.0, non_retryable=True),
    E.ModelCallCancelled("kill", {"output": 7}),
    E.ControlError("EXPIRED", "message expired"),
    E.IllegalTransition(TrajectoryState.COMPLETED, TrajectoryState.READY, "late"),
]


@pytest.mark.parametrize("error", CASES, ids=lambda e: type(e).__name__)
def test_error_round_trips_through_pickle(error: E.TetherError) -> None:
    # Given an error with structured fields / When it is pickled and unpickled
    copy = pickle.loads(pickle.dumps(error))
    # Then type, message and every attribute survive
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__
