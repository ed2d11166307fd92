"""Provider-side counters on a fake clock, and the config/fault models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runtime.clock import FakeClock
from testbed.provider.config import ConfigPatch, Fault, ProviderConfig
from testbed.provider.stats import ProviderStats


def test_counters_and_per_second_timeline() -> None:
    # Given two accepted requests in second 0 (one finishing in second 2) and a 429 in second 1
    clock = FakeClock()
    stats = ProviderStats(clock)
    for trajectory in ("a", "b"):
        stats.on_request(trajectory)
        stats.on_accepted(trajectory)
    stats.on_finished("a", prompt=10, cached=4, completion=3, aborted=False)
    clock.advance(1.5)
    stats.on_request("a")
    stats.on_rate_limited("a")
    clock.advance(1.0)
    stats.on_finished("b", prompt=7, cached=0, completion=2, aborted=True)
    # When reported
    report = stats.to_json()
    # Then totals, per-trajectory counters and the timeline agree
    assert (report["requests"], report["accepted"], report["rate_limited"], report["aborted"]) == (3, 2, 1, 1)
    assert report["in_flight"] == 0
    assert report["tokens"] == {"prompt": 17, "cached": 4, "completion": 5}
    assert report["trajectories"]["a"]["rate_limited"] == 1
    assert report["trajectories"]["b"]["aborted"] == 1
    assert report["timeline"] == [
        {"t": 0, "accepted": 2, "tokens": 13, "rate_limited": 0},
        {"t": 1, "accepted": 0, "tokens": 0, "rate_limited": 1},
        {"t": 2, "accepted": 0, "tokens": 9, "rate_limited": 0},
    ]


def test_reset_keeps_the_in_flight_gauge() -> None:
    stats = ProviderStats(FakeClock())
    stats.on_request("a")
    stats.on_accepted("a")
    stats.reset()
    assert stats.in_flight == 1
    stats.on_finished("a", prompt=1, cached=0, completion=1, aborted=False)
    assert stats.to_json()["in_flight"] == 0


def test_patch_changes_only_the_fields_it_sets() -> None:
    config = ProviderConfig(rpm=10, tpm=1000, ttft_ms=5)
    assert ConfigPatch(tpm=50).apply(config) == ProviderConfig(rpm=10, tpm=50, ttft_ms=5)


@pytest.mark.parametrize(
    "body",
    [{"status": 500}, {"status": 418, "count": 1}, {"status": 500, "count": 0}],
)
def test_faults_must_be_bounded_and_use_a_known_status(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Fault.model_validate(body)


def test_unknown_config_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="rpn"):
        ConfigPatch.model_validate({"rpn": 3})
