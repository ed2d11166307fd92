"""Running a workload: what ``tether run`` does between reading the file and printing the summary.

1. ``Services`` starts what the workload needs and stops it on exit (also on Ctrl-C): the embedded Redis
   (unless ``TETHER_REDIS_URL`` is set), the simulated provider, the testbed tool services, a small local
   Ray on loopback (unless ``--address``), the scheduler actor with the provider's limits and the priority
   classes, the control relays (``relay:0`` .. ``relay:<n-1>``), so ``tether pause/approve/...`` act on
   the trajectories while the run is going, and as many timer service replicas (``timers:<n>``), which fire
   durable timers (expiries, deadlines) into the trajectories, waking hibernated ones.
2. ``plan_launches`` turns every trajectory of the workload into a ``TrajectoryLaunch`` (stored in Redis, so
   anyone can re-create an actor later).
3. ``Driver`` creates one trajectory actor per launch, waits for each ``run()``, follows hibernated ones
   until a relay or the timer service wakes them (waking them itself only without a timer service), and
   samples every trajectory's status snapshot to draw progress and a states-over-time timeline.
4. ``RunResult.report()`` is the JSON report of issue 3, ``write_timeline_png`` the picture beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from actors import aio
from actors.contracts import ServerHints
from actors.launch import CheckLaunch, ProviderLaunch, RetryLaunch, TrajectoryLaunch, save_launch
from actors.outage import DEFAULT_OUTAGE_BUDGET_S, Outage
from actors.provider_tally import read_provider_tallies, summed
from actors.status import status_key
from actors.tools_mcp.config import McpRoute
from cluster.adapters import ClusterAdapters
from cluster.embedded import REDIS_URL_ENV, redis_url_from_env, stop_embedded, tether_home
from cluster.run_actions import OperatorActions, PlannedAction, alongside
from cluster.run_report import read_handoffs, read_ledger
from cluster.workload import ToolSource, TrajectorySpec, Workload, resolve_tool_contracts
from runtime.errors import DependencyError
from runtime.states import TrajectoryState

__all__ = [
    "RunOptions",
    "RunResult",
    "RunStopped",
    "Services",
    "TrajectoryResult",
    "keep_ray_on_loopback",
    "plan_launches",
    "prepare_local_ray",
    "prewarm_workers",
    "request_capacity",
    "run_driver",
    "start_local_ray",
    "write_timeline_png",
]

_STATE_ORDER = [s.value for s in TrajectoryState]
_log = logging.getLogger(__name__)
DEADLINE_GRACE_S = 60.0


class RunStopped(Exception):
    """``run_driver`` was asked to stop before every trajectory ended (the trajectories go on)."""


@dataclass(frozen=True)
class RunOptions:
    """How ``tether run`` runs: the cluster, the report, and local-cluster sizing."""

    address: str | None = None  # None: start a local Ray
    report: Path | None = None
    # Capacity asked for before the actors exist: on a local Ray this many worker processes are started;
    # on a cluster this run joined, the autoscaler is asked for room for this many trajectories.
    prewarm: int = 0
    dashboard: bool = False
    num_cpus: int = 2
    run_id: str | None = None  # None: a fresh id (a repeated id resumes that run's trajectories)
    poll_s: float = 0.25
    relays: int = 1  # control relays started for the run (0: the run takes no operator signals)
    sandboxes: int = 4  # sandboxed commands (run_command) running at once across the run
    metrics_port: int | None = None  # serve the driver's Prometheus /metrics here (0: a free port)


@dataclass(frozen=True)
class TrajectoryResult:
    """One trajectory as the run ended it."""

    id: str
    name: str  # the id in the workload file
    priority_class: str
    state: str
    exit_reason: str | None
    turns: int
    tokens: int
    dollars: float
    binding_dimension: str | None
    expected_state: str | None = None
    error: str | None = None
    # issue 12: the result's rung and machine-readable completeness, and what supervision left behind
    result: dict[str, Any] | None = None
    escalations: dict[str, str] = field(default_factory=dict)  # escalation id -> trigger
    children: dict[str, Any] = field(default_factory=dict)
    spend: dict[str, float] = field(default_factory=dict)

    @property
    def rung(self) -> str:
        return str((self.result or {}).get("rung", "full"))

    @property
    def as_expected(self) -> bool:
        return self.error is None and (self.expected_state is None or self.state == self.expected_state)

    def row(self) -> dict[str, Any]:
        """The report's per-trajectory entry (issue 3)."""
        return {
            "id": self.id,
            "state": self.state,
            "exit_reason": self.exit_reason,
            "turns": self.turns,
            "tokens": self.tokens,
            "dollars": self.dollars,
            "binding_dimension": self.binding_dimension,
            "rung": self.rung,
            "result": self.result,
            "escalations": dict(self.escalations),
            "children": dict(self.children),
        }


@dataclass
class RunResult:
    results: list[TrajectoryResult]
    # What the run saw of its provider (``Services.provider_counts``): issue 3's ``requests`` and
    # ``rate_limited``, plus ``simulated`` (the simulator's own counters, None for a real provider),
    # ``observed`` (what the trajectories' adapters saw, per provider) and ``scheduler`` (per provider key:
    # admissions, 429s reported, retry hints honoured, the limits learned).
    provider: dict[str, Any] = field(default_factory=lambda: {"requests": None, "rate_limited": None})
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    elapsed_s: float = 0.0
    # The testbed's own count of what the run did to the world (``cluster.run_report.ledger_summary``;
    # None without testbed tools), and the handoff packet of each trajectory that wrote one.
    ledger: dict[str, Any] | None = None
    handoff: dict[str, dict[str, Any]] = field(default_factory=dict)
    operator_actions: dict[str, str] = field(default_factory=dict)
    # issue 12: escalations by trigger, incidents and the quarantine, read from the cluster at the end
    supervision: dict[str, Any] = field(default_factory=dict)

    @property
    def unexpected(self) -> list[TrajectoryResult]:
        return [r for r in self.results if not r.as_expected]

    def report(self) -> dict[str, Any]:
        """``{"summary", "trajectories", "provider"}`` as issue 3 specifies, plus issue 11's ``ledger`` (the
        testbed's own count), ``handoff`` (packets by trajectory) and the scripted ``operator_actions``."""
        states = Counter(r.state for r in self.results)
        reasons = Counter(r.exit_reason for r in self.results if r.exit_reason is not None)
        rungs = Counter(r.rung for r in self.results)
        statuses = Counter(str((r.result or {}).get("status", "unknown")) for r in self.results)
        degraded = sum(n for rung, n in rungs.items() if rung != "full")
        return {
            "summary": {
                "states": dict(sorted(states.items())),
                "exit_reasons": dict(sorted(reasons.items())),
                "tokens": sum(r.tokens for r in self.results),
                "dollars": round(sum(r.dollars for r in self.results), 6),
                "rungs": dict(sorted(rungs.items())),
                "results": dict(sorted(statuses.items())),
                "degraded_result_rate": round(degraded / len(self.results), 4) if self.results else 0.0,
            },
            "trajectories": [r.row() for r in self.results],
            "provider": dict(self.provider),
            "ledger": self.ledger,
            "handoff": dict(self.handoff),
            "operator_actions": dict(self.operator_actions),
            "supervision": dict(self.supervision),
        }


# --------------------------------------------------------------------------- planning


def plan_launches(
    workload: Workload,
    *,
    run_id: str,
    redis_url: str,
    base_url: str,
    testbed_address: str | None,
    created_at: float,
    keyring_path: str | None = None,
    workspace_root: str | None = None,
    mcp_catalog: Mapping[str, Mapping[str, ServerHints]] | None = None,
    base_dir: Path | None = None,
) -> list[tuple[TrajectorySpec, TrajectoryLaunch]]:
    """A launch per trajectory (``count`` templates expanded); ids are ``<run_id>.<id in the file>``.

    ``workspace_root``: where each trajectory's sandbox workspace lives (``<root>/<trajectory id>``);
    None: no sandbox (tools that need one are refused). ``mcp_catalog``: what each MCP server listed at the
    run's start (``Services.mcp_catalog``), from which MCP tools import their schemas. ``base_dir``: what a
    stdio MCP server's relative ``cwd`` is relative to (default: this process's working directory).
    """
    provider = ProviderLaunch(
        base_url=base_url,
        model=workload.provider.model,
        api_key_env=workload.provider.api_key_env,
        input_per_mtok=workload.provider.prices.input_per_mtok,
        cached_input_per_mtok=workload.provider.prices.cached_input_per_mtok,
        output_per_mtok=workload.provider.prices.output_per_mtok,
    )
    routes: dict[str, str] = {}
    local: list[str] = []
    mcp_tools: dict[str, McpRoute] = {}
    for tool in workload.tools:
        if tool.source == ToolSource.BUILTIN:
            local.append(tool.name)
        elif tool.source == ToolSource.GRPC:
            assert tool.address is not None  # the schema requires it
            routes[tool.name] = tool.address
        elif tool.source == ToolSource.MCP:
            assert tool.server is not None  # the schema requires it
            mcp_tools[tool.name] = McpRoute(server=tool.server, remote=tool.remote or tool.name)
        else:
            if testbed_address is None:
                raise ValueError("testbed tools declared but no testbed address given")
            routes[tool.name] = testbed_address
    contracts, _ = resolve_tool_contracts(workload, mcp_catalog)
    base = base_dir or Path.cwd()
    mcp_servers = {name: spec.config(base) for name, spec in workload.mcp_servers.items()}
    retry = RetryLaunch(**workload.retry.model_dump())
    planned = []
    for spec in workload.expanded():
        check = spec.completion_check
        params: dict[str, Any] = {"count": check.count}
        if check.tool is not None:
            params["tool"] = check.tool
        if check.tools:
            params["tools"] = list(check.tools)
        budget = spec.budget.model_dump()
        launch = TrajectoryLaunch(
            trajectory_id=f"{run_id}.{spec.id}",
            tenant=spec.tenant,
            goal=spec.goal,
            priority_class=spec.priority_class,
            ceilings={k: float(v) for k, v in budget.items()},
            grants=spec.grants,
            max_tokens=spec.max_tokens,
            call_deadline_s=spec.call_deadline_s,
            deadline_s=spec.deadline_s,
            reserve_s=spec.reserve_s(),
            created_at=created_at,
            completion_check=CheckLaunch(name=check.kind, params=params),
            metadata={"scenario": spec.scenario},
            provider=provider,
            redis_url=redis_url,
            # every trajectory routes every declared tool; its grants decide what it may call
            tool_routes=routes,
            local_tools=tuple(local),
            tool_contracts=contracts,
            mcp_servers=mcp_servers,
            mcp_tools=mcp_tools,
            use_scheduler=workload.scheduler,
            guard=workload.guard,
            retry=retry,
            keyring_path=keyring_path,
            approval_timeout_s=workload.approval_timeout_s,
            approval_quorum=workload.approval_quorum,
            approval_roles=workload.approval_roles,
            tool_timeout_s=workload.tool_timeout_s,
            hibernate_after_s=workload.hibernate_after_s,
            workspace_root=workspace_root,
            resources=workload.trajectory_resources,
            supervision=_supervision_of(workload, spec),
        )
        planned.append((spec, launch))
    return planned


def _supervision_of(workload: Workload, spec: TrajectorySpec) -> Any:
    """The workload's supervision, with the trajectory's own delegation template where it declares one."""
    if spec.delegation is None:
        return workload.supervision
    from actors.supervision_config import SupervisionSpec

    base = workload.supervision or SupervisionSpec()
    return base.model_copy(update={"delegation": spec.delegation})


def new_run_id(now: float) -> str:
    """A short, sortable id for one run (seconds resolution plus the pid against same-second runs)."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{os.getpid() % 10000:04d}"


# --------------------------------------------------------------------------- services


class Services:
    """Everything a run needs, started in order and stopped in reverse (an ``ExitStack`` underneath)."""

    def __init__(self, workload: Workload, options: RunOptions, log_dir: Path | None = None) -> None:
        self.workload = workload
        self.options = options
        self.log_dir = log_dir or tether_home() / "logs"
        self.redis_url = ""
        self.base_url = workload.provider.base_url or ""
        self.testbed_address: str | None = None
        self.provider: Any = None  # testbed ProviderProcess when simulated
        self.keyring_path: str | None = None  # absolute, for a local run; a cluster's workers use their own
        self.workspace_root = str((tether_home() / "workspaces").resolve())
        self.adapters = ClusterAdapters()  # actors.ports over Redis and the keyring, handed to every actor
        self.started_ray = False  # True when this run started its own local Ray (else it joined one)
        self.relay_handles: list[Any] = []
        self.timer_handles: list[Any] = []
        self.mcp_catalog: dict[str, Any] = {}  # MCP server -> its tools' hints, listed at start
        # Handles of the actors we created: a non-detached actor lives as long as its creator holds one.
        self.actor_handles: list[Any] = []
        self.scheduler_actor: Any = None  # the scheduler actor this run started or joined
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Services:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        from testbed.provider import LimiterMode, ProviderConfig, start_provider_subprocess
        from testbed.tools import TestbedProcess

        self.log_dir.mkdir(parents=True, exist_ok=True)
        embedded = not os.environ.get(REDIS_URL_ENV)
        self.redis_url = redis_url_from_env()
        if embedded:
            self._stack.callback(stop_embedded)  # ours: stop it with the rest, not only at interpreter exit
        wl = self.workload
        if wl.provider.kind == "simulated":
            config = ProviderConfig(
                rpm=wl.provider.limits.rpm,
                tpm=wl.provider.limits.tpm,
                limiter=LimiterMode(wl.provider.limits.mode),
                ttft_ms=wl.provider.latency.ttft_ms,
                tokens_per_s=wl.provider.latency.tokens_per_s,
                models=(wl.provider.model,),
            )
            self.provider = start_provider_subprocess(config, log_path=self.log_dir / "provider.log")
            self._stack.callback(self.provider.stop)
            self.base_url = self.provider.base_url
        if any(t.source == ToolSource.TESTBED for t in wl.tools):
            from testbed.tools.faults import FaultPlan

            faults = {
                name: [FaultPlan.model_validate(p) for p in (plan if isinstance(plan, list) else [plan])]
                for name, plan in wl.testbed_faults.items()
            }
            testbed = TestbedProcess(faults=faults).start()
            self._stack.callback(testbed.stop)
            self.testbed_address = testbed.address
        if self.options.address is None:
            # Embedded mode needs no setup: the local operator key exists, so `tether approve` works at once,
            # and every actor reads the same keyring whatever its working directory.
            from cluster.signing import ensure_default_operator, keyring_path

            keyring = keyring_path().resolve()
            ensure_default_operator(keyring)
            self.keyring_path = str(keyring)
        self._start_ray()
        if wl.scheduler:
            self._start_scheduler()
        if wl.guard == "actor":
            self._start_guards()
        self._start_relays()

    def _start_ray(self) -> None:
        import ray

        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        if ray.is_initialized():
            return  # someone else's Ray (tests): not ours to stop
        if self.options.address:
            try:
                ray.init(address=self.options.address, namespace="tether", logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise DependencyError(f"cannot join the Ray cluster at {self.options.address}: {e}") from e
        else:
            start_local_ray(num_cpus=self.options.num_cpus, dashboard=self.options.dashboard)
            self.started_ray = True
        self._stack.callback(ray.shutdown)

    def _start_relays(self) -> None:
        """Start the control relays and as many durable timer service replicas; stop on exit only the ones
        this run created (a cluster this run joined may already run its own, which outlive us)."""
        import ray

        from actors.relay import NAMESPACE, relay_name, start_relays, stop_relays
        from cluster.timer_service import start_timer_services, stop_timer_services, timer_service_name

        def exists(name: str) -> bool:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return False
            return True

        count = self.options.relays
        if count == 0:
            return  # no control relays: the run takes no operator signals (tether pause/approve/...)
        already = {n for n in range(count) if exists(relay_name(n))}
        handles = start_relays(self.redis_url, count, adapters=self.adapters)
        self.relay_handles = handles
        ours = [h for n, h in enumerate(handles) if n not in already]
        if ours:
            self._stack.callback(stop_relays, ours)
        # Timers fire from the cluster, never from this driver (ARCHITECTURE.md, "Durable timers").
        already = {n for n in range(count) if exists(timer_service_name(n))}
        timers = start_timer_services(self.redis_url, count, adapters=self.adapters)
        self.timer_handles = timers
        ours = [h for n, h in enumerate(timers) if n not in already]
        if ours:
            self._stack.callback(stop_timer_services, ours)

    def _start_scheduler(self) -> None:
        from actors.metrics_ray import RayBackend
        from actors.tools_local import SANDBOX_POOL
        from scheduler.actor import SchedulerHandle
        from scheduler.config import ProviderLimits, SandboxPoolConfig, SchedulerConfig
        from scheduler.observe import MetricsAdapter

        p = self.workload.provider
        key = f"{self.base_url}|{p.model}"
        limits = ProviderLimits(
            tokens_per_minute=p.limits.tpm, requests_per_minute=p.limits.rpm, headroom=p.headroom
        )
        classes = dict(self.workload.classes)
        scheduler = SchedulerHandle.connect(
            SchedulerConfig(
                providers={key: limits},
                class_weights=classes,
                # run_command's permits: at most this many sandboxed commands run at once, cluster-wide
                pools={SANDBOX_POOL: SandboxPoolConfig(size=self.options.sandboxes)},
                reserved_class=max(classes, key=lambda c: classes[c]),  # nothing reserved (reserved=0)
                top_class_reserve=p.top_class_reserve,
            ),
            metrics=MetricsAdapter(RayBackend),
        )
        self.actor_handles.append(scheduler.actor)
        self.scheduler_actor = scheduler.actor

    def _start_guards(self) -> None:
        """Create the guard actor of every shared dependency scope, and the host actor of every MCP server,
        from the driver, which then owns them (an actor is owned by its creator: one created by a trajectory
        actor would die with it). Each MCP server's tools are listed here, once, at the run's start
        (``mcp_catalog``): their schemas are imported into the launches, and a declared tool the server
        does not offer stops the run before any trajectory starts."""
        from actors.metrics_ray import RayBackend
        from breakers.guard import GuardHandle

        wl = self.workload
        if wl.mcp_servers:
            self._start_mcp_hosts()
        scopes = sorted({t.guarded_scope(wl.mcp_servers) for t in wl.tools if t.source != ToolSource.BUILTIN})
        policy = None
        if wl.breaker is not None:  # issue 12: an example's outage trips a breaker in a few calls
            from breakers.breaker import BreakerPolicy
            from breakers.scope_guard import GuardPolicy

            b = wl.breaker
            breaker = BreakerPolicy(
                window_size=b.window_size,
                min_samples=b.min_samples,
                trip_threshold=b.failure_threshold,
                cooldown_s=b.cooldown_s,
                max_cooldown_s=max(b.cooldown_s, BreakerPolicy().max_cooldown_s),
                restore_s=b.restore_s,
            )
            policy = GuardPolicy(breaker=breaker)
        handle = GuardHandle(policy=policy, metrics_backend=RayBackend)
        self.actor_handles.extend(handle.actor(scope) for scope in scopes)

    def _start_mcp_hosts(self) -> None:
        import ray

        from actors.tools_mcp.host import RayMcpHosts
        from actors.tools_mcp.session import ToolListing

        servers = self.workload.mcp_servers
        hosts = RayMcpHosts({name: spec.config(Path.cwd()) for name, spec in servers.items()})
        actors = {name: hosts.actor(name) for name in sorted(servers)}
        self.actor_handles.extend(actors.values())
        catalog: dict[str, dict[str, ServerHints]] = {}
        for name, actor in actors.items():
            limit = servers[name].connect_timeout_s
            try:
                listed: list[ToolListing] = ray.get(actor.list_tools.remote(limit), timeout=limit + 30.0)
            except Exception as e:
                cause = getattr(e, "cause", None) or e
                raise DependencyError(
                    f"MCP server {name!r} ({servers[name].describe()}): could not list its tools: {cause}",
                    scope=servers[name].scope_name(name),
                ) from e
            catalog[name] = {
                t.name: ServerHints(t.description, t.input_schema, t.read_only, t.destructive, t.idempotent)
                for t in listed
            }
        self.mcp_catalog = catalog
        _, notes = resolve_tool_contracts(self.workload, catalog)  # fails early, naming the tool
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)

    def provider_counts(self, trajectory_ids: Sequence[str] = ()) -> dict[str, Any]:
        """What the run saw of its provider, from three places, each kept as it counted:

        - ``simulated``: the simulated provider's own counters (``GET /testbed/stats``); None for a real one;
        - ``observed``: what the trajectories' model adapters saw, per provider (requests, responses by HTTP
          status, outcomes, retry hints by header, estimated usage), summed from the tally hashes their
          ``actors.provider_tally.RedisProviderTally`` observers keep in Redis;
        - ``scheduler``: per provider key, what the scheduler actor admitted and was told (429s reported,
          retry hints honoured by header, the limits it learned and where from).

        ``requests`` and ``rate_limited`` (issue 3's report) are the provider's own counts when it keeps them,
        else the adapters' observation, else the scheduler's (admissions and 429s reported).
        """
        simulated = None
        requests: int | None
        limited: int | None
        if self.provider is not None:
            stats = self.provider.stats()
            simulated = {"requests": int(stats["requests"]), "rate_limited": int(stats["rate_limited"])}
        observed = self._observed(trajectory_ids)
        scheduler = self._scheduler_view()
        if simulated is not None:
            requests, limited = simulated["requests"], simulated["rate_limited"]
        elif observed:
            requests, limited = summed(observed, "requests"), summed(observed, "rate_limited")
        elif scheduler:
            requests = sum(int(lane["granted"]) for lane in scheduler.values())
            limited = sum(int(lane["rate_limited"]) for lane in scheduler.values())
        else:
            requests = limited = None
        return {
            "requests": requests,
            "rate_limited": limited,
            "simulated": simulated,
            "observed": observed,
            "scheduler": scheduler,
        }

    def _observed(self, trajectory_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        if not trajectory_ids or not self.redis_url:
            return {}

        async def read() -> dict[str, dict[str, Any]]:
            client = aioredis.Redis.from_url(self.redis_url, socket_timeout=10.0)
            try:
                return await read_provider_tallies(client, trajectory_ids)
            finally:
                await client.aclose()

        try:
            return asyncio.run(read())
        except Exception as e:  # the report is a view: say what is missing rather than fail the run
            _log.warning("provider tallies not read from %s: %s", self.redis_url, e)
            return {}

    def _scheduler_view(self) -> dict[str, dict[str, Any]]:
        if self.scheduler_actor is None:
            return {}
        import ray

        try:
            snapshot = ray.get(self.scheduler_actor.snapshot.remote(), timeout=30)
        except Exception as e:
            _log.warning("scheduler snapshot not read: %s", e)
            return {}
        return {
            key: {
                "granted": lane.granted,
                "rate_limited": lane.rate_limited,
                "retry_hints_honoured": dict(lane.retry_hints_honoured),
                "limit_requests": lane.limit_requests,
                "limit_tokens": lane.limit_tokens,
                "limit_sources": dict(lane.limit_sources),
                "delay_margin_s": round(lane.delay_margin_s, 3),
            }
            for key, lane in snapshot.lanes.items()
        }


_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback() -> None:
    """Make the next local ``ray.init(_node_ip_address="127.0.0.1")`` really bind to loopback.

    Ray resolves a loopback node address to the machine's routable one (``resolve_ip_for_localhost``)
    unless "cluster mode" is off, which it reads from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, at
    import. So: set it for the processes Ray starts (GCS, raylet, workers), and turn the already-imported
    flag off in this one. Call only before starting a local Ray; joining a cluster is unaffected.
    """
    os.environ[_RAY_CLUSTER_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def prepare_local_ray() -> None:
    """Set this process (and the processes a Ray started from it inherits the environment of) up for a local
    Ray: loopback only (``keep_ray_on_loopback``), no uv runtime environments, and actors at normal priority.

    Ray starts its worker processes (every actor) at niceness 15, so on a machine doing anything else the
    trajectories of a local run would crawl behind it (beside two busy loops the control-plane tests ran >10x
    slower). They are the run's work; an operator who wants Ray's default sets ``RAY_worker_niceness``.
    """
    keep_ray_on_loopback()
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")


def start_local_ray(
    *,
    num_cpus: int = 2,
    dashboard: bool = False,
    trajectory_slots: int | None = None,
    metrics_export_port: int | None = None,
) -> None:
    """Start a small local Ray on loopback (namespace ``tether``) holding ``trajectory_slots`` trajectories:
    what ``tether run`` uses without ``--address``, and the tests and benchmarks with it.

    ``trajectory_slots`` None: as many as the machine's available memory holds at 100 MB per trajectory
    actor and at most 64 per core (``actors.incarnation.default_trajectory_slots``;
    ``$TETHER_TRAJECTORY_SLOTS`` overrides), so a run wakes only what fits and the rest wait for a slot
    instead of exhausting memory or the CPU.
    """
    import ray

    from actors.incarnation import default_trajectory_slots

    if trajectory_slots is None:
        trajectory_slots = default_trajectory_slots()

    prepare_local_ray()
    extra: dict[str, Any] = {}
    if metrics_export_port is not None:
        extra["_metrics_export_port"] = metrics_export_port
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=dashboard,
        namespace="tether",
        object_store_memory=100 * 1024 * 1024,
        logging_level=logging.WARNING,
        log_to_driver=False,
        resources={"tether_trajectory": trajectory_slots},
        _node_ip_address="127.0.0.1",  # loopback only: a local run is never reachable from outside
        **extra,
    )


def request_capacity(trajectories: int) -> None:
    """Ask the cluster's autoscaler for room for ``trajectories`` trajectory actors now.

    ``request_resources`` is declarative (it replaces this driver's earlier request) and inert on a cluster
    without an autoscaler; ``request_capacity(0)`` withdraws the request.
    """
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[{"tether_trajectory": 1}] * trajectories)


def prewarm_workers(count: int) -> None:
    """Start ``count`` worker processes (importing the actor code) before the actors need them."""
    import ray

    if count <= 0:
        return

    def warm() -> int:
        import actors.trajectory  # noqa: F401 - the import is the warm-up

        time.sleep(0.5)  # hold the worker so the next warm-up starts another one
        return os.getpid()

    remote = ray.remote(num_cpus=0)(warm)
    ray.get([remote.remote() for _ in range(count)])


# --------------------------------------------------------------------------- the driver


Progress = Callable[[dict[str, int], int], None]  # (state counts, total)


class Driver:
    """Creates the actors, waits for every trajectory, samples their status for progress and timeline.

    It holds an actor's handle only while it waits on that actor's ``run()``: once the trajectory ended or
    hibernated it lets go, so an exited actor's name is never pinned (while its owner holds a handle, Ray
    keeps a dead named actor registered, and a relay looking the trajectory up found the dead actor and
    could never wake it: issue 16) and a finished actor's trajectory slot is freed for the next one. Reads
    of the status snapshots ride out a Redis outage within ``outage_budget_s`` (issue 13).

    A hibernated trajectory is woken by a control message (the relays) or by its durable timers (an approval's
    expiry, its deadline: the cluster's timer service, ``cluster.timer_service``), never by this driver,
    which only watches (issue 10: expiry must not depend on the CLI being there). ``self_wake`` is for a
    run without a timer service (``--relays 0``): then the driver re-creates the actor itself once the held
    approval expired or the deadline passed. Either way, a trajectory still hibernated ``deadline_grace_s``
    after its deadline is woken by the driver as a last resort.
    """

    def __init__(
        self,
        launches: Sequence[tuple[TrajectorySpec, TrajectoryLaunch]],
        redis_url: str,
        adapters: ClusterAdapters | None = None,
    ) -> None:
        self.launches = list(launches)
        self.redis_url = redis_url
        self.adapters = adapters or ClusterAdapters()
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.poll_s = 0.25
        # How long after a trajectory's absolute deadline the driver still waits for its actor's answer.
        # The harness ends a trajectory by its deadline itself; an actor that has not answered by then
        # is stuck (never placed, or wedged), and the run reports it instead of waiting forever.
        self.deadline_grace_s = DEADLINE_GRACE_S
        self.outage_budget_s = DEFAULT_OUTAGE_BUDGET_S
        # An actor that died for good while its trajectory had not ended (its owner died: e.g. the relay
        # that woke it) is re-created from its launch this many times; its log carries it on.
        self.max_revivals = 3
        self.live: dict[str, Any] = {}  # trajectory id -> handle, only while its run() is awaited
        self.self_wake = True  # no timer service runs: wake on expiry and deadline ourselves
        self.supervision: dict[str, Any] = {}

    async def run(
        self, on_progress: Progress | None = None, stop: threading.Event | None = None
    ) -> list[TrajectoryResult]:
        """Follow every trajectory to its end. ``stop`` set from another thread ends the wait early
        (``RunStopped``); the trajectories themselves go on, durable, and a later run with the same run id
        picks them up."""
        client = aioredis.Redis.from_url(self.redis_url, socket_timeout=10.0)
        started = time.monotonic()
        sampler = asyncio.ensure_future(self._sample(client, started, on_progress))
        follows = asyncio.gather(*(self._follow(spec, launch, client) for spec, launch in self.launches))
        stopper = asyncio.ensure_future(self._until_set(stop))
        try:
            waiting: set[asyncio.Future[Any]] = {follows, stopper}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not follows.done():
                await aio.stop(follows, what="following the trajectories", again_s=aio.ASK_AGAIN_S)
                raise RunStopped("the run was stopped before every trajectory ended")
            results = follows.result()
        finally:
            # bounded: a cancellation a library lost must not keep the run from returning (actors.aio).
            # ``follows`` too when the driver itself is cancelled (Ctrl-C): left to asyncio's shutdown, its
            # cancellation was logged as "_GatheringFuture exception was never retrieved" with tracebacks.
            await aio.stop(sampler, what="the status sampler", again_s=aio.ASK_AGAIN_S)
            await aio.stop(stopper, what="the stop watcher", again_s=aio.ASK_AGAIN_S)
            if not follows.done():
                await aio.stop(follows, what="following the trajectories", again_s=aio.ASK_AGAIN_S)
        with contextlib.suppress(Exception):  # the last picture is a view: Redis away must not fail the run
            await self._sample_once(client, started, on_progress)
        with contextlib.suppress(Exception):  # a view: a report without it says nothing rather than fail
            self.supervision = await supervision_report(client)
        with contextlib.suppress(Exception):
            await client.aclose()
        return list(results)

    async def _until_set(self, stop: threading.Event | None) -> None:
        if stop is None:
            await asyncio.Event().wait()  # never set: only the trajectories end the run
            return
        while not stop.is_set():
            await asyncio.sleep(self.poll_s)

    async def _follow(
        self, spec: TrajectorySpec, launch: TrajectoryLaunch, client: aioredis.Redis
    ) -> TrajectoryResult:
        import ray
        import ray.exceptions

        from actors.trajectory import ensure_actor

        tid = launch.trajectory_id
        error: str | None = None
        summary: dict[str, Any] = {}
        deadline_at = launch.created_at + launch.deadline_s  # epoch seconds
        give_up_at = deadline_at + self.deadline_grace_s
        revivals = 0
        while True:
            handle = self.live[tid] = ensure_actor(launch, self.adapters)
            try:
                summary = await asyncio.wait_for(handle.run.remote(), max(0.0, give_up_at - time.time()))
            except TimeoutError:
                error = (
                    f"no answer from its actor {self.deadline_grace_s:.0f}s after the trajectory's deadline "
                    "(never placed on a node, or wedged); its durable log is intact"
                )
                break
            except ray.exceptions.RayActorError as e:
                if isinstance(e, ray.exceptions.ActorDiedError):
                    # Dead for good: free its name even if someone else still pins the dead actor with a
                    # handle, so the next ensure_actor creates a new incarnation instead of finding it.
                    with contextlib.suppress(Exception):
                        ray.kill(handle, no_restart=True)
                status = await self._status(client, tid)
                if status.get("hibernated") == "1":
                    summary = {"hibernated": True}
                elif status.get("state") in _TERMINAL:
                    summary = await self._ended(client, launch)  # it ended and was collected before we asked
                elif revivals < self.max_revivals:
                    revivals += 1
                    _log.warning("traj:%s died for good before it ended (%s); re-creating it", tid, e)
                    summary = {"hibernated": True, "revive": True}
                else:
                    error = f"actor died: {e}"
                    break
            except ray.exceptions.RayTaskError as e:
                error = f"{type(e.cause).__name__}: {e.cause}"
                break
            finally:
                # Let go: a hibernated actor exits and a finished one is collected; neither stays pinned.
                self.live.pop(tid, None)
                del handle
            if not summary.get("hibernated"):
                break
            if not summary.get("revive"):
                ended = await self._until_woken(client, launch, deadline_at, give_up_at)
                if ended is not None:
                    summary = ended  # it ran to its end after a relay woke it: no need to create it again
                    break
        if error is not None:
            summary = _summary_of(await self._status(client, tid))
        return TrajectoryResult(
            id=tid,
            name=spec.id,
            priority_class=spec.priority_class,
            state=str(summary["state"]),
            exit_reason=summary.get("exit_reason"),
            turns=int(summary["turns"]),
            tokens=int(summary["tokens"]),
            dollars=float(summary["dollars"]),
            binding_dimension=summary.get("binding_dimension"),
            expected_state=spec.expected_state,
            error=error,
            result=summary.get("result"),
            escalations=dict(summary.get("escalations") or {}),
            children=dict(summary.get("children") or {}),
            spend=dict(summary.get("spend") or {}),
        )

    async def _until_woken(
        self, client: aioredis.Redis, launch: TrajectoryLaunch, deadline_at: float, give_up_at: float
    ) -> dict[str, Any] | None:
        """Wait while the trajectory hibernates. Returns its summary when it ended meanwhile (a relay or the
        timer service woke it and it ran to its end), else None: then follow it again (it was woken, or it
        is the driver's turn to wake it: see the class docstring)."""
        trajectory_id = launch.trajectory_id
        while True:
            status = await self._status(client, trajectory_id)
            if status.get("state") in _TERMINAL and status.get("hibernated") != "1":
                return await self._ended(client, launch)
            if status.get("hibernated") != "1":
                return None  # a relay or the timer service woke it (a control message or a timer)
            now = time.time()
            if now >= give_up_at:
                _log.warning("traj:%s still hibernates past its deadline; waking it", trajectory_id)
                return None  # the timer service did not: the re-created actor ends it as DEADLINE_EXCEEDED
            if self.self_wake:
                expires = status.get("held_expires_at")
                if expires and now >= float(expires):
                    return None  # the expiry must be recorded: re-create the actor and let it refuse the call
                if now >= deadline_at:
                    return None  # past its deadline: the re-created actor ends it as DEADLINE_EXCEEDED
            await asyncio.sleep(self.poll_s)

    async def _ended(self, client: aioredis.Redis, launch: TrajectoryLaunch) -> dict[str, Any]:
        """The run summary of a trajectory that ended without us (its actor is gone): folded from its log,
        the same summary its actor would have answered; from its status snapshot if the log cannot be read."""
        from actors.status import summarize
        from actors.wiring import build_policy, build_registry
        from cluster.log_store import RedisLogStore
        from runtime.snapshot import fold_entries

        trajectory_id = launch.trajectory_id
        store = RedisLogStore(client, url=self.redis_url, outage_s=self.outage_budget_s)
        try:
            entries = await store.read(trajectory_id)
            return summarize(fold_entries(entries, build_policy(launch, build_registry(launch))))
        except Exception as e:  # a view: the snapshot says almost as much
            _log.warning("traj:%s: summary from its status snapshot (log not folded: %s)", trajectory_id, e)
            return _summary_of(await self._status(client, trajectory_id))

    async def _status(self, client: aioredis.Redis, trajectory_id: str) -> dict[str, str]:
        """The status snapshot; an unreachable Redis is waited for within the outage budget."""
        outage = Outage(f"reading the status of {trajectory_id}", budget_s=self.outage_budget_s)

        async def read() -> dict[str, str]:
            raw = await client.hgetall(status_key(trajectory_id))
            return {_text(k): _text(v) for k, v in raw.items()}

        return await outage.call(read)

    async def _sample(self, client: aioredis.Redis, started: float, on_progress: Progress | None) -> None:
        while True:
            with contextlib.suppress(Exception):  # progress is a view: a failed sample is skipped
                await self._sample_once(client, started, on_progress)
            if aio.cancel_requested():  # asked to stop while sampling: the read may have lost the cancel
                raise asyncio.CancelledError
            await asyncio.sleep(self.poll_s)

    async def _sample_once(
        self, client: aioredis.Redis, started: float, on_progress: Progress | None
    ) -> None:
        pipe = client.pipeline(transaction=False)
        for _, launch in self.launches:
            pipe.hget(status_key(launch.trajectory_id), "state")
        states = await pipe.execute()
        counts = Counter((s.decode() if s else "STARTING") for s in states)
        self.timeline.append((time.monotonic() - started, dict(counts)))
        if on_progress is not None:
            on_progress(dict(counts), len(self.launches))


_TERMINAL = frozenset(
    {TrajectoryState.COMPLETED.value, TrajectoryState.FAILED.value, TrajectoryState.CANCELED.value}
)


def _summary_of(status: dict[str, str]) -> dict[str, Any]:
    """A run summary from a status snapshot (for a trajectory whose actor could not answer itself)."""
    return {
        "state": status.get("state", "UNKNOWN"),
        "exit_reason": status.get("exit_reason") or None,
        "turns": int(float(status.get("turns", 0) or 0)),
        "tokens": int(float(status.get("tokens", 0) or 0)),
        "dollars": float(status.get("dollars", 0.0) or 0.0),
        "binding_dimension": status.get("binding_dimension") or None,
    }


async def supervision_report(client: aioredis.Redis) -> dict[str, Any]:
    """Escalations by trigger (open, overdue, all), incidents and the quarantine, as the run leaves them."""
    from cluster.observe import supervision_counts
    from cluster.supervision_store import RedisSupervisionStore

    store = RedisSupervisionStore(client)
    escalations = await store.escalations()
    counts = supervision_counts(escalations, time.time())
    by_trigger = Counter(str(e.get("trigger")) for e in escalations)
    incidents = await store.incidents()
    return {
        "escalations": {
            "by_trigger": dict(sorted(by_trigger.items())),
            "open": {t: n for t, n in counts["open"].items() if n},
            "overdue": {t: n for t, n in counts["overdue"].items() if n},
        },
        "incidents": [
            {
                "incident_id": d["incident_id"],
                "status": d.get("status"),
                "members": sorted(d.get("members", {})),
                "artifacts": len(d.get("artifacts", [])),
            }
            for d in incidents
        ],
        "quarantined_artifacts": await store.quarantine_size(),
    }


def run_driver(
    workload: Workload,
    services: Services,
    options: RunOptions,
    on_progress: Progress | None = None,
    stop: threading.Event | None = None,
) -> RunResult:
    """Plan, store and run every trajectory on the started services; returns the results.

    ``stop``: set it from another thread to stop waiting (``RunStopped``); see ``Driver.run``.
    """
    now = time.time()
    planned = plan_launches(
        workload,
        run_id=options.run_id or new_run_id(now),
        redis_url=services.redis_url,
        base_url=services.base_url,
        testbed_address=services.testbed_address,
        created_at=now,
        keyring_path=services.keyring_path,
        workspace_root=services.workspace_root,
        mcp_catalog=services.mcp_catalog,
    )
    for _, launch in planned:
        save_launch(services.redis_url, launch)
    asked = False
    if options.prewarm > 0:
        if services.started_ray:
            prewarm_workers(options.prewarm)  # a local Ray has no autoscaler: start the processes now
        else:
            request_capacity(options.prewarm)
            asked = True
    driver = Driver(planned, services.redis_url, services.adapters)
    driver.poll_s = options.poll_s
    driver.self_wake = not services.timer_handles  # the timer service wakes hibernated trajectories
    metrics = None
    if options.metrics_port is not None:
        from cluster.observe import start_driver_metrics

        metrics = start_driver_metrics(
            options.metrics_port,
            redis_url=services.redis_url,
            trajectory_ids=[launch.trajectory_id for _, launch in planned],
            testbed_address=services.testbed_address,
        )
        print(f"driver metrics: {metrics.url}", file=sys.stderr)
    actions = OperatorActions(
        [PlannedAction(launch.trajectory_id, spec.operator) for spec, launch in planned if spec.operator],
        services.redis_url,
        services.keyring_path,
    )
    started = time.monotonic()
    try:
        results = asyncio.run(alongside(driver.run(on_progress, stop), actions))
    finally:
        if metrics is not None:
            metrics.close()
        if asked:
            with contextlib.suppress(Exception):  # the cluster may be gone; nothing left to withdraw
                request_capacity(0)  # the trajectories are done: let idle nodes scale down
    ids = [launch.trajectory_id for _, launch in planned]
    return RunResult(
        results=results,
        provider=services.provider_counts(ids),
        timeline=driver.timeline,
        elapsed_s=time.monotonic() - started,
        ledger=read_ledger(services.testbed_address),
        handoff=read_handoffs(services.redis_url, ids),
        operator_actions=dict(actions.sent),
        supervision=driver.supervision,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --------------------------------------------------------------------------- the picture


def write_timeline_png(result: RunResult, path: Path, title: str) -> Path:
    """Stacked areas of trajectories per state over the run's time (one sample per driver poll)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [t for t, _ in result.timeline]
    seen = {s for _, counts in result.timeline for s in counts}
    order = [s for s in ["STARTING", *_STATE_ORDER] if s in seen]
    series = [[counts.get(s, 0) for _, counts in result.timeline] for s in order]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    if times:
        ax.stackplot(times, series, labels=order, step="post")
    ax.set_xlabel("seconds since the actors were created")
    ax.set_ylabel("trajectories")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
