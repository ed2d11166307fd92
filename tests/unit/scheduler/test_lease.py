"""Chunk leases on a fake clock: when a chunk is granted, that chunks never over-grant the limit across
many holders, that a contended key falls back to per-call DRR order, and settlement into a chunk."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Any

import pytest

from runtime.clock import FakeClock
from runtime.errors import AdmissionRefused
from runtime.ports import TurnGrant, TurnRequest
from scheduler.config import LeaseConfig, ProviderLimits, SchedulerConfig
from scheduler.core import Admitted, SchedulerCore, SettleResult
from scheduler.errors import SchedulerInputError
from scheduler.inprocess import InProcessScheduler
from scheduler.lease import LocalLease, TurnLease
from scheduler.lease_client import LeaseClient

KEY = "p|m"
# 1000 tokens/s, 100 requests/s, no sub-window unless a row asks for one
LIMITS = ProviderLimits(tokens_per_minute=60_000, requests_per_minute=6_000, headroom=0.0, sub_window_s=0)
LEASING = LeaseConfig(max_requests=32, use_s=0.25, slack=0.5)
_ids = itertools.count()


def config(limits: ProviderLimits = LIMITS, leasing: LeaseConfig | None = LEASING) -> SchedulerConfig:
    return SchedulerConfig(providers={KEY: limits}, leasing=leasing)


def turn(clock: FakeClock, tokens: int = 100, cls: str = "batch", deadline_in: float = 600.0) -> TurnRequest:
    return TurnRequest(f"t{next(_ids)}", cls, KEY, tokens, clock.wall() + deadline_in)


# ----------------------------------------------------------------------------- core: when a chunk is granted


def full_core(clock: FakeClock, cfg: SchedulerConfig | None = None) -> SchedulerCore:
    core = SchedulerCore(cfg or config(), clock, id_prefix="t")
    clock.advance(60.0)  # buckets full: 60,000 tokens, 6,000 requests
    return core


@pytest.mark.parametrize(
    ("case", "want", "tokens", "expected_requests"),
    [
        ("uncontended: the chunk asked for", 8, 100, 8),
        ("capped at max_requests", 500, 100, 32),
        ("a lone turn is never leased", 1, 100, None),
        ("halved to at most half the bucket: 32 x 1000 > 60,000 / 2", 32, 1_000, 16),
        ("no chunk of two fits half the bucket: 2 x 20,000 > 30,000", 2, 20_000, None),
    ],
)
def test_chunk_size(case: str, want: int, tokens: int, expected_requests: int | None) -> None:
    clock = FakeClock()
    core = full_core(clock)
    lease = core.lease_turns(turn(clock, tokens), want)
    assert (lease.requests if lease else None) == expected_requests, case
    if lease is not None:
        assert lease.tokens == tokens * lease.requests
        assert lease.use_by == pytest.approx(clock.wall() + LEASING.use_s)


def test_no_chunk_while_leasing_is_off_or_the_key_was_rate_limited() -> None:
    clock = FakeClock()
    off = full_core(clock, config(leasing=None))
    assert off.lease_turns(turn(clock), 8) is None
    limited = full_core(clock)
    limited.report_rate_limited(KEY, retry_after=1.0)
    assert limited.lease_turns(turn(clock), 8) is None
    clock.advance(2.0)  # the pause is over but the rate is still cut: still per call
    assert limited.lease_turns(turn(clock), 8) is None


def test_a_chunk_is_refused_while_a_turn_waits_in_drr() -> None:
    # Given a bucket well above its slack, but an interactive turn of 50,000 queued at its head
    # (the bucket holds 40,000 after 40 s)
    clock = FakeClock()
    core = SchedulerCore(config(), clock, id_prefix="t")
    clock.advance(40.0)
    big = core.submit_turn(turn(clock, 50_000, "interactive"))
    assert core.tick() == []
    # When a batch process asks for a chunk of small turns that would fit beside the slack
    lease = core.lease_turns(turn(clock, 500, "batch"), 8)
    # Then it gets none: its turns queue behind the interactive one, which goes first
    assert lease is None
    small = core.submit_turn(turn(clock, 500, "batch"))
    order: list[int] = []
    while len(order) < 2:
        clock.advance(1.0)
        order += [d.ticket for d in core.tick() if isinstance(d, Admitted)]
    assert order == [big, small]


def test_returning_a_chunk_refunds_what_it_did_not_use_and_debits_overuse() -> None:
    clock = FakeClock()
    core = full_core(clock)
    lease = core.lease_turns(turn(clock, 1_000), 8)
    assert lease is not None
    assert core.snapshot().lanes[KEY].tokens == pytest.approx(60_000 - 8_000)
    # three turns used 4,000 in all (one of them more than it reserved)
    assert core.end_lease(lease.lease_id, 4_000, 3) is SettleResult.SETTLED
    lane = core.snapshot().lanes[KEY]
    assert lane.tokens == pytest.approx(60_000 - 4_000)
    assert lane.requests == pytest.approx(6_000 - 3)
    assert lane.granted == 3
    assert core.end_lease(lease.lease_id, 0, 0) is SettleResult.UNKNOWN  # once only
    assert core.snapshot().chunks == 0


def test_an_unreturned_chunk_expires_with_its_tokens_spent() -> None:
    # Given a chunk whose holder died
    clock = FakeClock()
    core = full_core(clock)
    lease = core.lease_turns(turn(clock, 1_000), 8)
    assert lease is not None and core.snapshot().chunks == 1
    # When its lease expires
    clock.advance(LEASING.use_s + core.config.turn_lease_s)
    core.tick()
    # Then the scheduler forgets it without a refund, and a late return is a no-op
    assert core.snapshot().chunks == 0
    assert core.end_lease(lease.lease_id, 0, 0) is SettleResult.UNKNOWN


def test_a_restarted_scheduler_does_not_know_the_old_chunks() -> None:
    clock = FakeClock()
    lease = full_core(clock).lease_turns(turn(clock), 8)
    assert lease is not None
    fresh = SchedulerCore(config(), clock, id_prefix="u")
    assert fresh.end_lease(lease.lease_id, 0, 0) is SettleResult.UNKNOWN


# ----------------------------------------------------------------------------- the holder's side


@pytest.mark.parametrize(
    ("case", "request_", "at", "granted"),
    [
        ("fits", dict(tokens=100, cls="batch"), 0.0, True),
        ("another class asks on its own", dict(tokens=100, cls="interactive"), 0.0, False),
        ("more tokens than left", dict(tokens=1_001, cls="batch"), 0.0, False),
        ("negative tokens go to the scheduler's input check", dict(tokens=-1, cls="batch"), 0.0, False),
        (
            "deadline passed: the scheduler refuses it",
            dict(tokens=100, cls="batch", deadline_in=-1),
            0.0,
            False,
        ),
        ("past use_by", dict(tokens=100, cls="batch"), 0.25, False),
    ],
)
def test_local_admission(case: str, request_: dict[str, Any], at: float, granted: bool) -> None:
    clock = FakeClock()
    lease = LocalLease(TurnLease("c-1", KEY, "batch", 1_000, 4, clock.wall() + 0.25, clock.wall() + 600))
    clock.advance(at)
    grant = lease.admit(turn(clock, **request_), clock.wall())
    assert (grant is not None) is granted, case


def test_local_settlement_refunds_into_the_chunk() -> None:
    clock = FakeClock()
    lease = LocalLease(TurnLease("c-1", KEY, "batch", 300, 4, clock.wall() + 0.25, clock.wall() + 600))
    grants = [lease.admit(turn(clock, 100), clock.wall()) for _ in range(3)]
    assert all(grants) and lease.admit(turn(clock, 100), clock.wall()) is None  # 300 tokens spoken for
    assert lease.settle(grants[0].grant_id, 40)  # type: ignore[union-attr]
    assert lease.admit(turn(clock, 60), clock.wall()) is not None  # the refund is usable again
    assert not lease.settle("c-1#99", 1)
    with pytest.raises(SchedulerInputError):
        lease.settle(grants[1].grant_id, -1)  # type: ignore[union-attr]
    assert lease.used() == (40 + 100 + 100 + 60, 4)
    assert lease.exhausted(clock.wall()) and not lease.done(clock.wall())


class Process:
    """One holder process: a LeaseClient over the shared in-process scheduler."""

    def __init__(self, sched: InProcessScheduler, clock: FakeClock, round_trip_s: float = 0.0) -> None:
        self.sched = sched
        self.clock = clock
        self.round_trip_s = round_trip_s
        self.calls = 0
        self.client = LeaseClient(self, sched.end_lease, clock)

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        self.calls += 1
        await self.clock.sleep(self.round_trip_s)  # a round trip: this process's other callers run meanwhile
        return await self.sched.admit_turn(request)

    async def admit_or_lease(self, request: TurnRequest, want: int) -> TurnGrant | TurnLease | None:
        self.calls += 1
        await self.clock.sleep(self.round_trip_s)
        return await self.sched.admit_or_lease(request, want)

    async def settle(self, grant_id: str, tokens: int) -> None:
        if not self.client.settle_local(grant_id, tokens):
            await self.sched.settle_turn(grant_id, tokens)


async def spin() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_lone_caller_keeps_the_per_call_path() -> None:
    clock = FakeClock()
    sched = InProcessScheduler(config(), clock, id_prefix="t")
    clock.advance(60.0)
    proc = Process(sched, clock)
    for _ in range(3):
        grant = await proc.client.admit_turn(turn(clock))
        await proc.settle(grant.grant_id, 90)
    assert proc.client.leased == 0 and proc.calls == 3
    assert sched.snapshot().chunks == 0
    await sched.aclose()


async def test_concurrent_callers_share_one_chunk_and_return_it_once_settled() -> None:
    # Given one process with 8 callers asking at once on a full bucket
    clock = FakeClock()
    sched = InProcessScheduler(config(), clock, id_prefix="t")
    clock.advance(60.0)
    proc = Process(sched, clock)
    # When they are admitted
    grants = await asyncio.gather(*(proc.client.admit_turn(turn(clock, 1_000)) for _ in range(8)))
    # Then the first asked on its own (alone at the time); the other seven came from two chunks, each
    # sized to twice the callers asking when it was fetched (2, then 3 waiting)
    assert proc.calls == 3 and proc.client.leased == 7
    assert sched.snapshot().chunks == 2
    # When they settle with 500 each and the chunk's use_by passes
    for grant in grants:
        await proc.settle(grant.grant_id, 500)
    clock.advance(LEASING.use_s)
    await spin()
    # Then the chunks went back with exactly what was used (plus 0.25 s of refill at 1000 tokens/s)
    assert sched.snapshot().chunks == 0
    lane = sched.snapshot().lanes[KEY]
    assert (
        lane.tokens == pytest.approx(60_000 - 8 * 500 + 250)
        and lane.granted == 8
        and sched.snapshot().grants == 0
    )
    assert sched.core._lanes[KEY].limiter.token_window.used(clock.now()) == pytest.approx(8 * 500)
    await proc.client.aclose()
    await sched.aclose()


async def test_a_refusal_still_reaches_the_caller_with_its_predicate() -> None:
    clock = FakeClock()
    sched = InProcessScheduler(config(), clock, id_prefix="t")
    clock.advance(60.0)
    proc = Process(sched, clock)
    results = await asyncio.gather(
        proc.client.admit_turn(turn(clock, 100)),
        proc.client.admit_turn(turn(clock, 100, deadline_in=-1.0)),
        proc.client.admit_turn(turn(clock, 100, cls="vip")),
        return_exceptions=True,
    )
    assert isinstance(results[0], TurnGrant)
    assert isinstance(results[1], AdmissionRefused) and results[1].predicate == "deadline"
    assert isinstance(results[2], SchedulerInputError)
    await proc.client.aclose()
    await sched.aclose()


def provider_overruns(admissions: list[tuple[float, int]], limit: float, window: float) -> float:
    """The largest sum of ``admissions`` (time, amount) in any sliding window, minus ``limit``."""
    worst = 0.0
    inside: deque[tuple[float, int]] = deque()
    total = 0.0
    for at, amount in sorted(admissions):
        inside.append((at, amount))
        total += amount
        while inside[0][0] <= at - window:
            total -= inside.popleft()[1]
        worst = max(worst, total - limit)
    return worst


@pytest.mark.parametrize(
    ("think_s", "chunks_used"),
    # demand about 2800, 1100, 700, 350 requests/s against 1000/s: at or above the limit it is contended
    [(0.01, False), (0.025, False), (0.04, True), (0.08, True)],
)
async def test_chunks_never_over_grant_the_limit_across_many_holders(
    think_s: float, chunks_used: bool
) -> None:
    # Given 6 holder processes of 4 callers each, plus 4 lone callers, against one key (1000 requests/s
    # over a 2 s window, sub-window 0.5 s), each caller thinking ``think_s`` between turns: demand around
    # the limit, so the key swings between slack (chunks) and contention (per call)
    clock = FakeClock()
    window, tpm, rpm, sub = 2.0, 100_000, 2_000, 0.5
    limits = ProviderLimits(
        tokens_per_minute=tpm, requests_per_minute=rpm, headroom=0.0, window_s=window, sub_window_s=sub
    )
    leasing = LeaseConfig(max_requests=16, use_s=0.2, slack=0.3)
    sched = InProcessScheduler(config(limits, leasing), clock, id_prefix="t")
    procs = [Process(sched, clock, round_trip_s=0.002) for _ in range(10)]
    callers = [(procs[i // 4], "batch" if i % 2 else "interactive") for i in range(24)]
    callers += [(procs[6 + i], "standard") for i in range(4)]
    admissions: list[tuple[float, int]] = []
    used: list[tuple[float, int]] = []
    stop = clock.now() + 10.0

    async def loop(proc: Process, cls: str) -> None:
        while clock.now() < stop:
            try:
                grant = await proc.client.admit_turn(turn(clock, 50, cls, deadline_in=1.0))
            except AdmissionRefused:
                continue
            admissions.append((clock.now(), 1))
            used.append((clock.now(), 60))  # every turn uses a little more than it reserved
            await proc.settle(grant.grant_id, 60)
            await clock.sleep(think_s)

    # When they run for 10 simulated seconds
    tasks = [asyncio.ensure_future(loop(p, c)) for p, c in callers]
    while not all(task.done() for task in tasks):  # past stop: until every caller finished its turn
        await spin()
        clock.advance(0.005)
    await asyncio.gather(*tasks)
    # Then many turns came from chunks, and over every window and sub-window the requests, and over
    # every window the tokens actually used, stayed within the provider's limit
    leased = sum(p.client.leased for p in procs)
    assert (leased > 100) is chunks_used  # over the limit the key is contended: every turn per call
    assert provider_overruns(admissions, rpm, window) <= 0
    assert provider_overruns(admissions, limits.sub_share(rpm), sub) <= 0
    assert provider_overruns(used, tpm + 60, window) <= 0  # a debit lands after its admission: one turn
    for proc in procs:
        await proc.client.aclose()
    await sched.aclose()


def test_a_chunk_counts_in_the_window_until_the_last_moment_its_turns_could_go_out() -> None:
    # Given a key of 10 requests per 10 s window and a chunk of 4, all used at the end of its use_s
    clock = FakeClock()
    limits = ProviderLimits(
        tokens_per_minute=10**6, requests_per_minute=10, headroom=0.0, window_s=10.0, sub_window_s=0
    )
    core = SchedulerCore(
        config(limits, LeaseConfig(max_requests=4, use_s=1.0, slack=0.0)), clock, id_prefix="t"
    )
    clock.advance(10.0)
    lease = core.lease_turns(turn(clock, 10), 4)
    assert lease is not None and lease.requests == 4
    holder = LocalLease(lease)
    clock.advance(0.9)
    sent = [(clock.now(), 1) for _ in range(4) if holder.admit(turn(clock, 10), clock.wall())]
    core.end_lease(lease.lease_id, *holder.used())
    # When, a window after the chunk was granted, ten single turns ask at once
    clock.advance(9.6)
    for _ in range(10):
        core.submit_turn(turn(clock, 10))
    sent += [(clock.now(), 1) for d in core.tick() if isinstance(d, Admitted)]
    # Then only what leaves the provider's window with the chunk's turns is admitted: 6, not 10
    assert len(sent) == 4 + 6
    assert provider_overruns(sent, 10, 10.0) <= 0


async def test_on_a_contended_key_every_caller_of_a_process_queues_in_drr_on_its_own() -> None:
    # Given a fresh (empty) bucket and one process whose ten callers ask at once for turns that must wait
    clock = FakeClock()
    sched = InProcessScheduler(config(), clock, id_prefix="t")
    proc = Process(sched, clock)
    waiting = [asyncio.ensure_future(proc.client.admit_turn(turn(clock, 5_000))) for _ in range(10)]
    await spin()
    # Then none waits behind another's chunk request: all ten are queued in the scheduler, in DRR order
    assert sched.snapshot().pending == 10 and sched.snapshot().chunks == 0
    for future in waiting:
        future.cancel()
    await proc.client.aclose()
    await sched.aclose()
