"""Weighted deficit round-robin across priority classes ("Scheduling Concurrent Trajectories", fig. 7).

Each round, a class with waiting work earns ``D_i += w_i * Q_base``; it may dispatch its head turn
when ``D_i >= cost`` (cost = the turn's estimated tokens) and pays ``D_i -= cost``. A class whose
queue empties is reset to ``D_i = 0``: a class returning from a quiet spell brings no banked credit.

A class returning from an empty queue joins the back of the round, so it waits for every other class's
visit first (about ``sum(w) * Q_base`` tokens of admissions). The classes named ``first`` (the scheduler
passes its highest-weight class) are visited next instead, right after the class being visited: an
interactive user's turn then waits for at most one visit, not a round. This changes when such a class is
served, not how much: it still earns only its quantum per visit and brings no banked credit, and a class
that never empties is never re-inserted, so the weights hold while every class is backlogged.

Pure and clock-free. ``peek`` names the next item DRR would dispatch (advancing rounds as needed,
idempotent until ``pop``); the caller decides *when* it may go (the token bucket) and then pops it.
A round in which nobody can pay is fast-forwarded arithmetically, so one decision costs
O(number of classes) however large the turn is compared to the quantum.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["DeficitRoundRobin", "Queued"]

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class Queued(Generic[K]):
    """One waiting item: its key (what the caller uses to find it) and its cost in tokens."""

    key: K
    cost: int
    alive: bool = True


@dataclass(slots=True)
class _ClassQueue(Generic[K]):
    weight: float
    deficit: float = 0.0
    credited: bool = False  # has this class earned its quantum on the current visit?
    items: deque[Queued[K]] = field(default_factory=deque)
    alive: int = 0


class DeficitRoundRobin(Generic[K]):
    """DRR over named classes with weights; items are identified by a hashable key."""

    def __init__(self, weights: Mapping[str, float], quantum: float, first: Collection[str] = ()) -> None:
        if quantum <= 0 or not weights or any(w <= 0 for w in weights.values()):
            raise ValueError("DRR needs a positive quantum and at least one class, all weights positive")
        self.quantum = float(quantum)
        self._classes: dict[str, _ClassQueue[K]] = {
            name: _ClassQueue(float(w)) for name, w in weights.items()
        }
        unknown = sorted(set(first) - set(weights))
        if unknown:
            raise ValueError(f"DRR: first names unknown classes {unknown}")
        self._first = frozenset(first)
        self._ring: deque[str] = deque()  # classes with waiting work; the front is being visited
        self._where: dict[K, tuple[str, Queued[K]]] = {}

    # ------------------------------------------------------------------ queue

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def push(self, class_name: str, key: K, cost: int) -> None:
        """Append an item to its class queue (FIFO within a class)."""
        queue = self._classes[class_name]  # KeyError: the caller validates class names
        if key in self._where:
            raise ValueError(f"item {key!r} is already queued")
        item = Queued(key, cost)
        queue.items.append(item)
        queue.alive += 1
        self._where[key] = (class_name, item)
        if queue.alive == 1:
            if class_name in self._first and self._ring:
                self._ring.insert(1, class_name)  # next, after the class being visited
            else:
                self._ring.append(class_name)

    def remove(self, key: K) -> bool:
        """Withdraw a waiting item (deadline passed, requester gone). False if it was not queued."""
        entry = self._where.pop(key, None)
        if entry is None:
            return False
        class_name, item = entry
        item.alive = False  # dropped lazily from the deque; the alive count is exact
        queue = self._classes[class_name]
        queue.alive -= 1
        if queue.alive == 0:
            self._deactivate(class_name)
        return True

    def _deactivate(self, class_name: str) -> None:
        queue = self._classes[class_name]
        queue.items.clear()
        queue.deficit = 0.0  # no banked credit for a class whose queue emptied
        queue.credited = False
        self._ring.remove(class_name)

    # ------------------------------------------------------------------ dispatch

    def peek(self) -> tuple[str, K, int] | None:
        """The (class, key, cost) DRR dispatches next, or None when nothing waits."""
        misses = 0
        while self._ring:
            name = self._ring[0]
            queue = self._classes[name]
            while not queue.items[0].alive:
                queue.items.popleft()
            if not queue.credited:
                queue.deficit += queue.weight * self.quantum
                queue.credited = True
            head = queue.items[0]
            if head.cost <= queue.deficit:
                return name, head.key, head.cost
            queue.credited = False
            self._ring.rotate(-1)
            misses += 1
            if misses >= len(self._ring):
                self._fast_forward()
                misses = 0
        return None

    def pop(self) -> tuple[str, K, int]:
        """Dispatch the item ``peek`` named and charge its class."""
        peeked = self.peek()
        if peeked is None:
            raise LookupError("nothing to dispatch")
        name, key, cost = peeked
        queue = self._classes[name]
        queue.items.popleft()
        queue.alive -= 1
        queue.deficit -= cost
        del self._where[key]
        if queue.alive == 0:
            self._deactivate(name)
        return peeked

    def waiting(self, class_name: str) -> int:
        """How many items ``class_name`` has queued."""
        return self._classes[class_name].alive

    def early(self, class_name: str) -> tuple[K, int] | None:
        """The (key, cost) of ``class_name``'s head when the class could dispatch it now, out of the round's
        order, with this round's credit (``pop_early``); None when it has nothing waiting or cannot pay."""
        queue = self._classes[class_name]
        if not queue.alive:
            return None
        head = self._head(class_name)
        credit = queue.deficit + (0.0 if queue.credited else queue.weight * self.quantum)
        return (head.key, head.cost) if head.cost <= credit else None

    def pop_early(self, class_name: str) -> tuple[str, K, int]:
        """Dispatch the head ``early`` named, out of the round's order, paid from the class's credit of the
        round (its visit's quantum credited now if it was not yet): what it takes early it does not get
        again at its visit, so the weights hold. The scheduler uses it for its top class while the head
        of the round waits for the bucket."""
        if self.early(class_name) is None:
            raise LookupError(f"{class_name} has nothing it can dispatch early")
        queue = self._classes[class_name]
        if not queue.credited:
            queue.deficit += queue.weight * self.quantum
            queue.credited = True
        head = queue.items.popleft()
        queue.alive -= 1
        queue.deficit -= head.cost
        del self._where[head.key]
        if queue.alive == 0:
            self._deactivate(class_name)
        return class_name, head.key, head.cost

    def _fast_forward(self) -> None:
        """A full round passed and no head was affordable: grant every class the rounds it would
        earn before the first of them can pay, in one step (same outcome as visiting them)."""
        rounds = min(
            math.ceil((self._head(name).cost - q.deficit) / (q.weight * self.quantum))
            for name in self._ring
            for q in (self._classes[name],)
        )
        if rounds > 1:
            for name in self._ring:
                q = self._classes[name]
                q.deficit += (rounds - 1) * q.weight * self.quantum

    def _head(self, name: str) -> Queued[K]:
        queue = self._classes[name]
        while not queue.items[0].alive:
            queue.items.popleft()
        return queue.items[0]

    # ------------------------------------------------------------------ introspection

    def deficits(self) -> dict[str, float]:
        return {name: q.deficit for name, q in self._classes.items()}

    def depth(self) -> dict[str, int]:
        return {name: q.alive for name, q in self._classes.items()}
