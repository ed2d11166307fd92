"""A real Prometheus (issue 17): the Debian ``prometheus`` server with the shipped scrape config
(``cluster/prometheus/prometheus.yml``, rewritten for this test's ports and a 1 s interval) scrapes a running
``tether run`` (the driver's ``--metrics-port``) and Ray's export port, evaluates the shipped rules
(``alerts.yml``), and every reliability-guide §12.5 signal is queried by name through its HTTP API. The
shipped rules pass ``promtool check rules`` and their unit tests (``promtool test rules``); a broken copy of a
rule fails them (the control).

Robust on a slow machine: every expected series is waited for (bounded), not the first ones, and queries use
``last_over_time`` so a target that already went away (the driver, after its run) still answers.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.runner import RunOptions, RunResult, Services, run_driver
from cluster.workload import parse_workload
from tests.integration.mcp_kit import free_port

pytestmark = [pytest.mark.integration]

SHIPPED = Path(__file__).resolve().parents[2] / "cluster" / "prometheus"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None, reason="prometheus/promtool missing: run `make setup`"
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False)


@needs_prometheus
def test_shipped_config_and_rules_pass_promtool() -> None:
    # Given the shipped config, rules and rule unit tests
    # When promtool checks them and runs the unit tests
    config = promtool("check", "config", str(SHIPPED / "prometheus.yml"))
    rules = promtool("check", "rules", str(SHIPPED / "alerts.yml"))
    tests = promtool("test", "rules", str(SHIPPED / "alerts_test.yml"))
    # Then all pass
    assert config.returncode == 0, config.stdout + config.stderr
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


@needs_prometheus
@pytest.mark.parametrize(
    ("rule", "broken"),
    [
        (
            "sum by (tool) (tether_duplicate_effects_total) > 0",
            "sum by (tool) (tether_duplicate_effects_total) > 1",
        ),
        ("max by (scope) (ray_tether_breaker_state) == 2", "max by (scope) (ray_tether_breaker_state) == 1"),
        ("tether:retry_ratio:ratio5m > 1.5\n", "tether:retry_ratio:ratio5m > 2.5\n"),
        (
            "sum by (trigger) (tether_escalations_overdue) > 0",
            "sum by (trigger) (tether_escalations_open) > 0",
        ),
        (
            'rate(ray_tether_results_total{rung!="full"}[5m])',
            'rate(ray_tether_results_total{rung="full"}[5m])',
        ),
    ],
    ids=[
        "duplicate-effect-threshold",
        "breaker-open-state",
        "retry-ratio-threshold",
        "escalation-sla-overdue-not-open",
        "degraded-results-rung",
    ],
)
def test_control_a_broken_rule_fails_the_rule_unit_tests(tmp_path: Path, rule: str, broken: str) -> None:
    # Given a copy of the shipped rules with one rule broken, beside the shipped unit tests
    text = (SHIPPED / "alerts.yml").read_text()
    assert rule in text
    (tmp_path / "alerts.yml").write_text(text.replace(rule, broken))
    shutil.copy(SHIPPED / "alerts_test.yml", tmp_path / "alerts_test.yml")
    # When the unit tests run on it, Then they fail
    result = promtool("test", "rules", str(tmp_path / "alerts_test.yml"))
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr, result.stdout


# ----------------------------------------------------------------------------------- the running server

RUN_ID = "prom"
WORKLOAD = """\
name: prometheus
provider:
  kind: simulated
  model: sim-small
  limits: {tpm: 200000, rpm: 1200}
  latency: {ttft_ms: 5, tokens_per_s: 5000}
tools:
  - {name: run_tests}
  - {name: send_notification}
approval_timeout_s: 25        # the held call keeps the run (and its driver endpoint) up while it is scraped
guard: actor
trajectories:
  - id: fix
    scenario: "finish_after:2"
    grants: [run_tests]
    completion_check: {kind: min_tool_results, count: 2}
  - {id: budget, scenario: "finish_after:9", grants: [run_tests], budget: {turns: 2}}
  - {id: loop, scenario: repeat_forever, grants: [run_tests]}
  - id: held
    scenario: "irreversible:send_notification"
    grants: [send_notification]
    completion_check: {kind: tool_succeeded, tool: send_notification}
"""

# Every §12.5 signal, by the name Prometheus has it: raw series (driver: tether_*, actors via Ray:
# ray_tether_*) and the shipped recording rules.
RAW = {
    "tether_trajectories": "driver: trajectories by state",
    "ray_tether_guard_fired_total": "guard firing, by guard",
    "ray_tether_budget_exhausted_total": "budget exhaustion",
    "ray_tether_escalations_total": "escalations, by trigger",
    "ray_tether_trajectories_finished_total": "partial completion (finished, by outcome)",
    "ray_tether_step_attempts_total": "retry ratio: attempts",
    "ray_tether_steps_completed_total": "retry ratio: completed steps",
    "ray_tether_steps_to_completion_bucket": "steps to completion, distribution",
    # issue 12: exit reasons, the ladder's rungs, results by rung (degraded-result rate), escalations open and
    # overdue by trigger, incidents and the quarantine (the driver's view of the cluster's registries)
    "ray_tether_exit_reasons_total": "exit reasons",
    "ray_tether_watchdog_rungs_total": "watchdog ladder, by detector and rung",
    "ray_tether_results_total": "results by rung and status",
    "tether_escalations_open": "driver: open escalations, by trigger",
    "tether_escalations_overdue": "driver: overdue escalations, by trigger",
    "tether_incidents": "driver: incidents, by status",
    "tether_quarantined_artifacts": "driver: quarantined artifacts",
}
RECORDED = [
    "tether:guard_fired:rate5m",
    "tether:budget_exhausted:rate5m",
    "tether:escalations:rate5m",
    "tether:partial_completion:ratio5m",
    "tether:retry_ratio:ratio5m",
    "tether:duplicate_effects:rate5m",
    "tether:steps_to_completion:p90",
    "tether:exit_reasons:rate5m",
    "tether:watchdog_rungs:rate5m",
    "tether:degraded_results:ratio5m",
]


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


@contextlib.contextmanager
def prometheus(tmp_path: Path, driver_port: int, ray_port: int) -> Iterator[str]:
    """The Prometheus server with the shipped config, its targets and intervals rewritten for this test."""
    config = yaml.safe_load((SHIPPED / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(SHIPPED / "alerts.yml")]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["tether-driver"]["static_configs"] = [{"targets": [f"127.0.0.1:{driver_port}"]}]
    del jobs["ray"]["file_sd_configs"]
    jobs["ray"]["static_configs"] = [{"targets": [f"127.0.0.1:{ray_port}"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    assert PROMETHEUS is not None
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={path}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                if r.status == 200:
                    break
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not become ready within 60 s"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def wait_for_every_series(base: str, names: list[str], timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    """Poll until every name has a series (bounded); fail naming the ones still missing."""
    deadline = time.monotonic() + timeout_s
    found: dict[str, list[dict[str, Any]]] = {}
    while True:
        for name in names:
            if name not in found:
                result = query(base, f"last_over_time({name}[15m])")
                if result:
                    found[name] = result
        missing = [n for n in names if n not in found]
        if not missing:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no series after {timeout_s:.0f}s for: {', '.join(missing)}")
        time.sleep(1.0)


def by(series: list[dict[str, Any]], label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in series:
        key = s["metric"].get(label, "")
        out[key] = out.get(key, 0.0) + float(s["value"][1])
    return out


@needs_prometheus
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prometheus_scrapes_a_running_tether_run_and_every_signal_is_queryable(
    ray_metrics_port: int, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given Prometheus with the shipped config and rules, scraping the driver's port and Ray's export port
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    driver_port = free_port()
    workload = parse_workload(WORKLOAD, "prometheus.yaml")
    options = RunOptions(run_id=RUN_ID, poll_s=0.1, metrics_port=driver_port)
    with prometheus(tmp_path, driver_port, ray_metrics_port) as base, Services(workload, options) as services:
        # When a workload runs through tether run's driver, its endpoint up while the run goes on
        outcome: dict[str, RunResult | BaseException] = {}

        def drive() -> None:
            try:
                outcome["result"] = run_driver(workload, services, options)
            except BaseException as e:  # surfaced below
                outcome["result"] = e

        runner = threading.Thread(target=drive, daemon=True)
        runner.start()
        try:
            # Then the driver is scraped while the run goes on, and every raw §12.5 series arrives
            raw = wait_for_every_series(base, list(RAW), timeout_s=240)
            up = query(base, 'max_over_time(up{job="tether-driver"}[15m])')
        finally:
            runner.join(300)
        result = outcome.get("result")
        assert isinstance(result, RunResult), result
        # And the shipped recording rules give each signal by its name
        recorded = wait_for_every_series(base, RECORDED, timeout_s=120)
        # (each raw series as the run left it: the first sighting above may predate later labels)
        raw = {name: query(base, f"last_over_time({name}[15m])") for name in RAW}
    # (the loop's watchdog informs, then takes run_tests away; with nothing left to call, the scripted model
    # ends its turn and its two earlier results pass the check: a loop is contained, not an error)
    assert {r.name: r.state for r in result.results} == {
        "fix": "COMPLETED",
        "budget": "FAILED",
        "loop": "COMPLETED",
        "held": "FAILED",
    }
    assert up and float(up[0]["value"][1]) == 1.0
    assert sum(by(raw["tether_trajectories"], "state").values()) == 4
    assert by(raw["ray_tether_guard_fired_total"], "guard").get("exact_repeat", 0) >= 1
    assert by(raw["ray_tether_budget_exhausted_total"], "dimension") == {"turns": 1.0}
    assert by(raw["ray_tether_escalations_total"], "trigger").get("approval_request") == 1.0
    assert by(raw["ray_tether_trajectories_finished_total"], "outcome").get("partial", 0) >= 1
    assert sum(by(raw["ray_tether_step_attempts_total"], "").values()) >= 3
    assert by(raw["ray_tether_exit_reasons_total"], "reason").get("BUDGET_EXCEEDED") == 1.0
    assert by(raw["ray_tether_watchdog_rungs_total"], "rung").get("inform", 0) >= 1
    assert by(raw["ray_tether_results_total"], "rung").get("full", 0) >= 1
    assert set(by(raw["tether_escalations_open"], "trigger")) >= {"approval_request", "guard", "novelty"}
    assert "open" in by(raw["tether_incidents"], "status") and raw["tether_quarantined_artifacts"]
    assert set(recorded) == set(RECORDED)
    assert float(recorded["tether:duplicate_effects:rate5m"][0]["value"][1]) == 0.0
