"""The driver's pure rules: trajectories by state from snapshots, duplicate effects from ledger snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from cluster.observe import STARTING, DuplicateTally, state_counts
from runtime.states import TrajectoryState


def test_every_state_is_present_so_an_emptied_state_drops_to_zero() -> None:
    counts = state_counts(["COMPLETED", "READY", None, "COMPLETED"])
    assert counts["COMPLETED"] == 2 and counts["READY"] == 1 and counts[STARTING] == 1
    assert counts["PAUSED"] == 0 and set(counts) >= {s.value for s in TrajectoryState}


@given(st.lists(st.sampled_from([None, *(s.value for s in TrajectoryState)]), max_size=50))
def test_state_counts_count_every_trajectory_exactly_once(states: list[str | None]) -> None:
    assert sum(state_counts(states).values()) == len(states)


@dataclass(frozen=True)
class Effect:
    tool: str
    effect_key: str
    applications: int


def test_duplicates_are_counted_once_however_often_the_ledger_is_read() -> None:
    # Given a ledger where one effect was applied twice
    tally = DuplicateTally()
    snapshot = [Effect("send_notification", "k1", 2), Effect("run_tests", "k2", 1)]
    # When it is read three times
    first = tally.update(snapshot)
    again = [tally.update(snapshot) for _ in range(2)]
    # Then the duplicate is counted on the first read only
    assert first == {"send_notification": 1}
    assert again == [{}, {}]


def test_a_growing_duplicate_counts_only_its_new_applications() -> None:
    tally = DuplicateTally()
    tally.update([Effect("send_notification", "k1", 2)])
    assert tally.update([Effect("send_notification", "k1", 4), Effect("create_env", "k3", 3)]) == {
        "send_notification": 2,
        "create_env": 2,
    }
