"""Tether against a gateway it did not write: the LiteLLM proxy (1.108.x) with ``mock_response`` models.

The proxy is installed by this module into its own virtual environment (not a dependency of Tether),
cached under ``$TETHER_LITELLM_VENV`` or ``<tmp>/tether-litellm-1.108`` so reruns start at once; the module
is skipped only when the package registry cannot be reached. Its config (``litellm/config.yaml`` here)
gives one rpm-limited deployment per test, served by LiteLLM's router (``usage-based-routing-v2``: real 429s,
``llm_provider-retry-after: 60``, ``x-ratelimit-limit/remaining-requests`` on successes), and the callback
``litellm/tether_scenarios.py`` makes the mock model stream text, call a tool, answer 500s or break its
stream mid-way, per trajectory, and keeps the proxy's own ledger of requests and errors: the judge.

Every workload here believes a limit 10x the proxy's real one.

- ``test_the_adapter_and_scheduler_learn_the_routers_real_limit`` drives the real adapter and the real
  scheduler as the trajectory interpreter will (admit, call, ``report_limits``, settle): real 429s in the
  provider's first full minute, none after it.
- The ``tether run`` tests run a small workload through ``cluster.runner.Services`` + ``run_driver``: every
  trajectory ends as expected (a 429 is admission feedback and consumes no turn; admission waits are
  bounded by the trajectory's deadline), failed calls are billed what they streamed, and the router's 429s
  stop after its first full window; the report counts what the trajectories' adapters saw, by status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from actors.model_openai import OpenAIModel
from cluster.redis_server import free_port
from cluster.runner import RunOptions, RunResult, Services, run_driver
from cluster.workload import parse_workload
from runtime.errors import DependencyError, ProviderRateLimited
from runtime.events import ModelCallFailed
from runtime.ports import CancelToken, ModelRequest, RateLimitInfo, TurnRequest
from scheduler.config import ProviderLimits, SchedulerConfig
from scheduler.inprocess import InProcessScheduler
from tests.integration.trajectory_kit import events_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1500)]

LITELLM_SPEC = "litellm[proxy]>=1.108,<1.109"
MASTER_KEY = "sk-tether-test-unused"  # the proxy runs without a key (config.yaml)
KEY_ENV = "TETHER_TEST_LITELLM_KEY"
HERE = Path(__file__).parent / "litellm"
MINUTE = 60.0  # LiteLLM's router counts rpm per calendar minute
# Output of pip that means the registry could not be reached (the only reason to skip)
_UNREACHABLE = (
    "Could not fetch URL",
    "Failed to establish a new connection",
    "Temporary failure in name",
    "Network is unreachable",
    "No matching distribution found for litellm",
)


# --------------------------------------------------------------------------- the proxy


def litellm_venv() -> Path:
    """The cached environment with LiteLLM 1.108.x, installed on first use.

    Installed under a private name and renamed into place once complete, so an interrupted install is never
    taken for a finished one; it is only ever run through its ``bin/python`` (which, unlike the console
    scripts, does not name the environment's path), so the rename is safe."""
    venv = Path(os.environ.get("TETHER_LITELLM_VENV") or Path(tempfile.gettempdir()) / "tether-litellm-1.108")
    if _litellm_version(venv).startswith("1.108."):
        return venv
    partial = venv.with_name(f"{venv.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(partial)], check=True, timeout=300)
    install = subprocess.run(
        [str(partial / "bin" / "python"), "-m", "pip", "install", "-q", LITELLM_SPEC],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if install.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        output = install.stdout + install.stderr
        if any(marker in output for marker in _UNREACHABLE):
            pytest.skip(f"the package registry is unreachable, LiteLLM cannot be installed: {output[-400:]}")
        raise AssertionError(f"pip install {LITELLM_SPEC} failed:\n{output[-2000:]}")
    shutil.rmtree(venv, ignore_errors=True)
    partial.rename(venv)
    version = _litellm_version(venv)
    assert version.startswith("1.108."), f"installed LiteLLM {version!r}, wanted {LITELLM_SPEC}"
    return venv


def _litellm_version(venv: Path) -> str:
    python = venv / "bin" / "python"
    if not python.exists():
        return ""
    probe = "import litellm, importlib.metadata as m; print(m.version('litellm'))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    return done.stdout.strip() if done.returncode == 0 else ""


@dataclass
class Proxy:
    base_url: str
    ledger: Path

    def entries(self, group: str | None = None) -> list[dict[str, Any]]:
        """The proxy's own ledger (requests, errors, broken streams), optionally of one model group."""
        if not self.ledger.exists():
            return []
        rows = [json.loads(line) for line in self.ledger.read_text().splitlines() if line.strip()]
        return [r for r in rows if group is None or r.get("trajectory", "").startswith(group + ".")]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    venv = litellm_venv()
    workdir = tmp_path_factory.mktemp("litellm")
    shutil.copy(HERE / "config.yaml", workdir / "config.yaml")
    shutil.copy(HERE / "tether_scenarios.py", workdir / "tether_scenarios.py")
    port = free_port()
    ledger = workdir / "ledger.jsonl"
    env = {
        **os.environ,
        "TETHER_LITELLM_LEDGER": str(ledger),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the price list from the internet
        "PYTHONPATH": str(workdir),
    }
    log = (workdir / "proxy.log").open("w")
    process = subprocess.Popen(
        [
            # its console script names the environment's install-time path in its shebang; the module does not
            str(venv / "bin" / "python"),
            "-m",
            "litellm.proxy.proxy_cli",
            "--config",
            "config.yaml",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=workdir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until_alive(f"http://127.0.0.1:{port}/health/liveliness", process, workdir / "proxy.log")
        yield Proxy(f"http://127.0.0.1:{port}/v1", ledger)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()


def wait_until_alive(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 180.0) -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if process.poll() is not None:
            raise AssertionError(
                f"the LiteLLM proxy exited ({process.returncode}):\n{log.read_text()[-3000:]}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"the LiteLLM proxy did not answer on {url} within {timeout_s:.0f}s")


def first_full_minute_end(started: float) -> float:
    """The end of the router's first full window: the first calendar minute that began after the start."""
    return (math.floor(started / MINUTE) + 2) * MINUTE


def rejected_429(entries: list[dict[str, Any]]) -> list[float]:
    return [e["t"] for e in entries if e["event"] == "error" and e.get("status") == 429]


def accepted_after(entries: list[dict[str, Any]], when: float) -> int:
    requests = [e for e in entries if e["event"] == "request" and e["t"] >= when]
    return len(requests) - len([t for t in rejected_429(entries) if t >= when])


# --------------------------------------------------------------------------- adapter + scheduler


async def test_the_adapter_and_scheduler_learn_the_routers_real_limit(proxy: Proxy) -> None:
    # Given the proxy's "tether-direct" deployment at rpm 6, a scheduler configured for 60 (10x), no headroom
    key = f"{proxy.base_url}|tether-direct"
    limits = ProviderLimits(tokens_per_minute=1_000_000, requests_per_minute=60, headroom=0.0)
    scheduler = InProcessScheduler(SchedulerConfig(providers={key: limits}))
    model = OpenAIModel(base_url=proxy.base_url, api_key=MASTER_KEY)
    started = time.time()
    stop_at = first_full_minute_end(started) + 20.0  # through the first full window and into the next
    outcomes: list[str] = []

    async def client(n: int) -> None:
        while time.time() < stop_at:
            deadline = time.time() + 300
            grant = await scheduler.admit_turn(
                TurnRequest(f"direct.plain-{n}", "standard", key, 200, deadline)
            )
            request = ModelRequest(
                f"direct.plain-{n}",
                "tether-direct",
                [{"role": "user", "content": "hi"}],
                50,
                time.time() + 30,
            )
            try:
                reply = await model.complete(request, CancelToken())
            except ProviderRateLimited as limited:
                info = (
                    limited.rate_limit if isinstance(limited.rate_limit, RateLimitInfo) else RateLimitInfo()
                )
                await scheduler.report_limits(key, info, rate_limited=True)
                await scheduler.settle_turn(grant.grant_id, 0)
                outcomes.append("429")
                continue
            if reply.rate_limit is not None:  # as the interpreter does after every response with headers
                await scheduler.report_limits(key, reply.rate_limit, rate_limited=False)
            await scheduler.settle_turn(grant.grant_id, reply.usage.total)
            outcomes.append("ok")

    # When four clients keep the key saturated (each waits for admission, bounded by its deadline)
    await asyncio.wait_for(
        asyncio.gather(*(client(n) for n in range(4))), timeout=stop_at - time.time() + 120
    )
    await model.aclose()
    lane = scheduler.snapshot().lanes[key]
    await scheduler.aclose()
    # Then the router really rejected calls in its first full window, and none after it
    entries = proxy.entries("direct")
    end = first_full_minute_end(started)
    assert rejected_429(entries), "no 429 from the router at all: the test proved nothing"
    assert [t for t in rejected_429(entries) if t >= end] == []
    assert accepted_after(entries, end) >= 1  # the judge saw traffic after the first window
    # And the scheduler holds the router's real limit, honoured its retry hint, and saw every 429
    assert lane.limit_requests <= 6 and lane.limit_sources["requests"] in {"stated", "inferred"}
    assert lane.retry_hints_honoured == {"llm_provider-retry-after": outcomes.count("429")}
    assert lane.rate_limited == outcomes.count("429") == len(rejected_429(entries))


# --------------------------------------------------------------------------- tether run


WORKLOAD = """\
name: litellm-proof
provider:
  kind: openai_compatible
  base_url: {base_url}
  model: tether-mock
  api_key_env: {key_env}
  limits: {{tpm: 1000000, rpm: 100}}   # the proxy's router allows 10: 10x too high
  headroom: 0.0
tools:
  - {{name: noop, source: builtin}}
trajectories:
  - {{id: plain, count: 6, completion_check: {{kind: always}}, expected_state: COMPLETED, {common}}}
  - {{id: tools, count: 3, grants: [noop], completion_check: {{kind: min_tool_results, count: 1}},
     expected_state: COMPLETED, {common}}}
  - {{id: flaky, count: 2, completion_check: {{kind: always}}, expected_state: COMPLETED, {common}}}
  - {{id: broken, count: 2, completion_check: {{kind: always}}, expected_state: COMPLETED, {common}}}
  - {{id: down, completion_check: {{kind: always}}, expected_state: FAILED, {common}}}
"""
# Calls wait up to 120 s for the proxy (the workload default is 30 s): under make test-stress the proxy
# answered after up to ~30 s, and a call abandoned at its deadline is answered (often 429) to nobody, so the
# adapters' counts could not match the proxy's ledger (75 calls, 30 abandoned, 20 of 39 429s seen in one run).
COMMON = (
    "deadline_s: 420, call_deadline_s: 120,"
    " budget: {turns: 12, wall_seconds: 420, tokens: 100000, dollars: 1.0}"
)
RUN_ID = "litellm"


@dataclass
class LitellmRun:
    result: RunResult
    started: float
    redis_url: str
    proxy: Proxy


@pytest.fixture(scope="module")
def litellm_run(
    proxy: Proxy, ray_local: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LitellmRun]:
    from cluster.redis_server import RedisServer

    home = tmp_path_factory.mktemp("tether-home")
    workload = parse_workload(
        WORKLOAD.format(base_url=proxy.base_url, key_env=KEY_ENV, common=COMMON), "litellm-proof.yaml"
    )
    redis = RedisServer(data_dir=home / "redis").start()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TETHER_REDIS_URL", redis.url)
            env.setenv("TETHER_HOME", str(home))
            env.setenv(KEY_ENV, MASTER_KEY)
            with Services(workload, RunOptions()) as services:
                started = time.time()
                result = run_driver(workload, services, RunOptions(run_id=RUN_ID, poll_s=0.2))
                yield LitellmRun(result, started, redis.url, proxy)
    finally:
        redis.stop()


def test_the_run_report_shows_what_tether_saw_of_the_gateway(litellm_run: LitellmRun) -> None:
    report = json.loads(json.dumps(litellm_run.result.report()))["provider"]
    states = [(r.name, r.state, r.exit_reason, r.error) for r in litellm_run.result.results]
    assert litellm_run.proxy.entries(RUN_ID), f"no request of the run reached the proxy: {states}"
    # Then the report is no longer null for a real server: the scheduler's view of the key
    (lane,) = report["scheduler"].values()
    entries = litellm_run.proxy.entries(RUN_ID)
    assert report["simulated"] is None
    assert report["requests"] == lane["granted"] >= len({e["trajectory"] for e in entries})
    assert report["rate_limited"] == lane["rate_limited"] == len(rejected_429(entries)) >= 1
    # (every 429's hint paused the key; which header carried it reaches the scheduler with the decider's
    # report_limits, until then as "unnamed")
    assert sum(lane["retry_hints_honoured"].values()) == lane["rate_limited"]
    assert set(lane["retry_hints_honoured"]) <= {"llm_provider-retry-after", "unnamed"}
    # And the limit the scheduler learned is the router's, not the workload's 100
    assert lane["limit_requests"] <= 10 and lane["limit_sources"]["requests"] in {"stated", "inferred"}
    # And each 429 came back with its grant, so the scheduler dated it: a delay margin, at most half a window
    assert 0 < lane["delay_margin_s"] <= 30


def test_completed_trajectories_are_metered_from_the_gateways_usage(litellm_run: LitellmRun) -> None:
    completed = [r for r in litellm_run.result.results if r.state == "COMPLETED"]
    assert completed, "no trajectory completed"
    assert all(r.tokens > 0 and r.dollars > 0 for r in completed)


def test_every_trajectory_ends_as_expected_and_the_429s_stop_after_the_first_window(
    litellm_run: LitellmRun,
) -> None:
    result = litellm_run.result
    # Then every trajectory ends in its expected state: none failed for a 429 or an admission wait
    assert [(r.name, r.state, r.exit_reason) for r in result.unexpected] == []
    assert {r.exit_reason for r in result.results if r.name.startswith("down")} == {"MODEL_ERROR"}
    # And the router's 429s stopped after its first full window, with traffic going on after it
    entries = litellm_run.proxy.entries(RUN_ID)
    end = first_full_minute_end(litellm_run.started)
    assert [t for t in rejected_429(entries) if t >= end] == []
    assert accepted_after(entries, end) >= 1
    # And the scheduler was told which header carried each retry hint (report_limits with the parsed info)
    (lane,) = result.provider["scheduler"].values()
    assert lane["retry_hints_honoured"] == {"llm_provider-retry-after": lane["rate_limited"]}


def test_failed_calls_are_billed_what_they_streamed(litellm_run: LitellmRun) -> None:
    # Then each broken stream's failed call carries the usage of the chunks it streamed, in the durable log
    # (a call the router refused with a 429 in its first window streamed nothing: not a broken stream)
    for name in ("broken-0", "broken-1"):
        events = asyncio.run(events_of(litellm_run.redis_url, f"{RUN_ID}.{name}"))
        failed = [e for e in events if isinstance(e, ModelCallFailed) and not e.rate_limited]
        assert failed and all(e.usage.output >= 2 and e.dollars > 0 for e in failed), failed


def test_control_the_bare_proxy_answers_429_with_only_the_gateway_hint(proxy: Proxy) -> None:
    """What the adapter has to read: LiteLLM's router 429 carries ``llm_provider-retry-after`` and no
    ``Retry-After`` (so an adapter reading only the standard headers pauses its default instead)."""

    async def hammer() -> ProviderRateLimited:
        model = OpenAIModel(base_url=proxy.base_url, api_key=MASTER_KEY)
        try:
            for _ in range(20):
                request = ModelRequest(
                    "control.plain-0",
                    "tether-control",
                    [{"role": "user", "content": "hi"}],
                    20,
                    time.time() + 30,
                )
                try:
                    await model.complete(request, CancelToken())
                except ProviderRateLimited as limited:
                    return limited
                except DependencyError:
                    continue
        finally:
            await model.aclose()
        raise AssertionError("the router never answered 429 to 20 calls at rpm 2")

    limited = asyncio.run(hammer())
    info = limited.rate_limit
    assert isinstance(info, RateLimitInfo)
    assert (info.hint_source, info.retry_after_s) == ("llm_provider-retry-after", 60.0)
    cause = limited.__cause__
    headers = getattr(getattr(cause, "response", None), "headers", {})
    assert "retry-after" not in headers and "retry-after-ms" not in headers


def test_the_report_counts_what_the_adapters_saw_by_status(litellm_run: LitellmRun) -> None:
    observed = litellm_run.result.provider["observed"]
    entries = litellm_run.proxy.entries(RUN_ID)
    (seen,) = observed.values()
    # Then every request the proxy received was seen by an adapter, with the proxy's own statuses
    assert seen["requests"] == len([e for e in entries if e["event"] == "request"])
    assert seen["responses"].get("429", 0) == len(rejected_429(entries))
    assert seen["responses"].get("500", 0) == len([e for e in entries if e.get("status") == 500])
    assert seen["retry_hints"] == {"llm_provider-retry-after": len(rejected_429(entries))}
