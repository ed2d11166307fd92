"""Sandbox semaphores with a reserved share ("Scheduling Concurrent Trajectories": reserving a share of
the sandbox pool for the interactive class removes priority inversion at the cost of some idle capacity).

A permit is taken when a tool call is dispatched and given back when it returns, never held through a
model call. The reserved class may take any free sandbox; every other class together may hold at most
``size - reserved``, so a batch build can never occupy the last sandboxes an interactive call needs.

Pure: waiters are keys; the caller turns grants into permits and leases.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from scheduler.config import SandboxPoolConfig

__all__ = ["SandboxPool"]

K = TypeVar("K", bound=Hashable)


class SandboxPool(Generic[K]):
    """Counting semaphore over ``config.size`` sandboxes with a reserve for ``reserved_class``.

    Waiters are served by class priority (``class_order``, the reserved class first), FIFO within
    a class. Holders are counted per class so a release frees the right share.
    """

    def __init__(self, name: str, config: SandboxPoolConfig, reserved_class: str, class_order: Sequence[str]):
        self.name = name
        self.size = config.size
        self.reserved = config.reserved
        self.reserved_class = reserved_class
        order = [reserved_class, *[c for c in class_order if c != reserved_class]]
        self._waiting: dict[str, deque[K]] = {c: deque() for c in order}
        self._where: dict[K, str] = {}
        self.in_use = 0
        self.in_use_unreserved = 0  # held by classes other than the reserved one

    def allowed(self, class_name: str) -> bool:
        """Could ``class_name`` take a sandbox right now?"""
        if self.in_use >= self.size:
            return False
        if class_name == self.reserved_class:
            return True
        return self.in_use_unreserved < self.size - self.reserved

    def enqueue(self, class_name: str, key: K) -> None:
        if class_name not in self._waiting:
            raise KeyError(class_name)
        self._waiting[class_name].append(key)
        self._where[key] = class_name

    def remove(self, key: K) -> bool:
        """Withdraw a waiter (deadline passed, requester gone). False if it was not waiting."""
        class_name = self._where.pop(key, None)
        if class_name is None:
            return False
        self._waiting[class_name].remove(key)
        return True

    def dispatch(self) -> list[tuple[str, K]]:
        """Take sandboxes for every waiter that may have one now, highest priority first."""
        granted: list[tuple[str, K]] = []
        for class_name, queue in self._waiting.items():
            while queue and self.allowed(class_name):
                key = queue.popleft()
                del self._where[key]
                self._hold(class_name)
                granted.append((class_name, key))
        return granted

    def _hold(self, class_name: str) -> None:
        self.in_use += 1
        if class_name != self.reserved_class:
            self.in_use_unreserved += 1

    def release(self, class_name: str) -> None:
        """Give back a sandbox held by ``class_name``."""
        if self.in_use <= 0:
            raise RuntimeError(f"sandbox pool {self.name!r}: release without a holder")
        self.in_use -= 1
        if class_name != self.reserved_class:
            self.in_use_unreserved -= 1

    @property
    def waiting(self) -> int:
        return len(self._where)
