"""What a run's report says about the world, read from outside the runtime (issue 11).

- ``ledger``: the testbed services' own count of what the run did to them, never the runtime's account:
  environments allocated, released, still allocated (orphaned), effect keys applied more than once
  (duplicate effects), and every physical delivery the services received (plus those that asked again for
  an effect already applied, still in flight or unknown: duplicate deliveries).
- ``handoff``: the handoff packet of every trajectory that did not complete cleanly, read from its log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from actors.status import status_key
from cluster.log_store import RedisLogStore
from runtime.codec import decode
from runtime.events import HandoffWritten
from runtime.snapshot import decode_snapshot, is_snapshot

__all__ = ["handoff_packets", "ledger_summary", "read_handoffs", "read_ledger"]

_log = logging.getLogger(__name__)


def ledger_summary(snapshot: Any) -> dict[str, Any]:
    """The report's ``ledger`` object from a ``testbed.tools.ledger.LedgerSnapshot``."""
    envs = list(snapshot.environments)
    deliveries = list(snapshot.deliveries)
    return {
        "environments_allocated": len(envs),
        "environments_released": sum(1 for e in envs if not e.allocated),
        "orphaned": len(snapshot.orphaned_environments()),
        "orphaned_ids": sorted(e.env_id for e in snapshot.orphaned_environments()),
        "duplicate_effects": len(snapshot.duplicate_effects()),
        "deliveries": len(deliveries),
        "duplicate_deliveries": len(snapshot.duplicate_deliveries()),
        "effect_keys": snapshot.effect_keys,
        "billed_seconds": round(float(snapshot.billed_seconds), 3),
    }


def read_ledger(address: str | None) -> dict[str, Any] | None:
    """The ledger summary of the testbed at ``address`` (None without one, or if it cannot be read: the
    report is a view, and says so in the log rather than failing the run)."""
    if address is None:
        return None
    from testbed.tools.host import TestbedClient

    async def read() -> Any:
        client = TestbedClient(address)
        try:
            return await client.ledger()
        finally:
            await client.close()

    try:
        return ledger_summary(asyncio.run(read()))
    except Exception as e:
        _log.warning("testbed ledger not read from %s: %s", address, e)
        return None


async def handoff_packets(
    redis_url: str, trajectory_ids: Sequence[str], *, flagged_only: bool = False
) -> dict[str, dict[str, Any]]:
    """Trajectory id -> its last handoff packet, read from its log. ``flagged_only``: read only the logs of
    trajectories whose status says they wrote one (a large run's report reads a few logs, not all)."""
    store = RedisLogStore.from_url(redis_url)
    flags = aioredis.Redis.from_url(redis_url, socket_timeout=10.0)
    out: dict[str, dict[str, Any]] = {}
    try:
        for tid in trajectory_ids:
            if flagged_only and (await flags.hget(status_key(tid), "handoff")) not in (b"1", "1"):
                continue
            packet = None
            for _, payload in await store.read(tid):
                if is_snapshot(payload):  # a compacted log: the record keeps the last packet
                    handoff = decode_snapshot(payload).handoff
                    packet = dict(handoff) if handoff is not None else None
                    continue
                event = decode(payload)
                if isinstance(event, HandoffWritten):
                    packet = dict(event.packet)
            if packet is not None:
                out[tid] = packet
    finally:
        await store.close()
        await flags.aclose()
    return out


def read_handoffs(redis_url: str, trajectory_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Trajectory id -> its (last) handoff packet, for the trajectories that wrote one."""
    if not trajectory_ids or not redis_url:
        return {}
    try:
        return asyncio.run(handoff_packets(redis_url, trajectory_ids, flagged_only=True))
    except Exception as e:
        _log.warning("handoff packets not read from %s: %s", redis_url, e)
        return {}
