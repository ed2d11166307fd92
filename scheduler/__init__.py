"""Admission across trajectories: token buckets per provider key, weighted deficit round-robin across
priority classes, sandbox semaphores with an interactive reserve, leases, chunk leases admitted in the
caller's process (``scheduler.lease``); the scheduler actor.

The pure halves (``TokenBucket``, ``ProviderLimiter``, ``DeficitRoundRobin``, ``SandboxPool``,
``SchedulerCore``) never touch Ray or the wall clock. ``InProcessScheduler`` and ``SchedulerHandle``
both implement ``runtime.ports.AdmissionPort``. Importing this package does not import Ray: the
actor lives in ``scheduler.actor``.
"""

from scheduler.bucket import ProviderLimiter, TokenBucket
from scheduler.config import (
    DEFAULT_CLASS_WEIGHTS,
    FeedbackConfig,
    LeaseConfig,
    ProviderLimits,
    SandboxPoolConfig,
    SchedulerConfig,
)
from scheduler.core import (
    Admitted,
    Decision,
    LaneView,
    PermitGranted,
    PoolView,
    Refused,
    RequestKind,
    SchedulerCore,
    SchedulerSnapshot,
    SettleResult,
)
from scheduler.drr import DeficitRoundRobin
from scheduler.errors import Predicate, SchedulerInputError
from scheduler.hooks import NoopMetrics, SchedulerMetrics
from scheduler.inprocess import AlwaysAdmit, InProcessScheduler
from scheduler.lease import LocalLease, TurnLease
from scheduler.lease_client import LeaseClient
from scheduler.observe import MetricsAdapter
from scheduler.sandbox import SandboxPool

__all__ = [
    "DEFAULT_CLASS_WEIGHTS",
    "Admitted",
    "AlwaysAdmit",
    "Decision",
    "DeficitRoundRobin",
    "FeedbackConfig",
    "InProcessScheduler",
    "LaneView",
    "LeaseClient",
    "LeaseConfig",
    "LocalLease",
    "MetricsAdapter",
    "NoopMetrics",
    "PermitGranted",
    "PoolView",
    "Predicate",
    "ProviderLimiter",
    "ProviderLimits",
    "Refused",
    "RequestKind",
    "SandboxPool",
    "SandboxPoolConfig",
    "SchedulerConfig",
    "SchedulerCore",
    "SchedulerInputError",
    "SchedulerMetrics",
    "SchedulerSnapshot",
    "SettleResult",
    "TokenBucket",
    "TurnLease",
]
