"""Driver-side metrics: the ``tether run`` driver's own Prometheus endpoint, and what it exports from outside
the actors.

Inside the actors, trajectories, guards and the scheduler record through ``RayBackend`` (Ray's metrics agent
serves them, names prefixed ``ray_``). The driver is a plain process that serves its own ``/metrics``
(``PrometheusBackend``) with what only a view of the whole run can know:

* ``tether_trajectories{state}``: every trajectory of the run by state, read from the status snapshots the
  actors keep in Redis (``tether:status:<id>``, field ``state``); a trajectory with no snapshot yet counts
  as ``STARTING``. Hibernated trajectories keep their state (AWAITING_APPROVAL, PAUSED), so they are counted
  although no process holds them.
* ``tether_duplicate_effects{tool}``: effects the testbed's independent ledger applied more than once
  (§12.5: zero by construction; only the system holding the effect can see a duplicate).
* issue 12, from the cluster's escalation registry, incident store and quarantine
  (``cluster.supervision_store``): ``tether_escalations_open{trigger}`` (nobody has custody yet),
  ``tether_escalations_overdue{trigger}`` (open past their SLA: the alert ``TetherEscalationSlaMissed``
  pages on it), ``tether_escalation_sla_missed_total{trigger}`` (each escalation counted once, when it
  missed), ``tether_incidents{status}`` and ``tether_quarantined_artifacts``.

``start_driver_metrics(port, ...)`` starts both; ``DriverMetrics.close()`` stops them after a last poll, so a
scrape after the run sees the final counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import redis.asyncio as aioredis

from actors.status import STATUS_KEY_PREFIX
from cluster.metrics import Metrics, PrometheusBackend
from runtime.states import TrajectoryState

__all__ = [
    "STARTING",
    "DriverMetrics",
    "DuplicateTally",
    "RunObserver",
    "SlaTally",
    "start_driver_metrics",
    "state_counts",
    "supervision_counts",
]

STARTING = "STARTING"
"""The state shown for a trajectory whose actor has not written its first snapshot yet."""

_log = logging.getLogger(__name__)


def state_counts(states: Iterable[str | None]) -> dict[str, int]:
    """Trajectories per state, every state present (zero included) so an emptied state drops to 0."""
    counts = {STARTING: 0, **{s.value: 0 for s in TrajectoryState}}
    for state in states:
        key = state or STARTING
        counts[key] = counts.get(key, 0) + 1
    return counts


class _Effect(Protocol):
    @property
    def tool(self) -> str: ...

    @property
    def effect_key(self) -> str: ...

    @property
    def applications(self) -> int: ...


@dataclass
class DuplicateTally:
    """Turns ledger snapshots into counter increments: each effect key's applications beyond the first,
    counted once however often the ledger is read."""

    counted: dict[tuple[str, str], int] = field(default_factory=dict)

    def update(self, effects: Iterable[_Effect]) -> dict[str, int]:
        """New duplicate applications per tool since the last update."""
        new: dict[str, int] = {}
        for e in effects:
            key = (e.tool, e.effect_key)
            duplicates = max(0, e.applications - 1)
            delta = duplicates - self.counted.get(key, 0)
            if delta > 0:
                self.counted[key] = duplicates
                new[e.tool] = new.get(e.tool, 0) + delta
        return new


def supervision_counts(escalations: Iterable[Mapping[str, Any]], now: float) -> dict[str, dict[str, int]]:
    """Open and overdue escalations per trigger (every trigger present, zero included)."""
    from runtime.escalation import EscalationTrigger

    open_ = dict.fromkeys((t.value for t in EscalationTrigger), 0)
    overdue = dict(open_)
    for e in escalations:
        trigger = str(e.get("trigger"))
        if e.get("status") == "open":
            open_[trigger] = open_.get(trigger, 0) + 1
            if now > float(e.get("due_at") or 0.0):
                overdue[trigger] = overdue.get(trigger, 0) + 1
    return {"open": open_, "overdue": overdue}


@dataclass
class SlaTally:
    """Counts each escalation's SLA miss once, however often the registry is read."""

    missed: set[str] = field(default_factory=set)

    def update(self, escalations: Iterable[Mapping[str, Any]], now: float) -> list[str]:
        """Triggers of escalations that missed their SLA since the last update (one entry per miss)."""
        new = []
        for e in escalations:
            eid = str(e.get("escalation_id"))
            if eid in self.missed:
                continue
            due = float(e.get("due_at") or 0.0)
            acked = e.get("acknowledged_at")
            late = (acked is not None and float(acked) > due) or (e.get("status") == "open" and now > due)
            if late:
                self.missed.add(eid)
                new.append(str(e.get("trigger")))
        return new


class RunObserver:
    """Polls the run's status snapshots (and the testbed ledger, if given) into ``metrics`` on a thread.

    Which trajectories belong to the run: ``trajectory_ids`` when known, else every key matching ``match``
    (``tether:status:<run_id>.*`` selects one run; the default selects every trajectory in this Redis).
    """

    def __init__(
        self,
        metrics: Metrics,
        redis_url: str,
        *,
        trajectory_ids: Sequence[str] | None = None,
        match: str = STATUS_KEY_PREFIX + "*",
        testbed_address: str | None = None,
        interval_s: float = 1.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.metrics = metrics
        self.redis_url = redis_url
        self.trajectory_ids = list(trajectory_ids) if trajectory_ids is not None else None
        self.match = match
        self.testbed_address = testbed_address
        self.interval_s = interval_s
        self.polls = 0
        self._tally = DuplicateTally()
        self._sla = SlaTally()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()

    def start(self) -> RunObserver:
        if self._thread is not None:
            raise RuntimeError("this observer is already running")
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="tether-observer")
        self._thread.daemon = True  # never keeps a crashed driver alive; close() joins it normally
        self._thread.start()
        self._started.wait(10.0)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop polling after one last poll (so the final states are exported)."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        self._thread = None

    async def poll_once(self, client: aioredis.Redis, testbed: Any = None) -> dict[str, int]:
        """Read every snapshot once and set the gauge; returns the counts."""
        if self.trajectory_ids is not None:
            keys = [STATUS_KEY_PREFIX + tid for tid in self.trajectory_ids]
        else:
            keys = [k async for k in client.scan_iter(match=self.match, count=500)]
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "state")
        raw = await pipe.execute() if keys else []
        counts = state_counts(v.decode() if isinstance(v, bytes) else v for v in raw)
        for state, count in counts.items():
            self.metrics.trajectories_in_state(state, count)
        if testbed is not None:
            snapshot = await testbed.ledger()
            for tool, n in self._tally.update(snapshot.effects).items():
                for _ in range(n):
                    self.metrics.duplicate_effect(tool)
        await self._supervision(client)
        self.polls += 1
        return counts

    async def _supervision(self, client: aioredis.Redis) -> None:
        """Escalations (open, overdue, SLA misses), incidents and the quarantine (issue 12)."""
        from cluster.supervision_store import RedisSupervisionStore

        store = RedisSupervisionStore(client)
        escalations = await store.escalations()
        now = time.time()
        counts = supervision_counts(escalations, now)
        for trigger, n in counts["open"].items():
            self.metrics.escalations_open(trigger, n)
        for trigger, n in counts["overdue"].items():
            self.metrics.escalations_overdue(trigger, n)
        for trigger in self._sla.update(escalations, now):
            self.metrics.escalation_sla_missed(trigger)
        by_status = {"open": 0, "released": 0, "closed": 0}
        for doc in await store.incidents():
            status = str(doc.get("status", "open"))
            by_status[status] = by_status.get(status, 0) + 1
        for status, n in by_status.items():
            self.metrics.incidents(status, n)
        self.metrics.quarantined_artifacts(await store.quarantine_size())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set()
        client = aioredis.Redis.from_url(self.redis_url, socket_timeout=10.0)
        testbed = None
        if self.testbed_address is not None:
            from testbed.tools.host import TestbedClient

            testbed = TestbedClient(self.testbed_address)
        try:
            while True:
                stopping = self._stop.is_set()
                try:
                    await self.poll_once(client, testbed)
                except Exception as e:  # a view: a failed poll is logged and retried next interval
                    _log.warning("metrics poll failed: %r", e)
                if stopping:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
        finally:
            await client.aclose()
            if testbed is not None:
                await testbed.close()


class DriverMetrics:
    """The driver's endpoint and its observer; a context manager (``close()`` stops both)."""

    def __init__(self, backend: PrometheusBackend, port: int, observer: RunObserver | None) -> None:
        self.backend = backend
        self.metrics = Metrics(backend)
        self.port = port
        self.observer = observer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def close(self) -> None:
        if self.observer is not None:
            self.observer.stop()
        self.backend.close()

    def __enter__(self) -> DriverMetrics:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def start_driver_metrics(
    port: int = 0,
    *,
    addr: str = "127.0.0.1",
    redis_url: str | None = None,
    trajectory_ids: Sequence[str] | None = None,
    match: str = STATUS_KEY_PREFIX + "*",
    testbed_address: str | None = None,
    interval_s: float = 1.0,
) -> DriverMetrics:
    """Serve the driver's ``/metrics`` on ``addr:port`` (0: a free port, see ``.port``); with ``redis_url``,
    also export the run's trajectories by state (and duplicate effects, with ``testbed_address``)."""
    backend = PrometheusBackend()
    bound = backend.serve(port, addr=addr)
    observer = None
    try:
        if redis_url is not None:
            observer = RunObserver(
                Metrics(backend),
                redis_url,
                trajectory_ids=trajectory_ids,
                match=match,
                testbed_address=testbed_address,
                interval_s=interval_s,
            ).start()
    except BaseException:
        backend.close()
        raise
    return DriverMetrics(backend, bound, observer)
