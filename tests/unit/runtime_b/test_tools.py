"""Tool contracts, registry, local argument validation, repeat contracts (issue 6)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from runtime.errors import InputError
from runtime.fingerprint import call_fingerprint
from runtime.tools import (
    ArgumentProblem,
    Compensation,
    CompensationUnbound,
    RepeatContract,
    SideEffect,
    ToolArgumentsInvalid,
    ToolContract,
    ToolContractError,
    ToolRegistry,
    UnknownOutcomePolicy,
    UnknownTool,
    may_retry_after_unknown,
    unknown_outcome_policy,
)


class ProvisionArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(min_length=1)
    size: str = Field(pattern="^(s|m|l)$")
    ttl_minutes: int = Field(default=60, ge=1, le=240)


class ReleaseArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env_id: str
    tenant: str
    reason: str


class Recipient(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str


class NotifyArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: list[Recipient] = Field(min_length=1)
    text: str


PROVISION = ToolContract(
    name="provision_env",
    description="Provision a temporary test environment.",
    arguments=ProvisionArgs,
    side_effect=SideEffect.REVERSIBLE,
    repeat=RepeatContract.PROBE_THEN_RETRY,
    probe=True,
    compensation=Compensation(
        tool="release_env",
        from_result={"env_id": "env_id"},
        from_args={"tenant": "tenant"},
        fixed={"reason": "compensation"},
    ),
    dependency_scope="env-service/tenant-a",
    sandbox_pool=None,
    charge=0.02,
    target_keys=("tenant",),
)
RELEASE = ToolContract(
    name="release_env",
    description="Release an environment.",
    arguments=ReleaseArgs,
    side_effect=SideEffect.READ_ONLY,  # releasing is the undo; modelled as safe to repeat
    repeat=RepeatContract.IDEMPOTENT,
    dependency_scope="env-service/tenant-a",
)
NOTIFY = ToolContract(
    name="notify",
    description="Send a message to people.",
    arguments=NotifyArgs,
    side_effect=SideEffect.IRREVERSIBLE,
    repeat=RepeatContract.NEVER_REPEAT,
    dependency_scope="notifier",
)


@pytest.fixture
def registry() -> ToolRegistry:
    reg = ToolRegistry([PROVISION, RELEASE, NOTIFY])
    reg.check_references()
    return reg


def test_valid_arguments_come_back_canonical_with_defaults(registry: ToolRegistry) -> None:
    # Given two serialisations of one call, one spelling out the default
    a = registry.validate("provision_env", '{"size":"m","tenant":"caf\\u00e9"}')
    b = registry.validate("provision_env", '{ "tenant": "café", "size": "m", "ttl_minutes": 60 }')
    # Then both validate to the same canonical dict and fingerprint
    assert a == b == {"tenant": "café", "size": "m", "ttl_minutes": 60}
    assert call_fingerprint("provision_env", a) == call_fingerprint("provision_env", b)


@pytest.mark.parametrize(
    ("tool", "raw", "problem", "field"),
    [
        ("provision_env", '{"tenant": "a", "size": ', ArgumentProblem.NOT_JSON, None),
        ("provision_env", "NaN", ArgumentProblem.NOT_JSON, None),
        ("provision_env", '["a", "m"]', ArgumentProblem.NOT_OBJECT, None),
        ("provision_env", '"tenant"', ArgumentProblem.NOT_OBJECT, None),
        (
            "provision_env",
            '{"tenant": "a", "tenant": "b", "size": "m"}',
            ArgumentProblem.DUPLICATE_KEY,
            "tenant",
        ),
        ("provision_env", '{"tenant": "a"}', ArgumentProblem.SCHEMA, "size"),
        ("provision_env", '{"tenant": "a", "size": "xl"}', ArgumentProblem.SCHEMA, "size"),
        (
            "provision_env",
            '{"tenant": "a", "size": "m", "ttl_minutes": 999}',
            ArgumentProblem.SCHEMA,
            "ttl_minutes",
        ),
        ("provision_env", '{"tenant": "a", "size": "m", "region": "eu"}', ArgumentProblem.SCHEMA, "region"),
        ("notify", '{"to": [{"address": "a@b"}, {}], "text": "hi"}', ArgumentProblem.SCHEMA, "to.1.address"),
    ],
)
def test_rejections_name_the_tool_and_the_field(
    registry: ToolRegistry, tool: str, raw: str, problem: ArgumentProblem, field: str | None
) -> None:
    # When the model's raw arguments are validated
    with pytest.raises(ToolArgumentsInvalid) as err:
        registry.validate(tool, raw)
    # Then the local rejection names tool, field and problem, and is an InputError
    rejection = err.value
    assert isinstance(rejection, InputError)
    assert rejection.tool == tool
    assert rejection.problem is problem
    assert rejection.field == field
    assert rejection.where == f"{tool}.arguments" + (f".{field}" if field else "")
    assert tool in str(rejection)
    observation = rejection.observation()
    assert observation["status"] == "REJECTED" and observation["tool"] == tool


def test_unknown_tool_is_a_local_rejection(registry: ToolRegistry) -> None:
    with pytest.raises(UnknownTool, match="'drop_table'") as err:
        registry.validate("drop_table", "{}")
    assert isinstance(err.value, InputError)
    assert "provision_env" in str(err.value)


def test_openai_specs_carry_the_pydantic_schema(registry: ToolRegistry) -> None:
    specs = registry.openai_tool_specs(["provision_env", "notify"])
    assert [s["function"]["name"] for s in specs] == ["provision_env", "notify"]
    params = specs[0]["function"]["parameters"]
    assert params["type"] == "object"
    assert set(params["properties"]) == {"tenant", "size", "ttl_minutes"}
    assert set(params["required"]) == {"tenant", "size"}
    assert params["additionalProperties"] is False
    assert len(registry.openai_tool_specs()) == 3


def test_approval_defaults_to_irreversible_and_can_be_overridden() -> None:
    assert NOTIFY.needs_approval is True and NOTIFY.requires_approval
    assert PROVISION.needs_approval is False
    reviewed_read = ToolContract(
        name="read_secrets",
        description="d",
        arguments=ReleaseArgs,
        side_effect=SideEffect.READ_ONLY,
        repeat=RepeatContract.IDEMPOTENT,
        dependency_scope="vault",
        needs_approval=True,
    )
    assert reviewed_read.requires_approval


def test_compensation_binds_the_created_resource_id() -> None:
    # Given the template registered before dispatch (env id unknown yet)
    comp = PROVISION.compensation
    assert comp is not None
    forward = {"tenant": "tenant-a", "size": "m", "ttl_minutes": 60}
    assert comp.template(forward) == {"reason": "compensation", "tenant": "tenant-a"}
    # When the provisioning result arrives; Then the release call is fully bound
    assert comp.bind(forward, {"env_id": "env_r18_01"}) == {
        "env_id": "env_r18_01",
        "tenant": "tenant-a",
        "reason": "compensation",
    }
    with pytest.raises(CompensationUnbound, match="env_id"):
        comp.bind(forward, {"status": "pending"})


@pytest.mark.parametrize(
    ("repeat", "policy"),
    [
        (RepeatContract.IDEMPOTENT, UnknownOutcomePolicy.RETRY),
        (RepeatContract.DEDUPLICATED, UnknownOutcomePolicy.RETRY),
        (RepeatContract.PROBE_THEN_RETRY, UnknownOutcomePolicy.PROBE),
        (RepeatContract.NEVER_REPEAT, UnknownOutcomePolicy.LEAVE_UNKNOWN),
    ],
)
def test_unknown_outcome_policy_follows_the_repeat_contract(
    repeat: RepeatContract, policy: UnknownOutcomePolicy
) -> None:
    contract = ToolContract(
        name="t",
        description="d",
        arguments=ReleaseArgs,
        side_effect=SideEffect.READ_ONLY,
        repeat=repeat,
        probe=True,
        dependency_scope="s",
    )
    assert unknown_outcome_policy(contract) is policy
    assert may_retry_after_unknown(contract) is (policy is UnknownOutcomePolicy.RETRY)


def _contract(**overrides: Any) -> ToolContract:
    fields: dict[str, Any] = {
        "name": "t",
        "description": "d",
        "arguments": ProvisionArgs,
        "side_effect": SideEffect.READ_ONLY,
        "repeat": RepeatContract.IDEMPOTENT,
        "dependency_scope": "s",
    }
    fields.update(overrides)
    return ToolContract(**fields)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"name": "bad name!"}, "name"),
        ({"arguments": dict}, "arguments"),
        ({"dependency_scope": ""}, "dependency_scope"),
        ({"charge": -0.1}, "charge"),
        ({"repeat": RepeatContract.PROBE_THEN_RETRY}, "probe"),
        ({"side_effect": SideEffect.REVERSIBLE}, "compensation"),
        ({"target_keys": ("nope",)}, "target_keys"),
    ],
)
def test_inconsistent_contracts_are_rejected(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ToolContractError) as err:
        _contract(**overrides)
    assert fragment in str(err.value)


def test_registry_rejects_duplicates_and_dangling_compensation() -> None:
    reg = ToolRegistry([PROVISION])
    with pytest.raises(ToolContractError, match="registered twice"):
        reg.register(PROVISION)
    with pytest.raises(ToolContractError, match="release_env"):
        reg.check_references()
