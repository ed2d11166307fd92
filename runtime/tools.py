"""Tool contracts, the tool registry, and argument validation before dispatch.

Every tool declares what the harness needs to dispatch it safely (issue 6; recovery chapter §12.7,
reliability guide §5-§7): an argument schema (a pydantic model, or a JSON Schema declared in the workload or
imported from an MCP server, behind :class:`ArgumentSchema`), its side-effect class, its repeat contract, its
compensation (a tool name and how the created resource's id binds into that tool's arguments) and whether
it supports a probe (result recovery), its dependency scope (the breaker/bulkhead it sits behind), its
sandbox pool, its per-call charge, whether it needs approval (irreversible tools do by default), and whether
it is a pivot (recovery chapter §12.4: the call after which the saga is completed forward, not undone).

Arguments are validated before dispatch. A rejection here is *local*: it never reaches the dependency and
never counts in that dependency's breaker window. The error names the tool and the field so the model gets
a precise observation.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ValidationError

from runtime.errors import InputError
from runtime.fingerprint import canonical_value

__all__ = [
    "ArgumentProblem",
    "ArgumentSchema",
    "ArgumentSchemaViolation",
    "CandidateRole",
    "Compensation",
    "CompensationUnbound",
    "RepeatContract",
    "SideEffect",
    "ToolArgumentsInvalid",
    "ToolContract",
    "ToolContractError",
    "ToolRegistry",
    "UnknownOutcomePolicy",
    "UnknownTool",
    "may_retry_after_unknown",
    "unknown_outcome_policy",
]

# OpenAI function names: letters, digits, underscores and dashes, at most 64 characters.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class SideEffect(StrEnum):
    """What a call can do to the world outside the sandbox."""

    READ_ONLY = "read_only"
    REVERSIBLE = "reversible"  # has a compensation
    IRREVERSIBLE = "irreversible"  # can only be completed forward: gated by approval


class CandidateRole(StrEnum):
    """What a tool does to the candidate (the artifact the task produces, e.g. a patch or a document) —
    recovery chapter §12.9.3, table 10, "candidate changes after a check"."""

    REVISES = "revises"  # a result (or an unknown outcome) makes a new candidate revision
    CHECKS = "checks"  # its result is evidence about the current revision, and that revision only


class RepeatContract(StrEnum):
    """What the endpoint guarantees about executing the same intent twice."""

    IDEMPOTENT = "idempotent"  # repeating has the effect of doing it once
    DEDUPLICATED = "deduplicated"  # the endpoint deduplicates by effect key
    PROBE_THEN_RETRY = "probe_then_retry"  # ask the endpoint what happened; retry only if established absent
    NEVER_REPEAT = "never_repeat"  # an unknown outcome stays unknown with an owner


class UnknownOutcomePolicy(StrEnum):
    """What the retry owner may do when a dispatched call's outcome is unknown (e.g. timed out)."""

    RETRY = "retry"
    PROBE = "probe"
    LEAVE_UNKNOWN = "leave_unknown"


class ArgumentSchemaViolation(Exception):
    """Arguments do not satisfy an :class:`ArgumentSchema`: ``errors`` is every violation as
    ``(dotted field path, message)`` (``"$"`` for the whole object)."""

    def __init__(self, errors: tuple[tuple[str, str], ...]) -> None:
        self.errors = errors or (("$", "invalid"),)
        super().__init__("; ".join(f"{f}: {m}" for f, m in self.errors))


@runtime_checkable
class ArgumentSchema(Protocol):
    """A tool's argument schema that is not a pydantic model (e.g. a JSON Schema from the workload or an
    MCP server). Implementations live outside ``runtime`` (``actors.contracts.JsonSchemaArguments``) and
    must be pure: the same value always validates the same way."""

    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema offered to the model as the function's ``parameters``."""
        ...

    def field_names(self) -> frozenset[str]:
        """The top-level argument names (for target keys and compensation bindings)."""
        ...

    def validate(self, value: Mapping[str, Any]) -> dict[str, Any]:
        """``value`` with defaults filled, or :class:`ArgumentSchemaViolation`."""
        ...


class ToolContractError(InputError):
    """A tool contract or registry is inconsistent (names the tool and field)."""


class UnknownTool(InputError):
    """The model named a tool that is not registered."""

    def __init__(self, tool: str, known: Iterable[str] = ()) -> None:
        self.tool = tool
        names = ", ".join(sorted(known))
        super().__init__(f"unknown tool {tool!r}" + (f" (known: {names})" if names else ""), where="tool")


class ArgumentProblem(StrEnum):
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    DUPLICATE_KEY = "duplicate_key"
    SCHEMA = "schema"


class ToolArgumentsInvalid(InputError):
    """Tool arguments were rejected locally. ``tool``, ``field`` (dotted path, ``None`` for the whole
    payload), ``problem`` and ``errors`` (every violation as ``(field, message)``) describe why."""

    def __init__(
        self, tool: str, problem: ArgumentProblem, message: str, errors: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.tool = tool
        self.problem = problem
        self.errors = errors or (("$", message),)
        self.field: str | None = errors[0][0] if errors else None
        where = f"{tool}.arguments" + (f".{self.field}" if self.field else "")
        super().__init__(message, where=where)

    def observation(self) -> dict[str, Any]:
        """Structured observation for the model: what was rejected and where, nothing dispatched."""
        return {
            "status": "REJECTED",
            "reason": "INVALID_ARGUMENTS",
            "tool": self.tool,
            "problem": self.problem.value,
            "errors": [{"field": f, "message": m} for f, m in self.errors],
            "message": "The call was not dispatched. Fix the arguments and propose it again.",
        }


class CompensationUnbound(InputError):
    """A compensation could not be bound: the forward result lacks the field it needs."""


def _frozen_str_map(values: Mapping[str, str], where: str) -> Mapping[str, str]:
    for k, v in values.items():
        if not isinstance(k, str) or not k or not isinstance(v, str) or not v:
            raise ToolContractError(f"bindings map non-empty names to names, got {k!r}: {v!r}", where=where)
    return MappingProxyType(dict(values))


@dataclass(frozen=True, slots=True)
class Compensation:
    """How to undo a reversible call: ``tool`` with arguments bound from the forward call's result
    (``from_result``: result field -> compensation argument), from the forward call's own arguments
    (``from_args``: forward argument -> compensation argument), and ``fixed`` constants.

    Registered before dispatch as a template with unbound result fields (recovery chapter §12.3);
    :meth:`bind` fills them once the result arrives.

    The cleanup graph and its evidence (``runtime.obligations``): ``after`` names tools whose obligations
    must be discharged before this one runs (stop the test before releasing its environment);
    ``postcondition`` names fields the compensation's verified result must carry (``{"released": true}``):
    without a probe of the compensation's effect key or a declared postcondition, nothing can show the
    compensation worked, and the obligation is handed off instead of being recorded clean.
    ``on_completion``: the resource is temporary, so it is released when the trajectory completes too
    (otherwise a completed task keeps what it did)."""

    tool: str
    from_result: Mapping[str, str] = field(default_factory=dict)
    from_args: Mapping[str, str] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    after: tuple[str, ...] = ()
    postcondition: Mapping[str, Any] = field(default_factory=dict)
    on_completion: bool = False

    def __post_init__(self) -> None:
        where = f"compensation[{self.tool}]"
        object.__setattr__(self, "from_result", _frozen_str_map(self.from_result, f"{where}.from_result"))
        object.__setattr__(self, "from_args", _frozen_str_map(self.from_args, f"{where}.from_args"))
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))
        object.__setattr__(self, "postcondition", MappingProxyType(dict(self.postcondition)))
        object.__setattr__(self, "after", tuple(self.after))
        if any(not isinstance(t, str) or not t for t in self.after):
            raise ToolContractError("after names tools", where=f"{where}.after")
        targets = [*self.from_result.values(), *self.from_args.values(), *self.fixed]
        duplicated = sorted({t for t in targets if targets.count(t) > 1})
        if duplicated:
            raise ToolContractError(f"argument bound twice: {', '.join(duplicated)}", where=where)

    def template(self, forward_args: Mapping[str, Any]) -> dict[str, Any]:
        """Compensation arguments known before dispatch (constants and forward arguments)."""
        out = dict(self.fixed)
        for src, dst in self.from_args.items():
            if src not in forward_args:
                raise CompensationUnbound(f"forward argument {src!r} missing", where=f"{self.tool}.{dst}")
            out[dst] = forward_args[src]
        return out

    def bind(self, forward_args: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
        """Full compensation arguments once the forward result (e.g. the created env id) is known."""
        out = self.template(forward_args)
        for src, dst in self.from_result.items():
            if not isinstance(result, Mapping) or src not in result:
                raise CompensationUnbound(f"result field {src!r} missing", where=f"{self.tool}.{dst}")
            out[dst] = result[src]
        return out


@dataclass(frozen=True, slots=True)
class ToolContract:
    """Everything the harness must know to dispatch one tool safely."""

    name: str
    description: str
    arguments: type[BaseModel] | ArgumentSchema
    side_effect: SideEffect
    repeat: RepeatContract
    dependency_scope: str
    compensation: Compensation | None = None
    probe: bool = False  # the endpoint supports result recovery by effect key
    sandbox_pool: str | None = None
    charge: float = 0.0  # direct dollars per attempt
    needs_approval: bool | None = None  # None: True exactly when irreversible
    target_keys: tuple[str, ...] = ()  # arguments naming the resource acted on (coarse fingerprint)
    isolate_network: bool = False  # run the sandboxed process without network access
    # A pivot (recovery chapter §12.5.2): the one irreversible commitment of its region. Every check that can
    # run before it runs before it (``prechecks``: tools with a successful result since the last pivot);
    # once established, what it ``commits`` (forward tools of the region) is no longer compensated, and its
    # ``follow_up`` duties are staged in the outbox in the same durable batch as its outcome (§12.5.3).
    pivot: bool = False
    prechecks: tuple[str, ...] = ()
    commits: tuple[str, ...] = ()
    follow_up: tuple[Compensation, ...] = ()
    # The candidate's revisions (``runtime._decide_candidate``): a tool that ``revises`` the candidate opens
    # a new revision; one that ``checks`` it adds evidence scoped to the revision it checked.
    candidate: CandidateRole | None = None

    def __post_init__(self) -> None:
        where = f"tool[{self.name!r}]"
        if not isinstance(self.name, str) or not _TOOL_NAME.match(self.name):
            raise ToolContractError("name must match [A-Za-z0-9_-]{1,64}", where=where)
        pydantic_model = isinstance(self.arguments, type) and issubclass(self.arguments, BaseModel)
        if not pydantic_model and not isinstance(self.arguments, ArgumentSchema):
            raise ToolContractError(
                "arguments must be a pydantic model class or an ArgumentSchema", where=f"{where}.arguments"
            )
        if not self.dependency_scope:
            raise ToolContractError("dependency scope is required", where=f"{where}.dependency_scope")
        if isinstance(self.charge, bool) or not math.isfinite(self.charge) or self.charge < 0:
            raise ToolContractError(
                f"charge must be finite and ≥ 0, got {self.charge!r}", where=f"{where}.charge"
            )
        if self.repeat is RepeatContract.PROBE_THEN_RETRY and not self.probe:
            raise ToolContractError("probe-then-retry needs a probe", where=f"{where}.probe")
        if self.side_effect is SideEffect.REVERSIBLE and self.compensation is None:
            raise ToolContractError("a reversible tool must declare its compensation", where=f"{where}")
        if (self.prechecks or self.commits or self.follow_up) and not self.pivot:
            raise ToolContractError(
                "prechecks, commits and follow_up belong to a pivot", where=f"{where}.pivot"
            )
        object.__setattr__(self, "prechecks", tuple(self.prechecks))
        object.__setattr__(self, "commits", tuple(self.commits))
        object.__setattr__(self, "follow_up", tuple(self.follow_up))
        fields = set(self.argument_names)
        unknown_targets = sorted(set(self.target_keys) - fields)
        if unknown_targets:
            raise ToolContractError(
                f"not arguments: {', '.join(unknown_targets)}", where=f"{where}.target_keys"
            )
        if self.compensation is not None:
            missing = sorted(set(self.compensation.from_args) - fields)
            if missing:
                raise ToolContractError(f"not arguments: {', '.join(missing)}", where=f"{where}.compensation")
        if self.needs_approval is None:
            object.__setattr__(self, "needs_approval", self.side_effect is SideEffect.IRREVERSIBLE)

    @property
    def argument_names(self) -> frozenset[str]:
        """The top-level argument names, whichever kind of schema declares them."""
        if isinstance(self.arguments, type):
            return frozenset(self.arguments.model_fields)
        return self.arguments.field_names()

    def parameters(self) -> dict[str, Any]:
        """The argument JSON Schema (the OpenAI function's ``parameters``)."""
        if isinstance(self.arguments, type):
            return self.arguments.model_json_schema()
        return self.arguments.json_schema()

    def validate_arguments(self, parsed: Mapping[str, Any]) -> dict[str, Any]:
        """Validate a parsed argument object; raises :class:`ArgumentSchemaViolation`. Returns the arguments
        with defaults filled (JSON types), not yet canonical."""
        if isinstance(self.arguments, type):
            try:
                model = self.arguments.model_validate(parsed)
            except ValidationError as e:
                raise ArgumentSchemaViolation(
                    tuple((_field_path(err["loc"]), err["msg"]) for err in e.errors())
                ) from e
            dumped: dict[str, Any] = model.model_dump(mode="json")
            return dumped
        return self.arguments.validate(parsed)

    @property
    def requires_approval(self) -> bool:
        """``needs_approval`` resolved (never None after construction)."""
        return bool(self.needs_approval)

    def openai_spec(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry, parameters from the argument JSON schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters(),
            },
        }


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _field_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "$"


class ToolRegistry:
    """The tools a deployment offers, by name. Registration is explicit; nothing happens at import."""

    def __init__(self, contracts: Iterable[ToolContract] = ()) -> None:
        self._tools: dict[str, ToolContract] = {}
        # each tool's spec and its JSON characters, built once (a name is registered once; contracts are
        # frozen)
        self._specs: dict[str, tuple[dict[str, Any], int]] = {}
        self._pivots: frozenset[str] = frozenset()
        for contract in contracts:
            self.register(contract)

    def register(self, contract: ToolContract) -> None:
        if contract.name in self._tools:
            raise ToolContractError("registered twice", where=f"tool[{contract.name!r}]")
        self._tools[contract.name] = contract
        if contract.pivot:
            self._pivots = self._pivots | {contract.name}

    @property
    def pivots(self) -> frozenset[str]:
        """The registered tools that are pivots (none, for most deployments: no pivot rule then applies)."""
        return self._pivots

    def get(self, tool: str) -> ToolContract:
        try:
            return self._tools[tool]
        except KeyError:
            raise UnknownTool(tool, self._tools) from None

    def __contains__(self, tool: object) -> bool:
        return tool in self._tools

    def names(self) -> list[str]:
        return sorted(self._tools)

    def check_references(self) -> None:
        """Every compensation names a registered tool whose arguments include the bound names."""
        for contract in self._tools.values():
            comp = contract.compensation
            if comp is None:
                continue
            where = f"tool[{contract.name!r}].compensation"
            if comp.tool not in self._tools:
                raise ToolContractError(f"compensation tool {comp.tool!r} is not registered", where=where)
            target_fields = set(self._tools[comp.tool].argument_names)
            bound = {*comp.from_result.values(), *comp.from_args.values(), *comp.fixed}
            unknown = sorted(bound - target_fields)
            if unknown:
                raise ToolContractError(f"{comp.tool!r} has no arguments {', '.join(unknown)}", where=where)
            missing = sorted(t for t in comp.after if t not in self._tools)
            if missing:
                raise ToolContractError(f"after names unregistered tools: {', '.join(missing)}", where=where)
        for contract in self._tools.values():
            where = f"tool[{contract.name!r}]"
            named = [*contract.prechecks, *contract.commits, *(f.tool for f in contract.follow_up)]
            missing = sorted({t for t in named if t not in self._tools})
            if missing:
                raise ToolContractError(
                    f"the pivot names unregistered tools: {', '.join(missing)}", where=where
                )
        self._check_cleanup_order()

    def _check_cleanup_order(self) -> None:
        """Declared cleanup dependencies form a DAG (recovery chapter §12.3.4): a cycle is contradictory and
        needs an operator, not an arbitrary order."""
        edges = {
            name: set(c.compensation.after) for name, c in self._tools.items() if c.compensation is not None
        }
        state: dict[str, int] = {}

        def visit(node: str, path: list[str]) -> None:
            if state.get(node) == 2:
                return
            if state.get(node) == 1:
                cycle = " -> ".join([*path[path.index(node) :], node])
                raise ToolContractError(
                    f"cleanup dependencies form a cycle: {cycle}", where="compensation.after"
                )
            state[node] = 1
            for nxt in sorted(edges.get(node, ())):
                visit(nxt, [*path, node])
            state[node] = 2

        for name in sorted(edges):
            visit(name, [])

    def openai_tool_specs(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI tool specs for ``names`` (all tools when None), in the order given (sorted for all).
        Keep the order stable across turns: reordering the tool list breaks the prefix cache."""
        selected = self.names() if names is None else list(names)
        return [self._spec(n)[0] for n in selected]

    def spec_chars(self, names: Iterable[str]) -> int:
        """The JSON characters of those tools' specs (what ``runtime.context.estimate_tokens`` counts)."""
        return sum(self._spec(n)[1] for n in names)

    def _spec(self, name: str) -> tuple[dict[str, Any], int]:
        # shared between turns (the model adapters only read a request): never changed once built
        known = self._specs.get(name)
        if known is None:
            spec = self.get(name).openai_spec()
            known = self._specs[name] = (spec, len(json.dumps(spec, ensure_ascii=False, default=str)))
        return known

    def validate(self, tool: str, raw_arguments: str) -> dict[str, Any]:
        """Parse and validate the model's raw argument text; return canonical arguments (defaults
        filled, JSON types, strings NFC). Raises :class:`UnknownTool` or :class:`ToolArgumentsInvalid`."""
        contract = self.get(tool)
        try:
            parsed = json.loads(
                raw_arguments, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
            )
        except _DuplicateKey as dup:
            raise ToolArgumentsInvalid(
                tool,
                ArgumentProblem.DUPLICATE_KEY,
                f"key {dup.key!r} appears twice",
                ((dup.key, "duplicate key"),),
            ) from None
        except (ValueError, TypeError) as e:
            raise ToolArgumentsInvalid(
                tool, ArgumentProblem.NOT_JSON, f"arguments are not valid JSON: {e}"
            ) from e
        if not isinstance(parsed, dict):
            raise ToolArgumentsInvalid(
                tool,
                ArgumentProblem.NOT_OBJECT,
                f"arguments must be a JSON object, got {type(parsed).__name__}",
            )
        try:
            valid = contract.validate_arguments(parsed)
        except ArgumentSchemaViolation as e:
            raise ToolArgumentsInvalid(tool, ArgumentProblem.SCHEMA, str(e), e.errors) from e
        canonical: dict[str, Any] = canonical_value(valid, where=f"{tool}.arguments")
        return canonical


def unknown_outcome_policy(contract: ToolContract) -> UnknownOutcomePolicy:
    """Settlement before retry (recovery chapter, settlement rule): an unknown outcome may be re-dispatched
    only when the repeat contract makes re-execution safe; otherwise probe, or leave it unknown with an
    owner."""
    match contract.repeat:
        case RepeatContract.IDEMPOTENT | RepeatContract.DEDUPLICATED:
            return UnknownOutcomePolicy.RETRY
        case RepeatContract.PROBE_THEN_RETRY:
            return UnknownOutcomePolicy.PROBE
        case RepeatContract.NEVER_REPEAT:
            return UnknownOutcomePolicy.LEAVE_UNKNOWN


def may_retry_after_unknown(contract: ToolContract) -> bool:
    """True when a call whose outcome is unknown may be dispatched again without probing first."""
    return unknown_outcome_policy(contract) is UnknownOutcomePolicy.RETRY
