"""MCP servers under faults, on Ray (issue 17): the repository and the guard actors are the judges.

- A trajectory actor is SIGKILLed while the approved ``git_commit`` is in flight (a pre-commit hook holds it
  for seconds). The session lives in the git server's host actor, so the commit is carried out exactly once;
  the restarted trajectory finds the call in doubt and, ``git_commit`` being never-repeat, does not send it
  again. The repository's own history is the ledger.
  Control: with the session held by the trajectory actor itself (``mcp_placement: trajectory``), the kill
  (the worker and every process it started: a stdio server orphaned by a bare SIGKILL of its parent could
  still finish the commit, or not, by timing) takes the call with it.
- Failures of one MCP server trip only that server's breaker; control: two servers declared under one scope
  share the trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.contracts import ServerHints
from actors.launch import TrajectoryLaunch, save_launch
from actors.relay import start_relays, stop_relays
from actors.tools_mcp.host import RayMcpHosts, host_actor_name
from actors.trajectory import ensure_actor
from breakers.breaker import BreakerPolicy, BreakerState
from breakers.guard import NAMESPACE as GUARD_NAMESPACE
from breakers.guard import GuardHandle
from breakers.guard import actor_name as guard_name
from breakers.scope_guard import GuardPolicy
from cluster.adapters import ClusterAdapters
from cluster.control_client import ControlClient
from cluster.runner import plan_launches
from cluster.signing import Role, create_key
from cluster.workload import parse_workload
from runtime.events import ToolDispatchIntent
from testbed.provider import ProviderConfig, ProviderThread, start_provider_thread
from tests.integration.mcp_kit import Repo, echo_server, stop
from tests.integration.trajectory_kit import MODEL, events_of

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

COMMIT_TAKES_S = 6.0


@pytest.fixture(scope="module")
def provider() -> Iterator[ProviderThread]:
    handle = start_provider_thread(ProviderConfig(ttft_ms=5.0, tokens_per_s=5000.0, models=(MODEL,)))
    try:
        yield handle
    finally:
        handle.stop()


async def eventually(probe: Any, what: str, timeout_s: float = 120.0) -> Any:
    """Poll ``probe`` (sync or async) until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def _kill_actor(name: str, namespace: str = "tether") -> None:
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)


def _commit_workload(repo: Repo) -> str:
    add = ["git_add", {"repo_path": str(repo.path), "files": ["notes.txt"]}]
    commit = ["git_commit", {"repo_path": str(repo.path), "message": "approved commit"}]
    return f"""
name: mcp-kill
provider: {{kind: simulated, model: {MODEL}}}
mcp_servers:
  git: {{command: [mcp-server-git, --repository, "{repo.path}"]}}
tools:
  - {{name: git_add, source: mcp, server: git, side_effect: irreversible, repeat: idempotent,
     needs_approval: false}}
  - {{name: git_commit, source: mcp, server: git, side_effect: irreversible, repeat: never_repeat}}
approval_timeout_s: 240
tool_timeout_s: 60
scheduler: false
trajectories:
  - id: commit
    scenario: '{"script:" + json.dumps([add, commit])}'
    grants: [git_add, git_commit]
    completion_check: {{kind: always}}
    deadline_s: 400
"""


@contextlib.asynccontextmanager
async def mcp_run(
    text: str,
    redis_url: str,
    provider: ProviderThread,
    tmp_path: Path,
    guard_policy: GuardPolicy | None = None,
    **launch_overrides: Any,
) -> AsyncIterator[tuple[list[TrajectoryLaunch], ControlClient]]:
    """What ``tether run`` sets up for an MCP workload, owned by this test: host and guard actors, a relay,
    an operator key; yields the planned launches (saved) and an operator's control client."""
    wl = parse_workload(text, "test.yaml")
    hosts = RayMcpHosts({name: spec.config(tmp_path) for name, spec in wl.mcp_servers.items()})
    catalog = {}
    for name in wl.mcp_servers:
        listed = await hosts.list_tools(name, 60.0)
        catalog[name] = {
            t.name: ServerHints(t.description, t.input_schema, t.read_only, t.destructive, t.idempotent)
            for t in listed
        }
    scopes = {t.guarded_scope(wl.mcp_servers) for t in wl.tools}
    guards = GuardHandle(guard_policy)
    for scope in scopes:
        guards.actor(scope)
    keyring = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], keyring)
    planned = plan_launches(
        wl,
        run_id=f"r{time.monotonic_ns() % 10**8}",
        redis_url=redis_url,
        base_url=provider.base_url,
        testbed_address=None,
        created_at=time.time(),
        keyring_path=str(keyring),
        mcp_catalog=catalog,
        base_dir=tmp_path,
    )
    launches = [launch.model_copy(update=launch_overrides) for _, launch in planned]
    for launch in launches:
        save_launch(redis_url, launch)
    relays = start_relays(redis_url, 1, adapters=ClusterAdapters())
    client = ControlClient.from_url(redis_url, keyring=keyring)
    try:
        yield launches, client
    finally:
        await client.close()
        stop_relays(relays)
        for launch in launches:
            _kill_actor(f"traj:{launch.trajectory_id}")
        for name in wl.mcp_servers:
            _kill_actor(host_actor_name(name))
        for scope in scopes:
            _kill_actor(guard_name(scope), GUARD_NAMESPACE)


@pytest.mark.parametrize(
    ("placement", "expected_commits"),
    [("host", ["approved commit"]), ("trajectory", [])],
    ids=["session-in-host-actor", "control-session-in-trajectory-actor"],
)
async def test_killing_the_trajectory_mid_git_commit_leaves_exactly_one_commit(
    ray_local: None,
    redis_url: str,
    provider: ProviderThread,
    tmp_path: Path,
    placement: str,
    expected_commits: list[str],
) -> None:
    # Given a trajectory that stages a file and proposes git_commit (irreversible: held for approval), in a
    # repository whose commits take seconds
    repo = Repo.create(tmp_path, commit_takes_s=COMMIT_TAKES_S)
    async with mcp_run(_commit_workload(repo), redis_url, provider, tmp_path, mcp_placement=placement) as (
        launches,
        client,
    ):
        [launch] = launches
        tid = launch.trajectory_id
        handle = ensure_actor(launch, ClusterAdapters())
        pid = await handle.pid.remote()
        running = handle.run.remote()
        held = await eventually(lambda: _held(client, tid), "git_commit held for approval")
        assert held.tool == "git_commit" and repo.commits() == []
        # When an operator approves it, and the trajectory's worker is SIGKILLed with every process it started
        # (a lost worker: a stdio server it spawned must not live on to finish the call) while the commit is
        # in flight
        await client.approve(tid, issuer="alice", call_digest=held.digest)
        await eventually(repo.hook_started.exists, "the commit to start", timeout_s=120)
        _kill_process_tree(pid)
        summary = await running  # Ray restarts the actor and retries run(); the trajectory goes on to its end
        assert await handle.pid.remote() != pid
        # (the end state: every call the git server's host holds has finished)
        host = ray.get_actor(host_actor_name("git"), namespace="tether") if placement == "host" else None
        if host is not None:
            await eventually(
                lambda: _idle(host), "the host to finish the commit", timeout_s=COMMIT_TAKES_S + 60
            )
        else:
            await asyncio.sleep(0)  # nothing outlives the killed actor's process to wait for
        events = await events_of(redis_url, tid)
    # Then the repository's history shows the approved commit exactly once (control: none at all)
    assert repo.commits() == expected_commits
    # And git_commit was dispatched once: the restarted trajectory did not send it again (never-repeat)
    commits_sent = [e for e in events if isinstance(e, ToolDispatchIntent) and e.tool == "git_commit"]
    assert len(commits_sent) == 1
    assert summary["state"] in ("COMPLETED", "FAILED")


def _kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (found before any dies, so none is reparented unseen); a
    descendant leading its own process group (the MCP SDK starts stdio servers in a new session) takes its
    group with it (git and the hook it runs)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current]
        tree += children
        frontier += children
    os.kill(pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(child) == child:
                os.killpg(child, signal.SIGKILL)
            else:
                os.kill(child, signal.SIGKILL)


async def _held(client: ControlClient, tid: str) -> Any:
    status = await client.status(tid)
    return status.held if status is not None else None


async def _idle(host: Any) -> bool:
    return int(await host.in_flight.remote()) == 0


def _isolation_workload(echo_url: str, shared_scope: bool) -> str:
    scope = "scope: shared, " if shared_scope else ""
    clock = json.dumps([["now", {"timezone": "Etc/UTC"}]])
    return f"""
name: mcp-isolation
provider: {{kind: simulated, model: {MODEL}}}
mcp_servers:
  time: {{{scope}command: [mcp-server-time, --local-timezone, Etc/UTC]}}
  echo: {{{scope}url: "{echo_url}", connect_timeout_s: 2}}
tools:
  - {{name: now, source: mcp, server: time, remote: get_current_time}}
  - {{name: echo, source: mcp, server: echo}}
scheduler: false
tool_timeout_s: 10
retry: {{max_attempts: 3, base_backoff_s: 0.05, max_backoff_s: 0.2}}
trajectories:
  - id: noisy
    count: 2
    scenario: "finish_after:8"
    grants: [echo]
    completion_check: {{kind: always}}
  - id: clock
    scenario: '{"script:" + clock}'
    grants: [now]
    completion_check: {{kind: tool_succeeded, tool: now}}
"""


@pytest.mark.parametrize(
    ("shared_scope", "clock_state", "time_scope"),
    [(False, "COMPLETED", "mcp-time"), (True, "FAILED", "shared")],
    ids=["scope-per-server", "control-one-shared-scope"],
)
async def test_failures_of_one_mcp_server_trip_only_its_own_breaker(
    ray_local: None,
    redis_url: str,
    provider: ProviderThread,
    tmp_path: Path,
    shared_scope: bool,
    clock_state: str,
    time_scope: str,
) -> None:
    # Given two MCP servers, time (stdio) and echo (streamable HTTP), each listed at start; then echo goes
    # away. Breakers cool down for a minute, so what is open stays open while the test looks.
    policy = GuardPolicy(breaker=BreakerPolicy(cooldown_s=60.0, max_cooldown_s=120.0))
    with echo_server() as (url, proc):
        text = _isolation_workload(url, shared_scope)
        async with mcp_run(text, redis_url, provider, tmp_path, guard_policy=policy) as (launches, _):
            stop(proc)
            noisy = [ln for ln in launches if ".noisy" in ln.trajectory_id]
            [clock] = [ln for ln in launches if ln.trajectory_id.endswith(".clock")]
            echo_scope = "shared" if shared_scope else "mcp-echo"
            # When trajectories keep calling echo until its breaker opens
            noisy_runs = [ensure_actor(ln, ClusterAdapters()).run.remote() for ln in noisy]
            await eventually(lambda: _breaker(echo_scope) is BreakerState.OPEN, "echo's breaker to open", 180)
            # And then a trajectory calls the time server
            clock_summary = await ensure_actor(clock, ClusterAdapters()).run.remote()
            await asyncio.gather(*noisy_runs)
            time_breaker = _breaker(time_scope)
    # Then the time server's breaker stayed closed and its call went through (control: one shared scope
    # refuses the time call too, and the clock trajectory fails its completion check)
    assert clock_summary["state"] == clock_state
    assert time_breaker is (BreakerState.OPEN if shared_scope else BreakerState.CLOSED)


def _breaker(scope: str) -> BreakerState:
    guard = ray.get_actor(guard_name(scope), namespace=GUARD_NAMESPACE)
    state: BreakerState = ray.get(guard.snapshot.remote()).state
    return state
