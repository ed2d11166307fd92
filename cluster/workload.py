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
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from actors.contracts import testbed_contracts
from actors.tools_local import builtin_tools
from runtime.errors import InputError

__all__ = [
    "BudgetSpec",
    "CompletionCheckSpec",
    "ProviderSpec",
    "RetrySpec",
    "ToolSource",
    "ToolSpec",
    "TrajectorySpec",
    "Workload",
    "WorkloadError",
    "load_workload",
    "parse_workload",
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
    headroom: Annotated[float, Field(ge=0, lt=1)] = 0.05
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
    GRPC = "grpc"  # a gRPC ToolService at `address`


class ToolSpec(_Strict):
    """A tool the trajectories may be granted. Its contract (side effect, repeat contract, scope) is known
    to Tether by name: the testbed services' tools, or the built-in in-process tools."""

    name: str
    source: ToolSource = ToolSource.TESTBED
    address: str | None = None

    @model_validator(mode="after")
    def _known_tool(self) -> ToolSpec:
        if self.source == ToolSource.BUILTIN:
            known = sorted(builtin_tools())
        else:
            known = sorted(c.name for c in testbed_contracts())
        if self.name not in known:
            raise ValueError(f"{self.source.value} tool {self.name!r} is unknown; known: {', '.join(known)}")
        if self.source == ToolSource.GRPC and not self.address:
            raise ValueError(f"tool {self.name!r} has source grpc and needs address HOST:PORT")
        if self.source != ToolSource.GRPC and self.address:
            raise ValueError(f"tool {self.name!r}: address is only for source grpc")
        return self


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
    - ``never``: always fails (exercises the COMPLETION_CHECK_FAILED path).
    """

    kind: Literal["always", "tool_succeeded", "min_tool_results", "never"] = "min_tool_results"
    tool: str | None = None
    count: Annotated[int, Field(ge=0)] = 1

    @model_validator(mode="after")
    def _tool_named(self) -> CompletionCheckSpec:
        if self.kind == "tool_succeeded" and not self.tool:
            raise ValueError("completion check tool_succeeded needs `tool`")
        return self


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
    tenant: str = "default"
    completion_check: CompletionCheckSpec = CompletionCheckSpec()
    expected_state: Literal["COMPLETED", "FAILED", "CANCELED"] | None = None

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


class Workload(_Strict):
    name: str = "workload"
    provider: ProviderSpec = ProviderSpec()
    classes: dict[str, PositiveFloat] = Field(
        default_factory=lambda: {"interactive": 4.0, "standard": 2.0, "batch": 1.0}
    )
    tools: tuple[ToolSpec, ...] = ()
    trajectories: Annotated[tuple[TrajectorySpec, ...], Field(min_length=1)]
    approval_timeout_s: PositiveFloat = 30.0  # silence until then is denial
    tool_timeout_s: PositiveFloat = 30.0
    hibernate_after_s: PositiveFloat | None = None  # waiting longer than this: the actor exits, state stays
    guard: Literal["actor", "local", "none"] = "actor"  # breaker + bulkhead per dependency scope
    retry: RetrySpec = RetrySpec()
    scheduler: bool = True  # admit turns through the scheduler actor (provider limits, priority classes)
    # Ray resources each trajectory actor requests. Absent: {"tether_trajectory": 1} when some node of the
    # cluster declares it, else none. Set it on a cluster that autoscales from zero workers, where no live
    # node declares the resource yet ({tether_trajectory: 1}); {} requests none.
    trajectory_resources: dict[str, PositiveFloat] | None = None

    @model_validator(mode="after")
    def _cross_references(self) -> Workload:
        tool_names = {t.name for t in self.tools}
        if len(tool_names) != len(self.tools):
            raise ValueError("tool names must be unique")
        seen: set[str] = set()
        for i, spec in enumerate(self.trajectories):
            where = f"trajectories[{i}]"
            if spec.priority_class not in self.classes:
                declared = ", ".join(self.classes)
                raise ValueError(f"{where}.class {spec.priority_class!r} is not declared ({declared})")
            unknown = [g for g in spec.grants if g not in tool_names]
            if unknown:
                raise ValueError(f"{where}.grants names undeclared tools: {', '.join(unknown)}")
            checked = spec.completion_check.tool
            if spec.completion_check.kind == "tool_succeeded" and checked not in spec.grants:
                raise ValueError(f"{where}.completion_check.tool {checked!r} is not in its grants")
            for expanded in spec.expand():
                if expanded.id in seen:
                    raise ValueError(f"{where}: trajectory id {expanded.id!r} is used twice")
                seen.add(expanded.id)
        return self

    def expanded(self) -> list[TrajectorySpec]:
        """Every trajectory, with ``count`` templates expanded."""
        return [t for spec in self.trajectories for t in spec.expand()]


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
