"""The launch record: everything needed to (re)build one trajectory actor, stored in Redis.

A ``TrajectoryLaunch`` is written once by whoever starts the trajectory (``tether run``) under
``tether:launch:<trajectory_id>`` (its JSON, zlib-compressed; a plain JSON launch reads as well). Whoever
has to bring the actor back later (a relay waking a hibernated trajectory, a driver resuming after its own
restart) reads it and calls ``ensure_actor(launch)``; the actor then folds its durable log and continues.
The launch holds configuration only, never state: the state is the log.

Secrets stay out of it: the provider's API key is named by an environment variable the actor reads.
"""

from __future__ import annotations

import zlib
from typing import Annotated, Literal

import redis
import redis.exceptions
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from actors.contracts import DeclaredContract
from actors.supervision_config import SupervisionSpec
from actors.tools_mcp.config import McpRoute, McpServerConfig
from runtime.budget import PriceTable
from runtime.errors import CodecError, DependencyError
from runtime.memstore import check_trajectory_id

__all__ = [
    "LAUNCH_KEY_PREFIX",
    "CheckLaunch",
    "GuardMode",
    "ProviderLaunch",
    "RetryLaunch",
    "TrajectoryLaunch",
    "launch_key",
    "load_launch",
    "save_launch",
]

LAUNCH_KEY_PREFIX = "tether:launch:"
_ZLIB_HEADER = b"\x78"  # the first byte of a zlib stream (deflate, 32 KB window)

NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
GuardMode = Literal["actor", "local", "none"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProviderLaunch(_Frozen):
    """The model endpoint as the actor reaches it (already resolved: a simulated provider's real URL)."""

    base_url: str = Field(min_length=1)
    model: str = Field(min_length=1)
    api_key_env: str = "OPENAI_API_KEY"  # read in the actor's process; unset -> a placeholder key
    input_per_mtok: NonNegative = 3.0
    cached_input_per_mtok: NonNegative = 0.30
    output_per_mtok: NonNegative = 15.0

    @property
    def provider_key(self) -> str:
        """The scheduler's bucket key: one per base URL and model."""
        return f"{self.base_url}|{self.model}"

    def prices(self) -> PriceTable:
        return PriceTable(self.input_per_mtok, self.cached_input_per_mtok, self.output_per_mtok)


class CheckLaunch(_Frozen):
    """The task contract's completion check (``runtime.completion.CHECKS`` names)."""

    name: Literal["always", "never", "min_tool_results", "tool_succeeded", "candidate_checked"] = (
        "min_tool_results"
    )
    params: dict[str, JsonValue] = Field(default_factory=dict)


class RetryLaunch(_Frozen):
    """The single retry owner's attempt budget per logical tool operation."""

    max_attempts: int = Field(3, ge=1)
    base_backoff_s: Positive = 0.2
    max_backoff_s: Positive = 5.0
    cleanup_max_attempts: int = Field(8, ge=1)  # a compensation's own budget (it is owed all the same)


class TrajectoryLaunch(_Frozen):
    """Everything needed to build (or rebuild) the actor of one trajectory."""

    trajectory_id: str
    tenant: str = "default"
    goal: str = Field(min_length=1)
    priority_class: str = "standard"
    ceilings: dict[str, Positive] = Field(min_length=1)
    grants: tuple[str, ...] = ()
    approval_required: tuple[str, ...] = ()
    max_tokens: int = Field(256, gt=0)
    call_deadline_s: Positive = 30.0
    deadline_s: Positive = 600.0
    reserve_s: float = Field(0.0, ge=0.0)  # the finalization reserve (seconds before the deadline)
    created_at: NonNegative  # epoch seconds, fixed at launch so a re-created actor builds the same record
    completion_check: CheckLaunch = CheckLaunch()
    metadata: dict[str, str] = Field(default_factory=dict)  # e.g. {"scenario": "finish_after:2"}
    system_prompt: str | None = None

    provider: ProviderLaunch
    redis_url: str = Field(min_length=1)
    tool_routes: dict[str, str] = Field(default_factory=dict)  # tool -> gRPC host:port
    local_tools: tuple[str, ...] = ()  # built-in in-process tools (actors.tools_local)
    # Contracts the workload declared (gRPC services, MCP tools), resolved at the run's start (an MCP tool's
    # schema as its server listed it then), so a re-created actor builds the same registry. A routed gRPC
    # tool without one is a testbed tool with its built-in contract.
    tool_contracts: dict[str, DeclaredContract] = Field(default_factory=dict)
    mcp_servers: dict[str, McpServerConfig] = Field(default_factory=dict)  # server name -> how to reach it
    mcp_tools: dict[str, McpRoute] = Field(default_factory=dict)  # tool -> (server, remote tool name)
    # Who holds the MCP sessions: "host" (one host actor per server, shared by the run; a call outlives a
    # killed trajectory actor) or "trajectory" (this trajectory's actor holds its own, a stdio server is its
    # child: for a server that must be private to one trajectory, at the price that killing the actor
    # kills its calls).
    mcp_placement: Literal["host", "trajectory"] = "host"
    # Where the model calls run: "node" (the node's model client actor holds the openai SDK and its
    # connection pools, actors.model_client: a trajectory process never loads the SDK) or "trajectory" (the
    # in-process adapter, actors.model_openai, in this trajectory's actor).
    model_placement: Literal["node", "trajectory"] = "node"
    use_scheduler: bool = True  # admit through the named scheduler actor when one exists
    guard: GuardMode = "actor"  # breaker + bulkhead: one guard actor per scope, in process, or none
    retry: RetryLaunch = RetryLaunch()
    keyring_path: str | None = None  # None: cluster default ($TETHER_KEYRING or .tether/keyring.yaml)
    approval_timeout_s: Positive = 300.0
    approval_quorum: int = Field(1, ge=1)
    # roles the approving signers must cover together (each signer's roles come from the keyring)
    approval_roles: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    tool_timeout_s: Positive = 30.0
    hibernate_after_s: Positive | None = None
    workspace_root: str | None = None  # sandbox workspaces (<root>/<trajectory id>); None: no sandbox
    # What run_command runs when the model's argv is empty (set by the operator, never by the model);
    # empty: such a call is refused. See actors.tools_local.SandboxCommand.
    sandbox_default_argv: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    resources: dict[str, Positive] | None = None  # None: {"tether_trajectory": 1} where defined
    # issue 12: supervision (the watchdog ladder, projection, disclosure, escalations, degradation,
    # delegation) and, for a child trajectory, its parent and depth
    supervision: SupervisionSpec | None = None
    parent_id: str | None = None
    depth: int = Field(0, ge=0)

    @field_validator("trajectory_id")
    @classmethod
    def _valid_id(cls, value: str) -> str:
        return check_trajectory_id(value)

    @model_validator(mode="after")
    def _tool_routes_consistent(self) -> TrajectoryLaunch:
        routed = [*self.tool_routes, *self.local_tools, *self.mcp_tools]
        twice = sorted({t for t in routed if routed.count(t) > 1})
        if twice:
            raise ValueError(f"tools routed twice: {', '.join(twice)}")
        for tool, route in self.mcp_tools.items():
            if route.server not in self.mcp_servers:
                raise ValueError(f"mcp_tools.{tool}: server {route.server!r} is not in mcp_servers")
            if tool not in self.tool_contracts:
                raise ValueError(f"mcp_tools.{tool}: an MCP tool needs its contract in tool_contracts")
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    def to_stored(self) -> bytes:
        """The launch as stored in Redis: its JSON, zlib-compressed (about half the bytes; a hibernated
        trajectory keeps its launch for as long as it lives)."""
        return zlib.compress(self.to_json().encode(), 9)

    @classmethod
    def from_json(cls, data: str | bytes, where: str = "launch") -> TrajectoryLaunch:
        """Decode a stored launch (JSON, or JSON zlib-compressed by ``to_stored``); ``CodecError`` names what
        is wrong."""
        if isinstance(data, bytes | bytearray) and data[:1] == _ZLIB_HEADER:  # JSON never starts with 0x78
            try:
                data = zlib.decompress(data)
            except zlib.error as e:
                raise CodecError(f"not a valid trajectory launch: {e}", where=where) from e
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise CodecError(f"not a valid trajectory launch: {problems}", where=where) from e


def launch_key(trajectory_id: str) -> str:
    """The Redis key of a trajectory's launch record."""
    return LAUNCH_KEY_PREFIX + check_trajectory_id(trajectory_id)


def _client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, socket_timeout=10.0, socket_connect_timeout=10.0)


def save_launch(redis_url: str, launch: TrajectoryLaunch) -> None:
    """Store ``launch`` under ``tether:launch:<id>`` (overwrites: the latest launch wins)."""
    client = _client(redis_url)
    try:
        client.set(launch_key(launch.trajectory_id), launch.to_stored())
    except redis.exceptions.RedisError as e:
        raise DependencyError(f"saving the launch of {launch.trajectory_id}: {e}", scope="redis") from e
    finally:
        client.close()


def load_launch(redis_url: str, trajectory_id: str) -> TrajectoryLaunch | None:
    """The stored launch of ``trajectory_id``, or None when it was never launched."""
    key = launch_key(trajectory_id)
    client = _client(redis_url)
    try:
        raw = client.get(key)
    except redis.exceptions.RedisError as e:
        raise DependencyError(f"loading the launch of {trajectory_id}: {e}", scope="redis") from e
    finally:
        client.close()
    if raw is None:
        return None
    return TrajectoryLaunch.from_json(raw, where=key)
