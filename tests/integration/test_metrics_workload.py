"""Metrics from the outside, end to end: a small workload runs through ``cluster.runner.run_driver`` with the
driver's endpoint on, and both scrape targets are read over real HTTP and parsed with
``prometheus_client.parser``:

* the driver's own ``/metrics`` (``cluster.observe.start_driver_metrics``): the run's trajectories by state,
  scraped while the workload runs and after it ended;
* Ray's metrics export port, where the trajectory actors' ``MetricsHooks`` and the guard actors' breakers
  record through ``RayBackend`` (names prefixed ``ray_``).
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.observe import start_driver_metrics
from cluster.runner import RunOptions, RunResult, Services, run_driver
from cluster.workload import parse_workload

# 600 s: a whole workload through the driver, then Ray's metrics agent is polled (up to 90 s) until every
# expected series has been exported.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

RUN_ID = "mtest"
WORKLOAD = """\
name: metrics
provider:
  kind: simulated
  model: sim-small
  limits: {tpm: 100000, rpm: 600}
  latency: {ttft_ms: 5, tokens_per_s: 5000}
tools:
  - {name: run_tests}
  - {name: send_notification}
approval_timeout_s: 2
guard: actor
trajectories:
  - id: fix
    scenario: "finish_after:2"
    grants: [run_tests]
    completion_check: {kind: min_tool_results, count: 2}
    expected_state: COMPLETED
  - id: unapproved
    class: interactive
    scenario: "irreversible:send_notification"
    grants: [send_notification]
    completion_check: {kind: tool_succeeded, tool: send_notification}
    expected_state: FAILED
  - id: budget
    scenario: "finish_after:9"
    grants: [run_tests]
    budget: {turns: 2}
    expected_state: FAILED
"""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LABELS = ("state", "outcome", "trigger", "dimension", "guard", "scope", "tool", "priority_class", "bucket")


def scrape(port: int) -> Samples:
    """GET /metrics, parse it, and index tether samples by (name, tether labels); Ray's per-worker series of
    one name and labels are summed, as a dashboard would."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "tether_" in s.name:
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in LABELS)))
                samples[key] = samples.get(key, 0.0) + s.value
    return samples


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name}


@dataclass
class Run:
    result: RunResult
    ray_port: int
    during: list[Samples] = field(default_factory=list)
    after: Samples = field(default_factory=dict)


@pytest.fixture(scope="module")
def run(ray_metrics_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The workload, run once with the driver's endpoint on; scraped during and after the run."""
    from cluster.redis_server import RedisServer

    tmp = tmp_path_factory.mktemp("metrics-run")
    server = RedisServer(data_dir=tmp / "redis").start()
    env = {"TETHER_REDIS_URL": server.url, "TETHER_HOME": str(tmp / "home")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        workload = parse_workload(WORKLOAD, "metrics.yaml")
        options = RunOptions(run_id=RUN_ID, poll_s=0.1)
        with Services(workload, options) as services:
            metrics = start_driver_metrics(
                0,
                redis_url=services.redis_url,
                match=f"tether:status:{RUN_ID}.*",
                testbed_address=services.testbed_address,
                interval_s=0.2,
            )
            with metrics:
                during: list[Samples] = []
                done = threading.Event()

                def scrape_while_running() -> None:
                    while not done.is_set():
                        during.append(scrape(metrics.port))
                        done.wait(0.3)

                scraper = threading.Thread(target=scrape_while_running)
                scraper.start()
                try:
                    result = run_driver(workload, services, options)
                finally:
                    done.set()
                    scraper.join()
                assert metrics.observer is not None
                metrics.observer.stop()  # one last poll: the final states are exported
                after = scrape(metrics.port)
            yield Run(result, ray_metrics_port, during, after)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def test_the_driver_endpoint_shows_the_runs_trajectories_by_state(run: Run) -> None:
    # Given the workload ended as its scripts imply
    assert {r.name: r.state for r in run.result.results} == {
        "fix": "COMPLETED",
        "unapproved": "FAILED",
        "budget": "FAILED",
    }
    # Then every scrape during the run parsed and never showed more trajectories than the run has
    assert run.during, "the endpoint was never scraped while the workload ran"
    assert all(sum(by_label(s, "tether_trajectories", "state").values()) <= 3 for s in run.during)
    # And after it, the gauge is exactly the run's end state, every other state at zero
    states = by_label(run.after, "tether_trajectories", "state")
    assert {k: v for k, v in states.items() if v} == {"COMPLETED": 1.0, "FAILED": 2.0}
    assert states["READY"] == 0.0 and states["STARTING"] == 0.0
    # and the testbed's ledger saw no duplicate effect (no series at all: nothing was ever counted)
    assert by_label(run.after, "tether_duplicate_effects_total", "tool") == {}


WIRED = {
    ("ray_tether_trajectories_finished_total", (("outcome", "completed"),)): 1.0,
    (
        "ray_tether_trajectories_finished_total",
        (("outcome", "partial"),),
    ): 1.0,  # budget: tests ran, then halt
    ("ray_tether_trajectories_finished_total", (("outcome", "failed"),)): 1.0,  # unapproved: nothing ran
    ("ray_tether_budget_exhausted_total", (("dimension", "turns"),)): 1.0,
    ("ray_tether_escalations_total", (("trigger", "approval_request"),)): 1.0,  # unapproved: held, expired
    ("ray_tether_escalations_total", (("trigger", "verification"),)): 1.0,  # then its check failed
    ("ray_tether_steps_to_completion_count", ()): 1.0,
    ("ray_tether_breaker_state", (("scope", "test-runner"),)): 0.0,
}


def exported(seen: Samples, turns: int) -> dict[str, object]:
    """Every series this test expects, as found in ``seen`` (compared whole against ``expected``)."""
    waits = by_label(seen, "ray_tether_admission_wait_seconds_count", "priority_class")
    levels = by_label(seen, "ray_tether_scheduler_bucket_level", "bucket")
    attempts = seen.get(("ray_tether_step_attempts_total", ()))
    return {
        "wired": {k: seen.get(k) for k in WIRED},
        # the retry ratio's parts: no tool failed here, so every operation took exactly one attempt
        "attempts >= 3": attempts is not None and attempts >= 3,
        "attempts == operations": attempts == seen.get(("ray_tether_tool_operations_total", ())),
        # the scheduler observed one admission wait per turn the run took, and reported its buckets
        "admission waits": sum(waits.values()) == turns,
        # and every turn's model call observed its prompt reservation against the provider's count
        "prompt reservations": seen.get(("ray_tether_prompt_reservation_ratio_count", ())) == turns,
        "priority classes": set(waits),
        "buckets": {b.rsplit("/", 1)[1] for b in levels},
    }


def expected() -> dict[str, object]:
    return {
        "wired": WIRED,
        "attempts >= 3": True,
        "attempts == operations": True,
        "admission waits": True,
        "prompt reservations": True,
        "priority classes": {"standard", "interactive"},
        "buckets": {"tokens", "requests"},
    }


def test_rays_export_port_shows_what_the_actors_recorded(run: Run) -> None:
    # Given the run above, whose actors (trajectories, guards, the scheduler) record through RayBackend
    turns = sum(r.turns for r in run.result.results)
    # When Ray's metrics export port is scraped until EVERY expected series has its value: each actor's
    # metrics reach the agent on their own schedule (Ray pushes every few seconds per worker), so the first
    # scrape that shows some of them may lack others (the scheduler's admission waits were once late here).
    # 90 s: on a machine with two busy loops beside the suite the pushes and the agent run late.
    deadline = time.monotonic() + 90.0
    found: dict[str, object] = {}
    while time.monotonic() < deadline:
        try:
            found = exported(scrape(run.ray_port), turns)
        except OSError:  # the agent's HTTP server may not be listening yet
            found = {}
        if found == expected():
            break
        time.sleep(1.0)
    # Then each §12.5 signal the workload implies is there with its exact value, and the rest as above
    assert found == expected()
