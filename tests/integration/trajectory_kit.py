"""Helpers shared by the trajectory-actor integration and fault tests (not a test module)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis

from actors.launch import CheckLaunch, ProviderLaunch, TrajectoryLaunch, save_launch
from actors.status import status_key
from actors.trajectory import ensure_actor
from cluster.adapters import ClusterAdapters
from cluster.log_store import RedisLogStore
from runtime.events import Event
from runtime.record import TrajectoryRecord
from runtime.snapshot import events_after_snapshot, fold_entries

MODEL = "tether-sim"
CEILINGS = {"turns": 12, "tokens": 60_000, "wall_seconds": 300, "dollars": 1.0}


def make_launch(
    trajectory_id: str,
    *,
    base_url: str,
    redis_url: str,
    scenario: str,
    grants: Iterable[str],
    check: str = "always",
    check_params: dict[str, Any] | None = None,
    tool_routes: dict[str, str] | None = None,
    local_tools: Iterable[str] = (),
    **overrides: Any,
) -> TrajectoryLaunch:
    """A launch against the simulated provider; unknown keywords override TrajectoryLaunch fields."""
    fields: dict[str, Any] = {
        "trajectory_id": trajectory_id,
        "goal": "Do the task.",
        "ceilings": dict(CEILINGS),
        "grants": tuple(grants),
        "created_at": time.time(),
        "completion_check": CheckLaunch(name=check, params=check_params or {}),  # type: ignore[arg-type]
        "metadata": {"scenario": scenario},
        "provider": ProviderLaunch(base_url=base_url, model=MODEL),
        "redis_url": redis_url,
        "tool_routes": tool_routes or {},
        "local_tools": tuple(local_tools),
        "guard": "local",
        "use_scheduler": False,
    }
    fields.update(overrides)
    launch = TrajectoryLaunch(**fields)
    save_launch(redis_url, launch)
    return launch


def start(launch: TrajectoryLaunch) -> Any:
    """Create (or find) the actor of ``launch``."""
    return ensure_actor(launch, ClusterAdapters())


async def events_of(redis_url: str, trajectory_id: str) -> list[Event]:
    """The trajectory's durable log, decoded (the judge of what the harness did): its events after the newest
    record snapshot (all of them unless it hibernated and compacted its log)."""
    async with RedisLogStore.from_url(redis_url) as store:
        return events_after_snapshot(await store.read(trajectory_id))


async def record_of(redis_url: str, trajectory_id: str) -> TrajectoryRecord:
    """The record folded from the durable log (what any restarted actor would rebuild)."""
    async with RedisLogStore.from_url(redis_url) as store:
        return fold_entries(await store.read(trajectory_id))


async def wait_for_status(
    redis_url: str, trajectory_id: str, states: set[str], timeout_s: float = 180.0, min_turns: int = 0
) -> dict[str, str]:
    """Poll the status snapshot until its state is one of ``states`` after at least ``min_turns`` turns
    (used to time a fault, not to assert)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            raw = await client.hgetall(status_key(trajectory_id))
            status = {k.decode(): v.decode() for k, v in raw.items()}
            if status.get("state") in states and int(status.get("turns", 0)) >= min_turns:
                return status
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()
    raise AssertionError(f"{trajectory_id} never reached {sorted(states)} within {timeout_s}s")
