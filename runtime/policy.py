"""A trajectory's policy: everything the decider needs that the workload fixes once, beside the record.

The record is the fold of the durable log; the policy comes from the trajectory's launch (stored in Redis
with it, so every incarnation of the actor reads the same one). ``runtime.fold.start`` attaches it to the
record, so ``runtime.decide(record, input, now)`` has everything it decides from in its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from runtime.budget import PriceTable, StageThresholds
from runtime.deadline import FinalizationReserve
from runtime.errors import InputError
from runtime.retry import RetryPolicy
from runtime.supervision import SupervisionPolicy
from runtime.tools import ToolRegistry
from runtime.watchdog import WatchdogConfig

__all__ = ["PolicyError", "TrajectoryPolicy"]

_FREE = PriceTable(0.0, 0.0, 0.0)


class PolicyError(InputError):
    """A policy value was out of range (names the field)."""


@dataclass(frozen=True, eq=False)
class TrajectoryPolicy:
    """Per-trajectory policy the workload sets. Compared by identity: one instance per launch."""

    registry: ToolRegistry = field(default_factory=ToolRegistry)
    provider_key: str = "default"
    prices: PriceTable = _FREE
    thresholds: StageThresholds = field(default_factory=StageThresholds)
    tool_timeout_s: float = 30.0  # one attempt of a tool call (clamped to the trajectory's deadline)
    probe_timeout_s: float = 30.0  # one result-recovery probe: a fresh question with its own deadline
    approval_timeout_s: float = 300.0
    approval_quorum: int = 1
    approval_roles: frozenset[str] = frozenset()  # roles the approving signers must cover together
    max_consecutive_model_failures: int = 4
    max_refusals: int = 2
    model_backoff_base_s: float = 0.5
    model_backoff_cap_s: float = 20.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # a compensation is itself an action that can fail and needs its own retry (reliability guide §5):
    # it is owed whatever happened to the forward work, so it gets a longer attempt budget than a forward
    # call (whose failure the model can route around); the trajectory's deadline still bounds it
    cleanup_retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=8))
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    reserve: FinalizationReserve = field(default_factory=FinalizationReserve)
    metadata: Mapping[str, str] = field(default_factory=dict)
    system_prompt: str | None = None
    idle_hibernate_s: float | None = None  # waiting (paused, awaiting approval) longer than this: hibernate
    rng_seed: int = 0  # the decider's only source of randomness (backoff jitter)
    escalation_owner: str = "operator"  # who receives the handoff packet and what is still owed
    repair_cap: int = 3  # corrective attempts of one repair episode (counted at admission)
    repair_success_probability: float | None = None  # p of the failure class, for the repair-vs-rebuild rule
    repair_attempt_cost: float | None = None  # C_r, in any unit shared with the fallback cost
    repair_fallback_cost: float | None = None  # C_f: compensating and rebuilding to the same point
    workspace: str | None = None  # the trajectory's sandbox workspace: a lease released in FINALIZING
    credentials: tuple[str, ...] = ()  # credential leases the trajectory holds, released in FINALIZING
    # issue 12: the watchdog ladder, task-state projection, disclosure rules, escalation routes,
    # degradation ladder and delegation template (runtime.supervision)
    supervision: SupervisionPolicy = field(default_factory=SupervisionPolicy)

    def __post_init__(self) -> None:
        for name in ("tool_timeout_s", "probe_timeout_s", "approval_timeout_s", "model_backoff_base_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise PolicyError(f"must be a finite number > 0, got {value!r}", where=f"policy.{name}")
        if self.model_backoff_cap_s < self.model_backoff_base_s:
            raise PolicyError("cap below base", where="policy.model_backoff_cap_s")
        for name in ("approval_quorum", "max_consecutive_model_failures"):
            if getattr(self, name) < 1:
                raise PolicyError("must be >= 1", where=f"policy.{name}")
        if self.max_refusals < 0:
            raise PolicyError("must be >= 0", where="policy.max_refusals")
        if self.idle_hibernate_s is not None and not self.idle_hibernate_s > 0:
            raise PolicyError("must be > 0 when set", where="policy.idle_hibernate_s")
