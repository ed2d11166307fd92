"""InProcessScheduler: the async AdmissionPort over the core, stepped with a fake clock."""

from __future__ import annotations

import asyncio
import threading

import pytest

from runtime.clock import FakeClock
from runtime.errors import AdmissionRefused
from runtime.ports import AdmissionPort, TurnRequest
from scheduler.config import ProviderLimits, SandboxPoolConfig, SchedulerConfig
from scheduler.errors import SchedulerInputError
from scheduler.inprocess import AlwaysAdmit, InProcessScheduler

KEY = "http://provider/v1|model-a"
CONFIG = SchedulerConfig(
    providers={
        KEY: ProviderLimits(tokens_per_minute=60_000, requests_per_minute=6_000, headroom=0.0, sub_window_s=0)
    },
    pools={"default": SandboxPoolConfig(size=1, reserved=0)},
)


async def let_loop_run() -> None:
    """Give every ready task a chance to run; no wall-clock time passes."""
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def sched(clock: FakeClock):
    scheduler = InProcessScheduler(CONFIG, clock, id_prefix="t")
    yield scheduler
    await scheduler.aclose()


def req(
    clock: FakeClock, tokens: int = 1_000, cls: str = "standard", deadline_in: float = 600.0
) -> TurnRequest:
    return TurnRequest("traj", cls, KEY, tokens, clock.wall() + deadline_in)


def test_all_adapters_implement_the_admission_port() -> None:
    from scheduler.actor import SchedulerHandle

    assert isinstance(InProcessScheduler(CONFIG, FakeClock()), AdmissionPort)
    assert isinstance(AlwaysAdmit(), AdmissionPort)
    assert isinstance(SchedulerHandle(actor=None), AdmissionPort)


async def test_admission_waits_for_the_bucket_without_blocking(
    clock: FakeClock, sched: InProcessScheduler
) -> None:
    # Given an empty bucket refilling at 1000 tokens/s and a 3000-token turn
    task = asyncio.create_task(sched.admit_turn(req(clock, 3_000)))
    await let_loop_run()
    assert not task.done()
    # When 2.9 s pass it still waits; at 3 s it is admitted
    clock.advance(2.9)
    await let_loop_run()
    assert not task.done()
    clock.advance(0.1)
    await let_loop_run()
    grant = task.result()
    assert grant.reserved_tokens == 3_000


async def test_deadline_refusal_raises_admission_refused(clock: FakeClock, sched: InProcessScheduler) -> None:
    task = asyncio.create_task(sched.admit_turn(req(clock, 30_000, deadline_in=5.0)))
    await let_loop_run()
    clock.advance(5.0)
    await let_loop_run()
    with pytest.raises(AdmissionRefused) as refused:
        task.result()
    assert refused.value.predicate == "deadline"


async def test_bad_input_raises_at_once(clock: FakeClock, sched: InProcessScheduler) -> None:
    with pytest.raises(SchedulerInputError, match="unknown priority class"):
        await sched.admit_turn(req(clock, cls="vip"))


async def test_settle_and_release_complete_while_many_admissions_wait(
    clock: FakeClock, sched: InProcessScheduler
) -> None:
    # Given a granted turn and sandbox, then 200 admissions and 50 sandbox acquisitions blocked
    clock.advance(60.0)
    grant = await sched.admit_turn(req(clock, 59_000))
    permit = await sched.acquire_sandbox("traj", "default", "batch", clock.wall() + 600)
    blocked = [asyncio.create_task(sched.admit_turn(req(clock, 5_000))) for _ in range(200)]
    blocked += [
        asyncio.create_task(sched.acquire_sandbox(f"t{i}", "default", "batch", clock.wall() + 600))
        for i in range(50)
    ]
    await let_loop_run()
    assert not any(t.done() for t in blocked)
    # When settle and release are called, Then they return at once (no clock movement)
    await sched.settle_turn(grant.grant_id, 9_000)  # refunds 50 000 tokens
    await sched.release_sandbox(permit.permit_id)
    await let_loop_run()
    # And the refund and the free sandbox were handed to waiters: 10 turns of 5000 and one sandbox
    assert sum(t.done() for t in blocked[:200]) == 10
    assert sum(t.done() for t in blocked[200:]) == 1
    for t in blocked:
        t.cancel()
    await asyncio.gather(*blocked, return_exceptions=True)
    assert sched.snapshot().pending == 0


async def test_a_cancelled_waiter_is_withdrawn(clock: FakeClock, sched: InProcessScheduler) -> None:
    task = asyncio.create_task(sched.admit_turn(req(clock, 5_000)))
    await let_loop_run()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert sched.snapshot().pending == 0
    # And its place is not kept: a later turn gets the tokens
    clock.advance(5.0)
    assert (await sched.admit_turn(req(clock, 5_000))).reserved_tokens == 5_000


async def test_a_release_from_another_thread_wakes_a_waiter_on_this_loop(
    clock: FakeClock, sched: InProcessScheduler
) -> None:
    # Given a waiter for the only sandbox (as in the actor, where release runs in another concurrency group)
    permit = await sched.acquire_sandbox("a", "default", "batch", clock.wall() + 600)
    waiter = asyncio.create_task(sched.acquire_sandbox("b", "default", "batch", clock.wall() + 600))
    await let_loop_run()
    # When the release happens on another thread's event loop
    thread = threading.Thread(target=lambda: asyncio.run(sched.release_sandbox(permit.permit_id)))
    thread.start()
    thread.join()
    for _ in range(50):
        await let_loop_run()
        if waiter.done():
            break
    # Then the waiter gets the sandbox
    assert waiter.result().pool == "default"


async def test_a_429_report_pauses_admission_until_retry_after(
    clock: FakeClock, sched: InProcessScheduler
) -> None:
    clock.advance(60.0)
    await sched.report_rate_limited(KEY, 10.0, {"x-ratelimit-remaining-tokens": 0})
    task = asyncio.create_task(sched.admit_turn(req(clock, 1_000)))
    await let_loop_run()
    clock.advance(9.9)
    await let_loop_run()
    assert not task.done()
    clock.advance(0.1)
    await let_loop_run()
    assert task.result().reserved_tokens == 1_000


async def test_close_refuses_waiters(clock: FakeClock) -> None:
    sched = InProcessScheduler(CONFIG, clock)
    task = asyncio.create_task(sched.admit_turn(req(clock, 5_000)))
    await let_loop_run()
    await sched.aclose()
    await let_loop_run()
    with pytest.raises(AdmissionRefused, match="shutdown"):
        task.result()
    with pytest.raises(AdmissionRefused, match="shutdown"):
        await sched.admit_turn(req(clock))


async def test_always_admit_grants_everything() -> None:
    port = AlwaysAdmit(clock=FakeClock())
    grant = await port.admit_turn(TurnRequest("t", "anything", "k", 10**9, 0.0))
    permit = await port.acquire_sandbox("t", "p", "batch", 0.0)
    assert grant.reserved_tokens == 10**9
    assert grant.grant_id != permit.permit_id
