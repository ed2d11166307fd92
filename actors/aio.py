"""Stopping background tasks when a library may lose the cancellation.

``task.cancel()`` asks; it does not guarantee. Code under the task can receive the ``CancelledError`` and
raise something else in its place (a client library that cleans its connection up on the way out and
reports that as its own error). A service loop that skips failed steps (``except Exception``) then goes
round again, and whoever awaits the cancelled task waits forever: in CI ``tether run``'s driver hung for
600 s after every trajectory had ended, awaiting its status sampler, whose cancellation had surfaced from
a Redis pipeline as an ordinary exception and been skipped like a failed sample.

Two defences, used together:

* loops that skip failed steps ask ``cancel_requested()`` before skipping, and stop if a cancellation is
  pending (``Task.cancelling()`` counts requests a library swallowed, until somebody un-cancels);
* whoever stops a task waits for it a bounded time (``stop``), and says so if it did not stop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["cancel_requested", "stop"]

_log = logging.getLogger("tether.aio")


def cancel_requested() -> bool:
    """Whether the current task was asked to stop (even if the ``CancelledError`` was lost on its way)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def stop(task: asyncio.Future[Any], *, what: str, within_s: float = 5.0) -> bool:
    """Cancel ``task`` and wait for it at most ``within_s``; True if it ended. Its outcome is consumed
    (a background task's failure at shutdown is not the caller's). One that did not end is logged and
    left to the event loop's own shutdown."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=within_s)
    if not done:
        _log.warning("%s did not stop within %.0fs of being cancelled; leaving it behind", what, within_s)
        return False
    if not task.cancelled():
        task.exception()  # retrieved: not reported as never retrieved
    return True
