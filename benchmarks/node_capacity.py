"""Capacity of one node, each figure beside its floor in the same run.

1. **Scheduler throughput.** ``C`` caller actors (separate processes, as trajectory actors are) each run
   ``L`` concurrent loops of admit -> settle through ``SchedulerHandle`` against the real scheduler actor
   (limits far above the load, so nothing waits for tokens: the admission path itself is measured), in
   two admission modes: ``leased`` (the default: each process admits from chunks it leases while the key
   is uncontended, ``scheduler.lease``) and ``per_call`` (``SchedulerConfig.leasing=None``: one admit call
   per turn, settlements batched). The floor: the same callers calling a bare async Ray actor (one call
   per operation). Also the scheduler's own logic with no Ray at all (``InProcessScheduler``, the same
   loops in one process): what the algorithm could do if calls were free. Runs are interleaved (floor,
   leased, per-call, floor, ...). ``--only scheduler`` runs this part alone.
2. **Memory per actor.** RSS, USS (private pages) and PSS from ``/proc/<pid>/smaps_rollup`` of: a bare Ray
   actor; a probe actor importing the trajectory actor's dependencies one by one (where the memory goes),
   then the modules a trajectory no longer loads (issue 14: the ``openai`` SDK lives in the node's model
   client actor, ``actors.model_client``; gRPC only when a tool routes to it; Ed25519 on the first control
   message), so their cost stays visible; ``N`` live, *running* trajectory actors (``actors.trajectory``,
   the built-in ``sleep`` tool every turn, a real Redis log and the testbed provider), and the node's
   model client actor they share (one per node, its cost amortised over every trajectory on the node).
   Also the extra hop's price: the same short model call, from one actor, through the in-process adapter
   and through the node's model client (alternating, sequential calls).
3. **Largest number of live trajectories.** Not probed to exhaustion (others share this machine, so it is
   capped at ``N`` and extrapolated, and says so): one more live trajectory costs the node about its PSS
   (its private pages plus its share of the shared ones; with many actors PSS tends to USS), so
   ``(MemAvailable at start - reserve) / median trajectory PSS``. The drop of ``MemAvailable`` over the
   ``N`` started is recorded beside it as a cross-check (noisy while others work on the machine).
4. **Hibernated trajectories.** ``H`` trajectories paused after two turns hibernate (their actor compacts
   its log to one record snapshot and exits); Redis ``MEMORY USAGE`` of each one's keys is its cost at
   rest, reported per key (log, launch, status, nonces) beside the log's entry count and payload bytes.
   Waking: ``ensure_actor`` from the stored launch and a ``status`` call (the record folded from the
   snapshot, the actor answering) for all ``H`` at once; the woken actors are then stopped and the wake
   repeated. The breakdown, same run: ``H`` bare Ray actors started at once (the process-start floor),
   the read + decode + fold of one log in the driver (no process), and a fresh interpreter's import of
   ``ray`` and of the trajectory actor's module.
5. **Idle CPU** (``--only idle``; not in the full run). ``I`` live trajectories each waiting on one sandboxed
   command (the fleet ``control_latency`` kills) beside ``I`` bare async Ray actors, in the same windows:
   each process's CPU time (``/proc/<pid>/stat``, every thread) and wakeups (context switches of every
   thread, and of the main thread alone), and the whole machine's busy share. What a live trajectory costs
   the node while it does nothing, against what any Ray actor costs.
6. **Largest live count, probed** (``--only max_live``; not in the full run, it takes the machine). Part 2
   extrapolates; this starts trajectories ``PROBE_BATCH`` at a time, each turn one model call and then the
   sleep tool for a minute, until the next batch would take ``MemAvailable`` below ``RESERVE_MB`` at what
   each started process has cost so far (or ``--cap``), then checks that every one of them takes another
   turn. The floor, after they are stopped: bare Ray actors ramped the same way to the same reserve.

    .venv/bin/python -m benchmarks.node_capacity [--quick] [--runs 3]
        [--only scheduler|memory|hibernation|idle|max_live] [--live N] [--hibernated H] [--idle I] [--cap N]

Writes ``benchmarks/results/node_capacity.json`` (``--quick``: ``node_capacity.quick.json``) and a PNG;
``--only PART`` measures that part alone and writes ``node_capacity.PART.json`` (never the headline).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from benchmarks._common import (
    MIN_RUNS,
    busy_times,
    calibration,
    mem_available_mb,
    provenance,
    result_path,
    spread,
    tick_share,
    write_json,
)

NAME = "node_capacity"
KEY = "bench|capacity"
CLASSES = ("interactive", "standard", "batch")
# The trajectory actor's dependencies in the order it pulls them in; the probe imports them one by one.
IMPORT_LADDER = (
    "pydantic",
    "msgpack",
    # the package first, as in a trajectory's worker: it imports redis.asyncio without the OpenTelemetry SDK
    # (``actors._worker_imports``), so this row is redis-py's cost as a trajectory pays it
    "actors",
    "redis.asyncio",
    "yaml",
    "runtime.decider",
    "actors.interpreter",
    "scheduler.actor",
    "breakers",
    "actors.model_client",
    "cluster.adapters",
    "actors.trajectory",
    # Ray's own, when it sets up the worker's serialization context for the actor's constructor arguments
    # (``ray.util.serialization_addons``: serializers for pydantic's v1 fields and starlette's State,
    # imported whenever those packages are installed; starlette comes with the ``mcp`` SDK). The probe's
    # first call (``load("pydantic")``) sets up its context, so their cost shows in the pydantic row and
    # these rows are ~0: listed so the ladder names everything a trajectory has loaded.
    "pydantic.v1.fields",
    "starlette.datastructures",
)
# What a trajectory actor does not load (issue 14), imported after it: each delta is what it would cost.
NOT_IN_TRAJECTORY = (
    # the control verifier: the relay verifies and hands its verdict to the actor (docs/control.md)
    "cryptography.hazmat.primitives.asymmetric.ed25519",
    "cluster.signing",
    "grpc",
    "actors.tools_grpc",
    "openai",
    "actors.model_openai",
    # what redis-py would load for its own OpenTelemetry metrics (``actors._worker_imports``)
    "opentelemetry.sdk.metrics",
)
# The native library each of those imports maps, as /proc/<pid>/maps names it: read from the running
# trajectories, it checks the lists above against what a trajectory really loads (``mapped_by_trajectories``).
NATIVE_LIBRARY = {
    "pydantic": "/pydantic_core/_pydantic_core",
    "msgpack": "/msgpack/_cmsgpack",
    "yaml": "/yaml/_yaml",
    "cryptography.hazmat.primitives.asymmetric.ed25519": "/cryptography/hazmat/bindings/_rust",
    "grpc": "/grpc/_cython/cygrpc",
}
RESERVE_MB = 2_048  # left to the system when extrapolating the largest number of live trajectories


@dataclass(frozen=True)
class Settings:
    runs: int = 3
    callers: int = 4  # caller processes
    loops: int = 16  # concurrent loops per caller: callers * loops concurrent admissions
    seconds: float = 5.0  # per throughput run
    live: int = 24  # live trajectory actors probed for memory
    hibernated: int = 20  # trajectories hibernated, then woken together
    idle: int = 10  # idle trajectories (and as many bare actors) whose CPU is sampled
    idle_window_s: float = 30.0  # per idle CPU run
    quick: bool = False


QUICK = Settings(
    runs=3, callers=2, loops=8, seconds=1.5, live=4, hibernated=4, idle=3, idle_window_s=5.0, quick=True
)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def memory_of(pid: int | str = "self") -> dict[str, float]:
    """RSS, USS (private clean + dirty) and PSS of a process, in MB."""
    fields: dict[str, float] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return {
        "rss": round(fields.get("Rss", 0.0), 1),
        "uss": round(fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0), 1),
        "pss": round(fields.get("Pss", 0.0), 1),
    }


def process_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds a process has used (user + system, every thread) and its context switches so far: of
    every thread, and of its main thread alone (voluntary + involuntary; an idle thread's are its wakeups)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    task_dir = Path(f"/proc/{pid}/task")
    main = str(os.getpid()) if pid == "self" else str(pid)
    switches = main_switches = 0
    for task in os.listdir(task_dir):
        try:
            counted = _switches(task_dir / task / "status")
        except FileNotFoundError:  # the thread ended while we looked
            continue
        switches += counted
        if task == main:
            main_switches = counted
    return {"cpu_s": ticks / os.sysconf("SC_CLK_TCK"), "switches": switches, "main_switches": main_switches}


def _switches(status: Path) -> int:
    total = 0
    for line in status.read_text().splitlines():
        if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
            total += int(line.split()[1])
    return total


def cpu_rates(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Two ``process_cpu`` readings ``seconds`` apart as rates: % of one core, switches per second."""
    return {
        "cpu_pct": round(100.0 * (after["cpu_s"] - before["cpu_s"]) / seconds, 2),
        "switches_per_s": round((after["switches"] - before["switches"]) / seconds, 1),
        "main_switches_per_s": round((after["main_switches"] - before["main_switches"]) / seconds, 1),
    }


# ----------------------------------------------------------------------------- actors


@ray.remote(num_cpus=0)
class Bare:
    """The floor: an async actor that answers at once."""

    async def ping(self) -> int:
        return 1

    def pid(self) -> int:
        return os.getpid()

    def memory(self) -> dict[str, float]:
        return memory_of()


@ray.remote(num_cpus=0)
class ImportProbe:
    """A bare actor that imports modules on request and reports its memory after each."""

    def memory(self) -> dict[str, float]:
        return memory_of()

    def load(self, module: str) -> dict[str, float]:
        started = time.perf_counter()
        importlib.import_module(module)
        return {**memory_of(), "import_s": round(time.perf_counter() - started, 3)}


@ray.remote(num_cpus=0, max_concurrency=1_000)  # type: ignore[call-overload]
class Caller:
    """Runs ``loops`` concurrent operation loops for ``seconds``; returns how many operations finished
    and how many of the admissions came from leased chunks."""

    async def run(self, target: Any, mode: str, loops: int, seconds: float) -> tuple[int, int]:
        from runtime.ports import TurnRequest
        from scheduler.actor import SchedulerHandle

        handle = SchedulerHandle(target)
        stop = time.monotonic() + seconds
        done = 0

        async def loop(i: int) -> None:
            nonlocal done
            cls = CLASSES[i % len(CLASSES)]
            while time.monotonic() < stop:
                if mode == "bare":
                    await target.ping.remote()
                else:
                    grant = await handle.admit_turn(TurnRequest(f"t{i}", cls, KEY, 100, time.time() + 600))
                    await handle.settle_turn(grant.grant_id, 90)
                done += 1

        await asyncio.gather(*(loop(i) for i in range(loops)))
        return done, handle.leased_turns


# ----------------------------------------------------------------------------- 1. scheduler


async def inprocess_rate(loops: int, seconds: float) -> float:
    """admit + settle per second through ``InProcessScheduler`` in this process (no Ray)."""
    from runtime.ports import TurnRequest
    from scheduler import InProcessScheduler, ProviderLimits, SchedulerConfig

    limits = ProviderLimits(tokens_per_minute=10**12, requests_per_minute=10**10)
    scheduler = InProcessScheduler(SchedulerConfig(providers={KEY: limits}))
    await asyncio.sleep(0.5)  # the buckets start empty: let them fill far above the load
    stop = time.monotonic() + seconds
    done = 0

    async def loop(i: int) -> None:
        nonlocal done
        cls = CLASSES[i % len(CLASSES)]
        while time.monotonic() < stop:
            grant = await scheduler.admit_turn(TurnRequest(f"t{i}", cls, KEY, 100, time.time() + 600))
            await scheduler.settle_turn(grant.grant_id, 90)
            done += 1

    await asyncio.gather(*(loop(i) for i in range(loops)))
    await scheduler.aclose()
    return done / seconds


def scheduler_throughput(s: Settings) -> dict[str, Any]:
    from scheduler.actor import SchedulerHandle
    from scheduler.config import ProviderLimits, SchedulerConfig

    limits = ProviderLimits(tokens_per_minute=10**12, requests_per_minute=10**10)
    leased = SchedulerHandle.connect(
        SchedulerConfig(providers={KEY: limits}), name=f"sched-{uuid.uuid4().hex[:6]}"
    )
    per_call = SchedulerHandle.connect(
        SchedulerConfig(providers={KEY: limits}, leasing=None), name=f"sched-{uuid.uuid4().hex[:6]}"
    )
    bare = Bare.remote()  # type: ignore[attr-defined]
    callers = [Caller.remote() for _ in range(s.callers)]  # type: ignore[attr-defined]
    targets = (("bare", bare), ("leased", leased.actor), ("per_call", per_call.actor))
    # warm every path (worker start, first calls, bucket fill)
    for mode, target in targets:
        ray.get([c.run.remote(target, mode, 2, 0.5) for c in callers])
    time.sleep(1.0)
    rates: dict[str, list[float]] = {mode: [] for mode, _ in targets}
    leased_share: list[float] = []
    for _ in range(s.runs):
        for mode, target in targets:
            counts = ray.get([c.run.remote(target, mode, s.loops, s.seconds) for c in callers])
            done = sum(n for n, _ in counts)
            rates[mode].append(done / s.seconds)
            if mode == "leased":
                leased_share.append(sum(k for _, k in counts) / max(1, done))
    inproc = [asyncio.run(inprocess_rate(s.callers * s.loops, s.seconds)) for _ in range(s.runs)]
    for actor in (*callers, bare, leased.actor, per_call.actor):
        ray.kill(actor)
    return {
        "admission_mode": "leased",
        "admissions_per_s": spread(rates["leased"], 1),
        "per_call_admissions_per_s": spread(rates["per_call"], 1),
        "bare_actor_calls_per_s": spread(rates["bare"], 1),
        "inprocess_admissions_per_s": spread(inproc, 1),
        "leased_share": spread(leased_share, 3),
        "concurrent_callers": s.callers * s.loops,
        "caller_processes": s.callers,
        "what": (
            "admissions_per_s: admit + settle pairs per second through SchedulerHandle and the scheduler "
            "actor at default settings (admission_mode leased: each caller process admits from chunks it "
            "leases while the key is uncontended, leased_share of the admissions; the rest one admit call "
            "each); per_call_admissions_per_s: the same with SchedulerConfig.leasing=None (one admit call "
            "per turn, settlements batched per process); bare_actor_calls_per_s: calls to an async actor "
            "that answers at once, same callers; inprocess_admissions_per_s: the same loops against "
            "InProcessScheduler in one process (no Ray: the logic's own ceiling)"
        ),
    }


# ----------------------------------------------------------------------------- 2./3. memory


def import_ladder() -> list[dict[str, Any]]:
    probe = ImportProbe.remote()  # type: ignore[attr-defined]
    rows: list[dict[str, Any]] = [{"module": "(bare actor)", **ray.get(probe.memory.remote())}]
    for module in (*IMPORT_LADDER, *NOT_IN_TRAJECTORY):
        row = {"module": module, **ray.get(probe.load.remote(module))}
        rows.append({**row, "loaded_by_trajectory": module in IMPORT_LADDER})
    ray.kill(probe)
    previous = rows[0]
    for row in rows[1:]:
        row["delta_rss"] = round(row["rss"] - previous["rss"], 1)
        row["delta_uss"] = round(row["uss"] - previous["uss"], 1)
        previous = row
    return rows


class Fleet:
    """Trajectory actors over one Redis and the testbed provider, started like ``tether run`` starts them."""

    def __init__(self, redis_url: str, provider_url: str, keyring: Path) -> None:
        from cluster.adapters import ClusterAdapters
        from cluster.control_client import ControlClient

        self.redis_url = redis_url
        self.provider_url = provider_url
        self.keyring = keyring
        self.adapters = ClusterAdapters()
        self.client = ControlClient.from_url(redis_url, keyring=keyring, ttl_s=600.0)
        self.runs: list[Any] = []

    def launch(
        self,
        prefix: str,
        hibernate_after_s: float | None = None,
        scenario: str = "finish_after:100000",
        supervision: Any = None,
    ) -> str:
        from actors.launch import CheckLaunch, ProviderLaunch
        from actors.trajectory import TrajectoryLaunch, ensure_actor, save_launch

        tid = f"{prefix}-{uuid.uuid4().hex[:8]}"
        launch = TrajectoryLaunch(
            trajectory_id=tid,
            goal="keep working until stopped",
            ceilings={"tokens": 10_000_000},
            grants=("sleep",),
            local_tools=("sleep",),
            created_at=time.time(),
            deadline_s=86_400.0,
            metadata={"scenario": scenario},
            provider=ProviderLaunch(base_url=self.provider_url, model="sim"),
            redis_url=self.redis_url,
            use_scheduler=False,
            guard="local",
            keyring_path=str(self.keyring),
            completion_check=CheckLaunch(name="always"),
            hibernate_after_s=hibernate_after_s,
            tool_timeout_s=600.0,
            supervision=supervision,
        )
        save_launch(self.redis_url, launch)
        self.runs.append(ensure_actor(launch, self.adapters).run.remote())
        return tid

    async def start_working(
        self, prefix: str, n: int, scenario: str, timeout_s: float, supervision: Any = None
    ) -> tuple[list[str], str | None]:
        """Launch ``n`` trajectories and wait until each is in WAITING_TOOL (its first model call answered,
        now in its first tool call): their ids, and why not if some did not get there in ``timeout_s``."""
        tids = [self.launch(prefix, scenario=scenario, supervision=supervision) for _ in range(n)]
        try:
            await self.wait(tids, lambda st: st.state == "WAITING_TOOL", "WAITING_TOOL", timeout_s=timeout_s)
        except TimeoutError as e:
            return tids, f"a batch did not start: {e}"
        return tids, None

    async def wait(self, tids: Sequence[str], check: Any, what: str, timeout_s: float = 900.0) -> None:
        from runtime.errors import DependencyError

        deadline = time.monotonic() + timeout_s
        left = set(tids)
        while left:
            for tid in list(left):
                try:
                    status = await self.client.status(tid)
                except DependencyError:
                    status = None
                if status is not None and check(status):
                    left.discard(tid)
            if left and time.monotonic() > deadline:
                raise TimeoutError(f"{len(left)} trajectories never reached {what}")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        await self.client.close()


def mapped_libraries(pid: int) -> set[str]:
    """Which of ``NATIVE_LIBRARY``'s modules have their library mapped into process ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    return {module for module, path in NATIVE_LIBRARY.items() if path in maps}


def actor_pid(trajectory_id: str) -> int:
    actor = ray.get_actor(f"traj:{trajectory_id}", namespace="tether")
    pid: Any = ray.get(actor.pid.remote())
    return int(pid)


async def live_trajectories(fleet: Fleet, n: int) -> dict[str, Any]:
    """Start ``n`` running trajectories in batches; their memory and the node's marginal cost of each."""
    available_before = mem_available_mb()
    tids: list[str] = []
    for start in range(0, n, 8):  # batches: many workers importing at once starve a 2-core machine
        batch = [fleet.launch("live") for _ in range(min(8, n - start))]
        tids += batch
        await fleet.wait(batch, lambda st: st.turns >= 3, "three turns")
    await asyncio.sleep(2.0)
    pids = [actor_pid(tid) for tid in tids]
    per_actor = [memory_of(pid) for pid in pids]
    mapped = [mapped_libraries(pid) for pid in pids]
    clients = model_clients()
    available_after = mem_available_mb()
    marginal = (available_before - available_after) / n
    return {
        "tids": tids,
        "per_actor": per_actor,
        "mapped": mapped,
        "available": (available_before, available_after),
        "marginal_mb": marginal,
        "model_clients": clients,
    }


def model_clients() -> list[dict[str, float]]:
    """The memory of every node's model client actor (shared by the node's trajectories)."""
    from actors.model_client import NAMESPACE as CLIENT_NAMESPACE

    found: list[dict[str, float]] = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == CLIENT_NAMESPACE and entry["name"].startswith("model-client:"):
            actor = ray.get_actor(entry["name"], namespace=CLIENT_NAMESPACE)
            pid: Any = ray.get(actor.pid.remote())
            found.append(memory_of(int(pid)))
    return found


@ray.remote(num_cpus=0)
class HopProbe:
    """Times the same model call through the in-process adapter and through the node's model client."""

    async def run(self, base_url: str, calls: int) -> dict[str, list[float]]:
        from actors.model_client import ModelTarget, RayModelClient
        from actors.model_openai import OpenAIModel
        from runtime.ports import CancelToken, ModelRequest

        local = OpenAIModel(base_url=base_url)
        hop = RayModelClient(ModelTarget(base_url))
        times: dict[str, list[float]] = {"in_process": [], "node_client": []}
        for i in range(calls + 5):  # the first 5 of each warm the connection pools and the actor
            for name, model in (("in_process", local), ("node_client", hop)):
                request = ModelRequest(
                    trajectory_id="hop",
                    model="sim",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=16,
                    deadline=time.time() + 60,
                    metadata={"scenario": "finish_after:0"},
                )
                started = time.perf_counter()
                await model.complete(request, CancelToken())
                if i >= 5:
                    times[name].append((time.perf_counter() - started) * 1000)
        await local.aclose()
        return times


def model_hop(provider_url: str, calls: int) -> dict[str, Any]:
    """Per-call latency of the in-process adapter and of the node's model client, from one actor."""
    probe = HopProbe.remote()  # type: ignore[attr-defined]
    times = ray.get(probe.run.remote(provider_url, calls))
    ray.kill(probe)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "calls": calls,
        "in_process_ms": spread(times["in_process"], 2),
        "node_client_ms": spread(times["node_client"], 2),
        "hop_cost_ms_median": round(med["node_client"] - med["in_process"], 2),
        "what": "one short streamed reply (finish_after:0, 16 max tokens) from the testbed provider, "
        "called sequentially from one actor, alternating the two paths; the hop is one actor call per "
        "model call (the stream is consumed in the client actor)",
    }


def stop_trajectories(tids: Sequence[str]) -> None:
    for tid in tids:
        with contextlib.suppress(ValueError):  # already gone
            ray.kill(ray.get_actor(f"traj:{tid}", namespace="tether"), no_restart=True)


# ----------------------------------------------------------------------------- 6. largest live count, probed

PROBE_BATCH = 8  # started at once, as in part 2: many workers importing together starve 2 cores
PROBE_BATCH_TIMEOUT_S = 120.0  # a batch of 8 starts in seconds; one that takes this long: the node is full
PROBE_SLEEP_S = 60.0  # each probe trajectory's tool call: a turn a minute, mostly waiting
# every turn calls the sleep tool; 40 turns outlast any probe
PROBE_SCENARIO = "script:" + json.dumps([["sleep", {"seconds": PROBE_SLEEP_S}]] * 40, separators=(",", ":"))


def _ramp_stop(live: int, available: int, start_available: int, cap: int, first_mb: float) -> str | None:
    """Why the ramp stops before the next batch, or None: the cap, or the reserve the next batch would cross
    at the memory each started process has cost so far."""
    if live >= cap:
        return "cap"
    per = (start_available - available) / live if live else first_mb
    if available - PROBE_BATCH * max(per, 1.0) < RESERVE_MB:
        return "reserve"
    return None


async def probe_live_trajectories(fleet: Fleet, cap: int) -> dict[str, Any]:
    """Start probe trajectories ``PROBE_BATCH`` at a time until the next batch would take ``MemAvailable``
    below ``RESERVE_MB`` (or ``cap``); then check that every one of them still turns."""
    from runtime.states import LIVE_STATES

    start_available = mem_available_mb()
    started = time.monotonic()
    tids: list[str] = []
    trace: list[dict[str, float]] = []
    reason: str | None = None  # set by the ramp's stop rule, or by a batch that did not start
    while reason is None:
        reason = _ramp_stop(len(tids), mem_available_mb(), start_available, cap, 100.0)
        if reason is not None:
            break
        batch, reason = await fleet.start_working("probe", PROBE_BATCH, PROBE_SCENARIO, PROBE_BATCH_TIMEOUT_S)
        tids += batch
        trace.append(
            {
                "live": len(tids),
                "available_mb": mem_available_mb(),
                "elapsed_s": round(time.monotonic() - started, 1),
                "load1": round(os.getloadavg()[0], 2),
            }
        )
        if len(tids) % 40 == 0:
            progress(f"{len(tids)} live, MemAvailable {trace[-1]['available_mb']} MB")
    ramp_s = time.monotonic() - started
    held_available = mem_available_mb()
    turns = {tid: (await fleet.client.status(tid)) for tid in tids}
    before = {tid: (st.turns if st is not None else -1) for tid, st in turns.items()}
    progress(f"{len(tids)} live ({reason}); checking that each one turns again")
    deadline = time.monotonic() + PROBE_SLEEP_S * 3
    advanced: set[str] = set()
    while len(advanced) < len(tids) and time.monotonic() < deadline:
        for tid in tids:
            if tid not in advanced:
                st = await fleet.client.status(tid)
                if st is not None and st.turns > before[tid] >= 0 and st.state in LIVE_STATES:
                    advanced.add(tid)
        await asyncio.sleep(1.0)
    sample = [memory_of(actor_pid(tid)) for tid in tids[:: max(1, len(tids) // 10)]]
    stop_trajectories(tids)
    return {
        "live": len(tids),
        "turned_again": len(advanced),
        "stop": reason,
        "ramp_s": round(ramp_s, 1),
        "available_mb": {"start": start_available, "held": held_available},
        "mb_per_trajectory": round((start_available - held_available) / max(1, len(tids)), 1),
        "sampled_pss_mb": spread([m["pss"] for m in sample], 1),
        "sampled_uss_mb": spread([m["uss"] for m in sample], 1),
        "trace": trace,
    }


def probe_bare_actors(cap: int) -> dict[str, Any]:
    """The floor: bare Ray actors started the same way, to the same reserve."""
    start_available = mem_available_mb()
    started = time.monotonic()
    actors: list[Any] = []
    reason: str | None = None
    while reason is None:
        reason = _ramp_stop(len(actors), mem_available_mb(), start_available, cap, 60.0)
        if reason is not None:
            break
        batch = [Bare.remote() for _ in range(PROBE_BATCH)]  # type: ignore[attr-defined]
        try:
            ray.get([b.ping.remote() for b in batch], timeout=PROBE_BATCH_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            reason = f"a batch did not start within {PROBE_BATCH_TIMEOUT_S:.0f} s"
        actors += batch
    held_available = mem_available_mb()
    answered = sum(ray.get([b.ping.remote() for b in actors], timeout=300.0))
    ramp_s = time.monotonic() - started
    for b in actors:
        ray.kill(b)
    return {
        "live": len(actors),
        "answered": answered,
        "stop": reason,
        "ramp_s": round(ramp_s, 1),
        "available_mb": {"start": start_available, "held": held_available},
        "mb_per_actor": round((start_available - held_available) / max(1, len(actors)), 1),
    }


async def _settle_memory(target_mb: int, timeout_s: float = 120.0) -> int:
    """Wait until the killed processes' memory is back (``MemAvailable`` within 300 MB of ``target_mb``)."""
    deadline = time.monotonic() + timeout_s
    while mem_available_mb() < target_mb - 300 and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    return mem_available_mb()


async def max_live_part(
    s: Settings, workdir: Path, cap: int, after_run: Callable[[list[dict[str, Any]]], None]
) -> list[dict[str, Any]]:
    """Part 6: ``s.runs`` ramps of probe trajectories to the reserve, each followed by its floor (bare
    actors); ``after_run`` gets the runs so far after each one (a long probe keeps what it measured)."""
    runs: list[dict[str, Any]] = []
    async with fleet_services(workdir) as fleet:
        baseline = mem_available_mb()
        for i in range(s.runs):
            progress(f"run {i + 1}/{s.runs}: probe trajectories to the {RESERVE_MB} MB reserve (cap {cap})")
            trajectories = await probe_live_trajectories(fleet, cap)
            await _settle_memory(baseline)
            progress(
                f"run {i + 1}/{s.runs}: {trajectories['live']} trajectories held ({trajectories['stop']}), "
                f"{trajectories['turned_again']} turned again; now bare actors"
            )
            bare = probe_bare_actors(cap)
            await _settle_memory(baseline)
            progress(f"run {i + 1}/{s.runs}: {bare['live']} bare actors held")
            runs.append({"trajectories": trajectories, "bare": bare})
            after_run(runs)
    return runs


def summarise_max_live(runs: list[dict[str, Any]], cap: int) -> dict[str, Any]:
    return {
        "live_trajectories": spread([float(r["trajectories"]["live"]) for r in runs], 0),
        "turned_again": spread([float(r["trajectories"]["turned_again"]) for r in runs], 0),
        "live_bare_actors": spread([float(r["bare"]["live"]) for r in runs], 0),
        "mb_per_trajectory": spread([r["trajectories"]["mb_per_trajectory"] for r in runs], 1),
        "mb_per_bare_actor": spread([r["bare"]["mb_per_actor"] for r in runs], 1),
        "ramp_s": spread([r["trajectories"]["ramp_s"] for r in runs], 1),
        "bare_ramp_s": spread([r["bare"]["ramp_s"] for r in runs], 1),
        "reserve_mb": RESERVE_MB,
        "cap": cap,
        "batch": PROBE_BATCH,
        "runs": runs,
        "what": (
            f"live_trajectories: trajectory actors started {PROBE_BATCH} at a time (each turn one model "
            f"call, then the sleep tool for {PROBE_SLEEP_S:.0f} s) until the next batch would take "
            "MemAvailable below reserve_mb at the memory each one had cost so far, or cap; turned_again: "
            "how many of them took another turn afterwards (alive and working, "
            "not only started); live_bare_actors: the floor, bare async Ray actors ramped the same way "
            "after the trajectories were stopped; mb_per_*: the drop of MemAvailable per process started"
        ),
    }


def run_max_live(s: Settings, cap: int, out: Path) -> dict[str, Any]:
    """Part 6 alone (``--only max_live``). Ray gets ``cap`` trajectory slots, so the machine is probed, not
    the slots a node declares by default (recorded beside it)."""
    from actors.incarnation import default_trajectory_slots
    from cluster.runner import start_local_ray

    before = calibration()
    default_slots = default_trajectory_slots()
    settings = {**s.__dict__, "cap": cap}

    def result(runs: list[dict[str, Any]]) -> dict[str, Any]:
        part = {**summarise_max_live(runs, cap), "default_trajectory_slots": default_slots}
        return {"runs": len(runs), "only": "max_live", "max_live": part, **provenance(settings, before)}

    def keep(runs: list[dict[str, Any]]) -> None:
        write_json(out.stem, result(runs), out.parent)

    start_local_ray(num_cpus=2, trajectory_slots=cap)
    try:
        with tempfile.TemporaryDirectory(prefix="tether-capacity-") as tmp:
            runs = asyncio.run(max_live_part(s, Path(tmp), cap, keep))
    finally:
        ray.shutdown()
    return result(runs)


# ----------------------------------------------------------------------------- 7. live trajectories on time


def run_on_time(s: Settings, steps: Sequence[int], out: Path) -> dict[str, Any]:
    """Part 7 alone (``--only on_time``, ``benchmarks/_on_time.py``): ``s.runs`` sweeps through ``steps``,
    the result written after each. Ray gets the largest step's slots, as the max_live probe does."""
    from actors.incarnation import default_trajectory_slots
    from benchmarks._on_time import ON_TIME_S, SLEEP_S, TICK_S, WINDOW_PERIODS, largest_on_time
    from cluster.runner import start_local_ray

    sleep_s = 2.0 if s.quick else SLEEP_S
    before = calibration()
    settings = {**s.__dict__, "steps": list(steps), "sleep_s": sleep_s, "window_periods": WINDOW_PERIODS}
    runs: list[dict[str, Any]] = []

    def result() -> dict[str, Any]:
        largest = [float(largest_on_time(r["rows"])) for r in runs]
        part = {
            "largest_on_time": spread(largest, 0) if runs else None,
            "on_time_s": ON_TIME_S,
            "tick_s": TICK_S,
            "default_trajectory_slots": default_trajectory_slots(),
            "runs": [{k: v for k, v in r.items() if k != "tids"} for r in runs],
            "what": (
                f"each turn one model call, then the sleep tool for sleep_s; at each step of live "
                f"trajectories (started {PROBE_BATCH} at a time), after one settling sleep, a window of "
                f"window_periods sleeps: lateness_s = time between two consecutive turn starts inside the "
                "window (server time of their log appends) minus sleep_s, over every such pair; silent = "
                "live trajectories that started no turn in the window; parts_s = where the turns' time went, "
                "from the same appends (model: model call intent to settlement; sleep_overrun: tool dispatch "
                "to accepted result minus sleep_s; next_turn: accepted result to the next turn's start); "
                "floor_late_s = how late one bare "
                f"async Ray actor's {TICK_S} s sleeps woke in the same window; on_time = lateness p99 <= "
                "on_time_s and none silent; largest_on_time = the largest step up to which every step "
                "was on time"
            ),
        }
        return {"runs": len(runs), "only": "on_time", "on_time": part, **provenance(settings, before)}

    start_local_ray(num_cpus=2, trajectory_slots=max(steps))
    try:
        with tempfile.TemporaryDirectory(prefix="tether-capacity-") as tmp:
            for i in range(s.runs):
                progress(f"run {i + 1}/{s.runs}: sweeping {list(steps)} live trajectories")
                runs.append(asyncio.run(_one_sweep(Path(tmp) / f"run-{i}", steps, sleep_s)))
                write_json(out.stem, result(), out.parent)
    finally:
        ray.shutdown()
    return result()


async def _one_sweep(workdir: Path, steps: Sequence[int], sleep_s: float) -> dict[str, Any]:
    from benchmarks._on_time import sweep

    workdir.mkdir(parents=True)
    async with fleet_services(workdir) as fleet:
        found = await sweep(fleet, steps, sleep_s, PROBE_BATCH, PROBE_BATCH_TIMEOUT_S, progress)
        stop_trajectories(found["tids"])
        await asyncio.sleep(5.0)
    return found


# ----------------------------------------------------------------------------- 4. hibernation


async def key_costs(client: Any, tid: str) -> dict[str, Any]:
    """``MEMORY USAGE`` of each of a trajectory's keys (exact: every stream node sampled), and what the log
    holds (entries, payload bytes, the share of snapshot entries)."""
    from actors.trajectory import NONCE_KEY_PREFIX
    from cluster.control_client import LAUNCH_PREFIX, status_key
    from cluster.log_store import FIELD, log_key

    keys = {
        "log": log_key(tid),
        "launch": f"{LAUNCH_PREFIX}{tid}",
        "status": status_key(tid),
        "nonces": f"{NONCE_KEY_PREFIX}{tid}",
    }
    row: dict[str, Any] = {}
    for name, key in keys.items():
        row[name] = int(await client.memory_usage(key, samples=0) or 0)
    entries = await client.xrange(keys["log"])
    row["log_entries"] = len(entries)
    row["log_payload_bytes"] = sum(len(fields.get(FIELD, b"")) for _, fields in entries)
    row["launch_bytes"] = int(await client.strlen(keys["launch"]))
    row["status_fields"] = int(await client.hlen(keys["status"]))
    row["total"] = sum(row[name] for name in keys)
    return row


async def fold_times(redis_url: str, tids: Sequence[str]) -> list[float]:
    """Seconds to read, decode and fold each trajectory's log in this process (what a woken actor does to
    its log, without the process start, the imports or the ports)."""
    from actors.launch import load_launch
    from actors.wiring import build_policy, build_registry
    from cluster.log_store import RedisLogStore
    from runtime.snapshot import fold_entries

    out: list[float] = []
    async with RedisLogStore.from_url(redis_url) as store:
        for tid in tids:
            launch = load_launch(redis_url, tid)
            assert launch is not None
            policy = build_policy(launch, build_registry(launch))
            started = time.perf_counter()
            fold_entries(await store.read(tid), policy)
            out.append(time.perf_counter() - started)
    return out


def bare_start_s(n: int) -> float:
    """Seconds for ``n`` bare Ray actors created at once to answer one call each (the process-start floor)."""
    started = time.perf_counter()
    bares = [Bare.remote() for _ in range(n)]  # type: ignore[attr-defined]
    ray.get([b.ping.remote() for b in bares])
    elapsed = time.perf_counter() - started
    for b in bares:
        ray.kill(b)
    return elapsed


def import_s() -> dict[str, float]:
    """Seconds a fresh interpreter takes to import ``ray`` alone and then the trajectory actor's module."""
    import subprocess

    code = (
        "import time; t = time.perf_counter(); import ray; r = time.perf_counter() - t; "
        "t = time.perf_counter(); import actors.trajectory; print(r, time.perf_counter() - t)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ray_s, actor_s = (float(x) for x in done.stdout.split())
    return {"ray": ray_s, "actors.trajectory": actor_s}


async def hibernation(fleet: Fleet, h: int, rounds: int) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from actors.trajectory import ensure_actor, load_launch
    from cluster.control import ControlAction

    tids = [fleet.launch("hib", hibernate_after_s=0.5) for _ in range(h)]
    await fleet.wait(tids, lambda st: st.turns >= 2, "two turns")
    for tid in tids:
        await fleet.client.send(tid, ControlAction.PAUSE, issuer="operator", check_known=False)
    await fleet.wait(tids, lambda st: st.hibernated, "hibernation")
    await asyncio.sleep(3.0)  # the hibernated processes are gone (and done writing)
    client = aioredis.Redis.from_url(fleet.redis_url)
    try:
        costs = [await key_costs(client, tid) for tid in tids]
    finally:
        await client.aclose()
    wake_s: list[float] = []
    bare_s: list[float] = []
    fold_s: list[float] = []
    imports: list[dict[str, float]] = []
    for _ in range(rounds):
        bare_s.append(bare_start_s(len(tids)))
        await asyncio.sleep(1.0)
        started = time.perf_counter()
        launches = [load_launch(fleet.redis_url, tid) for tid in tids]
        actors = [ensure_actor(launch, fleet.adapters) for launch in launches if launch is not None]
        statuses = await asyncio.gather(*(a.status.remote() for a in actors))
        wake_s.append(time.perf_counter() - started)
        assert all(st["state"] == "PAUSED" for st in statuses), [st["state"] for st in statuses]
        stop_trajectories(tids)  # back to rest: the record stays in Redis
        await asyncio.sleep(3.0)
        fold_s += await fold_times(fleet.redis_url, tids)
        imports.append(import_s())
    n = len(tids)
    parts = ("log", "launch", "status", "nonces", "log_entries", "log_payload_bytes", "launch_bytes")
    return {
        "bytes_per_trajectory": spread([float(c["total"]) for c in costs], 0),
        "bytes_by_key": {p: spread([float(c[p]) for c in costs], 0) for p in parts},
        "log_entries_per_trajectory": spread([float(c["log_entries"]) for c in costs], 1),
        "wake_n": n,
        "wake_s": spread(wake_s, 3),
        "wake_s_per_trajectory": round(statistics.median(wake_s) / n, 3),
        "wake_breakdown": {
            "bare_actors_start_s": spread(bare_s, 3),
            "fold_s_per_trajectory": spread(fold_s, 4),
            "import_ray_s": spread([i["ray"] for i in imports], 3),
            "import_trajectory_actor_s": spread([i["actors.trajectory"] for i in imports], 3),
            "what": (
                "bare_actors_start_s: wake_n bare Ray actors created at once until each answered a call "
                "(the process-start floor, same run); fold_s_per_trajectory: reading, decoding and folding "
                "one hibernated log in the driver (no process start, imports or ports); import_*: a fresh "
                "interpreter importing ray, then the trajectory actor's module (one at a time, so a lower "
                "bound on what each woken worker spends before it can fold)"
            ),
        },
        "keys": ["tether:log:<id>", "tether:launch:<id>", "tether:status:<id>", "tether:nonces:<id>"],
    }


# ----------------------------------------------------------------------------- run


@contextlib.asynccontextmanager
async def fleet_services(workdir: Path) -> AsyncIterator[Fleet]:
    """A ``Fleet`` with what it needs for as long as the block lasts: a Redis with its data under ``workdir``,
    the testbed provider, an operator key and two control relays."""
    from actors.relay import start_relays, stop_relays
    from cluster.redis_server import RedisServer
    from cluster.signing import Role, create_key
    from testbed.provider.config import ProviderConfig
    from testbed.provider.launch import start_provider_thread

    server = RedisServer(data_dir=workdir / "redis").start()
    provider = start_provider_thread(ProviderConfig(ttft_ms=20.0, tokens_per_s=2000.0))
    keyring = workdir / "keyring.yaml"
    create_key("operator", [Role.OPERATOR], keyring)
    fleet = Fleet(server.url, provider.base_url, keyring)
    relays = start_relays(server.url, 2, adapters=fleet.adapters, config={"block_ms": 100})
    try:
        yield fleet
    finally:
        stop_relays(relays)
        await fleet.close()
        provider.stop()
        server.stop()


async def services_part(s: Settings, workdir: Path, only: str | None = None) -> dict[str, Any]:
    async with fleet_services(workdir) as fleet:
        live: dict[str, Any] | None = None
        hop: dict[str, Any] | None = None
        hib: dict[str, Any] | None = None
        if only in (None, "memory"):
            progress(f"starting {s.live} live trajectories")
            live = await live_trajectories(fleet, s.live)
            stop_trajectories(live["tids"])
            await asyncio.sleep(3.0)
            progress("model-call hop")
            hop = model_hop(fleet.provider_url, 50 if s.quick else 200)
        if only in (None, "hibernation"):
            progress(f"hibernating {s.hibernated} trajectories")
            hib = await hibernation(fleet, s.hibernated, s.runs)
    return {"live": live, "hibernated": hib, "hop": hop}


def run_hibernation(s: Settings) -> dict[str, Any]:
    """The hibernation part alone (``--only hibernation``)."""
    from cluster.runner import start_local_ray

    before = calibration()
    start_local_ray(num_cpus=2)
    try:
        with tempfile.TemporaryDirectory(prefix="tether-capacity-") as tmp:
            part = asyncio.run(services_part(s, Path(tmp), only="hibernation"))
    finally:
        ray.shutdown()
    return {"runs": s.runs, "hibernated": part["hibernated"], **provenance(s.__dict__, before)}


def run(s: Settings, memory_only: bool = False) -> dict[str, Any]:
    """Every part (``memory_only``: part 2 and the model hop alone, no scheduler and no hibernation)."""
    from cluster.runner import start_local_ray

    before = calibration()
    start_local_ray(num_cpus=2)
    try:
        sched: dict[str, Any] | None = None
        if not memory_only:
            progress("scheduler throughput")
            sched = scheduler_throughput(s)
        progress("import ladder")
        ladder = import_ladder()
        bares = [Bare.remote() for _ in range(max(MIN_RUNS, s.runs))]  # type: ignore[attr-defined]
        bare_mem = ray.get([b.memory.remote() for b in bares])
        for b in bares:
            ray.kill(b)
        with tempfile.TemporaryDirectory(prefix="tether-capacity-") as tmp:
            part = asyncio.run(services_part(s, Path(tmp), "memory" if memory_only else None))
    finally:
        ray.shutdown()
    live, hib = part["live"], part["hibernated"]
    per_actor = live["per_actor"]
    clients = live["model_clients"]
    pss = statistics.median(m["pss"] for m in per_actor)
    mapped: list[set[str]] = live["mapped"]
    for row in ladder:  # what the running trajectories show, beside what the lists above claim
        if row["module"] in NATIVE_LIBRARY:
            row["mapped_by_trajectories"] = sum(row["module"] in m for m in mapped) / len(mapped)
    available_at_start = live["available"][0]
    max_live = int((available_at_start - RESERVE_MB) / pss)
    memory = {
        "actor_memory_mb": {
            "trajectory_rss": spread([m["rss"] for m in per_actor], 1),
            "trajectory_uss": spread([m["uss"] for m in per_actor], 1),
            "trajectory_pss": spread([m["pss"] for m in per_actor], 1),
            "bare_rss": spread([m["rss"] for m in bare_mem], 1),
            "bare_uss": spread([m["uss"] for m in bare_mem], 1),
            "model_client_rss": spread([m["rss"] for m in clients], 1) if clients else None,
            "model_client_uss": spread([m["uss"] for m in clients], 1) if clients else None,
            "model_clients": len(clients),
            "import_ladder": ladder,
            "what": (
                "trajectory_*: running trajectory actors (sleep tool every turn, >= 3 turns done), one "
                "value per actor; bare_*: an async Ray actor with no imports of ours; model_client_*: the "
                "node's model client actor the trajectories share (one per node); import_ladder: one "
                "probe actor importing the trajectory actor's dependencies in order, then what a "
                "trajectory does not load (loaded_by_trajectory false; cumulative, delta = that import); "
                "mapped_by_trajectories: the share of the running trajectory actors whose process maps "
                "that import's native library (a check of loaded_by_trajectory)"
            ),
        },
        "model_hop": part["hop"],
    }
    if memory_only:
        return {"runs": s.runs, "only": "memory", **memory, **provenance(s.__dict__, before)}
    return {
        "runs": s.runs,
        "scheduler": sched,
        **memory,
        "max_live_trajectories": max_live,
        "max_live_estimate": {
            "extrapolated": True,
            "probed_live": len(per_actor),
            "marginal_mb_per_live_trajectory": round(pss, 1),
            "mem_available_drop_mb_per_trajectory": round(live["marginal_mb"], 1),
            "mem_available_mb_at_start": available_at_start,
            "reserve_mb": RESERVE_MB,
            "how": "(MemAvailable at start - reserve) / median PSS of a running trajectory actor; the "
            "MemAvailable drop per trajectory started is a cross-check (others' work moves it)",
        },
        "hibernated": hib,
        **provenance(s.__dict__, before),
    }


async def idle_cpu(s: Settings, workdir: Path) -> dict[str, Any]:
    """Part 5: ``s.idle`` live trajectories waiting on their sandboxed commands, beside as many bare actors
    and the fleet's two relays; every process's CPU and wakeups over ``s.runs`` windows of the same length."""
    from actors.relay import start_relays, stop_relays
    from benchmarks.control_latency import Fleet as IdleFleet
    from benchmarks.control_latency import launch_fleet
    from cluster.adapters import ClusterAdapters
    from cluster.redis_server import RedisServer
    from cluster.signing import Role, create_key
    from testbed.provider.config import ProviderConfig
    from testbed.provider.launch import start_provider_thread

    server = RedisServer(data_dir=workdir / "redis").start()
    provider = start_provider_thread(ProviderConfig(ttft_ms=20.0, tokens_per_s=2000.0))
    keyring = workdir / "keyring.yaml"
    create_key("operator", [Role.OPERATOR], keyring)
    fleet = IdleFleet(server.url, provider.base_url, keyring)
    groups: dict[str, int] = {}
    relays: list[Any] = []
    bares: list[Any] = []
    try:
        relays = start_relays(server.url, 2, adapters=ClusterAdapters(), config={"block_ms": 100})
        progress(f"starting {s.idle} trajectories, each waiting on a sandboxed command")
        tids = await launch_fleet(fleet, s.idle, groups, workdir / "workspaces")
        bares = [Bare.remote() for _ in range(s.idle)]  # type: ignore[attr-defined]
        pids = {
            "trajectory": [actor_pid(tid) for tid in tids],
            "bare": ray.get([b.pid.remote() for b in bares]),
            "relay": ray.get([r.pid.remote() for r in relays]),
        }
        await asyncio.sleep(5.0)  # let the last starts settle
        windows: list[dict[str, Any]] = []
        for run_no in range(s.runs):
            progress(f"idle window {run_no + 1}/{s.runs} ({s.idle_window_s:.0f} s)")
            machine_before = busy_times()
            before = {kind: [process_cpu(pid) for pid in ps] for kind, ps in pids.items()}
            started = time.monotonic()
            await asyncio.sleep(s.idle_window_s)
            after = {kind: [process_cpu(pid) for pid in ps] for kind, ps in pids.items()}
            seconds = time.monotonic() - started
            machine_after = busy_times()
            window: dict[str, Any] = {
                kind: [cpu_rates(b, a, seconds) for b, a in zip(before[kind], after[kind], strict=True)]
                for kind in pids
            }
            window["machine_busy_share"] = tick_share(machine_before, machine_after)
            window["seconds"] = round(seconds, 2)
            windows.append(window)
        states = [(await fleet.client.status(tid)) for tid in tids]
        still_waiting = sum(st is not None and st.state == "WAITING_TOOL" for st in states)
    finally:
        for pgid in groups.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for b in bares:
            ray.kill(b)
        stop_relays(relays)
        await fleet.close()
        provider.stop()
        server.stop()
    return {"windows": windows, "still_waiting_tool": still_waiting, "trajectories": len(tids)}


def summarise_idle(part: dict[str, Any]) -> dict[str, Any]:
    """Per kind: the spread of every process's rates over every window, and of the windows' medians."""
    windows = part["windows"]
    out: dict[str, Any] = {}
    for kind in ("trajectory", "bare", "relay"):
        kind_out: dict[str, Any] = {}
        for rate in ("cpu_pct", "switches_per_s", "main_switches_per_s"):
            pooled = [p[rate] for w in windows for p in w[kind]]
            medians = [statistics.median(p[rate] for p in w[kind]) for w in windows]
            kind_out[rate] = {"per_process": spread(pooled, 2), "window_medians": spread(medians, 2)}
        out[kind] = kind_out
    shares = [w["machine_busy_share"] for w in windows if w["machine_busy_share"] is not None]
    out["machine_busy_share"] = spread(shares, 3) if shares else None
    out["trajectories"] = part["trajectories"]
    out["still_waiting_tool"] = part["still_waiting_tool"]
    out["windows"] = windows
    out["what"] = (
        "trajectory: live trajectory actors, each in WAITING_TOOL on one sandboxed run_command "
        "(sh -c 'sleep 3600 & wait'; the sandbox's processes are not counted); bare: async Ray actors with "
        "no imports of ours, started after them; relay: the fleet's two control relays (XREADGROUP, "
        "block_ms 100). cpu_pct: % of one core (user + system, every thread, /proc/<pid>/stat); "
        "switches_per_s: context switches of every thread; main_switches_per_s: of the main thread alone; "
        "machine_busy_share: the whole machine's non-idle share of its cores over the window"
    )
    return out


def run_idle(s: Settings) -> dict[str, Any]:
    """Part 5 alone (``--only idle``)."""
    from cluster.runner import start_local_ray

    before = calibration()
    start_local_ray(num_cpus=2)
    try:
        with tempfile.TemporaryDirectory(prefix="tether-capacity-") as tmp:
            part = asyncio.run(idle_cpu(s, Path(tmp)))
    finally:
        ray.shutdown()
    return {"runs": s.runs, "only": "idle", "idle": summarise_idle(part), **provenance(s.__dict__, before)}


def run_scheduler_only(s: Settings) -> dict[str, Any]:
    """Part 1 alone (``--only scheduler``)."""
    from cluster.runner import start_local_ray

    before = calibration()
    start_local_ray(num_cpus=2)
    try:
        progress("scheduler throughput")
        sched = scheduler_throughput(s)
    finally:
        ray.shutdown()
    return {"runs": s.runs, "scheduler": sched, **provenance(s.__dict__, before)}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_m) = plt.subplots(1, 2, figsize=(12, 4.4))
    sched = result["scheduler"]
    names = ["bare actor call", "admit+settle (leased)", "admit+settle (per call)", "in-process (no Ray)"]
    keys = [
        "bare_actor_calls_per_s",
        "admissions_per_s",
        "per_call_admissions_per_s",
        "inprocess_admissions_per_s",
    ]
    med = [sched[k]["median"] for k in keys]
    err = [
        [m - sched[k]["min"] for m, k in zip(med, keys, strict=True)],
        [sched[k]["max"] - m for m, k in zip(med, keys, strict=True)],
    ]
    ax_s.bar(names, med, yerr=err, color=["grey", "tab:blue", "tab:cyan", "tab:green"])
    ax_s.tick_params(axis="x", labelsize=7)
    ax_s.set_yscale("log")
    ax_s.set_ylabel("operations / s (median, min-max)")
    ax_s.set_title(f"{sched['concurrent_callers']} concurrent callers")
    ladder = result["actor_memory_mb"]["import_ladder"]
    ax_m.plot(range(len(ladder)), [r["rss"] for r in ladder], marker="o", label="RSS")
    ax_m.plot(range(len(ladder)), [r["uss"] for r in ladder], marker="o", label="USS")
    ax_m.set_xticks(
        range(len(ladder)),
        [r["module"].split(".")[0] if i else "bare" for i, r in enumerate(ladder)],
        rotation=60,
        fontsize=7,
    )
    mem = result["actor_memory_mb"]
    ax_m.axhline(
        mem["trajectory_rss"]["median"], color="tab:blue", linestyle=":", label="running trajectory RSS"
    )
    ax_m.axhline(
        mem["trajectory_uss"]["median"], color="tab:orange", linestyle=":", label="running trajectory USS"
    )
    ax_m.set_ylabel("MB")
    ax_m.set_title("where a trajectory actor's memory goes")
    ax_m.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small and short, to check the benchmark works")
    parser.add_argument("--runs", type=int, default=None, help=f"repetitions (at least {MIN_RUNS})")
    parser.add_argument(
        "--only",
        choices=["scheduler", "memory", "hibernation", "idle", "max_live", "on_time"],
        default=None,
        help="run one part alone; writes node_capacity.<part>.json beside (never over) the headline file",
    )
    parser.add_argument("--live", type=int, default=None, help="live trajectory actors probed for memory")
    parser.add_argument("--hibernated", type=int, default=None, help="trajectories hibernated and woken")
    parser.add_argument("--idle", type=int, default=None, help="idle trajectories (--only idle)")
    parser.add_argument("--cap", type=int, default=600, help="most processes a ramp starts (--only max_live)")
    parser.add_argument(
        "--steps",
        default=None,
        help="comma list of live counts the on_time sweep observes (default 32,64,...,256; --quick 4,8)",
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    if args.runs is not None:
        settings = Settings(**{**settings.__dict__, "runs": max(MIN_RUNS, args.runs)})
    if args.live is not None:
        settings = Settings(**{**settings.__dict__, "live": max(1, args.live)})
    if args.hibernated is not None:
        if args.hibernated < 1:
            parser.error("--hibernated must be >= 1")
        settings = Settings(**{**settings.__dict__, "hibernated": args.hibernated})
    if args.idle is not None:
        if args.idle < 1:
            parser.error("--idle must be >= 1")
        settings = Settings(**{**settings.__dict__, "idle": args.idle})
    if args.only == "scheduler":
        result = run_scheduler_only(settings)
        out = result_path(NAME, settings.quick)
        out = out.with_name(f"{out.stem}.scheduler.json")
        write_json(out.stem, result, out.parent)
        print(out)
        print(result["scheduler"])
        return
    out = result_path(NAME, settings.quick)
    if args.only == "idle":
        result = run_idle(settings)
        out = out.with_name(f"{out.stem}.idle.json")
        write_json(out.stem, result, out.parent)
        print(out)
        idle = result["idle"]
        print({kind: idle[kind]["cpu_pct"]["per_process"] for kind in ("trajectory", "bare", "relay")})
        return
    if args.only == "max_live":
        if args.cap < PROBE_BATCH:
            parser.error(f"--cap must be >= {PROBE_BATCH}")
        out = out.with_name(f"{out.stem}.max_live.json")
        result = run_max_live(settings, args.cap, out)  # written after every run, the last one included
        print(out)
        print({k: result["max_live"][k] for k in ("live_trajectories", "turned_again", "live_bare_actors")})
        return
    if args.only == "on_time":
        from benchmarks._on_time import STEPS

        try:
            steps = sorted({int(x) for x in args.steps.split(",")}) if args.steps else None
        except ValueError:
            parser.error(f"--steps must be a comma list of counts, not {args.steps!r}")
        if steps is not None and (not steps or steps[0] < 1):
            parser.error("--steps must be counts >= 1")
        steps = steps or ([4, 8] if settings.quick else list(STEPS))
        out = out.with_name(f"{out.stem}.on_time.json")
        result = run_on_time(settings, steps, out)  # written after every run
        print(out)
        print({"largest_on_time": result["on_time"]["largest_on_time"]})
        return
    if args.only == "hibernation":
        result = run_hibernation(settings)
        out = out.with_name(f"{out.stem}.hibernation.json")
        write_json(out.stem, result, out.parent)
        print(out)
        print(result["hibernated"])
        return
    result = run(settings, memory_only=args.only == "memory")
    if args.only is not None:
        out = out.with_name(f"{NAME}.{args.only}.json")
    write_json(out.stem, result, out.parent)
    if args.only is None:
        plot(result, out.with_suffix(".png"))
    print(out)
    mem = result["actor_memory_mb"]
    print({k: mem[k] for k in ("trajectory_rss", "trajectory_uss", "bare_rss", "bare_uss")})
    print(result["model_hop"])


if __name__ == "__main__":
    main()
