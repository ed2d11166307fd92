"""Simulated tool services over gRPC (test runner, environment provisioner, notifier, package
search) with fault knobs and their own independent ledger of external effects.

Run with ``python -m testbed.tools --port PORT``; regenerate ``testbed_tools_pb2*`` with
``python -m actors.tools_grpc.regen``.
"""

from testbed.tools.faults import MALFORMED_PAYLOAD, EffectKeys, FaultInjector, FaultMode, FaultPlan
from testbed.tools.host import Testbed, TestbedClient, TestbedProcess, parse_fault_plans, start_testbed
from testbed.tools.ledger import (
    NOT_REPEATABLE,
    DeliveryRecord,
    EffectCount,
    EnvironmentRecord,
    Ledger,
    LedgerSnapshot,
    NotificationRecord,
)
from testbed.tools.services import SERVICES, TOOL_SERVICES, TestbedTools

__all__ = [
    "MALFORMED_PAYLOAD",
    "NOT_REPEATABLE",
    "SERVICES",
    "TOOL_SERVICES",
    "DeliveryRecord",
    "EffectCount",
    "EffectKeys",
    "EnvironmentRecord",
    "FaultInjector",
    "FaultMode",
    "FaultPlan",
    "Ledger",
    "LedgerSnapshot",
    "NotificationRecord",
    "Testbed",
    "TestbedClient",
    "TestbedProcess",
    "TestbedTools",
    "parse_fault_plans",
    "start_testbed",
]
