"""rate_limit's demand scenarios: the users of ``interactive_users`` pause as the settings say, every policy
sees the same users, and the README row says which scenario it measured."""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.rate_limit import (
    CLASSES,
    POLICIES,
    SCENARIOS,
    RunSpec,
    class_of,
    policy_list,
    result_name,
    split_shares,
    think_times,
)
from benchmarks.readme_table import table


def test_the_scenarios_differ_only_in_the_interactive_users_pauses() -> None:
    backlogged, users = SCENARIOS["backlogged"], SCENARIOS["interactive_users"]
    assert backlogged == CLASSES
    assert [replace(c, think_windows=(0.0, 0.0)) for c in users] == list(backlogged)
    assert [c.think_windows for c in users] == [(1.5, 3.5), (0.0, 0.0), (0.0, 0.0)]
    spec = replace(RunSpec(10, 1, 1, 60.0, 1.0, 1.0), scenario="interactive_users")
    assert spec.classes == users
    # the slots are dealt to the classes as in the headline
    assert [class_of(i, 10, users).name for i in range(10)] == [class_of(i, 10).name for i in range(10)]


def test_a_backlogged_class_never_pauses() -> None:
    assert list(think_times(CLASSES[1], 60.0, random.Random(1))) == []


def test_a_user_arrives_within_the_longest_pause_then_pauses_within_the_range_after_each_trajectory() -> None:
    user = SCENARIOS["interactive_users"][0]
    pauses = list(itertools.islice(think_times(user, 60.0, random.Random(3)), 2_000))
    assert 0.0 <= pauses[0] <= 210.0
    assert all(90.0 <= p <= 210.0 for p in pauses[1:])
    assert 140.0 < sum(pauses[1:]) / len(pauses[1:]) < 160.0  # uniform: mean 150 s
    # the same slot's generator gives every policy the same users
    again = list(itertools.islice(think_times(user, 60.0, random.Random(3)), 2_000))
    assert again == pauses


def _result(scenario: str) -> dict[str, object]:
    classes = [{"name": c.name, "think_windows": list(c.think_windows)} for c in SCENARIOS[scenario]]
    policy = {
        "goodput_ratio": {"min": 0.7, "median": 0.75, "max": 0.8, "runs": 3},
        "rate_limited": {"min": 0, "median": 0, "max": 0, "runs": 3},
        "completed_per_min": {"min": 90, "median": 100, "max": 110, "runs": 3},
        "completed_per_min_by_class": {
            "interactive": {"min": 30, "median": 30, "max": 30, "runs": 3},
            "standard": {"min": 40, "median": 41.5, "max": 42, "runs": 3},
        },
        "wait_ms": {"interactive": {"p50": 1.0, "p99": 2.0}},
    }
    return {
        "trajectories": 200,
        "provider_mode": "sliding_window",
        "policies": {"static_split": policy},
        "settings": {"scenario": scenario, "classes": classes, "window_s": 60.0, "headroom_used": 0.02},
        "commit": {"sha": "0123456789abcdef", "dirty": False},
        "runs": 3,
    }


def test_the_readme_row_of_the_interactive_users_says_how_long_they_pause_and_who_completed_what(
    tmp_path: Path,
) -> None:
    (tmp_path / "rate_limit.json").write_text(json.dumps(_result("backlogged")))
    (tmp_path / "rate_limit.interactive_users.json").write_text(json.dumps(_result("interactive_users")))
    lines = table(tmp_path).splitlines()
    users = next(line for line in lines if "`rate_limit.interactive_users`" in line)
    assert "scenario `interactive_users` (users pause 90-210 s between trajectories)" in users
    assert "completed/min 100.0 [90.0-110.0] (interactive 30.0, standard 41.5 [40.0-42.0])" in users
    headline = next(line for line in lines if "`rate_limit`" in line)
    assert "scenario" not in headline and "(interactive" not in headline
    assert "goodput 0.750 [0.700-0.800]" in headline


def test_split_takes_one_share_per_class_and_says_what_was_wrong() -> None:
    assert split_shares("0.2,0.4,0.4") == (0.2, 0.4, 0.4)
    for text, wrong in (
        ("0.5,0.5", "expected 3 shares (interactive,standard,batch)"),
        ("0.2,x,0.4", "expected numbers separated by commas"),
        ("0.5,0.5,0.5", "together at most 1 (sum 1.5)"),
        ("0,0.5,0.5", "each share must be above 0"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(wrong)):
            split_shares(text)


def test_only_the_backlogged_run_at_the_classes_shares_writes_the_headline_file() -> None:
    spec = RunSpec(10, 1, 1, 60.0, 1.0, 1.0)
    assert result_name(spec) == "rate_limit"
    assert result_name(replace(spec, scenario="interactive_users")) == "rate_limit.interactive_users"
    tuned = replace(spec, scenario="interactive_users", split=(0.14, 0.43, 0.43))
    assert result_name(tuned) == "rate_limit.interactive_users.tuned_split"
    assert result_name(replace(spec, split=(0.2, 0.4, 0.4))) == "rate_limit.tuned_split"
    # nor a run that changes the provider, the headroom, the admission path or the policies
    assert result_name(replace(spec, provider_mode="token_bucket")) == "rate_limit.token_bucket"
    assert result_name(replace(spec, headroom=0.05)) == "rate_limit.headroom0.05"
    assert result_name(replace(spec, use_ray=True)) == "rate_limit.ray"
    assert result_name(replace(spec, top_class_reserve=0.005)) == "rate_limit.reserve0.005"
    assert result_name(spec, ("tether", "static_split")) == "rate_limit.tether+static_split"
    assert result_name(spec, POLICIES) == "rate_limit"
    both = replace(spec, scenario="interactive_users", provider_mode="token_bucket")
    assert result_name(both, ("tether",)) == "rate_limit.interactive_users.token_bucket.tether"


def test_policies_are_known_names_each_once() -> None:
    assert policy_list("static_split,tether") == ("static_split", "tether")
    for text, wrong in (("tether,foo", "unknown foo"), ("", "empty"), ("tether,tether", "a policy twice")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(wrong)):
            policy_list(text)
