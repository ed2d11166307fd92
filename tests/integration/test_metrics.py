"""Metrics scraped over real HTTP and parsed with ``prometheus_client.parser``.

Two export paths: the driver's own endpoint (``PrometheusBackend.serve``) and Ray's per-node metrics export,
where an actor records through ``RayBackend`` and the node's metrics agent serves it.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import Metrics, PrometheusBackend, RayBackend

pytestmark = [pytest.mark.integration]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(
    port: int, keep: tuple[str, ...] = ("guard", "state", "scope", "priority_class", "outcome")
) -> Samples:
    """GET /metrics and index every tether sample by (name, the tether labels among ``keep``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "tether_" in sample.name:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k in (*keep, "le")))
                # Ray exports one series per worker process; sum them as a dashboard would.
                samples[(sample.name, labels)] = samples.get((sample.name, labels), 0.0) + sample.value
    return samples


@pytest.fixture
def driver_endpoint() -> Iterator[tuple[Metrics, int]]:
    backend = PrometheusBackend()
    port = backend.serve(0, addr="127.0.0.1")
    try:
        yield Metrics(backend), port
    finally:
        backend.close()


def test_driver_endpoint_serves_what_a_running_workload_records(driver_endpoint: tuple[Metrics, int]) -> None:
    metrics, port = driver_endpoint
    # Given: a workload recording from several threads while the endpoint is scraped

    def trajectory(n: int) -> None:
        for _ in range(n):
            metrics.step_attempted()
            metrics.guard_fired("loop")
        metrics.trajectory_finished("completed", n)

    workers = [threading.Thread(target=trajectory, args=(50,)) for _ in range(4)]
    for worker in workers:
        worker.start()
    during = scrape(port)  # a scrape mid-workload parses and never shows more than was recorded
    for worker in workers:
        worker.join()
    metrics.breaker_state("search", "open")
    metrics.trajectories_in_state("RUNNING", 3)
    metrics.admission_waited("interactive", 0.3)

    # When: the endpoint is scraped after the workload
    after = scrape(port)

    # Then: the parsed values are exactly what was recorded
    assert during.get(("tether_guard_fired_total", (("guard", "loop"),)), 0.0) <= 200.0
    assert after[("tether_guard_fired_total", (("guard", "loop"),))] == 200.0
    assert after[("tether_step_attempts_total", ())] == 200.0
    assert after[("tether_trajectories_finished_total", (("outcome", "completed"),))] == 4.0
    assert after[("tether_steps_to_completion_count", ())] == 4.0
    assert after[("tether_steps_to_completion_sum", ())] == 200.0
    assert after[("tether_breaker_state", (("scope", "search"),))] == 2.0
    assert after[("tether_trajectories", (("state", "RUNNING"),))] == 3.0
    assert (
        after[("tether_admission_wait_seconds_bucket", (("le", "0.25"), ("priority_class", "interactive")))]
        == 0
    )
    assert (
        after[("tether_admission_wait_seconds_bucket", (("le", "0.5"), ("priority_class", "interactive")))]
        == 1
    )


@pytest.mark.slow
def test_metrics_recorded_inside_an_actor_reach_rays_export_endpoint(ray_metrics_port: int) -> None:
    import ray

    port = ray_metrics_port

    @ray.remote(num_cpus=0)
    class RecordingActor:
        def record(self) -> None:
            metrics = Metrics(RayBackend())
            for _ in range(3):
                metrics.guard_fired("schema")
            metrics.breaker_state("search", "half_open")

    # Given: an actor that records through the Ray backend
    actor = RecordingActor.remote()  # type: ignore[attr-defined]

    # When: it records, and the node's metrics agent is scraped until the values are exported
    ray.get(actor.record.remote())
    wanted = {
        ("ray_tether_guard_fired_total", (("guard", "schema"),)): 3.0,
        ("ray_tether_breaker_state", (("scope", "search"),)): 1.0,
    }
    deadline = time.monotonic() + 60.0
    seen: Samples = {}
    while time.monotonic() < deadline:
        try:
            seen = scrape(port)
        except OSError:  # the agent's HTTP server may not be listening yet
            seen = {}
        if all(seen.get(key) == value for key, value in wanted.items()):
            break
        time.sleep(1.0)  # Ray pushes metrics to the agent every few seconds

    # Then: the scraped, parsed values are the recorded ones
    assert {key: seen.get(key) for key in wanted} == wanted
