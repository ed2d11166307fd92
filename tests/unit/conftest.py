"""Unit tests are pure: no Ray, no Redis, no sleeping (use runtime.clock.FakeClock)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _forbid_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a runtime dependency
        return

    def _refuse(*_a: object, **_k: object) -> None:
        raise RuntimeError("tests/unit must not start Ray: use an in-process fake")

    monkeypatch.setattr(ray, "init", _refuse)
