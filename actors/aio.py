"""Stopping background tasks when a library may lose the cancellation.

``task.cancel()`` asks; it does not guarantee. Code under the task can lose the ``CancelledError`` in two
ways, both seen here:

* it raises something else in its place (a client library that cleans its connection up on the way out and
  reports that as its own error). A service loop that skips failed steps (``except Exception``) then goes
  round again, and whoever awaits the cancelled task waits forever: in CI ``tether run``'s driver hung for
  600 s after every trajectory had ended, awaiting its status sampler;
* it returns normally, as if nothing had been asked. On Python 3.11 ``asyncio.wait_for`` returns the inner
  result when the cancel lands just as the inner call finished (python/cpython#86296, fixed in 3.12), and
  redis-py 8 wraps every command it sends in ``wait_for(socket_timeout)``. Cancelled at a random moment
  inside a loop of Redis commands, about a third of the cancellations were lost this way here (20 of 60
  ``HGETALL``, 24 of 60 pipelines, 26 of 60 ``XADD``): the command came back with its reply, and the loop
  went round again with the cancellation still pending.

Two defences, used together:

* loops that only a cancel ends and that go round on Redis calls (the driver's status sampler, a live view)
  ask ``cancel_requested()`` after every step, failed or not, and stop if a cancellation is pending
  (``Task.cancelling()`` counts requests a library swallowed, until somebody un-cancels). Loops that end on
  a stop flag (the relay, the timer service, the status writer) need not. Not checked inside the Redis
  helpers themselves: code that caught a cancel and is cleaning up still has ``cancelling() > 0``, and its
  clean-up writes would fail;
* whoever stops a task waits a bounded time (``stop``); a loop's owner also asks again while it has not
  ended (``again_s``), and a cancel that arrives while the loop waits on anything else is delivered. Not
  for a task whose way out takes time of its own (a sandbox's graceful teardown under ``shield``): asked
  again, it would leave before its clean-up ended.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["ASK_AGAIN_S", "cancel_requested", "stop"]

_log = logging.getLogger("tether.aio")

ASK_AGAIN_S = 1.0
"""How long the owner of a loop waits after a cancel before asking again (``stop(again_s=...)``)."""


def cancel_requested() -> bool:
    """Whether the current task was asked to stop (even if the ``CancelledError`` was lost on its way)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def stop(
    task: asyncio.Future[Any], *, what: str, within_s: float = 5.0, again_s: float | None = None
) -> bool:
    """Cancel ``task`` and wait for it at most ``within_s``; True if it ended. With ``again_s``, a task
    still running that long after a cancel is cancelled again (the first may have been lost below it).
    Its outcome is consumed (a background task's failure at shutdown is not the caller's). One that did not
    end is logged and left to the event loop's own shutdown."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + within_s
    while True:
        task.cancel()
        left = give_up_at - loop.time()
        wait_s = left if again_s is None else min(again_s, left)
        done, _ = await asyncio.wait({task}, timeout=max(wait_s, 0.0))
        if done:
            break
        if loop.time() >= give_up_at:
            _log.warning("%s did not stop within %.0fs of being cancelled; leaving it behind", what, within_s)
            return False
    if not task.cancelled():
        task.exception()  # retrieved: not reported as never retrieved
    return True
