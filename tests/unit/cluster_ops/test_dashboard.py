"""The Grafana dashboard is valid JSON and charts every metric Tether exports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.metrics import METRICS, Kind

DASHBOARD = Path(__file__).resolve().parents[3] / "cluster" / "grafana" / "tether.json"


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_is_charted_under_its_exported_name(dashboard: dict[str, Any], name: str) -> None:
    spec = METRICS[name]
    exported = {
        Kind.COUNTER: f"{name}_total",
        Kind.GAUGE: name,
        Kind.HISTOGRAM: f"{name}_bucket",
    }[spec.kind]

    # Queries match both the driver's tether_* series and Ray's ray_tether_* export.
    assert any(f'"(ray_)?{exported}"' in expr for expr in _exprs(dashboard)), exported


def test_panels_have_unique_ids_and_a_prometheus_datasource(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]

    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["type"] == "prometheus" for p in dashboard["panels"] if p["type"] != "row")
    assert {"Scheduler: shared provider limits", "Breakers: tool dependencies"} <= {
        p["title"] for p in dashboard["panels"] if p["type"] == "row"
    }
