"""Sandbox semaphores with an interactive reserve: no priority inversion, priority order, exact counts."""

from __future__ import annotations

import pytest

from scheduler.config import SandboxPoolConfig
from scheduler.sandbox import SandboxPool

ORDER = ["interactive", "standard", "batch"]


def pool(size: int = 4, reserved: int = 1) -> SandboxPool[str]:
    return SandboxPool("default", SandboxPoolConfig(size=size, reserved=reserved), "interactive", ORDER)


def test_batch_cannot_take_the_reserved_sandboxes_so_interactive_never_waits_behind_it() -> None:
    # Given a pool of 4 with 1 reserved, and 10 batch tool calls waiting
    p = pool()
    for i in range(10):
        p.enqueue("batch", f"b{i}")
    # When the pool dispatches
    granted = p.dispatch()
    # Then batch holds only 3, and an interactive call arriving now gets the 4th at once
    assert [key for _, key in granted] == ["b0", "b1", "b2"]
    p.enqueue("interactive", "i0")
    assert p.dispatch() == [("interactive", "i0")]
    assert (p.in_use, p.in_use_unreserved, p.waiting) == (4, 3, 7)


def test_without_a_reserve_interactive_waits_behind_batch() -> None:
    # Given the same load with no reserve (the inversion the reserve exists to remove)
    p = pool(reserved=0)
    for i in range(10):
        p.enqueue("batch", f"b{i}")
    p.dispatch()
    p.enqueue("interactive", "i0")
    # Then the interactive call waits
    assert p.dispatch() == []


def test_interactive_may_use_the_whole_pool() -> None:
    p = pool()
    for i in range(4):
        p.enqueue("interactive", f"i{i}")
    assert len(p.dispatch()) == 4
    assert p.in_use_unreserved == 0


def test_waiters_are_served_by_priority_then_fifo() -> None:
    # Given a full pool and waiters of every class
    p = pool(size=2, reserved=0)
    p.enqueue("batch", "hold1")
    p.enqueue("batch", "hold2")
    holders = [cls for cls, _ in p.dispatch()]
    for key, cls in [("b", "batch"), ("s1", "standard"), ("i", "interactive"), ("s2", "standard")]:
        p.enqueue(cls, key)
    # When sandboxes come back one at a time (oldest holder first)
    order = []
    for _ in range(4):
        p.release(holders.pop(0))
        for cls, key in p.dispatch():
            holders.append(cls)
            order.append(key)
    # Then interactive goes first, then standard in arrival order, then batch
    assert order == ["i", "s1", "s2", "b"]


def test_release_frees_the_right_share_and_remove_withdraws() -> None:
    p = pool()
    p.enqueue("batch", "b0")
    p.enqueue("batch", "b1")
    p.dispatch()
    p.release("batch")
    assert (p.in_use, p.in_use_unreserved) == (1, 1)
    p.enqueue("standard", "s")
    assert p.remove("s") is True
    assert p.remove("s") is False
    assert p.dispatch() == []


def test_release_without_holder_is_an_error_and_reserve_must_fit() -> None:
    with pytest.raises(RuntimeError, match="without a holder"):
        pool().release("batch")
    with pytest.raises(ValueError, match="exceeds pool size"):
        SandboxPoolConfig(size=2, reserved=3)
