"""A cancellation a library loses must not keep a loop running, nor its owner waiting (``actors.aio``)."""

from __future__ import annotations

import asyncio

import pytest

from actors import aio


class LibraryError(Exception):
    """What a client library raises in place of the cancellation it received."""


async def _library_call() -> None:
    try:
        await asyncio.sleep(0.05)
    except asyncio.CancelledError:
        raise LibraryError("connection closed while reading") from None


async def _skipping_loop(guarded: bool, rounds: list[int]) -> None:
    """A service loop that skips failed steps, as the driver's status sampler does."""
    while len(rounds) < 20:  # (a control run ends by itself, after about a second)
        rounds.append(1)
        try:
            await _library_call()
        except Exception:
            if guarded and aio.cancel_requested():
                raise asyncio.CancelledError from None
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "control-unguarded"])
def test_a_loop_stops_although_its_library_lost_the_cancellation(guarded: bool) -> None:
    async def go() -> tuple[bool, int]:
        rounds: list[int] = []
        task = asyncio.ensure_future(_skipping_loop(guarded, rounds))
        await asyncio.sleep(0.02)  # inside the library call
        # asked once: what is judged here is the loop's own check, not stop() asking again
        stopped = await aio.stop(task, what="the loop", within_s=0.3, again_s=None)
        before = len(rounds)
        if not stopped:
            await task  # (control) it went round until its own end, cancelled or not
        return stopped, len(rounds) - before

    stopped, rounds_after = asyncio.run(go())
    if guarded:
        assert stopped
    else:  # without the check the cancelled loop skips the "failure" and goes on; stop() still returns
        assert not stopped and rounds_after > 0


async def _reply_despite_the_cancel(lost: list[int]) -> None:
    """A call that, the first time it is cancelled, returns its reply instead: Python 3.11's ``wait_for``
    does so when the cancel lands just as the inner call finished (redis-py sends every command that way)."""
    try:
        await asyncio.sleep(0.05)
    except asyncio.CancelledError:
        if lost:
            raise
        lost.append(1)


async def _unguarded_loop(lost: list[int], rounds: list[int]) -> None:
    """A loop with no check of its own: it stops only when a cancel reaches one of its awaits."""
    while len(rounds) < 200:  # (a control run ends by itself, after about 10 s)
        rounds.append(1)
        await _reply_despite_the_cancel(lost)
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("again_s", [0.1, None], ids=["asked-again", "control-asked-once"])
def test_stop_asks_again_when_a_call_returned_its_reply_in_place_of_the_cancel(again_s: float | None) -> None:
    async def go() -> tuple[bool, int]:
        lost: list[int] = []
        rounds: list[int] = []
        task = asyncio.ensure_future(_unguarded_loop(lost, rounds))
        await asyncio.sleep(0.02)  # inside the call
        stopped = await aio.stop(task, what="the loop", within_s=1.0, again_s=again_s)
        if not stopped:
            task.cancel()  # (control) the call takes this one
            with pytest.raises(asyncio.CancelledError):
                await task
        return stopped, len(lost)

    stopped, lost = asyncio.run(go())
    assert lost == 1  # the first cancel was taken by the call, in both runs
    assert stopped is (again_s is not None)


def test_stop_consumes_the_outcome_of_a_task_that_failed_on_its_way_out() -> None:
    async def go() -> bool:
        task = asyncio.ensure_future(_library_call())
        await asyncio.sleep(0)
        return await aio.stop(task, what="the call", within_s=1.0)

    assert asyncio.run(go()) is True


def test_cancel_requested_is_false_outside_a_cancelled_task() -> None:
    async def go() -> bool:
        return aio.cancel_requested()

    assert asyncio.run(go()) is False
