"""Control latency with many live trajectories: XADD -> durably recorded, and kill -> sandbox process
group gone.

Setup: one private ``redis-server`` (AOF, ``appendfsync always``), the simulated provider, a local Ray
(2 CPUs, loopback), two relay actors, and N real trajectory actors (``actors.trajectory``). Each one's
model called the built-in ``run_command`` tool, whose command (the launch's ``sandbox_default_argv``,
``sh -c "sleep 3600 & wait"``: a two-process group) runs in the trajectory's real process sandbox, so
every trajectory is live but idle in WAITING_TOOL with a process group to tear down (hibernation off).

- ``record_ms``: one signed interrupt at a time, round robin over the trajectories. For each message, the
  time from its ``tether:control`` entry to the ``ControlRequested`` entry in the trajectory's log, both read
  from the Redis stream ids (the same server clock, millisecond resolution): the request is durable when
  that log entry exists (AOF fsync before the reply). ``record_burst_ms``: one interrupt to every
  trajectory published back to back.
- ``kill_ms``: one kill at a time; time from just before the kill is published (``XADD``) until
  ``os.killpg(pgid, 0)`` raises ``ProcessLookupError`` for that trajectory's sandbox group (polled every
  millisecond from this process: every member of the group is gone). ``kill_burst_ms``: the same with the
  kills to the other half published back to back. ``kill_to_terminal_ms``: kill entry to the terminal
  ``StateChanged`` in the log (server clock), for comparison.
- ``sandbox_teardown_ms``: ``actors.sandbox.Sandbox.kill_all`` on N real sandboxed ``sleep`` process
  groups in this process (SIGTERM, SIGKILL after the grace, wait until ``killpg(pgid, 0)`` fails).
- ``hibernated_bytes``: Redis ``MEMORY USAGE`` summed over one hibernated trajectory's keys (log, launch,
  status, nonces), for H trajectories paused after a few turns.

    .venv/bin/python -m benchmarks.control_latency [--trajectories 100] [--rounds 5] [--hibernated 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import ray
import redis.asyncio as aioredis

from actors.launch import CheckLaunch, ProviderLaunch
from actors.relay import start_relays, stop_relays
from actors.sandbox import Sandbox
from actors.trajectory import NONCE_KEY_PREFIX, TrajectoryLaunch, ensure_actor, save_launch
from benchmarks._common import environment, percentile, write_json, write_plot
from cluster.adapters import ClusterAdapters
from cluster.control import ControlAction
from cluster.control_client import LAUNCH_PREFIX, ControlClient, status_key
from cluster.log_store import FIELD, log_key
from cluster.redis_server import RedisServer
from cluster.runner import start_local_ray
from cluster.signing import Role, create_key
from runtime.codec import decode
from runtime.errors import DependencyError
from runtime.events import ControlRequested, StateChanged
from runtime.states import TrajectoryState
from testbed.provider.config import ProviderConfig
from testbed.provider.launch import start_provider_thread

NAME = "control_latency"
LAUNCH_BATCH = 10  # trajectories started at a time during setup
_TERMINAL = {TrajectoryState.COMPLETED, TrajectoryState.FAILED, TrajectoryState.CANCELED}


def entry_ms(entry_id: bytes | str) -> int:
    """The server's millisecond timestamp in a stream entry id (``<ms>-<seq>``)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


class Fleet:
    """N live trajectories plus the operator client and a raw Redis client for reading logs."""

    def __init__(self, url: str, provider_url: str, keyring: Path) -> None:
        self.url = url
        self.provider_url = provider_url
        self.keyring = keyring
        self.client = ControlClient.from_url(url, keyring=keyring, ttl_s=600.0)
        self.redis = aioredis.Redis.from_url(url)
        self.cursors: dict[str, str] = {}
        self.runs: list[Any] = []

    def launch(
        self, prefix: str, hibernate_after_s: float | None = None, workspaces: Path | None = None
    ) -> str:
        """A trajectory; with ``workspaces`` it runs one long sandboxed command, else sleeps every turn."""
        tid = f"{prefix}-{uuid.uuid4().hex[:8]}"
        tool = "run_command" if workspaces is not None else "sleep"
        launch = TrajectoryLaunch(
            trajectory_id=tid,
            goal="stay busy until stopped",
            ceilings={"tokens": 10_000_000},
            grants=(tool,),
            local_tools=(tool,),
            created_at=time.time(),
            deadline_s=86_400.0,
            metadata={"scenario": "finish_after:1" if workspaces is not None else "finish_after:1000"},
            provider=ProviderLaunch(base_url=self.provider_url, model="sim"),
            redis_url=self.url,
            use_scheduler=False,
            guard="local",
            keyring_path=str(self.keyring),
            completion_check=CheckLaunch(name="always"),
            hibernate_after_s=hibernate_after_s,
            workspace_root=str(workspaces) if workspaces is not None else None,
            sandbox_default_argv=("sh", "-c", "sleep 3600 & wait") if workspaces is not None else (),
            tool_timeout_s=3600.0,
        )
        save_launch(self.url, launch)
        self.runs.append(ensure_actor(launch, ClusterAdapters()).run.remote())
        self.cursors[tid] = "0-0"
        return tid

    async def wait_status(self, tids: list[str], check: Any, what: str, timeout_s: float = 1200.0) -> None:
        deadline = time.monotonic() + timeout_s
        left = set(tids)
        while left:
            seen: list[str] = []
            for tid in list(left):
                try:
                    s = await self.client.status(tid)
                except DependencyError:  # Redis slow to answer while a hundred workers start: ask again
                    s = None
                if s is not None and check(s):
                    left.discard(tid)
                else:
                    seen.append("not started" if s is None else f"{s.state}/{s.turns} turns")
            if left and time.monotonic() > deadline:
                states = ", ".join(f"{n} {state}" for state, n in sorted(Counter(seen).items()))
                raise TimeoutError(f"{len(left)} trajectories never reached {what}: {states}")
            await asyncio.sleep(0.1)

    async def new_log_entries(self, tid: str) -> list[tuple[int, Any]]:
        """Log entries after the last one seen: (server ms, decoded event)."""
        raw: Any = await self.redis.xrange(log_key(tid), min=f"({self.cursors[tid]}", max="+")
        out = []
        for entry_id, fields in raw:
            self.cursors[tid] = entry_id.decode()
            out.append((entry_ms(entry_id), decode(fields[FIELD])))
        return out

    async def close(self) -> None:
        await self.client.close()
        await self.redis.aclose()


async def record_round(fleet: Fleet, tids: list[str], round_no: int) -> list[float]:
    """One interrupt to every trajectory, back to back; ms from control entry to log entry."""
    sent: dict[str, tuple[str, int]] = {}
    for tid in tids:
        s = await fleet.client.send(
            tid,
            ControlAction.INTERRUPT,
            issuer="operator",
            payload={"message": f"round {round_no}"},
            check_known=False,
        )
        sent[tid] = (s.message.message_id, entry_ms(s.entry_id))
    samples: list[float] = []
    left = dict(sent)
    deadline = time.monotonic() + 120.0
    while left:
        for tid, (message_id, published) in list(left.items()):
            for at, event in await fleet.new_log_entries(tid):
                if isinstance(event, ControlRequested) and event.message_id == message_id:
                    samples.append(float(at - published))
                    del left[tid]
                    break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(left)} interrupts never recorded")
        await asyncio.sleep(0.05)
    return samples


async def _await_entry(fleet: Fleet, tid: str, match: Any, what: str) -> int:
    """Server ms of the first new log entry of ``tid`` that ``match``es (polled every 2 ms)."""
    deadline = time.monotonic() + 60.0
    while True:
        for at, event in await fleet.new_log_entries(tid):
            if match(event):
                return at
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tid}: {what} never appeared in the log")
        await asyncio.sleep(0.002)


async def record_paced(fleet: Fleet, tids: list[str], rounds: int) -> list[float]:
    """One interrupt at a time (as an operator sends them), round robin over the live trajectories."""
    samples: list[float] = []
    for r in range(rounds):
        for tid in tids:
            s = await fleet.client.send(
                tid,
                ControlAction.INTERRUPT,
                issuer="operator",
                payload={"message": f"paced {r}"},
                check_known=False,
            )
            mid = s.message.message_id
            at = await _await_entry(
                fleet,
                tid,
                lambda e, mid=mid: isinstance(e, ControlRequested) and e.message_id == mid,
                "interrupt",
            )
            samples.append(float(at - entry_ms(s.entry_id)))
    return samples


async def sandbox_groups(tids: list[str], groups: dict[str, int], timeout_s: float = 600.0) -> None:
    """Fill ``groups`` with each trajectory's running sandbox process group, from the actor's status."""
    deadline = time.monotonic() + timeout_s
    while any(tid not in groups for tid in tids):
        for tid in tids:
            if tid in groups:
                continue
            actor = ray.get_actor(f"traj:{tid}", namespace="tether")
            status = await actor.status.remote()
            if status["sandbox_groups"]:
                groups[tid] = int(status["sandbox_groups"][0])
        if time.monotonic() > deadline:
            missing = sum(tid not in groups for tid in tids)
            raise TimeoutError(f"{missing} trajectories never started their command")
        await asyncio.sleep(0.1)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


async def kill_paced(
    fleet: Fleet, tids: list[str], groups: dict[str, int]
) -> tuple[list[float], list[float]]:
    """One kill at a time: ms until the sandbox group is gone, and ms from the kill entry to the terminal
    state entry in the log."""
    gone: list[float] = []
    terminal: list[float] = []
    for tid in tids:
        pgid = groups[tid]
        assert group_alive(pgid), f"{tid}'s command ended before the kill"
        t0 = time.perf_counter()
        s = await fleet.client.send(
            tid, ControlAction.KILL, issuer="operator", reason="bench", check_known=False
        )
        deadline = t0 + 60.0
        while group_alive(pgid):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{tid}: process group {pgid} survived the kill")
            await asyncio.sleep(0.001)
        gone.append((time.perf_counter() - t0) * 1000.0)
        at = await _await_entry(
            fleet, tid, lambda e: isinstance(e, StateChanged) and e.to_state in _TERMINAL, "terminal state"
        )
        terminal.append(float(at - entry_ms(s.entry_id)))
    return gone, terminal


async def kill_all(fleet: Fleet, tids: list[str], groups: dict[str, int]) -> tuple[list[float], list[float]]:
    """One kill per trajectory, back to back: ms from each kill's publication until its group is gone, and
    from its entry to the terminal state entry."""
    published: dict[str, float] = {}
    entries: dict[str, int] = {}
    for tid in tids:
        published[tid] = time.perf_counter()
        s = await fleet.client.send(
            tid, ControlAction.KILL, issuer="operator", reason="bench", check_known=False
        )
        entries[tid] = entry_ms(s.entry_id)
    gone: list[float] = []
    alive = dict(published)
    deadline = time.perf_counter() + 120.0
    while alive:
        for tid in list(alive):
            if not group_alive(groups[tid]):
                gone.append((time.perf_counter() - alive.pop(tid)) * 1000.0)
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(alive)} process groups survived their kill")
        await asyncio.sleep(0.001)
    terminal: list[float] = []
    left = dict(entries)
    deadline = time.perf_counter() + 120.0
    while left:
        for tid, at_publish in list(left.items()):
            for at, event in await fleet.new_log_entries(tid):
                if isinstance(event, StateChanged) and event.to_state in _TERMINAL:
                    terminal.append(float(at - at_publish))
                    del left[tid]
                    break
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(left)} kills never ended their trajectory")
        await asyncio.sleep(0.05)
    return gone, terminal


async def sandbox_teardown(n: int, root: Path) -> list[float]:
    """Tear down N real sandboxed process groups (each a shell with a child ``sleep``)."""
    sandboxes = [Sandbox(f"bench-{i}", root) for i in range(n)]
    runs = [
        asyncio.ensure_future(sb.run(["sh", "-c", "sleep 600 & sleep 600"], timeout=120.0))
        for sb in sandboxes
    ]

    async def started(sb: Sandbox) -> None:
        while not sb.live_process_groups:
            await asyncio.sleep(0.01)

    await asyncio.gather(*(started(sb) for sb in sandboxes))
    samples = []
    for sb in sandboxes:
        groups = set(sb.live_process_groups)
        t0 = time.perf_counter()
        await sb.kill_all()
        elapsed = (time.perf_counter() - t0) * 1000.0
        assert all(_group_gone(g) for g in groups), "a process group survived kill_all"
        samples.append(elapsed)
    for r in runs:
        with contextlib.suppress(Exception):
            await r
    return samples


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def hibernated_bytes(fleet: Fleet, h: int) -> dict[str, Any]:
    """Pause H trajectories with a short idle time, wait for hibernation, sum MEMORY USAGE of their keys."""
    tids = [fleet.launch("hib", hibernate_after_s=0.5) for _ in range(h)]
    await fleet.wait_status(tids, lambda s: s.turns >= 2, "two turns")
    for tid in tids:
        await fleet.client.send(tid, ControlAction.PAUSE, issuer="operator", check_known=False)
    await fleet.wait_status(tids, lambda s: s.hibernated, "hibernation")
    per: list[int] = []
    entries: list[int] = []
    for tid in tids:
        keys = [log_key(tid), f"{LAUNCH_PREFIX}{tid}", status_key(tid), f"{NONCE_KEY_PREFIX}{tid}"]
        total = 0
        for key in keys:
            total += int(await fleet.redis.memory_usage(key, samples=0) or 0)
        per.append(total)
        entries.append(int(await fleet.redis.xlen(log_key(tid))))
    return {
        "trajectories": h,
        "mean": round(sum(per) / len(per)),
        "min": min(per),
        "max": max(per),
        "log_entries_mean": round(sum(entries) / len(entries), 1),
        "keys": ["tether:log:<id>", "tether:launch:<id>", "tether:status:<id>", "tether:nonces:<id>"],
    }


async def run(n: int, rounds: int, hibernated: int, workdir: Path) -> dict[str, Any]:
    load_at_start = round(os.getloadavg()[0], 2)
    server = RedisServer(data_dir=workdir / "redis").start()
    provider = start_provider_thread(ProviderConfig())
    keyring = workdir / "keyring.yaml"
    create_key("operator", [Role.OPERATOR], keyring)
    start_local_ray()  # as a local tether run: loopback, actors at normal priority
    relays: list[Any] = []
    groups: dict[str, int] = {}
    fleet = Fleet(server.url, provider.base_url, keyring)
    try:
        relays = start_relays(server.url, 2, adapters=ClusterAdapters(), config={"block_ms": 100})
        t0 = time.perf_counter()
        tids: list[str] = []
        # In batches: a hundred Ray workers importing at once starve this 2-core machine (and its Redis)
        for start in range(0, n, LAUNCH_BATCH):
            batch = [
                fleet.launch("bench", workspaces=workdir / "workspaces")
                for _ in range(min(LAUNCH_BATCH, n - start))
            ]
            tids += batch
            await fleet.wait_status(batch, lambda s: s.state == "WAITING_TOOL", "WAITING_TOOL")
            await sandbox_groups(batch, groups)
        startup_s = time.perf_counter() - t0
        for tid in tids:
            await fleet.new_log_entries(tid)  # move the cursors past everything so far
        record = await record_paced(fleet, tids, rounds)
        record_burst: list[float] = []
        for r in range(rounds):
            record_burst += await record_round(fleet, tids, r)
        half = len(tids) // 2
        load_before_kills = os.getloadavg()[0]
        kills, kills_terminal = await kill_paced(fleet, tids[:half], groups)
        kills_burst, kills_burst_terminal = await kill_all(fleet, tids[half:], groups)
        teardown = await sandbox_teardown(min(n, 50), workdir / "sandboxes")
        hib = await hibernated_bytes(fleet, hibernated) if hibernated else None
    finally:
        for pgid in groups.values():  # an interrupted run: no sandboxed command outlives the benchmark
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        stop_relays(relays)
        await fleet.close()
        ray.shutdown()
        provider.stop()
        server.stop()

    def pct(samples: list[float]) -> dict[str, float]:
        return {"p50": round(percentile(samples, 50), 2), "p99": round(percentile(samples, 99), 2)}

    write_plot(
        NAME,
        {
            "XADD -> recorded (one at a time)": record,
            f"XADD -> recorded (burst of {n})": record_burst,
            "kill -> group gone (one at a time)": kills,
            f"kill -> group gone (burst of {n - n // 2})": kills_burst,
            "kill -> terminal state logged (one at a time)": kills_terminal,
            "sandbox group teardown": teardown,
        },
        title=f"Control latency, {n} live trajectories, 2 relays (2-core machine)",
    )
    return {
        "trajectories": n,
        "record_ms": pct(record),
        "kill_ms": pct(kills),
        "record_burst_ms": pct(record_burst),
        "kill_burst_ms": pct(kills_burst),
        "kill_to_terminal_ms": pct(kills_terminal),
        "kill_burst_to_terminal_ms": pct(kills_burst_terminal),
        "sandbox_teardown_ms": pct(teardown),
        "hibernated_bytes": hib,
        "samples": {
            "record": len(record),
            "record_burst": len(record_burst),
            "kill": len(kills),
            "kill_burst": len(kills_burst),
            "kill_to_terminal": len(kills_terminal),
            "sandbox_teardown": len(teardown),
        },
        "targets": {"record_p99_ms": 100, "kill_p99_ms": 500},
        "notes": (
            "record_ms/kill_ms: one message at a time with all N trajectories live, each waiting on a "
            "sandboxed run_command (sh + sleep); *_burst_ms: one message to every trajectory published back "
            "to back (queueing on 2 cores). record: Redis stream entry ids (server clock, 1 ms resolution). "
            "kill_ms: from just before the kill's XADD until killpg(pgid, 0) fails for that trajectory's "
            "sandbox process group (polled every ms by the benchmark process); kill_to_terminal_ms: kill "
            "entry to the terminal StateChanged in the log; sandbox_teardown_ms: Sandbox.kill_all alone"
        ),
        "setup": {
            "relays": 2,
            "ray_cpus": 2,
            "ray_worker_niceness": int(os.environ["RAY_worker_niceness"]),  # noqa: SIM112 - Ray spells it so
            "appendfsync": "always",
            "startup_s": round(startup_s, 1),
            "load_avg_1m_at_start": load_at_start,
            "load_avg_1m_before_kills": round(load_before_kills, 2),
            "sandbox_command": "sh -c 'sleep 3600 & wait' (run_command, empty argv -> launch default)",
        },
        "environment": environment(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hibernated", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        result = asyncio.run(run(args.trajectories, args.rounds, args.hibernated, Path(tmp)))
    path = write_json(NAME, result)
    print(path)
    print(
        {
            k: result[k]
            for k in ("trajectories", "record_ms", "kill_ms", "sandbox_teardown_ms", "hibernated_bytes")
        }
    )


if __name__ == "__main__":
    main()
