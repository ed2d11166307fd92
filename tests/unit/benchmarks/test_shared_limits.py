"""The shared-limits benchmark's workload and README row (the benchmark itself runs in benchmarks/)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks._common import spread
from benchmarks.readme_table import table
from benchmarks.shared_limits import FULL, QUICK, counts, workload_yaml
from cluster.workload import parse_workload


def test_each_job_deals_its_trajectories_to_the_three_classes() -> None:
    assert counts(10) == {"interactive": 4, "standard": 3, "batch": 3}
    assert counts(4) == {"interactive": 2, "standard": 1, "batch": 1}
    assert sum(counts(7).values()) == 7


def test_the_workload_both_jobs_run_is_a_valid_workload_on_one_provider_key() -> None:
    # Given the benchmark's workload for a provider at some URL
    for spec in (FULL, QUICK):
        workload = parse_workload(workload_yaml(spec, "http://127.0.0.1:9/v1"), "shared.yaml")
        # Then it parses, names that provider with the spec's limits, and holds per_job trajectories
        assert workload.provider.base_url == "http://127.0.0.1:9/v1"
        assert (workload.provider.limits.tpm, workload.provider.limits.rpm) == (spec.tpm, spec.rpm)
        assert sum(t.count for t in workload.trajectories) == spec.per_job
        assert {t.priority_class for t in workload.trajectories} == {"interactive", "standard", "batch"}


def test_the_readme_row_shows_each_policys_goodput_429s_and_job_shares(tmp_path: Path) -> None:
    policy = {
        "goodput_ratio": spread([0.95, 0.97, 0.96]),
        "rate_limited": spread([0.0, 0.0, 0.0], 0),
        "job_share": {"job-a": spread([0.5, 0.5, 0.5]), "job-b": spread([0.5, 0.5, 0.5])},
    }
    result = {
        "jobs": 2,
        "policies": {
            "tether": {**policy, "rate_limited_before": spread([0.0, 1.0, 0.0], 0)},
            "backoff": {**policy, "rate_limited": spread([9.0, 12.0, 30.0], 0)},
        },
        "settings": {"per_job": 10, "tpm": 60_000},
        "commit": {"sha": "0123456789abcdef", "dirty": False},
        "environment": {"measured_at": "2026-12-01T12:00:00Z"},
    }
    (tmp_path / "shared_limits.json").write_text(json.dumps(result))
    row = next(line for line in table(tmp_path).splitlines() if "`shared_limits`" in line)
    assert "**tether** combined goodput 0.960 [0.950-0.970], 429s 0 (start-up and warm-up: 0 [0-1])," in row
    assert "**backoff** combined goodput 0.960 [0.950-0.970], 429s 12 [9-30], job" in row  # not recorded
    assert "2 jobs x 10 trajectories" in row and "60,000 TPM" in row
