"""Fixtures for integration and fault tests: a private redis-server per test, one shared local Ray, and a
summary of where the suite's time went."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from cluster.redis_server import RedisServer
from cluster.runner import prepare_local_ray, start_local_ray

# Every Ray process these tests start (local ray.init, `ray start` heads, fake autoscaler workers, job
# drivers) inherits this process's environment, so it is set up once for the whole session as for a local
# `tether run` (cluster.runner.prepare_local_ray): all on loopback, actors at normal priority (Ray's default
# niceness 15 let two busy loops make the control-plane tests >10x slower).
prepare_local_ray()
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports from test clusters

# Ray's temp dir is this run's own (and each pytest-xdist worker's: `make test` runs two, each with a shared
# local Ray of its own). A plain `ray.init()` joins the cluster last started with `ray start` on the host when
# Ray's temp dir names one (`ray_current_cluster`), so with one temp dir for all a worker could join another's
# cluster, or a test run someone's `/tmp/ray`. Every Ray process and `tether run` the tests start inherits it.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))[:8]
RAY_TMPDIR = f"/tmp/tether-{_RUN}-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
os.environ["RAY_TMPDIR"] = RAY_TMPDIR
os.makedirs(RAY_TMPDIR, exist_ok=True)


# Property tests are judged by their examples, not by wall-clock time: no per-example deadline, no "too slow"
# health check, so a slower or busier machine cannot fail them.
settings.register_profile("tether", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tether")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the run: the unit tests (no Ray, no servers) first, then the tests that connect this process to
    a Ray cluster of their own (``own_ray_cluster``), then everything that uses the shared local Ray; within a
    tier, the modules with the most tests first.

    After this process has started and shut down a local Ray, actors created on a cluster it joins later
    were cancelled before running ("all references removed") in our runs; a fresh process, or these
    tests first, never showed it. The defect is in the issue notes; meanwhile the order keeps it out, and
    ``_own_cluster_first`` fails a test that comes after the shared Ray all the same.

    Under pytest-xdist (``--dist loadfile``) whole modules are handed to the workers in this order, as long
    as xdist does not reorder them itself: by default it sorts all modules by their number of tests, which
    mixes the tiers, so the Makefile passes ``--no-loadscope-reorder``. The most tests first within a tier is
    xdist's own heuristic (big modules early, so the run does not end on one), kept inside each tier.
    """

    def tier(item: pytest.Item) -> int:
        if item.nodeid.startswith("tests/unit/"):
            return 0
        return 1 if item.get_closest_marker("own_ray_cluster") else 2

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    tests_in = Counter(module(item) for item in items)
    items.sort(key=lambda item: (tier(item), -tests_in[module(item)]))  # stable: modules stay whole


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, data in the test's temp dir, AOF always."""
    with TIMINGS.measure("redis-server start"):
        server = RedisServer(data_dir=tmp_path / "redis").start()
    try:
        yield server
    finally:
        with TIMINGS.measure("redis-server stop"):
            server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


class SharedRay:
    """One small local Ray for every test module that needs one, started on first use.

    Starting and stopping a local Ray is the most expensive fixture there is (a GCS, a raylet, agents and
    worker processes), so modules share it. Between modules every named actor is killed, so no module sees
    another's scheduler, relays, guards or trajectories. A test that must start a Ray of its own asks for
    ``no_shared_ray`` first; the next module that needs the shared one starts it again.
    """

    def __init__(self) -> None:
        self.metrics_port: int | None = None  # Ray's metrics export port (scraped by the metrics tests)
        self.started = False  # whether this process ever started it

    def ensure(self) -> int:
        import ray

        from cluster.fake_cluster import free_tcp_port

        if not ray.is_initialized():
            port = free_tcp_port()
            with TIMINGS.measure("ray.init (shared local Ray)"):
                start_local_ray(num_cpus=2, trajectory_slots=1000, metrics_export_port=port)
            self.started = True
            self.metrics_port = port
        assert self.metrics_port is not None, "a Ray not started by SharedRay is running"
        return self.metrics_port

    def kill_named_actors(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for entry in ray.util.list_named_actors(all_namespaces=True):
            with contextlib.suppress(ValueError):  # it ended on its own meanwhile
                ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]))

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            with TIMINGS.measure("ray.shutdown"):
                ray.shutdown()
        self.metrics_port = None


SHARED_RAY = SharedRay()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """The shared local Ray (see ``SharedRay``); this module's named actors are killed afterwards."""
    SHARED_RAY.ensure()
    try:
        yield
    finally:
        SHARED_RAY.kill_named_actors()


@pytest.fixture(scope="module")
def ray_metrics_port() -> Iterator[int]:
    """Ray's metrics export port (what Prometheus scrapes on each node) of a freshly started shared Ray:
    Ray's counters are cluster-wide, and a module that asserts exact values must not see another's."""
    SHARED_RAY.stop()
    port = SHARED_RAY.ensure()
    try:
        yield port
    finally:
        SHARED_RAY.kill_named_actors()


@pytest.fixture(autouse=True)
def _own_cluster_first(request: pytest.FixtureRequest) -> None:
    """An ``own_ray_cluster`` test must run before this process starts the shared Ray (see
    ``pytest_collection_modifyitems``); after it, it fails saying why, instead of meeting the defect."""
    if SHARED_RAY.started and request.node.get_closest_marker("own_ray_cluster"):
        pytest.fail(
            f"{request.node.nodeid} connects to a Ray cluster of its own, but this process already started "
            "the shared local Ray: the run order is broken (tests/conftest.py, "
            "pytest_collection_modifyitems; under pytest-xdist pass --no-loadscope-reorder)"
        )


@pytest.fixture
def no_shared_ray() -> None:
    """For a test that starts (or asserts there is no) Ray of its own: stop the shared one first."""
    SHARED_RAY.stop()


# --------------------------------------------------------------------------- where the time went
# Printed at the end of every run, so a slow CI machine says which part of the suite was slow.


class Timings:
    def __init__(self) -> None:
        self.fixtures: dict[str, list[float]] = defaultdict(list)
        self.modules: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def measure(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.fixtures[what].append(time.monotonic() - started)


TIMINGS = Timings()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    TIMINGS.modules[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    SHARED_RAY.stop()
    shutil.rmtree(RAY_TMPDIR, ignore_errors=True)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its fixture timings go back to the controller
        workeroutput["tether_fixture_timings"] = dict(TIMINGS.fixtures)


def pytest_testnodedown(node: Any, error: object) -> None:
    """On the xdist controller: a worker's fixture timings, for the summary."""
    for what, samples in getattr(node, "workeroutput", {}).get("tether_fixture_timings", {}).items():
        TIMINGS.fixtures[what].extend(samples)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    write = terminalreporter.write_line
    terminalreporter.section("where the time went")
    modules = sorted(TIMINGS.modules.items(), key=lambda kv: -kv[1])
    total = sum(TIMINGS.modules.values())
    workers = getattr(config.option, "numprocesses", None) or 0
    across = f", summed over {workers} workers" if workers > 1 else ""
    write(f"{total:8.1f}s in {len(modules)} modules{across}; the slowest:")
    for name, seconds in modules[:12]:
        write(f"{seconds:8.1f}s  {name}")
    for what, samples in sorted(TIMINGS.fixtures.items()):
        write(f"{what}: {len(samples)}x, mean {statistics.fmean(samples):.2f}s, max {max(samples):.2f}s")
    write(_machine_calibration())


def _machine_calibration() -> str:
    """The benchmarks' calibration (``benchmarks._common.calibration``), as the summary's one line, to compare
    this machine with the one the suite was written on (there: cpu loop 0.07-0.15s, process spawn ~1ms,
    fsync ~0.2ms)."""
    from benchmarks._common import calibration

    c = calibration()
    load = c["load_avg"]
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    shm_mb = shm.f_bavail * shm.f_frsize // 2**20 if shm else 0
    return (
        f"machine: cpu loop {c['cpu_loop_s']:.2f}s, process spawn {c['process_spawn_ms']:.1f}ms, "
        f"fsync {c['fsync_ms']:.1f}ms, load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, cpus {c['cpus']}, "
        f"memory available {c['mem_available_mb']} MB of {c['mem_total_mb']} MB, /dev/shm free {shm_mb} MB"
        + (f", cpu steal {c['cpu_steal']:.0%}" if c.get("cpu_steal") is not None else "")
    )
