"""A workload chooses how its simulated provider meters limits (``provider.limits.mode``)."""

from __future__ import annotations

import pytest

from cluster.workload import WorkloadError, parse_workload
from testbed.provider import LimiterMode, ProviderConfig

DOC = """
provider:
  kind: simulated
  limits: {{tpm: 60000, rpm: 600{mode}}}
trajectories: [{{id: t}}]
"""


def test_the_default_mimics_openai() -> None:
    workload = parse_workload(DOC.format(mode=""))
    assert workload.provider.limits.mode == "sliding_window"
    assert ProviderConfig().limiter is LimiterMode.SLIDING_WINDOW


def test_token_bucket_is_selectable_and_maps_onto_the_provider_config() -> None:
    workload = parse_workload(DOC.format(mode=", mode: token_bucket"))
    assert LimiterMode(workload.provider.limits.mode) is LimiterMode.TOKEN_BUCKET


def test_an_unknown_mode_names_the_field() -> None:
    with pytest.raises(WorkloadError, match=r"provider\.limits\.mode"):
        parse_workload(DOC.format(mode=", mode: leaky"))
