"""Simulated OpenAI-compatible model provider with real rate limits and scripted behaviours.

Start it with ``python -m testbed.provider --port PORT --tpm N --rpm N``, in-process with
:class:`ProviderServer`, or for tests/benchmarks with :func:`start_provider_subprocess` /
:func:`start_provider_thread`. Scenario grammar: :mod:`testbed.provider.scenarios`; stats JSON:
:mod:`testbed.provider.stats`; rate-limit rules: :mod:`testbed.provider.limits` (modes
:mod:`~testbed.provider.sliding_window` and :mod:`~testbed.provider.token_bucket`); tokenizer:
:mod:`testbed.provider.tokenizer`.
"""

from testbed.provider.config import ConfigPatch, Fault, ProviderConfig
from testbed.provider.launch import (
    ProviderHandle,
    ProviderProcess,
    ProviderThread,
    start_provider_subprocess,
    start_provider_thread,
)
from testbed.provider.limits import LimiterMode
from testbed.provider.scenarios import ScenarioError, ScenarioKind, parse_scenario
from testbed.provider.server import SCENARIO_HEADER, TRAJECTORY_HEADER, ProviderServer

__all__ = [
    "SCENARIO_HEADER",
    "TRAJECTORY_HEADER",
    "ConfigPatch",
    "Fault",
    "LimiterMode",
    "ProviderConfig",
    "ProviderHandle",
    "ProviderProcess",
    "ProviderServer",
    "ProviderThread",
    "ScenarioError",
    "ScenarioKind",
    "parse_scenario",
    "start_provider_subprocess",
    "start_provider_thread",
]
