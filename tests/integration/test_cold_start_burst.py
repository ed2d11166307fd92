"""A run's first calls reach the provider as the scheduler spaced them, even while the node's model client
actor is still starting (``actors.model_client.AdmitWhenWarm``).

Judged by the provider's own count of 429s, in a process of its own. The scheduler is told a quarter of the
provider's request limit: 30 a minute, so it grants at most one call per second (its share of a second,
rounded up), while the provider refuses only a third call within a second (120 a minute). Only a burst
meets a 429 here; the jitter of a loaded machine would have to exceed a second. Without the warm before the
first admission, the calls granted while the client actor was being created (a new Ray worker and the
``openai`` import, seconds on this machine) waited in front of it and reached the provider together. The
control (the fix stashed) got 1 x 429 in 3 of 3 runs with 16 trajectories and in 2 of 2 with 12; with 8
the burst was two calls and passed.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

from cluster.runner import RunOptions, Services, run_driver
from cluster.workload import parse_workload
from testbed.provider import ProviderConfig, start_provider_subprocess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TRAJECTORIES = 16


def _workload(base_url: str) -> str:
    one = "scenario: 'finish_after:0', completion_check: {kind: always}"
    runs = "\n".join(f"  - {{id: t{i}, {one}}}" for i in range(TRAJECTORIES))
    return f"""\
name: cold-start
provider:
  kind: openai_compatible
  base_url: {base_url}
  model: sim-small
  limits: {{tpm: 1000000, rpm: 30}}
tools: [{{name: noop, source: builtin}}]
guard: local
trajectories:
{runs}
"""


def _no_model_client() -> None:
    """The node's model client gone, so the run starts it cold (an earlier test may have left one)."""
    import ray

    from actors.model_client import NAMESPACE, client_actor_name

    name = client_actor_name(ray.get_runtime_context().get_node_id())
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))


async def test_the_first_calls_of_a_cold_run_are_not_refused_as_a_burst(
    ray_local: None, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    # Given a provider of its own (60 requests a minute, at most one a second, as OpenAI enforces a
    # per-minute limit over shorter periods) and a node with no model client yet
    provider = start_provider_subprocess(
        ProviderConfig(tpm=1_000_000, rpm=120, models=("sim-small",)), log_path=tmp_path / "provider.log"
    )
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    try:
        _no_model_client()
        workload = parse_workload(_workload(provider.base_url), "cold.yaml")
        options = RunOptions(run_id="cold")
        # When eight one-call trajectories start together through the scheduler
        stop = threading.Event()
        with Services(workload, options) as services:
            try:
                result = await asyncio.to_thread(run_driver, workload, services, options, None, stop)
            finally:
                stop.set()
        stats = provider.stats()
    finally:
        provider.stop()
    # Then every trajectory made its call, and the provider refused none of them
    ended = [(r.state, r.turns) for r in result.results]
    assert ended == [("COMPLETED", 1)] * TRAJECTORIES, [r.exit_reason for r in result.results]
    assert (stats["accepted"], stats["rate_limited"]) == (TRAJECTORIES, 0), stats["timeline"]
