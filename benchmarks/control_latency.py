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
  ``StateChanged`` in the log (server clock), for comparison. ``--kill-rounds K`` repeats this on K fresh
  fleets of N (each round: N live at its first kill, N/2 + 1 at its last one-at-a-time kill), so the
  one-at-a-time percentiles pool N/2 x K kills (200 at the defaults); each round's own are kept too.
- ``kill_hops``: for the one-at-a-time kills, where each one's time went, every hop in ms from just before
  its publication: the server stamped the kill's XADD, the publisher had its reply (after the fsync), the
  trajectory's ``ControlRequested`` entry, the group gone, the terminal entry (server stream ids against
  this process's wall clock: one clock on one machine); p50/p99 per hop and the slowest kills hop by hop.
- ``slow_kill_states``: a one-at-a-time kill still waiting 300 ms, 1 s and 2 s after its publication has
  its sandbox group's processes looked at once at each mark (state letter and the kernel function each
  waits in, ``group_members``); the counts over every kill, and each slow kill's looks in ``kill_hops``.
  ``--damon-off`` (root; with ``--out``, never the headline) stops the kernel's DAMON monitors for the run
  and starts them again after it: with the platform's proactive-reclaim monitor on, Redis's AOF fsyncs
  stalled ten times as often, the kill's XADD waited in them, and a few dying sandbox processes waited in
  ``unlink_file_vma_batch_process`` for seconds (docs/perf/capacity.md, "Kill latency: the kernel's exit").
- ``kill_rounds[].page_cache``: per kill round, how much the kernel's page-cache counters grew while its
  kills ran (``/proc/vmstat``): file pages read back after an eviction (``workingset_refault_file``), major
  faults, KiB read from disk: whether pages that DAMON's pageout evicted are read back while the kills
  run (at ``1154253`` a handful per round with it on, none with it off).
- ``redis_fsync_stalls``: per kill round, the seconds in which Redis's own latency monitor saw an AOF fsync of
  100 ms or more while the kills ran (with ``appendfsync always`` the server's thread waits for the disk,
  and every client's command with it: the kill's XADD, the relay's read), and the slowest; with the AOF's
  size and how many background AOF rewrites the server had run by the end of the round.
- ``--redis-dir DIR`` puts the server's data (the AOF) under DIR instead of the run's temporary directory,
  which shares its disk with Ray's session logs and the sandboxes' workspaces: a disk of its own, as a
  production node's AOF should have. ``setup.redis_dir`` records the directory, its filesystem and whether
  that is durable; a tmpfs (``/dev/shm``) is not (its fsync returns at once) and serves only to show what the
  kill path costs without the disk. ``--out PATH`` writes such a run beside the headline file.
- ``sandbox_teardown_ms``: ``actors.sandbox.Sandbox.kill_all`` on N real sandboxed ``sleep`` process
  groups in this process (SIGKILL at once, wait until ``killpg(pgid, 0)`` fails).
- Provenance (``benchmarks._common.provenance``): the commit, the machine calibration before and after,
  the settings. ``--only live`` rewrites the live fields and keeps the stored ``parked`` result.
- ``hibernated_bytes``: Redis ``MEMORY USAGE`` summed over one hibernated trajectory's keys (log, launch,
  status, nonces), for H trajectories paused after a few turns.
- ``parked`` (issue 16): P trajectories each hold a call for approval and hibernate (their actors exit);
  one more runs a sandboxed command (live in WAITING_TOOL). Then every held call is approved at once
  (``ControlClient.held_calls`` + ``decide_many``, what ``tether approve --all-pending`` does: one signed
  message each, one round trip), and ``approve_all_s`` is the time from just before that publication until
  every parked trajectory's status is terminal. Meanwhile interrupts go to the live trajectory one at a
  time, and ``interrupt_ms`` is each one's control entry -> ``ControlRequested`` in its log (server clock):
  what the wake-up storm costs a running trajectory. The local Ray declares ``--slots`` trajectory slots
  (fewer than the fleet: a local Ray declares at most 64 a core by default), so the relays wake them as
  slots free.

    .venv/bin/python -m benchmarks.control_latency [--only live] [--trajectories 100] [--rounds 5]
        [--kill-rounds 4] [--hibernated 10]   (--only live keeps the stored parked result)
    .venv/bin/python -m benchmarks.control_latency --only live --damon-off --out PATH   (diagnostic, root)
    .venv/bin/python -m benchmarks.control_latency --only parked [--parked 300] [--repeats 3] [--slots 24]
        [--append]   (add the repetitions to the stored ones instead of replacing them)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ray
import redis.asyncio as aioredis

from actors.launch import CheckLaunch, ProviderLaunch
from actors.relay import start_relays, stop_relays
from actors.sandbox import Sandbox
from actors.trajectory import NONCE_KEY_PREFIX, TrajectoryLaunch, ensure_actor, save_launch
from benchmarks._common import (
    DAMON_ADMIN,
    RESULTS_DIR,
    calibration,
    damon_state,
    durable_filesystem,
    environment,
    filesystem_of,
    percentile,
    provenance,
    spread,
    write_json,
    write_plot,
)
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
        # the observer outwaits a stalled server (redis-py's default gives up after 5 s): a stall is what
        # the run measures, not a reason to end it
        self.redis = aioredis.Redis.from_url(url, socket_timeout=120.0, socket_connect_timeout=10.0)
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


async def _await_entry(
    fleet: Fleet, tid: str, match: Any, what: str, seen: list[tuple[int, Any]] | None = None
) -> int:
    """Server ms of the first new log entry of ``tid`` that ``match``es (polled every 2 ms); ``seen`` gets
    every entry read up to and including that one, as (server ms, event)."""
    deadline = time.monotonic() + 60.0
    while True:
        for at, event in await fleet.new_log_entries(tid):
            if seen is not None:
                seen.append((at, event))
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
    fleet: Fleet, tids: list[str], groups: dict[str, int], known: dict[int, set[int]] | None = None
) -> tuple[list[float], list[float], list[dict[str, Any]]]:
    """One kill at a time: ms until the sandbox group is gone, ms from the kill entry to the terminal
    state entry in the log, and each kill's hops (``_HOPS``: ms from just before the publication, the
    server's stream ids read against this process's wall clock, the same clock on one machine). ``known``
    (from ``launch_fleet``) keeps a slow kill's looks to its own group's processes."""
    gone: list[float] = []
    terminal: list[float] = []
    hops: list[dict[str, Any]] = []
    for tid in tids:
        pgid = groups[tid]
        assert group_alive(pgid), f"{tid}'s command ended before the kill"
        t0 = time.perf_counter()
        wall0 = time.time() * 1000.0
        s = await fleet.client.send(
            tid, ControlAction.KILL, issuer="operator", reason="bench", check_known=False
        )
        published = (time.perf_counter() - t0) * 1000.0
        deadline = t0 + 60.0
        looks = list(_LOOK_AT_MS)
        members_at: list[dict[str, Any]] = []
        while group_alive(pgid):
            waited_ms = (time.perf_counter() - t0) * 1000.0
            if looks and waited_ms >= looks[0]:
                looks.pop(0)  # a slow kill: what the group's processes are doing (one /proc scan)
                members = group_members(pgid, (known or {}).get(pgid))
                members_at.append({"after_ms": round(waited_ms), "members": members})
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{tid}: process group {pgid} survived the kill")
            await asyncio.sleep(0.001)
        gone.append((time.perf_counter() - t0) * 1000.0)
        seen: list[tuple[int, Any]] = []
        terminal_at = await _await_entry(
            fleet,
            tid,
            lambda e: isinstance(e, StateChanged) and e.to_state in _TERMINAL,
            "terminal state",
            seen=seen,
        )
        requested = [at for at, event in seen if isinstance(event, ControlRequested)]
        if not requested:
            raise AssertionError(f"{tid}: a terminal state in the log, but no ControlRequested for the kill")
        terminal.append(float(terminal_at - entry_ms(s.entry_id)))
        hops.append(
            {
                "stamped": round(entry_ms(s.entry_id) - wall0, 1),
                "published": round(published, 1),
                "recorded": round(requested[0] - wall0, 1),
                "gone": round(gone[-1], 1),
                "terminal": round(terminal_at - wall0, 1),
                **({"members_at": members_at} if members_at else {}),
            }
        )
    return gone, terminal, hops


# A kill still waiting this long (ms) has its sandbox group's processes looked at once per mark: each one's
# scheduler state and the kernel function it waits in. That tells a process that has not been signalled yet
# (still S in its own code) from one that is dying in the kernel (D in an exit path): the slow kills at
# 100 live were the second kind (docs/perf/capacity.md).
_LOOK_AT_MS = (300.0, 1000.0, 2000.0)


def group_pids(pgids: Iterable[int]) -> dict[int, set[int]]:
    """The processes of each group in ``pgids``, from one scan of ``/proc`` (run once a batch has started,
    before any kill is timed)."""
    wanted = set(pgids)
    found: dict[int, set[int]] = {pgid: set() for pgid in wanted}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[2] in wanted:
                found[stat[2]].add(int(entry))
    return found


def group_members(pgid: int, known: Iterable[int] | None = None) -> list[str]:
    """Each live process of group ``pgid`` as ``"<state> <where>"``: its state letter from
    ``/proc/<pid>/stat`` (R running, S sleeping, D uninterruptible, Z exited and not yet reaped) and where
    the kernel has it waiting (``wchan``, or the first frame of ``/proc/<pid>/stack`` where readable).

    With ``known`` (the group's processes from ``group_pids``) only those and their descendants are read: a
    few files, where a scan of every process's took up to a second of a loaded machine's time, during which
    the kill being timed went unobserved. Without it, every process is scanned."""
    if known is None:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    else:
        pids, queue = [], list(known)
        while queue:
            pid = queue.pop()
            if pid not in pids:
                pids.append(pid)
                queue += _children(pid)
    found = []
    for pid in pids:
        stat = _stat(pid)
        if stat is not None and stat[2] == pgid:
            found.append(f"{stat[0]} {_waiting_in(pid)}".rstrip())
    return sorted(found)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """State, parent and process group of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold anything
        return fields[0], int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except (OSError, ValueError):
        return []


def _waiting_in(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            where = f.read().strip()
    except OSError:
        where = ""
    if where in ("", "0"):
        try:
            with open(f"/proc/{pid}/stack") as f:  # root only; a running task's kernel frames
                first = f.readline().split()
            where = first[1].split("+", 1)[0] if len(first) > 1 else ""
        except OSError:
            where = ""
    return where


def slow_kill_states(hops: list[dict[str, Any]]) -> dict[str, int]:
    """How often each "<state> <where>" was seen among the sandbox processes of kills still waiting at a
    look (``_LOOK_AT_MS``), over every one-at-a-time kill: what the slow kills were waiting for."""
    seen: Counter[str] = Counter()
    for hop in hops:
        for look in hop.get("members_at", ()):
            seen.update(look["members"])
    return dict(seen.most_common())


# A kill's hops, each in ms from just before its publication: the server stamped the XADD (``stamped``),
# the publisher had the reply (``published``: after the AOF fsync), the trajectory's ControlRequested entry
# (``recorded``: after relay pickup, delivery and the signature check; the teardown starts before this
# append), the sandbox group gone (``gone``), the terminal StateChanged entry (``terminal``). A kill of a
# trajectory waiting on a tool logs its request and its terminal state in one batch, and one append stamps
# both with the same millisecond, so ``recorded`` and ``terminal`` agree there.
_HOPS = ("stamped", "published", "recorded", "gone", "terminal")


def hop_summary(hops: list[dict[str, Any]], slowest: int = 5) -> dict[str, Any]:
    """p50/p99 of every hop, and the ``slowest`` kills (by ``gone``) hop by hop."""
    return {
        "p50_ms": {h: round(percentile([k[h] for k in hops], 50), 1) for h in _HOPS},
        "p99_ms": {h: round(percentile([k[h] for k in hops], 99), 1) for h in _HOPS},
        "slowest": sorted(hops, key=lambda k: -k["gone"])[:slowest],
    }


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


async def launch_fleet(
    fleet: Fleet,
    n: int,
    groups: dict[str, int],
    workspaces: Path,
    known: dict[int, set[int]] | None = None,
) -> list[str]:
    """N live trajectories, each waiting on its sandboxed command; returns their ids. Fills ``groups`` and,
    if given, ``known`` with each group's processes (``group_pids``)."""
    tids: list[str] = []
    # In batches: a hundred Ray workers importing at once starve this 2-core machine (and its Redis)
    for start in range(0, n, LAUNCH_BATCH):
        batch = [fleet.launch("bench", workspaces=workspaces) for _ in range(min(LAUNCH_BATCH, n - start))]
        tids += batch
        await fleet.wait_status(batch, lambda s: s.state == "WAITING_TOOL", "WAITING_TOOL")
        await sandbox_groups(batch, groups)
        if known is not None:
            known.update(group_pids(groups[tid] for tid in batch))
    for tid in tids:
        await fleet.new_log_entries(tid)  # move the cursors past everything so far
    return tids


async def run(
    n: int,
    rounds: int,
    kill_rounds: int,
    hibernated: int,
    workdir: Path,
    redis_dir: Path | None = None,
    plot: Path = RESULTS_DIR / f"{NAME}.png",
) -> dict[str, Any]:
    before = calibration()
    load_at_start = round(os.getloadavg()[0], 2)
    data_dir = (
        workdir / "redis"
        if redis_dir is None
        else Path(tempfile.mkdtemp(prefix="tether-aof-", dir=redis_dir))
    )
    redis_fs = filesystem_of(data_dir)
    server = RedisServer(data_dir=data_dir).start()
    provider = start_provider_thread(ProviderConfig())
    keyring = workdir / "keyring.yaml"
    create_key("operator", [Role.OPERATOR], keyring)
    # as a local tether run (loopback, actors at normal priority), with a slot for every live trajectory
    start_local_ray(trajectory_slots=n + hibernated + 10)
    relays: list[Any] = []
    groups: dict[str, int] = {}
    fleet = Fleet(server.url, provider.base_url, keyring)
    try:
        relays = start_relays(server.url, 2, adapters=ClusterAdapters(), config={"block_ms": 100})
        kills: list[float] = []
        kills_terminal: list[float] = []
        kill_hops: list[dict[str, Any]] = []
        fsync_stalls: list[dict[str, Any]] = []
        # Redis's own record of slow fsyncs (appendfsync always: the server's thread waits for the disk,
        # and every client with it), read after each round's kills
        await fleet.redis.config_set("latency-monitor-threshold", _SLOW_FSYNC_MS)
        kills_burst: list[float] = []
        kills_burst_terminal: list[float] = []
        startup: list[float] = []
        load_before_kills: list[float] = []
        per_round: list[dict[str, Any]] = []
        for k in range(kill_rounds):
            # Each kill round starts from a fleet of N live trajectories (a new one: the last was killed)
            t0 = time.perf_counter()
            known: dict[int, set[int]] = {}
            tids = await launch_fleet(fleet, n, groups, workdir / "workspaces", known)
            startup.append(round(time.perf_counter() - t0, 1))
            if k == 0:
                record = await record_paced(fleet, tids, rounds)
                record_burst: list[float] = []
                for r in range(rounds):
                    record_burst += await record_round(fleet, tids, r)
            half = len(tids) // 2
            load_before_kills.append(round(os.getloadavg()[0], 2))
            kills_began = int(time.time())
            vm_before = vmstat()
            paced, paced_terminal, paced_hops = await kill_paced(fleet, tids[:half], groups, known)
            burst, burst_terminal = await kill_all(fleet, tids[half:], groups)
            fsync_stalls.append(await slow_fsyncs(fleet, since=kills_began))
            refaults = vmstat_delta(vm_before, vmstat())
            for tid in tids:
                groups.pop(tid, None)
            kills += paced
            kills_terminal += paced_terminal
            kill_hops += paced_hops
            kills_burst += burst
            kills_burst_terminal += burst_terminal
            per_round.append(
                {
                    "kill_ms": _pct(paced),
                    "kill_burst_ms": _pct(burst),
                    "kills": len(paced),
                    "kill_hops": hop_summary(paced_hops),
                    "slow_kill_states": slow_kill_states(paced_hops),
                    "page_cache": refaults,
                }
            )
            print(
                f"kill round {k}: one at a time {per_round[-1]['kill_ms']}, burst "
                f"{per_round[-1]['kill_burst_ms']}",
                flush=True,
            )
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
        if redis_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)

    write_plot(
        plot.stem,
        {
            "XADD -> recorded (one at a time)": record,
            f"XADD -> recorded (burst of {n})": record_burst,
            "kill -> group gone (one at a time)": kills,
            f"kill -> group gone (burst of {n - n // 2})": kills_burst,
            "kill -> terminal state logged (one at a time)": kills_terminal,
            "sandbox group teardown": teardown,
        },
        title=f"Control latency, {n} live trajectories, 2 relays (2-core machine)",
        results_dir=plot.parent,
    )
    settings = {
        "trajectories": n,
        "rounds": rounds,
        "kill_rounds": kill_rounds,
        "hibernated": hibernated,
        "relays": 2,
        "ray_cpus": 2,
    }
    return {
        **provenance(settings, before=before),
        "trajectories": n,
        "record_ms": _pct(record),
        "kill_ms": _pct(kills),
        "record_burst_ms": _pct(record_burst),
        "kill_burst_ms": _pct(kills_burst),
        "kill_to_terminal_ms": _pct(kills_terminal),
        "kill_burst_to_terminal_ms": _pct(kills_burst_terminal),
        "sandbox_teardown_ms": _pct(teardown),
        "kill_rounds": per_round,
        "kill_p99_ms_over_rounds": spread([r["kill_ms"]["p99"] for r in per_round], digits=1),
        "kill_hops": hop_summary(kill_hops, slowest=10),
        "slow_kill_states": slow_kill_states(kill_hops),
        "redis_fsync_stalls": fsync_stalls,
        "kill_burst_p99_ms_over_rounds": spread([r["kill_burst_ms"]["p99"] for r in per_round], digits=1),
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
            "record_ms: one message at a time with all N trajectories live, each waiting on a sandboxed "
            "run_command (sh + sleep); *_burst_ms: one message to every trajectory published back to back "
            "(queueing on 2 cores). record: Redis stream entry ids (server clock, 1 ms resolution). kill "
            "rounds: each starts from a fresh fleet of N live trajectories and kills half of them one at a "
            "time (N down to N/2 + 1 live), then the other half in a burst; kill_ms pools the one-at-a-time "
            "kills of every round, kill_rounds has each round's own percentiles and kill_p99_ms_over_rounds "
            "their spread. kill_ms: from just before the kill's XADD until killpg(pgid, 0) fails for that "
            "trajectory's sandbox process group (polled every ms by the benchmark process); "
            "kill_to_terminal_ms: kill entry to the terminal StateChanged in the log; sandbox_teardown_ms: "
            "Sandbox.kill_all alone"
        ),
        "setup": {
            "relays": 2,
            "ray_cpus": 2,
            "ray_worker_niceness": int(os.environ["RAY_worker_niceness"]),  # noqa: SIM112 - Ray spells it so
            "appendfsync": "always",
            "redis_dir": "the run's temporary directory" if redis_dir is None else str(redis_dir),
            "redis_fs": redis_fs,
            "redis_durable": durable_filesystem(redis_fs),
            "startup_s": startup,
            "load_avg_1m_at_start": load_at_start,
            "load_avg_1m_before_kills": load_before_kills,
            "sandbox_command": "sh -c 'sleep 3600 & wait' (run_command, empty argv -> launch default)",
        },
    }


_SLOW_FSYNC_MS = 100


async def slow_fsyncs(fleet: Fleet, since: int) -> dict[str, Any]:
    """The seconds since ``since`` in which an AOF fsync took >= 100 ms, from Redis's latency monitor
    (``LATENCY HISTORY aof-fsync-always``: the slowest per second, the last 160 such seconds)."""
    raw = await fleet.redis.execute_command("LATENCY", "HISTORY", "aof-fsync-always")  # type: ignore[no-untyped-call]
    stalls = [int(ms) for at, ms in raw if int(at) >= since]
    persistence = await fleet.redis.info("persistence")
    return {
        "seconds_with_a_stall": len(stalls),
        "max_ms": max(stalls, default=0),
        "threshold_ms": _SLOW_FSYNC_MS,
        "aof_mb": round(int(persistence.get("aof_current_size", 0)) / 1e6, 1),
        "aof_rewrites": int(persistence.get("aof_rewrites", 0)),
    }


_VMSTAT = ("workingset_refault_file", "pgmajfault", "pgpgin")


def vmstat(path: Path = Path("/proc/vmstat")) -> dict[str, int]:
    """The kernel's page-cache counters a reclaim shows in: file pages read back after they were evicted
    (``workingset_refault_file``), major faults, KiB read from disk (``pgpgin``). Empty where unreadable."""
    try:
        rows = (line.split() for line in path.read_text().splitlines())
        return {name: int(value) for name, value in rows if name in _VMSTAT}
    except (OSError, ValueError):
        return {}


def vmstat_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """How much each counter of ``vmstat`` grew between two readings (one missing from either is left out)."""
    return {name: after[name] - before[name] for name in _VMSTAT if name in before and name in after}


@contextlib.contextmanager
def damon_paused(pause: bool, admin: Path = DAMON_ADMIN) -> Iterator[list[dict[str, Any]] | None]:
    """With ``pause``, every running DAMON monitor of the kernel is stopped for the block and started again
    after it (its configuration stays in sysfs): a diagnostic, to tell what the platform's proactive-reclaim
    monitor costs a kill from what Tether does. Yields the monitors' state during the block."""
    stopped: list[Path] = []
    if pause:
        for state in sorted(admin.glob("[0-9]*/state")):
            if state.read_text().strip() == "on":
                state.write_text("off")
                stopped.append(state)
    try:
        yield damon_state(admin)
    finally:
        for state in stopped:
            state.write_text("on")


def _pct(samples: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(samples, 50), 2), "p99": round(percentile(samples, 99), 2)}


# --------------------------------------------------------------------------- the parked fleet


def commit() -> str:
    """The commit the numbers were measured at (``+dirty`` when the tree had changes)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _mem_available_mb() -> int:
    from actors.incarnation import memory_available_bytes

    available = memory_available_bytes()
    return -1 if available is None else available // 2**20


def _park_launch(fleet: Fleet, prefix: str) -> str:
    """A trajectory that proposes one ``sleep`` call, held for approval, and hibernates a second later."""
    tid = f"{prefix}-{uuid.uuid4().hex[:8]}"
    launch = TrajectoryLaunch(
        trajectory_id=tid,
        goal="wait for an approval",
        ceilings={"tokens": 1_000_000},
        grants=("sleep",),
        local_tools=("sleep",),
        approval_required=("sleep",),
        approval_timeout_s=86_400.0,  # only the approval ends the wait
        hibernate_after_s=1.0,
        created_at=time.time(),
        deadline_s=86_400.0,
        metadata={"scenario": "irreversible:sleep"},
        provider=ProviderLaunch(base_url=fleet.provider_url, model="sim"),
        redis_url=fleet.url,
        use_scheduler=False,
        guard="local",
        keyring_path=str(fleet.keyring),
        completion_check=CheckLaunch(name="always"),
    )
    save_launch(fleet.url, launch)
    fleet.runs.append(ensure_actor(launch, ClusterAdapters()).run.remote())
    return tid


async def _statuses(fleet: Fleet, tids: list[str]) -> list[dict[bytes, bytes]]:
    pipe = fleet.redis.pipeline(transaction=False)
    for tid in tids:
        pipe.hgetall(status_key(tid))
    return list(await pipe.execute())


async def _until_all(fleet: Fleet, tids: list[str], check: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = await _statuses(fleet, tids)
        left = sum(1 for row in rows if not check(row))
        if not left:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{left} of {len(tids)} trajectories never reached {what}")
        await asyncio.sleep(0.25)


def _parked(row: dict[bytes, bytes]) -> bool:
    return row.get(b"hibernated") == b"1" and bool(row.get(b"held_digest"))


def _terminal(row: dict[bytes, bytes]) -> bool:
    return row.get(b"state", b"").decode() in {s.value for s in _TERMINAL}


async def _interrupts(
    fleet: Fleet,
    live: str,
    *,
    count: int | None = None,
    stop: asyncio.Event | None = None,
    into: list[float] | None = None,
) -> list[float]:
    """Interrupts to the live trajectory one at a time (10 per second at most), each timed from its control
    entry to its ``ControlRequested`` log entry (server clock), ``count`` of them or until ``stop`` is set."""
    samples = [] if into is None else into
    k = 0
    while (count is None or k < count) and (stop is None or not stop.is_set()):
        s = await fleet.client.send(
            live, ControlAction.INTERRUPT, issuer="operator", payload={"message": f"i{k}"}, check_known=False
        )
        mid = s.message.message_id
        at = await _await_entry(
            fleet,
            live,
            lambda e, mid=mid: isinstance(e, ControlRequested) and e.message_id == mid,
            "interrupt",
        )
        samples.append(float(at - entry_ms(s.entry_id)))
        k += 1
        await asyncio.sleep(0.1)
    return samples


async def stuck_entries(
    fleet: Fleet, live: str, relays: list[Any], entries: int, count: int
) -> dict[str, Any]:
    """Interrupt latency of the live trajectory while ``entries`` messages cannot be delivered: each is for a
    parked trajectory whose actor needs a resource no node has, so its relay lane waits for a placement
    that never comes (the relay's other lanes go on)."""
    tids = []
    for i in range(entries):
        tid = f"stuck-{i}-{uuid.uuid4().hex[:6]}"
        launch = TrajectoryLaunch(
            trajectory_id=tid,
            goal="never placed",
            ceilings={"tokens": 1_000},
            created_at=time.time(),
            provider=ProviderLaunch(base_url=fleet.provider_url, model="sim"),
            redis_url=fleet.url,
            keyring_path=str(fleet.keyring),
            resources={"nowhere": 1.0},
        )
        save_launch(fleet.url, launch)
        tids.append(tid)
    for tid in tids:
        await fleet.client.send(tid, ControlAction.RESUME, issuer="operator", check_known=False)

    async def all_stuck() -> bool:
        stats = [await h.stats.remote() for h in relays]
        return sum(int(st.get("lanes", 0)) for st in stats) >= entries

    deadline = time.monotonic() + 300.0
    while not await all_stuck():
        if time.monotonic() > deadline:
            raise TimeoutError("the stuck entries never reached the relays")
        await asyncio.sleep(0.2)
    await fleet.new_log_entries(live)
    samples = await _interrupts(fleet, live, count=count)
    pending = sum([int((await h.stats.remote()).get("queued", 0)) for h in relays])
    # Clean up: without a launch they are unknown (audited, acked); their pending actors are killed.
    for tid in tids:
        await fleet.redis.delete(f"{LAUNCH_PREFIX}{tid}")
    for tid in tids:
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(f"traj:{tid}", namespace="tether"), no_restart=True)
    return {
        "entries": entries,
        "still_queued_after": pending,
        "interrupt_ms": {"p50": round(percentile(samples, 50), 2), "p99": round(percentile(samples, 99), 2)},
        "samples": len(samples),
    }


async def parked_round(fleet: Fleet, live: str, n: int, repetition: int) -> dict[str, Any]:
    """Park N trajectories, approve them all at once; time until all are terminal, interrupts meanwhile."""
    t0 = time.perf_counter()
    tids = [_park_launch(fleet, f"park{repetition}") for _ in range(n)]
    await _until_all(fleet, tids, _parked, "hibernation while holding a call", timeout_s=3600.0)
    park_s = time.perf_counter() - t0
    await fleet.new_log_entries(live)  # move the live trajectory's cursor past everything so far
    mem_before = _mem_available_mb()
    mine = set(tids)
    held = [h for h in await fleet.client.held_calls(tool="sleep") if h.trajectory_id in mine]
    assert len(held) == n, f"{len(held)} of {n} held calls listed"

    baseline = await _interrupts(fleet, live, count=50)
    done = asyncio.Event()
    interrupts: list[float] = []

    async def interrupt_meanwhile() -> None:
        await _interrupts(fleet, live, stop=done, into=interrupts)

    sampler = asyncio.ensure_future(interrupt_meanwhile())
    lowest_mem = mem_before
    started = time.perf_counter()
    result = await fleet.client.decide_many(
        ControlAction.APPROVE, [(h.trajectory_id, h.digest) for h in held], issuer="operator"
    )
    assert not result.refused and len(result.sent) == n
    deadline = time.monotonic() + 3600.0
    while True:
        rows = await _statuses(fleet, tids)
        lowest_mem = min(lowest_mem, _mem_available_mb())
        if all(_terminal(r) for r in rows):
            break
        if time.monotonic() > deadline:
            left = sum(1 for r in rows if not _terminal(r))
            raise TimeoutError(f"{left} of {n} approved trajectories never ended")
        await asyncio.sleep(0.25)
    approve_all_s = time.perf_counter() - started
    done.set()
    await sampler
    states = Counter(r.get(b"state", b"").decode() for r in rows)
    return {
        "n": n,
        "park_s": round(park_s, 1),
        "approve_all_s": round(approve_all_s, 1),
        "interrupts": len(interrupts),
        "interrupt_samples_ms": interrupts,
        "baseline_samples_ms": baseline,
        "states": dict(states),
        "mem_available_mb_before": mem_before,
        "mem_available_mb_lowest": lowest_mem,
    }


async def run_parked(n: int, repeats: int, slots: int, workdir: Path) -> dict[str, Any]:
    load_at_start = round(os.getloadavg()[0], 2)
    server = RedisServer(data_dir=workdir / "redis").start()
    provider = start_provider_thread(ProviderConfig())
    keyring = workdir / "keyring.yaml"
    create_key("operator", [Role.OPERATOR], keyring)
    start_local_ray(trajectory_slots=slots)
    relays: list[Any] = []
    groups: dict[str, int] = {}
    fleet = Fleet(server.url, provider.base_url, keyring)
    rounds: list[dict[str, Any]] = []
    stuck: dict[str, Any] = {}
    try:
        relays = start_relays(server.url, 2, adapters=ClusterAdapters(), config={"block_ms": 100})
        live = fleet.launch("live", workspaces=workdir / "workspaces")
        await fleet.wait_status([live], lambda s: s.state == "WAITING_TOOL", "WAITING_TOOL")
        await sandbox_groups([live], groups)
        for r in range(repeats):
            rounds.append(await parked_round(fleet, live, n, r))
            print(f"parked round {r}: {rounds[-1]['approve_all_s']} s to approve {n}", flush=True)
        relay_stats = [ray.get(h.stats.remote()) for h in relays]
        # last: the unplaceable trajectories' lanes keep waiting (and re-creating their pending actors from
        # the relays' launch cache) until the relays stop
        stuck = await stuck_entries(fleet, live, relays, entries=51, count=200)
        print(f"stuck entries: {stuck['interrupt_ms']}", flush=True)
    finally:
        for pgid in groups.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        stop_relays(relays)
        await fleet.close()
        ray.shutdown()
        provider.stop()
        server.stop()
    at = commit()
    for rep in rounds:
        samples = rep.pop("interrupt_samples_ms")
        baseline = rep.pop("baseline_samples_ms")
        rep["interrupt_ms"] = {
            "p50": round(percentile(samples, 50), 2),
            "p99": round(percentile(samples, 99), 2),
        }
        rep["interrupt_idle_ms"] = {
            "p50": round(percentile(baseline, 50), 2),
            "p99": round(percentile(baseline, 99), 2),
        }
        rep["commit"] = at
    return summarise_parked(
        rounds,
        stuck=stuck,
        setup={
            "trajectory_slots": slots,
            "relays": 2,
            "woken_by_relays": sum(int(s.get("woken", 0)) for s in relay_stats),
            "parked_scenario": "irreversible:sleep, approval_required sleep, hibernate_after_s 1",
            "approve": "ControlClient.held_calls + decide_many (tether approve --all-pending): one signed "
            "message per held call, published in one pipeline",
            "live_trajectory": "one run_command sh -c 'sleep 3600 & wait' in WAITING_TOOL",
            "load_avg_1m_at_start": load_at_start,
            "ray_cpus": 2,
        },
    )


PARKED_NOTES = (
    "approve_all_s: median over repetitions of the time from just before the approvals are published "
    "until every parked trajectory's status is terminal (each is woken from its launch by a relay as "
    "slots free, and runs its approved call to completion). interrupt_ms: one interrupt at a time to the "
    "live trajectory during those windows, control entry -> ControlRequested in its log (server clock, 1 "
    "ms resolution); target p99 100 ms; each repetition has its own p50/p99, and the summary is the "
    "median of their p50s and the largest of their p99s. interrupt_idle_ms: the same, 50 per repetition "
    "just before approving (no wake-ups going on). stuck: the same with 51 undeliverable entries held by "
    "the relays (trajectories whose actors can never be placed), no wake-up storm; from the latest "
    "invocation. Repetitions may come from several invocations (--append); each records its commit."
)


def summarise_parked(
    rounds: list[dict[str, Any]], *, stuck: dict[str, Any], setup: dict[str, Any]
) -> dict[str, Any]:
    """The parked-fleet result from its repetitions (each with its own percentiles and commit)."""
    if not rounds:
        raise ValueError("no parked-fleet repetitions to summarise")
    totals = [r["approve_all_s"] for r in rounds]
    commits = [r["commit"] for r in rounds]

    def summary(key: str) -> dict[str, float]:
        return {
            "p50": round(statistics.median(r[key]["p50"] for r in rounds), 2),
            "p99": round(max(r[key]["p99"] for r in rounds), 2),
        }

    return {
        "n": rounds[0]["n"],
        "approve_all_s": round(statistics.median(totals), 1),
        "approve_all_s_each": totals,
        "interrupt_ms": summary("interrupt_ms"),
        "interrupt_samples": sum(r["interrupts"] for r in rounds),
        "interrupt_idle_ms": summary("interrupt_idle_ms"),
        "stuck": stuck,
        "repetitions": rounds,
        "commit": commits[-1],
        "commits_per_repetition": commits,
        "setup": setup,
        "notes": PARKED_NOTES,
        "environment": environment(),
    }


def append_parked(previous: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s repetitions after ``previous``'s, summarised together (same N and trajectory slots).

    A result written before repetitions carried their own percentiles and commit had one repetition, so the
    result's own figures are that repetition's."""
    if previous["n"] != new["n"]:
        raise ValueError(
            f"cannot append: {new['n']} parked trajectories, the stored result has {previous['n']}"
        )
    slots = (previous.get("setup") or {}).get("trajectory_slots")
    if slots != new["setup"]["trajectory_slots"]:
        raise ValueError(
            f"cannot append: trajectory_slots {new['setup']['trajectory_slots']} differs from {slots}"
        )
    old = [dict(r) for r in previous["repetitions"]]
    missing = [r for r in old if "interrupt_ms" not in r or "commit" not in r]
    if missing and len(old) != 1:
        raise ValueError("cannot append: stored repetitions lack their own percentiles and commit")
    for r in missing:
        r.setdefault("interrupt_ms", previous["interrupt_ms"])
        r.setdefault("interrupt_idle_ms", previous["interrupt_idle_ms"])
        r.setdefault("commit", previous["commit"])
    setup = dict(new["setup"])
    setup["woken_by_relays"] = int((previous.get("setup") or {}).get("woken_by_relays", 0)) + int(
        setup["woken_by_relays"]
    )
    return summarise_parked(old + new["repetitions"], stuck=new["stuck"], setup=setup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5, help="interrupt rounds over the live fleet")
    parser.add_argument(
        "--kill-rounds",
        type=int,
        default=4,
        help="fleets of N live trajectories to kill (half one at a time, half in a burst): N/2 x this kills",
    )
    parser.add_argument("--hibernated", type=int, default=10)
    parser.add_argument(
        "--redis-dir",
        type=Path,
        default=None,
        help="keep Redis's AOF here (a disk of its own) instead of the run's temporary directory",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"result path (default: results/{NAME}.json; live case only)"
    )
    parser.add_argument(
        "--damon-off",
        action="store_true",
        help="diagnostic (root, with --out): stop the kernel's DAMON monitors for the run, start them after",
    )
    parser.add_argument("--parked", type=int, default=300, help="parked trajectories per repetition")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of the parked-fleet case")
    parser.add_argument("--slots", type=int, default=24, help="trajectory slots the local Ray declares")
    parser.add_argument(
        "--only",
        choices=["all", "live", "parked"],
        default="all",
        help="run one case; the other's results are kept from the last JSON",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="add this run's parked-fleet repetitions to the stored ones (same --parked and --slots)",
    )
    args = parser.parse_args()
    if args.kill_rounds < 1 or args.trajectories < 2:
        parser.error("--kill-rounds must be at least 1 and --trajectories at least 2")
    if args.redis_dir is not None and not args.redis_dir.is_dir():
        parser.error(f"--redis-dir {args.redis_dir}: not a directory")
    if args.out is not None and args.only != "live":
        parser.error("--out writes a live-case run beside the headline: use it with --only live")
    if args.damon_off and (args.out is None or os.geteuid() != 0 or damon_state() is None):
        parser.error("--damon-off changes the machine: it needs root, a kernel with DAMON and --out")
    out: Path = args.out or RESULTS_DIR / f"{NAME}.json"
    previous = RESULTS_DIR / f"{NAME}.json"
    # a run beside the headline (--out, live case only) is its own file: nothing is kept from the headline
    keep = args.out is None and previous.exists()
    result: dict[str, Any] = json.loads(previous.read_text()) if keep else {}
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        if args.only in ("all", "live"):
            kept = result.get("parked")
            with damon_paused(args.damon_off) as damon:
                result = asyncio.run(
                    run(
                        args.trajectories,
                        args.rounds,
                        args.kill_rounds,
                        args.hibernated,
                        Path(tmp) / "live",
                        redis_dir=args.redis_dir,
                        plot=out.with_suffix(".png"),
                    )
                )
            result["setup"]["damon_during_run"] = damon
            if kept is not None:
                result["parked"] = kept
        if args.only in ("all", "parked"):
            parked = asyncio.run(run_parked(args.parked, args.repeats, args.slots, Path(tmp) / "parked"))
            if args.append and result.get("parked"):
                parked = append_parked(result["parked"], parked)
            result["parked"] = parked
    path = write_json(out.stem, result, out.parent)
    print(path)
    print({k: result.get(k) for k in ("trajectories", "record_ms", "kill_ms", "hibernated_bytes")})
    parked_result = result.get("parked") or {}
    print({k: parked_result.get(k) for k in ("n", "approve_all_s", "approve_all_s_each", "interrupt_ms")})


if __name__ == "__main__":
    main()
