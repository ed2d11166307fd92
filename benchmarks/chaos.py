"""The chaos suite: many trajectories doing side-effecting, compensable tool work while a seeded schedule of
faults hits every part of the system; judged from outside (``make chaos``).

    python -m benchmarks.chaos --seeds 20 --trajectories 100 --out benchmarks/results/chaos.json

For each seed: a fresh redis-server (AOF, ``appendfsync always``), the simulated provider and the testbed
tool services (applying every delivery) started here, and ``tether run`` as a subprocess joining a Ray head
started here. While it runs, the seeded schedule SIGKILLs trajectory actors, a control relay, the scheduler
and a guard actor (their worker processes, found in the head's POSIX session by their process titles),
kills redis-server and restarts it on the same port and directory, and makes the provisioner drop and hang
replies. Nothing the runtime reports is taken on trust; after the run:

- every trajectory's durable log is folded: ``terminal`` (COMPLETED/FAILED/CANCELED), ``handed_off``
  (not terminal, but handed to an owner with a reason: none exist before the cleanup issue), else ``lost``;
- ``over_budget``: a trajectory whose recorded spend exceeds one of its ceilings, or whose tokens billed by
  the provider (its own count) exceed the token ceiling;
- ``duplicate_effects``: deliveries of a non-repeatable tool that repeated an effect already applied, in
  flight or unknown (the testbed's record, ``LedgerSnapshot.duplicate_deliveries``);
- ``orphaned``: environments the testbed still has allocated at the end, each explained in the notes (who
  provisioned it, and what that trajectory's record says about its release); ``orphaned_handed_off``, of
  those, the ones whose release was handed off with the trajectory's packet (an owner was told; the rest
  have none);
- ``lost_acked_entries``: log entries read back from Redis before its crash (so acknowledged) that are
  missing or changed afterwards;
- ``tether_run``: its exit code and whether it wrote its report.

Results: ``{commit, seeds, trajectories, faults_injected:{kind:n}, terminal, handed_off, lost,
duplicate_effects, orphaned, over_budget, lost_acked_entries}`` plus one row per seed. A trajectory actor
costs up to 100 MB (``actors.incarnation.TRAJECTORY_ACTOR_BYTES``): ``--trajectories`` is sized down to what
the machine's available memory holds (said in the results).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from actors.incarnation import TRAJECTORY_ACTOR_BYTES
from benchmarks._common import environment
from cluster.fake_cluster import RayHead, session_pids
from cluster.log_store import FIELD
from cluster.redis_server import RedisServer
from cluster.runner import prepare_local_ray
from runtime.codec import decode
from runtime.errors import DependencyError
from runtime.fold import fold
from runtime.memstore import LOG_KEY_PREFIX
from runtime.obligations import ObligationState
from testbed.provider import ProviderConfig
from testbed.provider.launch import start_provider_subprocess
from testbed.tools import FaultMode, FaultPlan, LedgerSnapshot, TestbedClient, TestbedProcess

__all__ = ["ChaosConfig", "SeedResult", "judge_acked", "main", "plan_faults", "run_chaos", "run_seed"]

MODEL = "sim-small"
ACTOR_MB = TRAJECTORY_ACTOR_BYTES // 2**20  # what one trajectory actor's worker may cost
RESERVE_MB = 4096  # left to everything else on the machine
PROVISIONER = "env-provisioner"
TITLES = {  # process title prefix of each actor kind's worker
    "trajectory": "ray::TrajectoryActor",
    "relay": "ray::RelayActor",
    "scheduler": "ray::_SchedulerActorBody",
    "guard": "ray::GuardActor",
}
CEILINGS = {"turns": 12, "tokens": 40_000, "wall_seconds": 900, "dollars": 0.5}


@dataclass(frozen=True)
class ChaosConfig:
    trajectories: int = 100
    window_s: float = 60.0  # faults land within the first window_s seconds of the run
    run_bound_s: float = 1200.0  # `tether run` is interrupted after this (a hang becomes a finding)
    redis_down_s: tuple[float, float] = (2.0, 4.0)
    trajectory_kills: int = 0  # 0: one per 10 trajectories
    # tool calls each trajectory's script makes before its final answer: the run must outlast the window,
    # or the faults planned late in it land after the run ended (a faster runtime ends a run sooner)
    tool_calls: int = 3
    work_dir: Path | None = None


@dataclass
class SeedResult:
    seed: int
    trajectories: int
    faults_injected: dict[str, int]
    terminal: int
    handed_off: int
    lost: int
    duplicate_effects: int
    orphaned: int
    over_budget: int
    lost_acked_entries: int
    tether_run_exit: int | None
    report_written: bool
    duration_s: float
    states: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    orphaned_handed_off: int = 0  # of ``orphaned``: released by nobody, but handed off with the packet


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True, order=True)
class Fault:
    at_s: float
    kind: str
    arg: float = 0.0


def plan_faults(seed: int, trajectories: int, config: ChaosConfig) -> list[Fault]:
    """The seed's fault schedule: what, and how long after the run started (pure: same seed, same plan)."""
    rng = random.Random(seed)
    window = config.window_s
    kills = config.trajectory_kills or max(1, trajectories // 10)
    plan = [Fault(rng.uniform(0.1, 1.0) * window, "trajectory_sigkill") for _ in range(kills)]
    plan.append(Fault(rng.uniform(0.2, 0.9) * window, "relay_sigkill"))
    plan.append(Fault(rng.uniform(0.2, 0.9) * window, "scheduler_sigkill"))
    plan.append(Fault(rng.uniform(0.2, 0.9) * window, "guard_sigkill"))
    plan.append(Fault(rng.uniform(0.3, 0.8) * window, "redis_restart", rng.uniform(*config.redis_down_s)))
    plan.append(Fault(rng.uniform(0.1, 0.7) * window, "drop_replies", float(rng.randint(2, 4))))
    plan.append(Fault(rng.uniform(0.1, 0.7) * window, "hang_replies", float(rng.randint(1, 3))))
    return sorted(plan)


def workload_yaml(name: str, n: int, provider_url: str, testbed: str, tool_calls: int = 3) -> str:
    envs = max(1, (n * 7) // 10)
    tests = n - envs
    tools = "\n".join(
        f"  - {{name: {tool}, source: grpc, address: {testbed}}}"
        for tool in ("provision_env", "release_env", "run_tests")
    )
    budget = ", ".join(f"{k}: {v}" for k, v in CEILINGS.items())
    body = f"""\
name: {name}
provider:
  kind: openai_compatible
  base_url: {provider_url}
  model: {MODEL}
  limits: {{tpm: 5000000, rpm: 50000}}
tools:
{tools}
guard: actor
scheduler: true
tool_timeout_s: 3
retry: {{max_attempts: 3, base_backoff_s: 0.1, max_backoff_s: 1.0}}
trajectories:
  - id: env
    count: {envs}
    scenario: "finish_after:{tool_calls}"
    grants: [provision_env]
    budget: {{{budget}}}
    completion_check: {{kind: min_tool_results, count: {tool_calls}}}
"""
    if tests:
        body += f"""\
  - id: tests
    count: {tests}
    scenario: "finish_after:{tool_calls}"
    grants: [run_tests]
    budget: {{{budget}}}
    completion_check: {{kind: min_tool_results, count: {tool_calls}}}
"""
    return body


# --------------------------------------------------------------------------- finding and hitting the parts


def actor_workers(session: int, kind: str) -> list[int]:
    """Worker pids of one actor kind in the Ray head's session (by process title)."""
    prefix = TITLES[kind].encode()
    found = []
    for pid in session_pids(session):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(prefix):
            found.append(pid)
    return found


def read_logs(url: str) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every trajectory log as (entry id, event bytes) pairs, read straight from Redis."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        logs: dict[str, list[tuple[bytes, bytes]]] = {}
        for key in client.scan_iter(match=f"{LOG_KEY_PREFIX}*", count=500, _type="STREAM"):
            entries: Any = client.xrange(key)
            logs[key.decode()[len(LOG_KEY_PREFIX) :]] = [(i, f.get(FIELD, b"")) for i, f in entries]
        return logs
    finally:
        client.close()


def judge_acked(
    acked: Mapping[str, Iterable[tuple[bytes, bytes]]], after: Mapping[str, Iterable[tuple[bytes, bytes]]]
) -> int:
    """How many acknowledged entries (read back before a crash) are missing or changed afterwards."""
    lost = 0
    for trajectory, entries in acked.items():
        now = dict(after.get(trajectory, ()))
        lost += sum(1 for entry_id, payload in entries if now.get(entry_id) != payload)
    return lost


class Injector:
    """Carries out a seed's schedule against the running system; counts what it injected."""

    def __init__(self, head: RayHead, server: RedisServer, testbed: str, rng: random.Random) -> None:
        self.head = head
        self.server = server
        self.testbed = testbed
        self.rng = rng
        self.injected: Counter[str] = Counter()
        self.acked: dict[str, list[tuple[bytes, bytes]]] = {}
        self.notes: list[str] = []

    @property
    def session(self) -> int:
        session = getattr(self.head, "_session_id", None)
        assert isinstance(session, int), "the Ray head is not running"
        return session

    def _kill_one(self, kind: str) -> None:
        workers = actor_workers(self.session, kind)
        if not workers:
            self.notes.append(f"{kind}: no live worker to kill")
            return
        pid = self.rng.choice(workers)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            self.injected[f"{kind}_sigkill"] += 1

    def _redis_restart(self, down_s: float) -> None:
        with contextlib.suppress(redis.RedisError):
            for trajectory, entries in read_logs(self.server.url).items():
                self.acked.setdefault(trajectory, []).extend(entries)
        self.server.kill()
        time.sleep(down_s)  # the outage itself
        self.server.restart()
        self.injected["redis_restart"] += 1

    def _replies(self, mode: FaultMode, count: int) -> None:
        async def go() -> None:
            async with TestbedClient(self.testbed) as client:
                plan = FaultPlan(mode=mode, count=count, hang_s=1.0, tools=frozenset({"provision_env"}))
                await client.set_faults(plan, PROVISIONER)

        for attempt in range(3):  # the testbed is ours and local: a busy machine can still time a call out
            try:
                asyncio.run(go())
            except DependencyError as e:
                last = e
                time.sleep(1.0 + attempt)
                continue
            self.injected[f"{mode.value}"] += count
            return
        self.notes.append(f"{mode.value}: not injected, the testbed did not answer: {last}")

    def apply(self, fault: Fault) -> None:
        if fault.kind.endswith("_sigkill"):
            self._kill_one(fault.kind.removesuffix("_sigkill"))
        elif fault.kind == "redis_restart":
            self._redis_restart(fault.arg)
        elif fault.kind == "drop_replies":
            self._replies(FaultMode.DROP_REPLY, int(fault.arg))
        elif fault.kind == "hang_replies":
            self._replies(FaultMode.HANG, int(fault.arg))
        else:
            raise ValueError(f"unknown fault {fault.kind!r}")


# --------------------------------------------------------------------------- one seed


def git_commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()


def run_seed(seed: int, head: RayHead, config: ChaosConfig, trajectories: int, work: Path) -> SeedResult:
    """One seed: fresh Redis, provider and testbed; ``tether run`` under the seed's faults; the judges."""
    started = time.monotonic()
    seed_dir = work / f"seed-{seed}"
    seed_dir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(data_dir=seed_dir / "redis").start()
    provider = start_provider_subprocess(
        ProviderConfig(ttft_ms=150.0, tokens_per_s=200.0, models=(MODEL,), rpm=50_000, tpm=5_000_000),
        log_path=seed_dir / "provider.log",
    )
    testbed = TestbedProcess(provision_s=0.3).start()
    rng = random.Random(seed * 7919 + 1)
    injector = Injector(head, server, testbed.address, rng)
    run_id = f"chaos-s{seed}"
    report = seed_dir / "report.json"
    workload = seed_dir / "chaos.yaml"
    workload.write_text(
        workload_yaml(run_id, trajectories, provider.base_url, testbed.address, config.tool_calls)
    )
    env = {
        **os.environ,
        "TETHER_REDIS_URL": server.url,
        "TETHER_HOME": str(seed_dir / "home"),
        # as the head was started (RayHead): a process that ran a local Ray before has "token" here, and a
        # driver whose auth mode differs from its cluster's has its actors cancelled before they run
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }
    command = [
        str(Path(sys.executable).parent / "tether"),
        "run",
        str(workload),
        "--address",
        head.gcs_address,
        "--run-id",
        run_id,
        "--report",
        str(report),
        "--relays",
        "2",
    ]
    exit_code: int | None = None
    try:
        with (seed_dir / "tether-run.log").open("w") as out:
            proc = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            # The schedule's clock starts once trajectories run (the first log exists): the faults hit the
            # run, not `tether run` starting its services.
            if not _until_running(proc, server.url, run_id, config.run_bound_s):
                injector.notes.append("no trajectory log appeared: the schedule never started")
            t0 = time.monotonic()
            for fault in plan_faults(seed, trajectories, config):
                wait = fault.at_s - (time.monotonic() - t0)
                if wait > 0 and _wait_or_exit(proc, wait):
                    injector.notes.append(f"tether run ended before {fault.kind} at {fault.at_s:.1f}s")
                    break
                injector.apply(fault)
            try:
                exit_code = proc.wait(timeout=max(1.0, config.run_bound_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                injector.notes.append(
                    f"tether run still running after {config.run_bound_s:.0f}s: interrupted"
                )
                os.killpg(proc.pid, signal.SIGTERM)  # as Ctrl-C, also where SIGINT is ignored
                try:
                    exit_code = proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    exit_code = proc.wait()
        result = _judge(seed, trajectories, run_id, server, testbed.address, provider, injector)
    finally:
        testbed.stop()
        provider.stop()
        server.stop()
    tail = (seed_dir / "tether-run.log").read_text(errors="replace")[-1500:]
    result.tether_run_exit = exit_code
    result.report_written = report.exists()
    if result.lost:
        # what `tether run` said about the trajectories that did not end (it prints one line per failure)
        lines = (seed_dir / "tether-run.log").read_text(errors="replace").splitlines()
        said = Counter(
            line.split(":", 1)[1].strip()[:200] for line in lines if ": " in line and "." in line[:40]
        )
        result.notes += [f"tether run said, {n}x: {what}" for what, n in said.most_common(5)]
    result.duration_s = round(time.monotonic() - started, 1)
    if not result.report_written:
        result.notes.append(f"tether run wrote no report (exit {exit_code}); its last output: {tail}")
    return result


def _until_running(proc: subprocess.Popen[bytes], url: str, run_id: str, bound_s: float) -> bool:
    """Wait until some trajectory of ``run_id`` has a log (or ``proc`` ended, or ``bound_s`` passed)."""
    client = redis.Redis.from_url(url, socket_timeout=5)
    give_up = time.monotonic() + bound_s
    try:
        while time.monotonic() < give_up and proc.poll() is None:
            with contextlib.suppress(redis.RedisError):
                if next(client.scan_iter(match=f"{LOG_KEY_PREFIX}{run_id}.*", _type="STREAM"), None):
                    return True
            time.sleep(0.2)
    finally:
        client.close()
    return False


def _wait_or_exit(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    """Sleep ``seconds`` unless ``proc`` exits first; True if it exited."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def _judge(
    seed: int,
    trajectories: int,
    run_id: str,
    server: RedisServer,
    testbed: str,
    provider: Any,
    injector: Injector,
) -> SeedResult:
    logs = read_logs(server.url)
    ours = {tid: entries for tid, entries in logs.items() if tid.startswith(f"{run_id}.")}
    billed = provider.stats().get("trajectories", {})
    states: Counter[str] = Counter()
    terminal = handed_off = over_budget = 0
    notes = list(injector.notes)
    records: dict[str, Any] = {}
    for tid, entries in sorted(ours.items()):
        try:
            record = records[tid] = fold([decode(payload) for _, payload in entries])
        except Exception as e:  # a log that does not fold is a finding, and the trajectory is lost
            notes.append(f"{tid}: log does not fold: {type(e).__name__}: {e}")
            states["UNFOLDABLE"] += 1
            continue
        states[record.state.value] += 1
        if record.is_terminal:
            terminal += 1
        elif getattr(record, "handoff", None):
            handed_off += 1
        ceilings = record.ceilings.as_dict()
        spent = {dim: record.spend.get(dim) for dim in ceilings}
        counted = billed.get(tid, {})
        tokens = counted.get("prompt_tokens", 0) + counted.get("completion_tokens", 0)
        if any(spent[dim] > ceiling for dim, ceiling in ceilings.items()) or tokens > CEILINGS["tokens"]:
            over_budget += 1
            notes.append(f"{tid}: over budget: {spent}, provider billed {tokens} tokens")
    ledger = asyncio.run(_ledger(testbed))
    notes.extend(explain_orphans(ledger, records))
    return SeedResult(
        seed=seed,
        trajectories=trajectories,
        faults_injected=dict(injector.injected),
        terminal=terminal,
        handed_off=handed_off,
        lost=trajectories - terminal - handed_off,
        duplicate_effects=len(ledger.duplicate_deliveries()),
        orphaned=len(ledger.orphaned_environments()),
        orphaned_handed_off=orphans_handed_off(ledger, records),
        over_budget=over_budget,
        lost_acked_entries=judge_acked(injector.acked, logs),
        tether_run_exit=None,
        report_written=False,
        duration_s=0.0,
        states=dict(states),
        notes=notes,
    )


def _orphans(
    ledger: LedgerSnapshot, records: Mapping[str, Any]
) -> list[tuple[Any, str, Any, list[Any], list[Any]]]:
    """Each environment still allocated, with the trajectory that provisioned it (by the deliveries of its
    effect key), that trajectory's folded record (None if it has none), the operations under the key and
    their obligations."""
    owners = {d.effect_key: d.trajectory_id for d in ledger.deliveries if d.tool == "provision_env"}
    found = []
    for env in ledger.orphaned_environments():
        tid = owners.get(env.effect_key, "?")
        record = records.get(tid)
        ops: list[Any] = []
        obs: list[Any] = []
        if record is not None:
            ops = [op for op in record.operations.values() if op.effect_key == env.effect_key]
            obs = [o for op in ops for o in record.obligations.values() if o.operation_id == op.operation_id]
        found.append((env, tid, record, ops, obs))
    return found


def explain_orphans(ledger: LedgerSnapshot, records: Mapping[str, Any]) -> list[str]:
    """For each environment still allocated: whose it is and what that trajectory's record says about its
    release obligation."""
    out = []
    for env, tid, record, ops, obs in _orphans(ledger, records):
        if record is None:
            out.append(
                f"orphan {env.env_id}: provisioned by {tid}, whose log does not fold or does not exist"
            )
            continue
        said = "; ".join(
            f"obligation {o.state.value} owner={o.owner or '-'} resource={o.resource} "
            f"evidence={list(o.evidence)[-2:]}"
            for o in obs
        )
        op_said = ", ".join(f"{op.operation_id} {op.settlement.value} attempts={op.attempts}" for op in ops)
        out.append(
            f"orphan {env.env_id}: {tid} {record.state.value} exit={record.exit_reason}; "
            f"operation {op_said or 'none on record'}; {said or 'no obligation on record'}"
        )
    return out


def orphans_handed_off(ledger: LedgerSnapshot, records: Mapping[str, Any]) -> int:
    """Of the environments still allocated, those whose release the trajectory handed off with its packet:
    still billed (so counted in ``orphaned``), but owned by whoever holds the packet, unlike the rest, which
    nobody was told about."""
    return sum(
        1 for *_, obs in _orphans(ledger, records) if any(o.state is ObligationState.HANDED_OFF for o in obs)
    )


async def _ledger(address: str) -> LedgerSnapshot:
    async with TestbedClient(address) as client:
        return await client.ledger()


# --------------------------------------------------------------------------- many seeds


def available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def sized(requested: int) -> tuple[int, str | None]:
    """The trajectory count the machine's available memory holds (and why, when fewer than asked)."""
    fits = max(2, (available_mb() - RESERVE_MB) // ACTOR_MB)
    if requested <= fits:
        return requested, None
    return (
        fits,
        f"sized down from {requested} to {fits}: {available_mb()} MB available, ~{ACTOR_MB} MB per actor",
    )


def run_chaos(
    seeds: Iterable[int], config: ChaosConfig, on_seed: Callable[[SeedResult], None] | None = None
) -> dict[str, Any]:
    """Every seed on one Ray head; the aggregate and per-seed rows."""
    prepare_local_ray()
    trajectories, why = sized(config.trajectories)
    rows: list[SeedResult] = []
    with contextlib.ExitStack() as stack:
        work = config.work_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="tether-chaos-"))
        )
        head = RayHead(num_cpus=2, object_store_memory=400 * 1024 * 1024).start()
        stack.callback(head.stop)
        for seed in seeds:
            row = run_seed(seed, head, config, trajectories, work)
            rows.append(row)
            if on_seed is not None:
                on_seed(row)
    faults: Counter[str] = Counter()
    for row in rows:
        faults.update(row.faults_injected)
    total = {
        key: sum(getattr(row, key) for row in rows)
        for key in (
            "terminal",
            "handed_off",
            "lost",
            "duplicate_effects",
            "orphaned",
            "orphaned_handed_off",
            "over_budget",
            "lost_acked_entries",
        )
    }
    return {
        "commit": git_commit(),
        "seeds": [row.seed for row in rows],
        "trajectories": trajectories,
        "trajectories_requested": config.trajectories,
        "sizing": why,
        "faults_injected": dict(faults),
        **total,
        "tether_run_survived": sum(1 for row in rows if row.report_written),
        "environment": environment(),
        "per_seed": [asdict(row) for row in rows],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds (0..N-1 from --first-seed)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--trajectories", type=int, default=100)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chaos.json"))
    parser.add_argument("--work-dir", type=Path, default=None, help="keep each seed's logs here")
    parser.add_argument("--why", default=None, help="recorded in the results: why this size, this machine")
    args = parser.parse_args(argv)
    config = ChaosConfig(trajectories=args.trajectories, window_s=args.window_s, work_dir=args.work_dir)

    def progress(row: SeedResult) -> None:
        print(
            f"seed {row.seed}: terminal {row.terminal}/{row.trajectories} lost {row.lost} "
            f"dup {row.duplicate_effects} orphaned {row.orphaned} (handed off {row.orphaned_handed_off}) "
            f"over {row.over_budget} "
            f"lost-acked {row.lost_acked_entries} tether-run exit {row.tether_run_exit} "
            f"report {row.report_written} ({row.duration_s}s) faults {row.faults_injected}",
            flush=True,
        )

    results = run_chaos(range(args.first_seed, args.first_seed + args.seeds), config, progress)
    if args.why:
        results["note"] = args.why
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k not in ("per_seed", "environment")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
