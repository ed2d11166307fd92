"""Child trajectories on Ray (issue 12, reliability guide §11): the interpreter's ``ChildrenPort``.

A child is a trajectory like any other, with its own actor (``traj:<child id>``), its own durable log and
its own launch record, derived from its parent's launch under the delegation contract: the contract's goal,
its allocation as the child's budget ceilings, its deadline (within the parent's), the template's grants
and model behaviour, one level deeper. The launch is saved before the actor starts and reused if it
exists, so a restarted parent that attaches again (``SpawnChild`` after ``Recovered``) finds the same
child, running or ended, and never starts a second one.

``run_child`` waits for the child's actor to end, then reads the child's log itself and folds it: the
evidence the parent's check judges is the runtime's record of what the child did, not what the child's
model says about it (§11.3). ``cancel_child`` cascades cancel or kill to the child's actor (which cascades
on to its own children); the child runs its own FINALIZING, so its cleanup is done by its own rules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from actors.launch import CheckLaunch, TrajectoryLaunch, load_launch, save_launch
from actors.ports import ClusterPorts
from runtime.delegation import ChildEvidence, DelegationContract, evidence_of
from runtime.ports import LogStore
from runtime.snapshot import fold_entries

__all__ = ["RayChildren", "child_launch"]

_log = logging.getLogger(__name__)


def child_launch(parent: TrajectoryLaunch, contract: DelegationContract, now: float) -> TrajectoryLaunch:
    """The launch of a child: its parent's cluster wiring, the contract's task, budget and deadline."""
    ceilings = {dim: float(amount) for dim, amount in contract.allocation.items()}
    span = max(1.0, contract.deadline - now)
    ceilings.setdefault("wall_seconds", span)
    spec = parent.supervision
    completion = CheckLaunch()
    if spec is not None and spec.delegation is not None:
        own = spec.delegation.completion_check
        completion = CheckLaunch(name=own.name, params=dict(own.params))
    return parent.model_copy(
        update={
            "trajectory_id": contract.child_id,
            "parent_id": contract.parent_id,
            "depth": contract.depth,
            "goal": contract.goal,
            "ceilings": ceilings,
            "grants": tuple(contract.grants),
            "approval_required": (),
            "created_at": now,
            "deadline_s": span,
            "completion_check": completion,
            "metadata": {**parent.metadata, **contract.metadata},
            "hibernate_after_s": None,  # a child works to its end: its parent waits for it
        }
    )


class RayChildren:
    """``actors.interpreter.ChildrenPort`` over Ray actors and the cluster's log store."""

    def __init__(self, parent: TrajectoryLaunch, adapters: ClusterPorts, log: LogStore) -> None:
        self.parent = parent
        self.adapters = adapters
        self.log = log

    async def _launch(self, contract: DelegationContract) -> TrajectoryLaunch:
        url = self.parent.redis_url
        existing = await asyncio.to_thread(load_launch, url, contract.child_id)
        if existing is not None:
            return existing
        launch = child_launch(self.parent, contract, time.time())
        await asyncio.to_thread(save_launch, url, launch)
        return launch

    async def run_child(self, contract: DelegationContract) -> ChildEvidence:
        """Start (or find) the child, wait for it to end, and read its evidence from its own log."""
        import ray.exceptions

        from actors.trajectory import ensure_actor

        launch = await self._launch(contract)
        failures = 0
        while True:
            handle = ensure_actor(launch, self.adapters)
            try:
                summary: dict[str, Any] = await handle.run.remote()
            except ray.exceptions.RayActorError as e:
                failures += 1  # died, or exited to hibernate: re-created from its launch, it folds its log
                if failures > 20:
                    raise RuntimeError(f"child {contract.child_id} keeps dying: {e}") from e
                await asyncio.sleep(min(0.1 * failures, 2.0))
                continue
            if not summary.get("hibernated"):
                break
            await asyncio.sleep(0.5)
        return await self.evidence(launch)

    async def evidence(self, launch: TrajectoryLaunch) -> ChildEvidence:
        from actors.wiring import build_policy, build_registry

        entries = await self.log.read(launch.trajectory_id)
        record = fold_entries(entries, build_policy(launch, build_registry(launch)))
        return evidence_of(record)

    async def cancel_child(self, child_id: str, kill: bool, reason: str) -> None:
        """Cascade cancel or kill to the child's actor (re-created from its launch if it is gone)."""
        import ray

        from actors.trajectory import NAMESPACE, actor_name, ensure_actor

        try:
            handle = ray.get_actor(actor_name(child_id), namespace=NAMESPACE)
        except ValueError:
            launch = await asyncio.to_thread(load_launch, self.parent.redis_url, child_id)
            if launch is None:
                _log.warning("cannot cascade to %s: it was never launched", child_id)
                return
            handle = ensure_actor(launch, self.adapters)
        answer = await handle.cascade.remote(kill, self.parent.trajectory_id, reason)
        if not str(answer).startswith(("recorded", "duplicate", "rejected:TRAJECTORY_TERMINAL")):
            _log.warning("cascade to %s answered %s", child_id, answer)
