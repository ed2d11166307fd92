"""JSON-Schema arguments (issue 17): a contract whose schema comes from the workload or an MCP server
validates the model's arguments before dispatch exactly as a pydantic one does: every violation named by its
argument path, defaults filled so the canonical arguments (and the effect key) do not depend on spelling."""

from __future__ import annotations

import pickle

import pytest

from actors.contracts import JsonSchemaArguments
from runtime.tools import (
    ArgumentProblem,
    RepeatContract,
    SideEffect,
    ToolArgumentsInvalid,
    ToolContract,
    ToolContractError,
    ToolRegistry,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "repo_path": {"type": "string", "minLength": 1},
        "files": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "options": {
            "type": "object",
            "properties": {"depth": {"type": "integer", "minimum": 1}},
            "additionalProperties": False,
        },
        "verbose": {"type": "boolean", "default": False},
    },
    "required": ["repo_path", "files"],
    "additionalProperties": False,
}


def _registry(pivot: bool = False) -> ToolRegistry:
    return ToolRegistry(
        [
            ToolContract(
                name="git_add",
                description="Stage files.",
                arguments=JsonSchemaArguments(SCHEMA),
                side_effect=SideEffect.IRREVERSIBLE,
                repeat=RepeatContract.IDEMPOTENT,
                dependency_scope="mcp-git",
                target_keys=("repo_path",),
                pivot=pivot,
            )
        ]
    )


def test_valid_arguments_are_canonical_with_defaults_filled() -> None:
    # Given a JSON-Schema tool
    registry = _registry()
    # When the same call is spelled with and without the default, keys in another order
    a = registry.validate("git_add", '{"files": ["a.txt"], "repo_path": "/r"}')
    b = registry.validate("git_add", '{"repo_path": "/r", "verbose": false, "files": ["a.txt"]}')
    # Then both are the same canonical arguments
    assert a == b == {"files": ["a.txt"], "repo_path": "/r", "verbose": False}


@pytest.mark.parametrize(
    ("raw", "errors"),
    [
        ('{"files": ["a"]}', [("repo_path", "Field required")]),
        (
            '{"repo_path": "", "files": []}',
            [("files", "[] should be non-empty"), ("repo_path", "'' should be non-empty")],
        ),
        ('{"repo_path": "/r", "files": [3]}', [("files.0", "3 is not of type 'string'")]),
        (
            '{"repo_path": "/r", "files": ["a"], "options": {"depth": 0}}',
            [("options.depth", "0 is less than the minimum of 1")],
        ),
        (
            '{"repo_path": "/r", "files": ["a"], "force": true}',
            [("$", "Additional properties are not allowed ('force' was unexpected)")],
        ),
    ],
)
def test_violations_name_every_argument_path(raw: str, errors: list[tuple[str, str]]) -> None:
    # Given a JSON-Schema tool, When the model's arguments break its schema
    with pytest.raises(ToolArgumentsInvalid) as info:
        _registry().validate("git_add", raw)
    # Then the rejection is local, a schema problem, naming each violation's path
    assert info.value.problem is ArgumentProblem.SCHEMA
    assert list(info.value.errors) == errors
    assert info.value.observation()["status"] == "REJECTED"


def test_the_model_is_offered_the_schema_and_the_contract_carries_pivot() -> None:
    # Given a pivot tool with a JSON-Schema contract
    registry = _registry(pivot=True)
    # When its OpenAI spec is built, Then the parameters are the schema, and the pivot flag is kept
    assert registry.openai_tool_specs()[0]["function"]["parameters"] == SCHEMA
    assert registry.get("git_add").pivot and registry.get("git_add").argument_names >= {"repo_path"}


def test_schema_arguments_survive_pickling_with_the_same_behaviour() -> None:
    # Given schema arguments (a contract may cross a process boundary), When pickled and loaded
    copy = pickle.loads(pickle.dumps(JsonSchemaArguments(SCHEMA)))
    # Then they are equal and validate the same way
    assert copy == JsonSchemaArguments(SCHEMA)
    assert copy.validate({"repo_path": "/r", "files": ["a"]})["verbose"] is False


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array"}, "must describe an object"),
        (
            {"type": "object", "properties": {"n": {"type": "integr"}}},
            "arguments.properties.n.type: not a valid JSON Schema",
        ),
    ],
)
def test_a_bad_schema_is_refused_with_where(schema: dict[str, object], message: str) -> None:
    # Given a schema that cannot describe arguments, When made into arguments, Then it is refused
    with pytest.raises(ToolContractError, match=message):
        JsonSchemaArguments(schema)


def test_target_keys_must_be_schema_properties() -> None:
    # Given a contract naming a target key its schema does not have, When built, Then it is refused
    with pytest.raises(ToolContractError, match=r"tool\['t'\]\.target_keys: not arguments: branch"):
        ToolContract(
            name="t",
            description="",
            arguments=JsonSchemaArguments(SCHEMA),
            side_effect=SideEffect.READ_ONLY,
            repeat=RepeatContract.IDEMPOTENT,
            dependency_scope="s",
            target_keys=("branch",),
        )
