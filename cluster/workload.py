"""Workload files: what ``tether run`` executes.

A workload declares the model provider (a real OpenAI-compatible base URL, or ``simulated`` with limits and
prices), the priority classes, the tools, and the trajectories (an explicit list, or ``count`` copies of a
template). Every error names the file, the path inside the document, the line, and what was expected.

Example (see ``examples/quickstart.yaml``)::

    name: quickstart
    provider:
      kind: simulated
      model: sim-small
      limits: {tpm: 60000, rpm: 600}   # mode: sliding_window (OpenAI-like, default) | token_bucket
    classes: {interactive: 4, standard: 2, batch: 1}
    tools: [{name: run_tests, source: testbed}, {name: noop, source: builtin}]
    approval_timeout_s: 30      # silence until then is denial
    guard: actor                # breakers/bulkheads: one guard actor per dependency scope
    trajectories:
      - id: fix-bug
        count: 3
        scenario: "finish_after:2"
        class: standard
        budget: {turns: 10, tokens: 50000, wall_seconds: 120, dollars: 0.5}
        grants: [run_tests]
        completion_check: {kind: min_tool_results, count: 2}
        expected_state: COMPLETED
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from actors.contracts import (
    ContractFields,
    DeclaredContract,
    ServerHints,
    resolve_contract,
    testbed_contracts,
)
from actors.supervision_config import DelegationSpec, SupervisionSpec
from actors.tools_local import builtin_tools
from actors.tools_mcp.config import McpServerConfig
from runtime.errors import InputError
from runtime.tools import ToolContractError

__all__ = [
    "BudgetSpec",
    "CompletionCheckSpec",
    "McpServerSpec",
    "ProviderSpec",
    "RetrySpec",
    "ToolSource",
    "ToolSpec",
    "TrajectorySpec",
    "Workload",
    "WorkloadError",
    "load_workload",
    "parse_workload",
    "resolve_tool_contracts",
]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class WorkloadError(InputError):
    """A workload file could not be read or does not match the schema."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Limits(_Strict):
    tpm: PositiveInt = Field(description="provider tokens per minute")
    rpm: PositiveInt = Field(description="provider requests per minute")
    # How a simulated provider meters them (testbed/provider/limits.py): sliding_window mimics OpenAI (minute
    # window, also enforced per second, refusals count), token_bucket mimics Anthropic (continuous refill).
    mode: Literal["sliding_window", "token_bucket"] = "sliding_window"


class Latency(_Strict):
    ttft_ms: Annotated[float, Field(ge=0)] = 20.0
    tokens_per_s: PositiveFloat = 2000.0


class Prices(_Strict):
    """Dollars per million tokens."""

    input_per_mtok: Annotated[float, Field(ge=0)] = 3.0
    cached_input_per_mtok: Annotated[float, Field(ge=0)] = 0.30
    output_per_mtok: Annotated[float, Field(ge=0)] = 15.0


class ProviderSpec(_Strict):
    kind: Literal["simulated", "openai_compatible"] = "simulated"
    base_url: str | None = None
    model: str = "sim-small"
    api_key_env: str = "OPENAI_API_KEY"
    limits: Limits = Limits(tpm=60_000, rpm=600)
    headroom: Annotated[float, Field(ge=0, lt=1)] = 0.02  # scheduler.config.ProviderLimits
    # room kept for the highest-weight class's arriving turns (scheduler.config.SchedulerConfig); 0: off
    top_class_reserve: Annotated[float, Field(ge=0, lt=0.5)] = 0.0
    latency: Latency = Latency()
    prices: Prices = Prices()

    @model_validator(mode="after")
    def _base_url_matches_kind(self) -> ProviderSpec:
        if self.kind == "openai_compatible" and not self.base_url:
            raise ValueError("an openai_compatible provider needs base_url (e.g. https://api.example.com/v1)")
        if self.kind == "simulated" and self.base_url:
            raise ValueError("a simulated provider is started by tether; remove base_url or set kind")
        return self


class ToolSource(StrEnum):
    BUILTIN = "builtin"  # in-process Python tool (actors.tools_local)
    TESTBED = "testbed"  # the testbed gRPC services, started by tether run
    GRPC = "grpc"  # any service speaking the ToolService protocol at `address`
    MCP = "mcp"  # a tool of an MCP server declared under `mcp_servers`


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolSpec(ContractFields):
    """A tool the trajectories may be granted, and its contract (docs/tools.md).

    - ``builtin`` and ``testbed`` tools have their contracts built in: name them, declare nothing else.
    - ``grpc``: any ``ToolService`` at ``address``. A testbed tool name with nothing declared keeps the
      testbed's contract; any other tool declares at least ``arguments`` (a JSON Schema) and ``side_effect``.
    - ``mcp``: a tool of the MCP server ``server`` (listed there as ``remote``, default: the same name).
      Its description and argument schema are imported from the server when the run starts; its
      annotations (readOnlyHint, idempotentHint) fill only what is not declared here.

    Contract fields (all optional, see ``actors.contracts.ContractFields``): description, arguments,
    side_effect, repeat, probe, compensation, pivot, needs_approval, scope, pool, charge, target_keys. What
    is left out defaults to the safe side: irreversible (so it waits for approval) and never repeated,
    unless the tool is read-only.
    """

    name: str
    source: ToolSource = ToolSource.TESTBED
    address: str | None = None
    server: str | None = None
    remote: str | None = Field(None, min_length=1)

    @field_validator("name")
    @classmethod
    def _name_shape(cls, v: str) -> str:
        if not _TOOL_NAME.match(v):
            raise ValueError("a tool name is 1-64 letters, digits, '_' or '-' (what a model API accepts)")
        return v

    @model_validator(mode="after")
    def _source_fields(self) -> ToolSpec:
        declared = self.declared()
        src = self.source
        if src != ToolSource.GRPC and self.address:
            raise ValueError(f"tool {self.name!r}: address is only for source grpc")
        if src != ToolSource.MCP and (self.server or self.remote):
            raise ValueError(f"tool {self.name!r}: server and remote are only for source mcp")
        if src in (ToolSource.BUILTIN, ToolSource.TESTBED):
            known = sorted(builtin_tools()) if src == ToolSource.BUILTIN else _testbed_names()
            if self.name not in known:
                raise ValueError(f"{src.value} tool {self.name!r} is unknown; known: {', '.join(known)}")
            if declared:
                raise ValueError(
                    f"{src.value} tool {self.name!r} has its contract built in; remove "
                    f"{', '.join(sorted(declared))} (or serve it yourself with source grpc)"
                )
        elif src == ToolSource.GRPC:
            if not self.address:
                raise ValueError(f"tool {self.name!r} has source grpc and needs address HOST:PORT")
            if declared or self.name not in _testbed_names():
                missing = [f for f in ("arguments", "side_effect") if f not in declared]
                if missing:
                    raise ValueError(
                        f"grpc tool {self.name!r} needs its contract declared: {', '.join(missing)} "
                        "(a ToolService does not describe its tools)"
                    )
                self._check_consistent(f"grpc-{self.address}")
        else:
            if not self.server:
                raise ValueError(f"mcp tool {self.name!r} needs server (a name under mcp_servers)")
            if self.probe:
                raise ValueError(
                    f"mcp tool {self.name!r}: MCP has no result recovery, so probe cannot be true"
                )
        return self

    def _check_consistent(self, scope: str) -> None:
        """The declared contract holds together (what the runtime's ToolContract checks), known at parse
        time when nothing comes from a server."""
        try:
            resolve_contract(self.name, self.contract_fields(), scope=scope)
        except (ToolContractError, ValidationError) as e:
            detail = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
            raise ValueError(f"contract of {self.name!r}: {detail}") from None

    @property
    def has_declared_contract(self) -> bool:
        """True when this tool's contract comes from the workload (and the source), not built in."""
        return self.source == ToolSource.MCP or (self.source == ToolSource.GRPC and bool(self.declared()))

    def default_scope(self, servers: dict[str, McpServerSpec]) -> str:
        """The dependency scope when none is declared: the MCP server's, or one per gRPC address."""
        if self.source == ToolSource.MCP and self.server in servers:
            return servers[self.server].scope_name(self.server)
        return f"grpc-{self.address}"

    def guarded_scope(self, servers: dict[str, McpServerSpec]) -> str:
        """The dependency scope this tool's calls are guarded under."""
        if self.has_declared_contract:
            return self.scope or self.default_scope(servers)
        if self.source == ToolSource.BUILTIN:
            return builtin_tools()[self.name].contract.dependency_scope
        return next(c.dependency_scope for c in testbed_contracts() if c.name == self.name)

    def contract_fields(self) -> ContractFields:
        """The declared contract fields alone."""
        return ContractFields.model_validate(self.model_dump(include=set(ContractFields.model_fields)))


def _testbed_names() -> list[str]:
    return sorted(c.name for c in testbed_contracts())


class McpServerSpec(McpServerConfig):
    """An MCP server the tools of ``source: mcp`` name: ``command`` (argv of a stdio server; ``env``,
    ``cwd`` relative to where ``tether run`` starts) or ``url`` (streamable HTTP; ``headers``). Each server
    is its own dependency scope (``scope``, default ``mcp-<name>``) with its own guard actor."""

    scope: str | None = Field(None, min_length=1)

    def scope_name(self, name: str) -> str:
        return self.scope or f"mcp-{name}"

    def config(self, base: Path) -> McpServerConfig:
        """The launch form: ``cwd`` made absolute against ``base`` (default: ``base`` itself), since the
        server is started by a host actor whose working directory is not the driver's."""
        fields = self.model_dump(exclude={"scope"})
        if self.command:
            fields["cwd"] = str((base / (self.cwd or ".")).resolve())
        return McpServerConfig.model_validate(fields)


class BudgetSpec(_Strict):
    turns: PositiveFloat = 20
    tokens: PositiveFloat = 200_000
    wall_seconds: PositiveFloat = 300
    dollars: PositiveFloat = 1.0


class CompletionCheckSpec(_Strict):
    """The externally evaluated completion check of the task contract (never the model's word).

    - ``always``: any end_turn passes (use only for smoke tests);
    - ``tool_succeeded``: the last settled call of ``tool`` was established without error;
    - ``min_tool_results``: at least ``count`` tool results were accepted;
    - ``candidate_checked``: the current candidate revision passed its checks (``tools``: the check tools
      required, each by its latest verdict; default the latest check of any tool). A check of an earlier
      revision does not count once a tool that revises the candidate has run (docs/tools.md, "candidate");
    - ``never``: always fails (exercises the COMPLETION_CHECK_FAILED path).
    """

    kind: Literal["always", "tool_succeeded", "min_tool_results", "candidate_checked", "never"] = (
        "min_tool_results"
    )
    tool: str | None = None
    count: Annotated[int, Field(ge=0)] = 1
    tools: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _tool_named(self) -> CompletionCheckSpec:
        if self.kind == "tool_succeeded" and not self.tool:
            raise ValueError("completion check tool_succeeded needs `tool`")
        if self.tools and self.kind != "candidate_checked":
            raise ValueError("`tools` belongs to the completion check candidate_checked")
        return self


class OperatorStep(_Strict):
    """An operator action the run performs on this trajectory (``cluster.run_actions``): sent signed through
    the control stream, as ``tether <action>`` would, once ``when`` holds and ``after_s`` more passed.
    ``started``: the trajectory has a status; ``owing``: it owes a bound compensation (e.g. an environment it
    provisioned). For demos and tests of the exit paths."""

    action: Literal["kill", "cancel", "pause", "resume"]
    when: Literal["started", "owing"] = "owing"
    after_s: Annotated[float, Field(ge=0.0, le=3600.0)] = 0.0


class TrajectorySpec(_Strict):
    id: str
    count: PositiveInt = 1
    goal: str = "Complete the task."
    scenario: str = "finish_after:1"
    priority_class: str = Field("standard", alias="class")
    budget: BudgetSpec = BudgetSpec()
    grants: tuple[str, ...] = ()
    max_tokens: PositiveInt = 256
    call_deadline_s: PositiveFloat = 30.0
    deadline_s: PositiveFloat = 600.0
    # The finalization reserve: forward work stops this many seconds before the deadline, so cleanup has
    # time on every exit (None: 10 % of the deadline, at least 5 s and at most 120 s).
    finalization_reserve_s: PositiveFloat | None = None
    tenant: str = "default"
    completion_check: CompletionCheckSpec = CompletionCheckSpec()
    expected_state: Literal["COMPLETED", "FAILED", "CANCELED"] | None = None
    operator: OperatorStep | None = None
    # issue 12: this trajectory's own delegation template (instead of the workload's supervision.delegation)
    delegation: DelegationSpec | None = None

    @field_validator("id")
    @classmethod
    def _id_shape(cls, v: str) -> str:
        if not _ID.match(v):
            raise ValueError("id must be 1-96 characters of letters, digits, '.', '_' or '-'")
        return v

    @field_validator("scenario")
    @classmethod
    def _scenario_grammar(cls, v: str) -> str:
        from testbed.provider.scenarios import ScenarioError, parse_scenario

        try:
            parse_scenario(v)
        except ScenarioError as e:
            raise ValueError(str(e)) from None
        return v

    def reserve_s(self) -> float:
        """The finalization reserve, bounded so forward work always keeps most of the deadline."""
        if self.finalization_reserve_s is not None:
            return min(self.finalization_reserve_s, self.deadline_s / 2)
        return min(120.0, max(5.0, 0.1 * self.deadline_s), self.deadline_s / 2)

    def expand(self) -> list[TrajectorySpec]:
        """``count`` copies with ids ``<id>-<n>`` (or the id itself when count is 1)."""
        if self.count == 1:
            return [self]
        return [self.model_copy(update={"id": f"{self.id}-{i}", "count": 1}) for i in range(self.count)]


class RetrySpec(_Strict):
    """The single retry owner's attempt budget per logical tool operation."""

    max_attempts: PositiveInt = 3
    base_backoff_s: PositiveFloat = 0.2
    max_backoff_s: PositiveFloat = 5.0
    # a compensation's own attempt budget: cleanup is owed whatever became of the forward work, so it is
    # tried longer than a forward call (the trajectory's deadline still bounds it)
    cleanup_max_attempts: PositiveInt = 8


class BreakerSpec(_Strict):
    """The breaker of every dependency scope's guard actor (defaults: ``breakers.BreakerPolicy``)."""

    window_size: PositiveInt = 50
    min_samples: PositiveInt = 20
    failure_threshold: Annotated[float, Field(gt=0, le=1)] = 0.5
    cooldown_s: PositiveFloat = 5.0
    # after a successful probe, regular traffic comes back over this long (0: at once)
    restore_s: Annotated[float, Field(ge=0)] = 10.0

    @model_validator(mode="after")
    def _samples_fit(self) -> BreakerSpec:
        if self.min_samples > self.window_size:
            raise ValueError("min_samples cannot exceed window_size")
        return self


class Workload(_Strict):
    name: str = "workload"
    provider: ProviderSpec = ProviderSpec()
    classes: dict[str, PositiveFloat] = Field(
        default_factory=lambda: {"interactive": 4.0, "standard": 2.0, "batch": 1.0}
    )
    tools: tuple[ToolSpec, ...] = ()
    mcp_servers: dict[str, McpServerSpec] = Field(default_factory=dict)
    trajectories: Annotated[tuple[TrajectorySpec, ...], Field(min_length=1)]
    approval_timeout_s: PositiveFloat = 30.0  # silence until then is denial
    approval_quorum: PositiveInt = 1  # distinct signers who must approve (their approvals accumulate)
    # roles the approving signers must cover together (each signer's roles come from the keyring)
    approval_roles: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    tool_timeout_s: PositiveFloat = 30.0
    hibernate_after_s: PositiveFloat | None = None  # waiting longer than this: the actor exits, state stays
    guard: Literal["actor", "local", "none"] = "actor"  # breaker + bulkhead per dependency scope
    retry: RetrySpec = RetrySpec()
    scheduler: bool = True  # admit turns through the scheduler actor (provider limits, priority classes)
    # Ray resources each trajectory actor requests. Absent: {"tether_trajectory": 1} when some node of the
    # cluster declares it, else none. Set it on a cluster that autoscales from zero workers, where no live
    # node declares the resource yet ({tether_trajectory: 1}); {} requests none.
    trajectory_resources: dict[str, PositiveFloat] | None = None
    # issue 12: the watchdog ladder, task-state projection, disclosure rules, escalation routes, degradation
    # ladder and delegation template (actors.supervision_config), for every trajectory of the workload
    supervision: SupervisionSpec | None = None
    breaker: BreakerSpec | None = None
    # Faults the testbed's services start with (testbed.tools.faults.FaultPlan, or a list of them, per
    # service; the first matching rule applies): a dependency outage the example runs into, by hand as in
    # its test.
    testbed_faults: dict[str, dict[str, Any] | list[dict[str, Any]]] = Field(default_factory=dict)

    @field_validator("testbed_faults")
    @classmethod
    def _fault_plans(
        cls, v: dict[str, dict[str, Any] | list[dict[str, Any]]]
    ) -> dict[str, dict[str, Any] | list[dict[str, Any]]]:
        from testbed.tools.faults import FaultPlan
        from testbed.tools.services import SERVICES

        for service, given in v.items():
            if service not in SERVICES:
                raise ValueError(f"testbed_faults: unknown service {service!r}; known: {', '.join(SERVICES)}")
            for i, plan in enumerate(given if isinstance(given, list) else [given]):
                try:
                    FaultPlan.model_validate(plan)
                except ValueError as e:
                    raise ValueError(f"testbed_faults.{service}[{i}]: {e}") from e
        return v

    @property
    def delegation_tool(self) -> str | None:
        spec = self.supervision
        return spec.delegation.tool if spec is not None and spec.delegation is not None else None

    @field_validator("mcp_servers")
    @classmethod
    def _server_names(cls, v: dict[str, McpServerSpec]) -> dict[str, McpServerSpec]:
        for name in v:
            if not _ID.match(name):
                raise ValueError(f"server name {name!r}: 1-96 letters, digits, '.', '_' or '-'")
        return v

    @model_validator(mode="after")
    def _cross_references(self) -> Workload:
        tool_names = {t.name for t in self.tools}
        if len(tool_names) != len(self.tools):
            raise ValueError("tool names must be unique")
        declared_tools = set(tool_names)
        delegate = self.delegation_tool
        if delegate is not None:
            if delegate in tool_names:
                raise ValueError(f"supervision.delegation.tool {delegate!r} is also a declared tool")
            assert self.supervision is not None and self.supervision.delegation is not None
            unknown_child = [g for g in self.supervision.delegation.grants if g not in tool_names]
            if unknown_child:
                raise ValueError(
                    f"supervision.delegation.grants names undeclared tools: {', '.join(unknown_child)}"
                )
            tool_names = tool_names | {delegate}
        if self.supervision is not None:
            for name in self.supervision.progress:
                if name not in tool_names:
                    raise ValueError(f"supervision.progress.{name}: not a declared tool")
            for i, rule in enumerate(self.supervision.disclosure):
                unknown = [t for t in rule.tools if t not in tool_names]
                if unknown:
                    raise ValueError(f"supervision.disclosure[{i}].tools names undeclared tools: {unknown}")
        for i, tool in enumerate(self.tools):
            where = f"tools[{i}]"
            if tool.source == ToolSource.MCP and tool.server not in self.mcp_servers:
                declared = ", ".join(sorted(self.mcp_servers)) or "none"
                raise ValueError(
                    f"{where}.server {tool.server!r} is not under mcp_servers (declared: {declared})"
                )
            comp = tool.compensation
            if comp is not None and comp.tool not in tool_names:
                raise ValueError(f"{where}.compensation.tool {comp.tool!r} is not a declared tool")
        if self.mcp_servers and self.guard != "actor":
            raise ValueError(
                "mcp_servers need guard: actor (each MCP server is a dependency scope with its own guard "
                "actor, and its session lives in a host actor of the run)"
            )
        seen: set[str] = set()
        for i, spec in enumerate(self.trajectories):
            where = f"trajectories[{i}]"
            if spec.priority_class not in self.classes:
                declared = ", ".join(self.classes)
                raise ValueError(f"{where}.class {spec.priority_class!r} is not declared ({declared})")
            own = spec.delegation
            allowed = tool_names | ({own.tool} if own is not None else set())
            unknown = [g for g in spec.grants if g not in allowed]
            if unknown:
                raise ValueError(f"{where}.grants names undeclared tools: {', '.join(unknown)}")
            if own is not None:
                if own.tool in declared_tools:
                    raise ValueError(f"{where}.delegation.tool {own.tool!r} is also a declared tool")
                unknown_child = [g for g in own.grants if g not in declared_tools]
                if unknown_child:
                    raise ValueError(f"{where}.delegation.grants names undeclared tools: {unknown_child}")
            checked = spec.completion_check.tool
            if spec.completion_check.kind == "tool_succeeded" and checked not in spec.grants:
                raise ValueError(f"{where}.completion_check.tool {checked!r} is not in its grants")
            ungranted = [t for t in spec.completion_check.tools if t not in spec.grants]
            if ungranted:
                raise ValueError(f"{where}.completion_check.tools not in its grants: {', '.join(ungranted)}")
            for expanded in spec.expand():
                if expanded.id in seen:
                    raise ValueError(f"{where}: trajectory id {expanded.id!r} is used twice")
                seen.add(expanded.id)
        return self

    def expanded(self) -> list[TrajectorySpec]:
        """Every trajectory, with ``count`` templates expanded."""
        return [t for spec in self.trajectories for t in spec.expand()]


def resolve_tool_contracts(
    workload: Workload,
    catalog: Mapping[str, Mapping[str, ServerHints]] | None = None,
    source: str = "<workload>",
) -> tuple[dict[str, DeclaredContract], list[str]]:
    """The full contract of every tool whose contract the workload declares (gRPC services and MCP tools),
    with notes where a declaration and a server's hints disagree.

    ``catalog``: per MCP server, what it listed (remote tool name -> its hints), from the run's start.
    Raises ``WorkloadError`` naming the tool's path when a server does not offer a declared tool or the
    resolved contract is inconsistent."""
    catalog = catalog or {}
    contracts: dict[str, DeclaredContract] = {}
    notes: list[str] = []
    for i, tool in enumerate(workload.tools):
        if not tool.has_declared_contract:
            continue
        where = f"{source}: tools[{i}]"
        hints: ServerHints | None = None
        if tool.source == ToolSource.MCP:
            assert tool.server is not None  # the schema requires it
            listed = catalog.get(tool.server)
            if listed is None:
                raise WorkloadError(f"MCP server {tool.server!r} was not listed at start", where=where)
            remote = tool.remote or tool.name
            hints = listed.get(remote)
            if hints is None:
                offered = ", ".join(sorted(listed)) or "no tools"
                raise WorkloadError(
                    f"MCP server {tool.server!r} has no tool {remote!r}; it offers: {offered}",
                    where=f"{where}.{'remote' if tool.remote else 'name'}",
                )
        try:
            contract, said = resolve_contract(
                tool.name,
                tool.contract_fields(),
                scope=tool.default_scope(workload.mcp_servers),
                hints=hints,
            )
        except (ToolContractError, ValidationError) as e:
            raise WorkloadError(f"contract of {tool.name!r}: {e}", where=where) from e
        contracts[tool.name] = contract
        notes.extend(said)
    return contracts, notes


def _line_of(node: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """Walk the composed YAML node tree along a pydantic error location to find its line."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
            if match is None:
                break
            node = match
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            break
        line = node.start_mark.line + 1
    return line


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def parse_workload(text: str, source: str = "<workload>") -> Workload:
    """Parse and validate a workload document. Raises ``WorkloadError`` naming source, path and line."""
    try:
        node = yaml.compose(text)
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise WorkloadError(f"not valid YAML: {getattr(e, 'problem', e)}", where=where) from e
    if not isinstance(data, dict):
        raise WorkloadError(f"expected a mapping at the top level, got {type(data).__name__}", where=source)
    try:
        return Workload.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(err["loc"])
            line = _line_of(node, loc)
            at = f"line {line}, " if line else ""
            lines.append(f"  {at}{_format_loc(loc)}: {err['msg']}")
        raise WorkloadError(
            f"{e.error_count()} problem(s) in the workload:\n" + "\n".join(lines), where=source
        ) from e


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise WorkloadError("no such file", where=str(p)) from e
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read: {e}", where=str(p)) from e
    return parse_workload(text, source=str(p))
