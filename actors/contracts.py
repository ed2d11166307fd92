"""Client-side tool contracts: the testbed services' built-in ones, and the ones a workload declares for any
tool (a gRPC ``ToolService`` or an MCP server), with JSON-Schema arguments.

Kept apart from the wiring so that validating a workload file needs only pydantic, jsonschema and
``runtime.tools``.

- ``testbed_contracts()``: the testbed tools. Their argument schemas mirror the services' own validation
  (``testbed/tools/services.py``); the service validates again on its side, so a drift shows up as a client
  rejection, never as a wrong effect.
- ``ContractFields``: what a workload may declare about a tool (every field optional);
  ``DeclaredContract``: a contract resolved to the last field, what a launch carries (JSON, so a re-created
  actor builds the same registry) and ``DeclaredContract.build`` turns into a ``runtime.tools.ToolContract``.
- ``resolve_contract``: declared fields first; for an MCP tool, what the server listed (description, input
  schema) and its annotations fill only what the workload left out. An annotation is a hint from the server:
  it may set a default, it never overrides (so never weakens) a declared field.
- ``JsonSchemaArguments``: ``runtime.tools.ArgumentSchema`` over a JSON Schema (the ``jsonschema`` library),
  errors with the argument's path.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from runtime.tools import (
    ArgumentSchemaViolation,
    CandidateRole,
    Compensation,
    RepeatContract,
    SideEffect,
    ToolContract,
    ToolContractError,
)

__all__ = [
    "CompensationSpec",
    "ContractFields",
    "DeclaredContract",
    "JsonSchemaArguments",
    "ServerHints",
    "resolve_contract",
    "testbed_contracts",
]


# --------------------------------------------------------------------------- JSON-Schema arguments


def _path(parts: Any) -> str:
    return ".".join(str(p) for p in parts)


class JsonSchemaArguments:
    """``runtime.tools.ArgumentSchema`` over a JSON Schema: the root must describe an object.

    Validation reports every violation with its argument path (a missing required argument is named by its
    own path, as pydantic does); top-level ``default`` values are filled in, so the canonical arguments (and
    with them the effect key) are the same whether the model spelled a default out or left it out.
    """

    __slots__ = ("_fields", "_schema", "_text", "_validator")

    def __init__(self, schema: Mapping[str, Any], where: str = "arguments") -> None:
        if not isinstance(schema, Mapping):
            raise ToolContractError(f"a JSON Schema is an object, got {type(schema).__name__}", where=where)
        plain = json.loads(json.dumps(dict(schema)))  # JSON values only, and our own copy
        if plain.get("type", "object") != "object":
            raise ToolContractError(
                f"the arguments schema must describe an object (type: object), got type {plain['type']!r}",
                where=where,
            )
        plain.setdefault("type", "object")
        cls = jsonschema.validators.validator_for(plain, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(plain)
        except jsonschema.exceptions.SchemaError as e:
            at = _path(e.absolute_path)
            raise ToolContractError(
                f"not a valid JSON Schema: {e.message}", where=f"{where}.{at}" if at else where
            ) from None
        self._schema: dict[str, Any] = plain
        self._text = json.dumps(plain, sort_keys=True, separators=(",", ":"))
        self._validator = cls(plain)
        properties = plain.get("properties") or {}
        self._fields = frozenset(properties) if isinstance(properties, Mapping) else frozenset()

    def json_schema(self) -> dict[str, Any]:
        return copy.deepcopy(self._schema)

    def field_names(self) -> frozenset[str]:
        return self._fields

    def validate(self, value: Mapping[str, Any]) -> dict[str, Any]:
        filled = dict(value)
        for name, prop in (self._schema.get("properties") or {}).items():
            if name not in filled and isinstance(prop, Mapping) and "default" in prop:
                filled[name] = copy.deepcopy(prop["default"])
        errors: list[tuple[str, str]] = []
        for error in sorted(self._validator.iter_errors(filled), key=lambda e: list(map(str, e.path))):
            parts = list(error.absolute_path)
            if error.validator == "required" and isinstance(error.validator_value, list):
                missing = [n for n in error.validator_value if isinstance(error.instance, dict)]
                missing = [n for n in missing if n not in error.instance]
                for name in missing:
                    errors.append((_path([*parts, name]), "Field required"))
                continue
            errors.append((_path(parts) or "$", error.message))
        if errors:
            raise ArgumentSchemaViolation(tuple(errors))
        return filled

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JsonSchemaArguments) and other._text == self._text

    def __hash__(self) -> int:
        return hash(self._text)

    def __repr__(self) -> str:
        return f"JsonSchemaArguments({self._text[:80]}{'...' if len(self._text) > 80 else ''})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (JsonSchemaArguments, (self._schema,))


# --------------------------------------------------------------------------- declared contracts


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


ArgName = Annotated[str, Field(min_length=1)]


class CompensationSpec(_Spec):
    """How to undo a reversible call: ``tool`` with arguments bound from the forward call's result
    (``from_result``: result field -> argument), its arguments (``from_args``) and constants (``fixed``);
    ``after``: tools whose cleanup runs first; ``postcondition``: fields the verified compensation result
    must carry; ``on_completion``: a temporary resource, released when the trajectory completes too."""

    tool: str = Field(min_length=1)
    from_result: dict[ArgName, ArgName] = Field(default_factory=dict)
    from_args: dict[ArgName, ArgName] = Field(default_factory=dict)
    fixed: dict[ArgName, JsonValue] = Field(default_factory=dict)
    after: tuple[str, ...] = ()
    postcondition: dict[ArgName, JsonValue] = Field(default_factory=dict)
    on_completion: bool = False

    def build(self) -> Compensation:
        return Compensation(
            self.tool,
            self.from_result,
            self.from_args,
            self.fixed,
            after=self.after,
            postcondition=self.postcondition,
            on_completion=self.on_completion,
        )


def _check_schema(value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
    if value is not None:
        try:
            JsonSchemaArguments(value)
        except ToolContractError as e:
            raise ValueError(str(e)) from None
    return value


class ContractFields(_Spec):
    """What a workload may declare about a tool's contract; a field left out is filled by the source's
    default (an MCP server's listing and annotations) or the safe default."""

    description: str | None = None
    arguments: dict[str, JsonValue] | None = None  # JSON Schema of the arguments (an object)
    side_effect: SideEffect | None = None
    repeat: RepeatContract | None = None
    probe: bool | None = None  # the endpoint answers result-recovery probes by effect key
    compensation: CompensationSpec | None = None
    pivot: bool | None = None
    candidate: CandidateRole | None = None  # the tool revises the candidate, or checks it
    needs_approval: bool | None = None  # absent: exactly when irreversible
    scope: str | None = Field(None, min_length=1, description="dependency scope (breaker + bulkhead)")
    pool: str | None = Field(None, min_length=1, description="sandbox pool whose permit each call takes")
    charge: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None  # dollars per attempt
    target_keys: tuple[str, ...] | None = None

    _check_arguments = field_validator("arguments")(_check_schema)

    def declared(self) -> dict[str, Any]:
        """The contract fields the workload actually wrote."""
        return self.model_dump(include=set(ContractFields.model_fields), exclude_none=True)


class DeclaredContract(_Spec):
    """A contract resolved to its last field: what a launch carries; ``build`` makes the runtime's."""

    description: str
    arguments: dict[str, JsonValue]
    side_effect: SideEffect
    repeat: RepeatContract
    scope: str = Field(min_length=1)
    probe: bool = False
    compensation: CompensationSpec | None = None
    pivot: bool = False
    candidate: CandidateRole | None = None
    needs_approval: bool | None = None
    pool: str | None = None
    charge: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    target_keys: tuple[str, ...] = ()

    _check_arguments = field_validator("arguments")(_check_schema)

    def build(self, name: str) -> ToolContract:
        """The runtime contract (raises ``ToolContractError`` naming the tool and field)."""
        return ToolContract(
            name=name,
            description=self.description,
            arguments=JsonSchemaArguments(self.arguments, where=f"tool[{name!r}].arguments"),
            side_effect=self.side_effect,
            repeat=self.repeat,
            dependency_scope=self.scope,
            compensation=self.compensation.build() if self.compensation else None,
            probe=self.probe,
            sandbox_pool=self.pool,
            charge=self.charge,
            needs_approval=self.needs_approval,
            target_keys=self.target_keys,
            pivot=self.pivot,
            candidate=self.candidate,
        )

    @model_validator(mode="after")
    def _consistent(self) -> DeclaredContract:
        try:
            self.build("checked")
        except ToolContractError as e:
            raise ValueError(str(e).replace("tool['checked']", "contract")) from None
        return self


@dataclass(frozen=True, slots=True)
class ServerHints:
    """What a tool's server said about it when listed: description, input schema, annotation hints
    (MCP ``readOnlyHint``/``destructiveHint``/``idempotentHint``; ``None`` when not given)."""

    description: str | None = None
    input_schema: Mapping[str, Any] | None = None
    read_only: bool | None = None
    destructive: bool | None = None
    idempotent: bool | None = None


def resolve_contract(
    name: str, fields: ContractFields, *, scope: str, hints: ServerHints | None = None
) -> tuple[DeclaredContract, list[str]]:
    """The full contract of ``name`` and notes on where the declaration and the server's hints disagree.

    Declared fields win. A field left out takes the server's hint, else the safe default: a tool nobody said
    is read-only is irreversible (it waits for approval) and never repeated; a read-only tool repeats.
    ``scope`` is the default dependency scope (the server's or the service's)."""
    hints = hints or ServerHints()
    notes: list[str] = []
    side_effect = fields.side_effect
    if side_effect is None:
        side_effect = SideEffect.READ_ONLY if hints.read_only else SideEffect.IRREVERSIBLE
    elif side_effect is SideEffect.READ_ONLY and (hints.read_only is False or hints.destructive):
        notes.append(
            f"tool {name!r} is declared read_only but its server does not say so "
            f"(readOnlyHint={hints.read_only}, destructiveHint={hints.destructive}); the declaration stands"
        )
    repeat = fields.repeat
    if repeat is None:
        safe_to_repeat = side_effect is SideEffect.READ_ONLY or bool(hints.idempotent)
        repeat = RepeatContract.IDEMPOTENT if safe_to_repeat else RepeatContract.NEVER_REPEAT
    arguments = fields.arguments
    if arguments is None:
        if hints.input_schema is None:
            raise ToolContractError(
                "no argument schema: declare `arguments` (a JSON Schema) for this tool",
                where=f"tool[{name!r}].arguments",
            )
        arguments = json.loads(json.dumps(dict(hints.input_schema)))
    resolved = DeclaredContract(
        description=fields.description or hints.description or name,
        arguments=arguments,
        side_effect=side_effect,
        repeat=repeat,
        scope=fields.scope or scope,
        probe=bool(fields.probe),
        compensation=fields.compensation,
        pivot=bool(fields.pivot),
        candidate=fields.candidate,
        needs_approval=fields.needs_approval,
        pool=fields.pool,
        charge=fields.charge or 0.0,
        target_keys=fields.target_keys or (),
    )
    return resolved, notes


# --------------------------------------------------------------------------- the testbed's tools


class _Args(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RunTestsArgs(_Args):
    suite: str = Field(min_length=1, max_length=200)
    commit: str = Field(default="HEAD", min_length=1, max_length=80)


class ProvisionArgs(_Args):
    tenant: str = Field(min_length=1, max_length=80)
    size: str = Field(default="small", pattern="^(small|medium|large)$")


class ReleaseArgs(_Args):
    env_id: str = Field(min_length=1, max_length=80)


class NotifyArgs(_Args):
    recipient: str = Field(min_length=1, max_length=200)
    message: str = Field(min_length=1, max_length=4000)


class SearchArgs(_Args):
    query: str = Field(min_length=1, max_length=200)
    limit: int = Field(default=10, ge=1, le=100)


class WriteNoteArgs(_Args):
    title: str = Field(min_length=1, max_length=200)
    body: str = Field(min_length=1, max_length=8000)


class NoteArgs(_Args):
    note_id: str = Field(min_length=1, max_length=80)


def testbed_contracts() -> list[ToolContract]:
    """How the harness dispatches each testbed tool (the services' scopes are their breaker scopes)."""
    return [
        ToolContract(
            name="run_tests",
            description="Run a test suite at a commit; reports totals and failures (read-only).",
            arguments=RunTestsArgs,
            side_effect=SideEffect.READ_ONLY,
            repeat=RepeatContract.IDEMPOTENT,
            dependency_scope="test-runner",
            target_keys=("suite",),
            candidate=CandidateRole.CHECKS,  # its verdict covers the candidate revision it ran on
        ),
        ToolContract(
            name="provision_env",
            description="Allocate a billed environment for a tenant; release it with release_env.",
            arguments=ProvisionArgs,
            side_effect=SideEffect.REVERSIBLE,
            # The service deduplicates by effect key and answers probes: an unknown outcome is probed first.
            repeat=RepeatContract.PROBE_THEN_RETRY,
            probe=True,
            dependency_scope="env-provisioner",
            # A test environment is temporary: released on every exit, completion included, and released
            # only when the endpoint's own record shows it released (probed by the release's effect key).
            compensation=Compensation(
                "release_env",
                from_result={"env_id": "env_id"},
                postcondition={"released": True},
                on_completion=True,
            ),
            target_keys=("tenant",),
        ),
        ToolContract(
            name="release_env",
            description="Release an environment (idempotent).",
            arguments=ReleaseArgs,
            side_effect=SideEffect.IRREVERSIBLE,
            repeat=RepeatContract.IDEMPOTENT,
            probe=True,  # the service answers probes by effect key: a release is verified against its record
            needs_approval=False,  # undoing spend needs nobody's permission
            dependency_scope="env-provisioner",
            target_keys=("env_id",),
        ),
        ToolContract(
            name="send_notification",
            description="Send a notification to a recipient. Irreversible: there is no unsend.",
            arguments=NotifyArgs,
            side_effect=SideEffect.IRREVERSIBLE,
            repeat=RepeatContract.NEVER_REPEAT,
            dependency_scope="notifier",
            target_keys=("recipient",),
        ),
        ToolContract(
            name="search_packages",
            description="Search the package catalogue by name or summary (read-only).",
            arguments=SearchArgs,
            side_effect=SideEffect.READ_ONLY,
            repeat=RepeatContract.IDEMPOTENT,
            dependency_scope="package-search",
            target_keys=("query",),
        ),
        ToolContract(
            name="write_note",
            description="Store a note (an artifact others may read); its id is its content's address.",
            arguments=WriteNoteArgs,
            side_effect=SideEffect.REVERSIBLE,
            repeat=RepeatContract.IDEMPOTENT,  # content-addressed: writing the same note again is harmless
            dependency_scope="notes",
            # deleted only when the service's reply says so (the postcondition is the evidence)
            compensation=Compensation(
                "delete_note", from_result={"note_id": "note_id"}, postcondition={"deleted": True}
            ),
            target_keys=("title",),
            candidate=CandidateRole.REVISES,  # a note is the testbed's candidate artifact
        ),
        ToolContract(
            name="read_note",
            description="Read a note by id (read-only).",
            arguments=NoteArgs,
            side_effect=SideEffect.READ_ONLY,
            repeat=RepeatContract.IDEMPOTENT,
            dependency_scope="notes",
            target_keys=("note_id",),
        ),
        ToolContract(
            name="delete_note",
            description="Delete a note (idempotent).",
            arguments=NoteArgs,
            side_effect=SideEffect.IRREVERSIBLE,
            repeat=RepeatContract.IDEMPOTENT,
            needs_approval=False,  # undoing one's own artifact needs nobody's permission
            dependency_scope="notes",
            target_keys=("note_id",),
        ),
    ]
