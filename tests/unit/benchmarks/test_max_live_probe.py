"""node_capacity's largest-live-count probe (``--only max_live``): when a ramp stops, and its README row."""

from __future__ import annotations

from benchmarks.node_capacity import PROBE_BATCH, RESERVE_MB, _ramp_stop
from benchmarks.readme_table import node_capacity_max_live


def test_the_ramp_stops_at_the_cap() -> None:
    assert _ramp_stop(live=64, available=20_000, start_available=22_000, cap=64, first_mb=100.0) == "cap"


def test_the_ramp_stops_before_a_batch_that_would_cross_the_reserve_at_the_cost_measured_so_far() -> None:
    # Given 100 started, which took 7,000 MB: 70 MB each
    start = 10_000
    # When the next batch of PROBE_BATCH would cost 70 MB each
    just_enough = RESERVE_MB + PROBE_BATCH * 70
    # Then it starts while the reserve stays whole, and stops one MB short of that
    assert _ramp_stop(100, just_enough, just_enough + 7_000, cap=600, first_mb=1.0) is None
    assert _ramp_stop(100, just_enough - 1, just_enough - 1 + 7_000, cap=600, first_mb=1.0) == "reserve"
    # And nothing started yet: the first guess is the cost
    assert _ramp_stop(0, start, start, cap=600, first_mb=(start - RESERVE_MB) / PROBE_BATCH) is None
    assert _ramp_stop(0, start, start, cap=600, first_mb=(start - RESERVE_MB) / PROBE_BATCH + 1) == "reserve"


def _spread(median: float, low: float, high: float) -> dict[str, float]:
    return {"min": low, "median": median, "max": high, "runs": 3}


def test_the_readme_row_shows_the_count_beside_its_floor_with_the_spread() -> None:
    row = node_capacity_max_live(
        {
            "max_live": {
                "batch": 8,
                "reserve_mb": 2048,
                "cap": 600,
                "live_trajectories": _spread(288, 280, 296),
                "turned_again": _spread(288, 280, 296),
                "mb_per_trajectory": _spread(68.5, 67.0, 70.1),
                "ramp_s": _spread(200, 190, 230),
                "live_bare_actors": _spread(456, 448, 464),
                "mb_per_bare_actor": _spread(44.0, 43.0, 45.0),
            }
        }
    )
    assert "288 [280-296]" in row and "bare Ray actors 456 [448-464]" in row
    assert "68.5 [67.0-70.1] MB each" in row and "2,048 MB" in row
