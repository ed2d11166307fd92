"""Client-side contracts of the testbed tool services: what the harness must know to dispatch each one
safely (argument schema, side effect, repeat contract, probe, compensation, dependency scope).

Kept apart from the wiring so that validating a workload file needs only pydantic and ``runtime.tools``.
The argument schemas mirror the services' own validation (``testbed/tools/services.py``); the service
validates again on its side, so a drift shows up as a client rejection, never as a wrong effect.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from runtime.tools import Compensation, RepeatContract, SideEffect, ToolContract

__all__ = ["testbed_contracts"]


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
            compensation=Compensation("release_env", from_result={"env_id": "env_id"}),
            target_keys=("tenant",),
        ),
        ToolContract(
            name="release_env",
            description="Release an environment (idempotent).",
            arguments=ReleaseArgs,
            side_effect=SideEffect.IRREVERSIBLE,
            repeat=RepeatContract.IDEMPOTENT,
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
    ]
