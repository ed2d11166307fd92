"""Reaching a trajectory: resolve it to a live incarnation of its actor, waking it when it is gone.

A trajectory's actor ``traj:<id>`` may be alive; exiting to hibernate (it refuses calls for a moment); not
yet placed on a node (no room); gone while its name is still registered (Ray keeps a dead named actor's
name for as long as any owner holds a handle to it: the ``tether run`` driver used to, so relays kept
calling the dead actor and no parked trajectory was ever woken, issue 16); gone altogether (hibernated,
crashed for good, or its owner died); or finished for good (terminal). ``Incarnations.call`` handles every
case the same way for the relays (``deliver``) and the timer service (``fire_timer``):

- a live actor is called;
- a dead one is killed by handle (which frees its name whoever pins it) and replaced;
- a missing one is re-created from its stored launch (``actors.launch``), unless it never existed
  (``UNKNOWN``) or its status shows it ended (``TERMINAL``): an ended trajectory costs no process, except
  for what applies in any state (an operator's settle or handoff of what it still owes: ``wake_ended``);
- waking is admission-controlled: the re-created actor asks Ray for a ``tether_trajectory`` slot and waits
  for one (the autoscaler sees that demand); where the cluster declares no such slots, a ``WakeGate``
  admits at most a memory-derived number of woken trajectories per process, first come first served.

The Ray calls go through ``ActorRuntime`` (``actors.incarnation_ray.RayActors`` in production), so the rules
are unit-tested with an in-memory stand-in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from runtime.clock import Clock, SystemClock
from runtime.errors import DependencyError
from runtime.states import TERMINAL_STATES

__all__ = [
    "NAMESPACE",
    "TRAJECTORIES_PER_CORE",
    "TRAJECTORY_ACTOR_BYTES",
    "TRAJECTORY_RESOURCE",
    "ActorBusy",
    "ActorGone",
    "ActorRuntime",
    "Incarnations",
    "Reach",
    "Reached",
    "TargetGone",
    "TrajectoryInfo",
    "WakeGate",
    "default_trajectory_slots",
    "memory_available_bytes",
    "usable_cores",
]

NAMESPACE = "tether"
TRAJECTORY_RESOURCE = "tether_trajectory"
# What one more live trajectory actor costs a node's memory, the unit its default number of trajectory slots
# is derived from. Measured: MemAvailable fell by ~69 MB per running trajectory, 296 of them held on a 24 GB
# node (``benchmarks/node_capacity.py --only max_live``; 111 MB RSS each, of which ~45 MB are pages shared
# between processes). 100 MB leaves room for a long trajectory's record and context to grow. (It was 155 MB
# while every trajectory process loaded the provider SDK.)
TRAJECTORY_ACTOR_BYTES = 100 * 2**20
# Live trajectory actors per CPU core. Every Ray worker process, a bare one as much as a trajectory, costs
# ~0.9 % of a core while it does nothing (``node_capacity --only idle``), so on 2 cores ~230 of them take
# all the CPU before memory runs out (the max_live probe: starting 8 more took 4 s on an empty node and
# 78 s at 280). 64 a core keeps that idle cost near half the cores. Swept (``node_capacity --only on_time``,
# a turn every 20 s): at 128 live every turn started within 1 s of its sleep's end (p99), at 160 not.
TRAJECTORIES_PER_CORE = 64
SLOTS_ENV = "TETHER_TRAJECTORY_SLOTS"
_log = logging.getLogger(__name__)


class ActorGone(Exception):
    """The actor is dead for good (exited, killed, or its owner died): replace it."""


class ActorBusy(Exception):
    """The actor refused the call for now (exiting to hibernate, restarting): call again shortly."""


class TargetGone(DependencyError):
    """The trajectory could not be reached this time (not placed yet, or unanswering); try again later."""


class ActorRuntime(Protocol):
    """The actor operations ``Incarnations`` needs (``RayActors`` over Ray; a fake in unit tests)."""

    async def lookup(self, trajectory_id: str) -> Any | None:
        """The handle registered under the trajectory's actor name, alive or not; None when free."""
        ...

    async def create(self, launch: Any) -> Any:
        """Create the actor from its launch (or get the one that now holds the name)."""
        ...

    async def kill(self, handle: Any) -> None:
        """Kill this incarnation for good (frees its name); no error if it is gone already."""
        ...

    async def call(self, handle: Any, method: str, *args: Any) -> Any:
        """Call ``method`` (an actor not placed yet takes it once placed); ``ActorGone`` / ``ActorBusy`` as
        above."""
        ...

    async def run(self, handle: Any) -> None:
        """Run the trajectory on (``run()``) until it ends or hibernates again."""
        ...


@dataclass(frozen=True, slots=True)
class TrajectoryInfo:
    """What waking needs: the stored launch and the last state the status snapshot showed ("" if none)."""

    launch: Any
    state: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in {s.value for s in TERMINAL_STATES}


InfoLoader = Callable[[str], Awaitable[TrajectoryInfo | None]]


class Reach(StrEnum):
    """How a call to a trajectory ended."""

    CALLED = "called"  # a live incarnation answered (``Reached.value``)
    UNKNOWN = "unknown"  # never launched: no launch record
    TERMINAL = "terminal"  # ended for good; not woken
    NOT_LIVE = "not_live"  # no live incarnation, and the caller asked not to wake one


@dataclass(frozen=True, slots=True)
class Reached:
    reach: Reach
    value: Any = None
    woke: bool = False


class WakeGate:
    """At most ``capacity`` trajectories woken (and still running) at once; the rest wait in arrival order.

    ``capacity=None`` admits everyone: the cluster's own ``tether_trajectory`` slots do the admission.
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"wake capacity must be >= 1 (or None), got {capacity}")
        self.capacity = capacity
        self.in_use = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> None:
        if self.capacity is None or (self.in_use < self.capacity and not self.waiting):
            self.in_use += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # release() hands its slot straight to us
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # we were handed a slot just as we were cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the next in line; in_use is unchanged
                return
        self.in_use = max(0, self.in_use - 1)


class Incarnations:
    """Calls a trajectory's actor, waking or replacing it as needed (see the module docstring)."""

    def __init__(
        self,
        runtime: ActorRuntime,
        load: InfoLoader,
        *,
        gate: WakeGate | None = None,
        clock: Clock | None = None,
        call_timeout_s: float = 30.0,
        wake_wait_s: float = 600.0,
        busy_wait_s: float = 10.0,
        retry_every_s: float = 0.05,
        max_replacements: int = 3,
    ) -> None:
        self.runtime = runtime
        self.load = load
        self.gate = gate or WakeGate(None)
        self.clock = clock or SystemClock()
        self.call_timeout_s = call_timeout_s
        self.wake_wait_s = wake_wait_s
        self.busy_wait_s = busy_wait_s
        self.retry_every_s = retry_every_s
        self.max_replacements = max_replacements
        self.woken = 0  # incarnations this process created
        self.replaced = 0  # dead incarnations it killed to free their name
        self.running: dict[str, asyncio.Task[None]] = {}  # woken here, run() not over yet (holds the handle)
        self._unplaced: set[str] = set()  # last call timed out: wait for placement before calling again

    async def call(
        self, trajectory_id: str, method: str, *args: Any, wake: bool = True, wake_ended: bool = False
    ) -> Reached:
        """Call ``method(*args)`` on a live incarnation of the trajectory, waking one if ``wake``. An ended
        trajectory is woken only with ``wake_ended`` (an operator's settle or handoff, which applies in any
        state: ``runtime.record.ANY_STATE_ACTIONS``); otherwise it answers ``TERMINAL``.

        Raises ``TargetGone`` when it could not be reached this time (the caller retries later).
        """
        busy_until = self.clock.now() + self.busy_wait_s
        replacements = 0
        while True:
            handle = await self.runtime.lookup(trajectory_id)
            woke = False
            if handle is None:
                if not wake:
                    return Reached(Reach.NOT_LIVE)
                info = await self.load(trajectory_id)
                if info is None:
                    return Reached(Reach.UNKNOWN)
                if info.terminal and not wake_ended:
                    return Reached(Reach.TERMINAL)
                handle = await self._wake(info)
                woke = True
            # A woken (or not yet placed) actor takes the call once Ray has placed it in a free trajectory
            # slot: the call waits in its queue meanwhile, so it is the first thing the actor does.
            placing = woke or trajectory_id in self._unplaced
            timeout = self.call_timeout_s + (self.wake_wait_s if placing else 0.0)
            try:
                value = await asyncio.wait_for(self.runtime.call(handle, method, *args), timeout)
            except ActorGone:
                if woke:
                    self.gate.release()
                # Dead for good, yet its name may still be registered (someone pins it with a handle):
                # killing it by handle frees the name, so the next lookup misses and we wake a new one.
                await self.runtime.kill(handle)
                self.replaced += 1
                replacements += 1
                if replacements > self.max_replacements:
                    raise TargetGone(
                        f"traj:{trajectory_id} died {replacements} times in a row", scope="trajectory"
                    ) from None
                if not wake:
                    return Reached(Reach.NOT_LIVE)
                continue
            except ActorBusy as e:
                if woke:
                    self.gate.release()
                if self.clock.now() >= busy_until:
                    raise TargetGone(f"traj:{trajectory_id} kept refusing: {e}", scope="trajectory") from e
                await self.clock.sleep(self.retry_every_s)
                continue
            except TimeoutError as e:
                self._unplaced.add(trajectory_id)  # next time, give it the placement wait first
                if woke:
                    self._hold(trajectory_id, handle)  # keep its place in the queue for a slot
                what = (
                    "was not placed (no free trajectory slot) or did not answer"
                    if placing
                    else "did not answer"
                )
                raise TargetGone(
                    f"traj:{trajectory_id} {what} {method} within {timeout:.0f}s", scope="trajectory"
                ) from e
            self._unplaced.discard(trajectory_id)
            if woke:
                self._hold(trajectory_id, handle)
            return Reached(Reach.CALLED, value, woke=woke)

    async def _wake(self, info: TrajectoryInfo) -> Any:
        """Create the actor from its launch once the gate admits it (the gate slot is released when the
        woken incarnation stops running, or at once if the call to it fails)."""
        await self.gate.acquire()
        try:
            handle = await self.runtime.create(info.launch)
        except BaseException:
            self.gate.release()
            raise
        self.woken += 1
        return handle

    def _hold(self, trajectory_id: str, handle: Any) -> None:
        """Run the woken incarnation on, holding its handle while ``run()`` lasts (an actor nobody holds a
        handle to is collected) and letting go when it ends or hibernates again, so a dead incarnation is
        never pinned from here."""
        self.running[trajectory_id] = asyncio.ensure_future(self._keep_running(trajectory_id, handle))

    async def _keep_running(self, trajectory_id: str, handle: Any) -> None:
        try:
            await self.runtime.run(handle)
        except Exception as e:  # it died or hibernated; whoever calls next wakes it again
            _log.debug("woken traj:%s stopped running: %r", trajectory_id, e)
        finally:
            self.gate.release()
            if self.running.get(trajectory_id) is asyncio.current_task():
                del self.running[trajectory_id]

    async def close(self) -> None:
        """Stop holding woken actors (they are collected once nobody else holds them)."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.running.clear()


# --------------------------------------------------------------------------- sizing


def memory_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_trajectory_slots(
    available_bytes: int | None = None,
    *,
    env: dict[str, str] | None = None,
    reserve_fraction: float = 0.2,
    cores: int | None = None,
) -> int:
    """How many trajectory actors a node has room for: ``$TETHER_TRAJECTORY_SLOTS`` when set, else the fewer
    of its available memory less a reserve (Ray's own processes, Redis, the driver) at
    ``TRAJECTORY_ACTOR_BYTES`` each and ``TRAJECTORIES_PER_CORE`` per core it may run on; at least one."""
    env = dict(os.environ) if env is None else env
    raw = env.get(SLOTS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{SLOTS_ENV} must be a positive integer, got {raw!r}")
        return value
    cores = usable_cores() if cores is None else cores
    by_cpu = max(1, cores) * TRAJECTORIES_PER_CORE
    available = memory_available_bytes() if available_bytes is None else available_bytes
    if available is None:
        return min(8, by_cpu)  # no /proc: a small, safe default
    usable = available * (1.0 - reserve_fraction)
    return max(1, min(by_cpu, int(usable // TRAJECTORY_ACTOR_BYTES)))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity), or the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
