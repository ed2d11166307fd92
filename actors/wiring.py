"""Building a trajectory's interpreter from its launch record: the record's creation event, the policy
(``runtime.policy.TrajectoryPolicy``), the tool registry, and the ports (log, model, tools, admission,
guard, timers).

Also here, because only the wiring needs them:

- ``testbed_contracts()`` (from ``actors.contracts``): the client-side contracts of the testbed tools;
- ``RoutedToolPort``: one ``ToolPort`` over several (gRPC services and in-process tools), by tool name.

Nothing here touches Ray except ``build_ports``, which looks up the named scheduler actor and creates
guard-actor handles when the launch asks for them.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from actors.contracts import testbed_contracts
from actors.interpreter import InterpreterPorts, TimerPort
from actors.launch import TrajectoryLaunch
from actors.ports import ClosableLogStore
from actors.sandbox import Sandbox
from actors.tools_local import LocalToolPort, builtin_tools
from runtime.clock import Clock
from runtime.deadline import FinalizationReserve
from runtime.dispatch import NoGuard
from runtime.errors import InputError
from runtime.events import TrajectoryCreated
from runtime.policy import TrajectoryPolicy
from runtime.ports import (
    AdmissionPort,
    GuardPermit,
    GuardPort,
    ModelPort,
    OutcomeClass,
    ProbeResult,
    ToolInvocation,
    ToolOutcome,
    ToolPort,
)
from runtime.record import CallLimits, CompletionCheck, Grants, TaskContract
from runtime.retry import RetryPolicy
from runtime.tools import SideEffect, ToolRegistry, UnknownTool

if TYPE_CHECKING:
    from actors.tools_mcp.port import McpToolPort

__all__ = [
    "BuiltPorts",
    "LogStoreFactory",
    "RoutedToolPort",
    "SplitGuard",
    "build_created",
    "build_policy",
    "build_ports",
    "build_registry",
    "testbed_contracts",
]


# --------------------------------------------------------------------------- tools by route


class RoutedToolPort:
    """One ``ToolPort`` over several, chosen by tool name (gRPC services beside in-process tools)."""

    def __init__(self, routes: Mapping[str, ToolPort]) -> None:
        self._routes = dict(routes)

    def _port(self, tool: str) -> ToolPort:
        port = self._routes.get(tool)
        if port is None:
            raise UnknownTool(tool, self._routes)
        return port

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        return await self._port(invocation.tool).invoke(invocation)

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        return await self._port(tool).probe(tool, effect_key, deadline)

    async def cancel(self, tool: str, effect_key: str) -> None:
        await self._port(tool).cancel(tool, effect_key)


class SplitGuard:
    """One ``GuardPort`` over two: scopes in ``local_scopes`` (in-process tools) use ``local``, every
    other scope ``shared`` (e.g. the guard actors every trajectory of the cluster shares)."""

    def __init__(self, shared: GuardPort, local: GuardPort, local_scopes: frozenset[str]) -> None:
        self._shared = shared
        self._local = local
        self._local_scopes = local_scopes

    def _for(self, scope: str) -> GuardPort:
        return self._local if scope in self._local_scopes else self._shared

    async def admit(self, scope: str, call_id: str, deadline: float) -> GuardPermit:
        return await self._for(scope).admit(scope, call_id, deadline)

    async def record(self, permit: GuardPermit, outcome: OutcomeClass) -> None:
        await self._for(permit.scope).record(permit, outcome)

    async def release(self, permit: GuardPermit) -> None:
        await self._for(permit.scope).release(permit)

    async def settle(self, permit: GuardPermit, outcome: OutcomeClass | None) -> None:
        await self._for(permit.scope).settle(permit, outcome)


# --------------------------------------------------------------------------- record, config, registry


def build_registry(launch: TrajectoryLaunch) -> ToolRegistry:
    """Contracts of every tool the launch routes: a contract the launch carries (declared in the workload for
    a gRPC service or an MCP tool) first, else the testbed's built-in contract by name; built-ins by name.
    Compensation references are checked (every compensation names a routed tool with those arguments)."""
    known = {c.name: c for c in testbed_contracts()}
    builtins = builtin_tools()
    registry = ToolRegistry()
    where = f"launch[{launch.trajectory_id}]"
    for name in sorted({*launch.tool_routes, *launch.mcp_tools}):
        declared = launch.tool_contracts.get(name)
        if declared is not None:
            registry.register(declared.build(name))
        elif name in known and name in launch.tool_routes:
            registry.register(known[name])
        else:
            raise InputError(
                f"no contract for {'gRPC' if name in launch.tool_routes else 'MCP'} tool {name!r}; "
                "declare it in the workload "
                f"(built in: {', '.join(sorted(known))})",
                where=f"{where}.tool_contracts",
            )
    delegation = launch.supervision.delegation if launch.supervision is not None else None
    if delegation is not None:  # issue 12: calls to the delegation tool spawn child trajectories
        from actors.supervision_config import delegate_contract

        if delegation.tool in registry:
            raise InputError(
                f"the delegation tool {delegation.tool!r} is also a routed tool",
                where=f"{where}.supervision.delegation.tool",
            )
        registry.register(delegate_contract(delegation.tool))
    for name in sorted(launch.local_tools):
        if name not in builtins:
            raise InputError(
                f"no built-in tool {name!r}; known: {', '.join(sorted(builtins))}",
                where=f"{where}.local_tools",
            )
        registry.register(builtins[name].contract)
    registry.check_references()
    return registry


def build_created(launch: TrajectoryLaunch, registry: ToolRegistry) -> TrajectoryCreated:
    """The trajectory's creation event, a pure function of its launch (a re-created actor builds the same)."""
    granted = frozenset(launch.grants)
    missing = sorted(granted - set(registry.names()))
    if missing:
        raise InputError(
            f"grants name tools that are not routed: {', '.join(missing)}",
            where=f"launch[{launch.trajectory_id}].grants",
        )
    read_only = frozenset(n for n in granted if registry.get(n).side_effect is SideEffect.READ_ONLY)
    return TrajectoryCreated(
        trajectory_id=launch.trajectory_id,
        parent_id=launch.parent_id,
        tenant=launch.tenant,
        contract=TaskContract(
            launch.goal, CompletionCheck(launch.completion_check.name, dict(launch.completion_check.params))
        ),
        limits=CallLimits(launch.provider.model, launch.max_tokens, launch.call_deadline_s),
        ceilings=dict(launch.ceilings),
        grants=Grants(
            tools=granted,
            read_only_tools=read_only,
            approval_required=frozenset(launch.approval_required) & granted,
        ),
        priority_class=launch.priority_class,
        created_at=launch.created_at,
        deadline=launch.created_at + launch.deadline_s,
        context_ref=f"tether:log:{launch.trajectory_id}",
    )


def build_policy(launch: TrajectoryLaunch, registry: ToolRegistry) -> TrajectoryPolicy:
    """The trajectory's policy from its launch: the same for every incarnation (the seed of the decider's
    jitter is derived from the trajectory id with a stable hash, never Python's per-process ``hash``)."""
    supervision = launch.supervision
    extra: dict[str, Any] = {}
    if supervision is not None:  # issue 12
        extra = {"supervision": supervision.build(launch.depth), "watchdog": supervision.call_watchdog()}
    return TrajectoryPolicy(
        registry=registry,
        provider_key=launch.provider.provider_key,
        prices=launch.provider.prices(),
        tool_timeout_s=launch.tool_timeout_s,
        probe_timeout_s=launch.tool_timeout_s,
        approval_timeout_s=launch.approval_timeout_s,
        approval_quorum=launch.approval_quorum,
        approval_roles=frozenset(launch.approval_roles),
        retry=RetryPolicy(
            max_attempts=launch.retry.max_attempts,
            base_backoff_s=launch.retry.base_backoff_s,
            max_backoff_s=max(launch.retry.max_backoff_s, launch.retry.base_backoff_s),
        ),
        cleanup_retry=RetryPolicy(
            max_attempts=launch.retry.cleanup_max_attempts,
            base_backoff_s=launch.retry.base_backoff_s,
            max_backoff_s=max(launch.retry.max_backoff_s, launch.retry.base_backoff_s),
        ),
        metadata=dict(launch.metadata),
        system_prompt=launch.system_prompt,
        idle_hibernate_s=launch.hibernate_after_s,
        rng_seed=zlib.crc32(launch.trajectory_id.encode()),
        reserve=FinalizationReserve(seconds=launch.reserve_s),
        **extra,
    )


# --------------------------------------------------------------------------- ports


Closer = Callable[[], Awaitable[None]]


@dataclass
class BuiltPorts:
    """The interpreter's ports plus what must be closed when the actor goes away."""

    ports: InterpreterPorts
    local_tools: LocalToolPort | None
    closers: list[Closer] = field(default_factory=list)

    async def close(self) -> None:
        for closer in reversed(self.closers):
            with contextlib.suppress(Exception):  # best effort: the process may be exiting
                await closer()


def _mcp_port(launch: TrajectoryLaunch, clock: Clock) -> McpToolPort:
    """The MCP tools' port: calls go to each server's host actor (``actors.tools_mcp.host``), so a server's
    session, and a stdio server's process, outlive this trajectory's actor (``mcp_placement: trajectory``:
    this actor holds its own sessions instead)."""
    from actors.tools_mcp.host import InProcessMcpHosts, McpHosts, RayMcpHosts
    from actors.tools_mcp.port import McpToolPort

    servers = {route.server for route in launch.mcp_tools.values()}
    configs = {name: launch.mcp_servers[name] for name in sorted(servers)}
    hosts: McpHosts = RayMcpHosts(configs) if launch.mcp_placement == "host" else InProcessMcpHosts(configs)
    return McpToolPort(launch.mcp_tools, hosts, clock)


def _openai_model(
    launch: TrajectoryLaunch, clock: Clock, env: Mapping[str, str], closers: list[Closer]
) -> ModelPort:
    """The in-process OpenAI adapter (the ``openai`` SDK loaded into this process)."""
    from actors.model_openai import OpenAIModel
    from actors.provider_tally import RedisProviderTally

    tally = RedisProviderTally.from_url(launch.redis_url)  # what this adapter saw, per status, for the report
    closers.append(tally.aclose)
    adapter = OpenAIModel(
        base_url=launch.provider.base_url,
        api_key=env.get(launch.provider.api_key_env) or "tether-unused",
        clock=clock,
        observer=tally,
    )
    closers.append(adapter.aclose)
    return adapter


class LogStoreFactory(Protocol):
    """Opens the durable log store (``actors.ports.ClusterPorts.open_log``)."""

    def open_log(self, redis_url: str) -> ClosableLogStore: ...


def build_ports(
    launch: TrajectoryLaunch,
    clock: Clock,
    *,
    admission: AdmissionPort,
    logs: LogStoreFactory,
    guard: GuardPort | None = None,
    env: Mapping[str, str] | None = None,
    sandbox: Sandbox | None = None,
    timers: TimerPort | None = None,
    model: ModelPort | None = None,
) -> BuiltPorts:
    """Log store, model and tools for ``launch``; admission, guard and the timer store are chosen by the
    caller (the actor knows whether a scheduler actor exists and whether it runs inside Ray), the log store
    comes from ``logs`` (the cluster layer, injected); ``sandbox`` is the trajectory's process sandbox, where
    ``run_command`` runs; ``model`` replaces the in-process OpenAI adapter (the trajectory actor passes the
    node's model client, ``actors.model_client.RayModelClient``, unless the launch says
    ``model_placement: trajectory``)."""
    env = os.environ if env is None else env
    closers: list[Closer] = []
    log = logs.open_log(launch.redis_url)
    closers.append(log.close)
    if model is None:
        model = _openai_model(launch, clock, env, closers)
    routes: dict[str, ToolPort] = {}
    local: LocalToolPort | None = None
    if launch.tool_routes:
        from actors.tools_grpc import GrpcToolPort  # grpc is loaded only by trajectories that route to it

        grpc_port = GrpcToolPort(launch.tool_routes, clock=clock)
        closers.append(grpc_port.close)
        routes.update(dict.fromkeys(launch.tool_routes, grpc_port))
    if launch.mcp_tools:
        mcp_port = _mcp_port(launch, clock)
        closers.append(mcp_port.close)
        routes.update(dict.fromkeys(launch.mcp_tools, mcp_port))
    if launch.local_tools:
        builtins = builtin_tools(
            sandbox,
            default_argv=launch.sandbox_default_argv,
            max_command_timeout_s=launch.tool_timeout_s,
        )
        local = LocalToolPort(builtins[n] for n in launch.local_tools)
        routes.update(dict.fromkeys(launch.local_tools, local))
    ports = InterpreterPorts(
        model=model,
        tools=RoutedToolPort(routes),
        log=log,
        admission=admission,
        clock=clock,
        guard=guard or NoGuard(),
        timers=timers,
    )
    return BuiltPorts(ports, local, closers)
