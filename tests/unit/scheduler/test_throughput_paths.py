"""The admission fast path and batched settlement: fewer wake-ups and fewer actor calls, same decisions."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest

from runtime.clock import FakeClock
from runtime.errors import AdmissionRefused
from runtime.ports import SandboxPermit, TurnGrant, TurnRequest
from scheduler.actor import SchedulerHandle, _Outcome, _outcome_of, _request_of, _request_wire, _unwrap
from scheduler.config import ProviderLimits, SchedulerConfig
from scheduler.errors import SchedulerInputError
from scheduler.inprocess import InProcessScheduler
from scheduler.lease import TurnLease

KEY = "p|m"
CONFIG = SchedulerConfig(
    providers={
        KEY: ProviderLimits(tokens_per_minute=60_000, requests_per_minute=6_000, headroom=0.0, sub_window_s=0)
    }
)


def turn(clock: FakeClock, tokens: int = 100, cls: str = "standard") -> TurnRequest:
    return TurnRequest("t", cls, KEY, tokens, clock.wall() + 600)


async def test_a_turn_that_fits_is_answered_without_a_driver_or_a_waiter() -> None:
    # Given a scheduler whose bucket has room
    clock = FakeClock()
    sched = InProcessScheduler(CONFIG, clock, id_prefix="t")
    clock.advance(60.0)
    # When a turn that fits asks
    grant = await sched.admit_turn(turn(clock))
    # Then it is granted at once: no driver task was needed and nothing is left waiting
    assert grant.reserved_tokens == 100
    assert sched._driver is None and not sched._waiters
    await sched.aclose()


async def test_a_turn_that_must_wait_still_waits_for_the_driver() -> None:
    clock = FakeClock()
    sched = InProcessScheduler(CONFIG, clock, id_prefix="t")
    waiting = asyncio.ensure_future(sched.admit_turn(turn(clock)))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not waiting.done() and sched._driver is not None
    clock.advance(1.0)  # the bucket refills 1000 tokens/s
    assert (await waiting).reserved_tokens == 100
    await sched.aclose()


async def test_a_refusal_on_the_fast_path_is_raised_to_its_caller() -> None:
    clock = FakeClock()
    sched = InProcessScheduler(CONFIG, clock, id_prefix="t")
    with pytest.raises(AdmissionRefused, match="exceeds"):
        await sched.admit_turn(turn(clock, tokens=10**9))
    await sched.aclose()


async def test_settle_many_refunds_every_grant_in_one_call() -> None:
    clock = FakeClock()
    sched = InProcessScheduler(CONFIG, clock, id_prefix="t")
    clock.advance(60.0)
    grants = [await sched.admit_turn(turn(clock, 1_000)) for _ in range(5)]
    before = sched.snapshot().lanes[KEY].tokens
    await sched.settle_many([(g.grant_id, 100) for g in grants])
    assert sched.snapshot().grants == 0
    assert sched.snapshot().lanes[KEY].tokens == pytest.approx(before + 5 * 900)
    await sched.aclose()


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeSchedulerActor:
    """Stands in for the actor handle: ``settle_many.remote`` applies to an in-process scheduler."""

    def __init__(self, sched: InProcessScheduler, fail: bool = False) -> None:
        self.calls: list[int] = []
        self.fail = fail

        async def settle_many(items: list[tuple[str, int]]) -> _Outcome:
            self.calls.append(len(items))
            await asyncio.sleep(0)  # a round trip: others queue meanwhile
            if self.fail:
                raise ConnectionError("actor unreachable")
            await sched.settle_many(items)
            return ("ok", None)

        self.settle_many = _Method(settle_many)


async def test_concurrent_settlements_from_one_process_share_calls() -> None:
    # Given 50 grants settled concurrently through one handle
    clock = FakeClock()
    sched = InProcessScheduler(CONFIG, clock, id_prefix="t")
    clock.advance(60.0)
    grants = [await sched.admit_turn(turn(clock)) for _ in range(50)]
    actor = FakeSchedulerActor(sched)
    handle = SchedulerHandle(actor)
    # When they settle
    await asyncio.gather(*(handle.settle_turn(g.grant_id, 10) for g in grants))
    # Then every one was applied, in far fewer calls than settlements (one in flight, the rest batched)
    assert sched.snapshot().grants == 0
    assert sum(actor.calls) == 50
    assert len(actor.calls) <= 3
    await sched.aclose()


async def test_a_failed_batch_reaches_every_caller_in_it() -> None:
    clock = FakeClock()
    sched = InProcessScheduler(CONFIG, clock, id_prefix="t")
    handle = SchedulerHandle(FakeSchedulerActor(sched, fail=True))
    results = await asyncio.gather(
        *(handle.settle_turn(f"g{i}", 1) for i in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, ConnectionError) for r in results)
    await sched.aclose()


def _answer(value: Any) -> Any:
    async def answer() -> Any:
        if isinstance(value, BaseException):
            raise value
        return value

    return answer()


@pytest.mark.parametrize(
    "value",
    [
        None,
        TurnGrant("g-1", 476, 1_800_000_000.5),
        TurnLease("l-1", KEY, "batch", 4_000, 8, 1_800_000_001.0, 1_800_000_061.0),
        SandboxPermit("p-1", "bwrap", 1_800_000_002.0),
    ],
)
async def test_what_the_actor_returns_is_plain_data_the_handle_turns_back_into_the_value(value: Any) -> None:
    # Given an answer of the scheduler, as the actor wraps it for the way back
    outcome = await _outcome_of(_answer(value))
    # Then it is primitives only (Ray carries them as MessagePack: no pickled dataclasses on the turn's path)
    msgpack.packb(outcome)  # TypeError for anything that is not plain data
    # And the handle's side rebuilds the same value
    assert _unwrap(outcome) == value


async def test_refusals_and_input_errors_cross_as_plain_data_and_are_raised_on_the_callers_side() -> None:
    refused = await _outcome_of(_answer(AdmissionRefused("deadline", "no admission after the deadline")))
    bad_key = SchedulerInputError("unknown provider key", where="request.provider_key")
    bad = await _outcome_of(_answer(bad_key))
    msgpack.packb([refused, bad])
    with pytest.raises(AdmissionRefused) as refusal:
        _unwrap(refused)
    assert refusal.value.predicate == "deadline"
    assert str(refusal.value) == "deadline: no admission after the deadline"
    with pytest.raises(SchedulerInputError) as error:
        _unwrap(bad)
    assert error.value.where == "request.provider_key"
    assert "unknown provider key" in str(error.value)


def test_a_request_crosses_as_a_tuple_and_is_rebuilt_equal() -> None:
    request = TurnRequest("t-9", "interactive", KEY, 1_234, 1_800_000_003.25)
    wire = _request_wire(request)
    msgpack.packb(wire)
    assert _request_of(wire) == request
    assert _request_of(list(wire)) == request  # as a list, too (MessagePack has no tuples)
    assert _request_of(request) is request
