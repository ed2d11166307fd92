"""Operator actions a workload asks its run to perform (``trajectories[].operator``).

A demo or a test of the exit paths needs a person who kills or cancels a trajectory at the moment that
matters: after it has provisioned something. ``OperatorActions`` is that person, scripted: for each
trajectory with an ``operator`` step it watches the trajectory's status snapshot until the step's
condition holds, waits ``after_s``, then sends the action as a signed control message through the control
stream, exactly as ``tether kill`` would (same keyring, same relays, same audit). It never touches the
trajectory in any other way.

Conditions (``when``):

- ``started``: the trajectory has a status snapshot (its actor ran its first step);
- ``owing``: the status lists an obligation in state ``bound``: a compensable effect is established and
  its compensation's arguments are known (e.g. an environment was provisioned and its id seen).

A condition that never holds sends nothing (the trajectory ends by itself; the report shows it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import redis.asyncio as aioredis

from actors import aio
from actors.status import status_key
from cluster.control import ControlAction
from cluster.control_client import ControlClient
from cluster.signing import DEFAULT_OPERATOR
from cluster.workload import OperatorStep

__all__ = ["OperatorActions", "PlannedAction", "alongside", "condition_holds"]

_log = logging.getLogger(__name__)
T = TypeVar("T")
_TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELED"})


@dataclass(frozen=True, slots=True)
class PlannedAction:
    trajectory_id: str
    step: OperatorStep


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def condition_holds(step: OperatorStep, status: dict[str, str]) -> bool:
    """Whether ``step``'s condition holds for this status hash (decoded)."""
    if not status:
        return False
    if step.when == "started":
        return True
    try:
        rows = json.loads(status.get("owed") or "[]")
    except ValueError:
        return False
    return any(
        isinstance(r, dict) and r.get("kind") != "operation" and r.get("state") == "bound" for r in rows
    )


class OperatorActions:
    """Sends each planned action once its condition holds; ``sent`` records what was sent (trajectory ->
    action), for the report."""

    def __init__(
        self,
        planned: Sequence[PlannedAction],
        redis_url: str,
        keyring: str | None,
        *,
        poll_s: float = 0.1,
    ) -> None:
        self.planned = list(planned)
        self.redis_url = redis_url
        self.keyring = Path(keyring) if keyring else None
        self.poll_s = poll_s
        self.sent: dict[str, str] = {}

    async def run(self) -> None:
        if not self.planned:
            return
        client = ControlClient.from_url(self.redis_url, keyring=self.keyring)
        reader = aioredis.Redis.from_url(self.redis_url, socket_timeout=10.0)
        try:
            await asyncio.gather(*(self._one(p, client, reader) for p in self.planned))
        finally:
            await client.close()
            await reader.aclose()

    async def _one(self, p: PlannedAction, client: ControlClient, reader: aioredis.Redis) -> None:
        while True:
            raw = await reader.hgetall(status_key(p.trajectory_id))
            status = {_text(k): _text(v) for k, v in raw.items()}
            if status.get("state") in _TERMINAL:
                return  # ended before the moment came: nothing to do
            if condition_holds(p.step, status):
                break
            await asyncio.sleep(self.poll_s)
        if p.step.after_s > 0:
            await asyncio.sleep(p.step.after_s)
        reason = f"scripted by the workload: {p.step.action} when {p.step.when}"
        await client.send(
            p.trajectory_id, ControlAction(p.step.action), issuer=DEFAULT_OPERATOR, reason=reason
        )
        self.sent[p.trajectory_id] = p.step.action
        _log.info("operator step: %s %s", p.step.action, p.trajectory_id)


async def alongside(main: Awaitable[T], actions: OperatorActions) -> T:
    """Await ``main`` while ``actions`` run; an action failing is logged, never fails the run."""
    side = asyncio.ensure_future(actions.run())
    try:
        return await main
    finally:
        if not side.done():
            await aio.stop(side, what="the operator steps", again_s=aio.ASK_AGAIN_S)
        if side.done() and not side.cancelled() and side.exception() is not None:
            _log.error("operator steps failed: %s", side.exception())
