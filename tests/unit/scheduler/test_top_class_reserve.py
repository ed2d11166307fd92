"""The top class's reserve (``SchedulerConfig.top_class_reserve``, off by default), on a fake clock: an
interactive turn arriving while standard and batch keep the key full is admitted at once, instead of waiting
for room behind their turns and for a round of DRR; the weights still hold while every class is
backlogged."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable

import pytest

from runtime.clock import FakeClock
from runtime.ports import TurnRequest
from scheduler.config import ProviderLimits, SchedulerConfig
from scheduler.core import Admitted, SchedulerCore
from scheduler.drr import DeficitRoundRobin

KEY = "http://provider/v1|model-a"
LIMITS = ProviderLimits(tokens_per_minute=60_000, requests_per_minute=6_000, headroom=0.0)  # 1000 tok/s
RESERVE = 0.01  # 600 tokens: a couple of interactive turns
_ids = itertools.count()


def config(reserve: float) -> SchedulerConfig:
    return SchedulerConfig(providers={KEY: LIMITS}, top_class_reserve=reserve, leasing=None)


def turn(clock: FakeClock, cls: str, tokens: int) -> TurnRequest:
    return TurnRequest(f"t{next(_ids)}", cls, KEY, tokens, clock.wall() + 3_600.0)


def run(core: SchedulerCore, clock: FakeClock, until: float, tickets: dict[int, str]) -> list[Admitted]:
    """Tick whenever the core asks to be woken, until ``until``; the admissions in order."""
    out: list[Admitted] = []
    while (wake := core.next_wakeup()) is not None and wake <= until:
        clock.advance(max(0.0, wake - clock.now()))
        out += [d for d in core.tick() if isinstance(d, Admitted)]
    clock.advance(max(0.0, until - clock.now()))
    out += [d for d in core.tick() if isinstance(d, Admitted)]
    for d in out:
        assert d.ticket in tickets
    return out


# --------------------------------------------------------------------------- DRR


def test_a_first_class_returning_from_an_empty_queue_is_visited_next_not_at_the_back() -> None:
    for first, expected in (((), ["b2", "c1", "a1"]), (("a",), ["b2", "a1", "c1"])):
        drr: DeficitRoundRobin[str] = DeficitRoundRobin({"a": 4, "b": 2, "c": 1}, quantum=100, first=first)
        drr.push("b", "b1", 100)  # b is visited first: its 200 of credit pay for both of its turns
        drr.push("b", "b2", 100)
        drr.push("c", "c1", 100)
        assert drr.pop()[1] == "b1"
        drr.push("a", "a1", 100)  # a returns from an empty queue in the middle of b's visit
        # without first: b finishes its visit, then c, then a at the back; with it: a right after b
        assert [drr.pop()[1] for _ in range(3)] == expected, first


def test_an_early_turn_is_paid_from_the_round_s_credit_and_not_earned_twice() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin({"a": 2, "b": 1}, quantum=100)
    for i in range(3):
        drr.push("a", f"a{i}", 150)
    drr.push("b", "b0", 100)
    assert drr.peek() is not None and drr.peek()[1] == "a0"  # a is visited first with 200 of credit
    assert drr.early("a") == ("a0", 150)
    assert drr.pop_early("a")[1] == "a0"  # 50 left this visit: not enough for a1
    assert drr.early("a") is None
    with pytest.raises(LookupError):
        drr.pop_early("a")
    # the ring goes on: a's visit ends (50 < 150), b pays 100, then a earns its next 200 (250 in all)
    assert [drr.pop()[1] for _ in range(3)] == ["b0", "a1", "a2"]
    assert drr.deficits()["a"] == 0.0  # emptied: no banked credit


def test_first_names_known_classes() -> None:
    with pytest.raises(ValueError, match="unknown classes"):
        DeficitRoundRobin({"a": 1}, quantum=10, first=("z",))


# --------------------------------------------------------------------------- the scheduler


@pytest.mark.parametrize("reserve", [RESERVE, 0.0], ids=["reserve", "control-off"])
def test_an_arriving_interactive_turn_is_admitted_at_once_while_lower_classes_keep_the_key_full(
    reserve: float,
) -> None:
    # Given standard and batch turns backlogged far beyond the limit (1000 tokens/s)
    clock = FakeClock()
    core = SchedulerCore(config(reserve), clock, id_prefix="r")
    tickets: dict[int, str] = {}
    for _ in range(200):
        for cls, size in (("standard", 1_500), ("batch", 4_000)):
            tickets[core.submit_turn(turn(clock, cls, size))] = cls
    run(core, clock, clock.now() + 90.0, tickets)  # a full window: the key runs at its limit
    # When an interactive user's turn of 200 tokens arrives every 4 s for two minutes
    users: list[int] = []
    admitted: list[Admitted] = []
    for _ in range(30):
        users.append(core.submit_turn(turn(clock, "interactive", 200)))
        tickets[users[-1]] = "interactive"
        admitted += run(core, clock, clock.now() + 4.0, tickets)
    admitted += run(core, clock, clock.now() + 60.0, tickets)  # (the control's last ones)
    waits = [d.waited_s for d in admitted if d.ticket in set(users)]
    # Then each was admitted the moment it arrived; without the reserve (control) it waited for room
    # behind the lower classes' turns (a 4,000-token batch turn alone needs 4 s of refill) and for DRR
    assert len(waits) == 30
    if reserve:
        assert max(waits) == 0.0, waits
    else:
        assert statistics.median(waits) >= 0.5, waits


def test_with_every_class_backlogged_the_weights_hold_and_the_limit_is_used() -> None:
    # Given every class backlogged with turns of different sizes, the reserve on
    clock = FakeClock()
    core = SchedulerCore(config(RESERVE), clock, id_prefix="w")
    sizes = {"interactive": 800, "standard": 1_500, "batch": 4_000}
    tickets: dict[int, str] = {}
    for cls, size in sizes.items():
        for _ in range(600_000 // size + 1):
            tickets[core.submit_turn(turn(clock, cls, size))] = cls
    # When 10 simulated minutes pass
    tokens = dict.fromkeys(sizes, 0)
    for d in run(core, clock, clock.now() + 600.0, tickets):
        tokens[tickets[d.ticket]] += d.grant.reserved_tokens
    # Then shares follow 4:2:1 within a percentage point (the top class goes early only on its credit),
    # and the limit was used as without the reserve (test_core: at least 95 % of it)
    total = sum(tokens.values())
    assert 0.95 * 600_000 <= total <= 600_000
    for cls, weight in {"interactive": 4, "standard": 2, "batch": 1}.items():
        assert tokens[cls] / total == pytest.approx(weight / 7.0, abs=0.01)


def test_with_every_class_backlogged_the_reserve_keeps_no_room_the_top_class_cannot_use() -> None:
    # Given every class backlogged, and a large reserve (5 % of the limit)
    def used(reserve: float) -> int:
        clock = FakeClock()
        core = SchedulerCore(config(reserve), clock, id_prefix=f"u{reserve}")
        tickets: dict[int, str] = {}
        for cls, size in {"interactive": 800, "standard": 1_500, "batch": 4_000}.items():
            for _ in range(600_000 // size + 1):
                tickets[core.submit_turn(turn(clock, cls, size))] = cls
        return sum(d.grant.reserved_tokens for d in run(core, clock, clock.now() + 600.0, tickets))

    # When 10 simulated minutes pass, with the reserve and without it
    with_reserve, without = used(0.05), used(0.0)
    # Then the reserve cost nothing: it is kept only while a waiting top-class turn could go early on its
    # credit of the round. (Kept whenever the top class waited, the rule of 65cb4ef, it cost 3.4 %: 574,700
    # tokens against 595,100, and this failed.)
    assert with_reserve >= 0.995 * without, (with_reserve, without)


def test_the_reserve_lapses_when_the_top_class_has_been_quiet_for_a_window() -> None:
    # Given standard and batch turns keeping the key full, and one interactive turn, all at the start
    def granted_by(reserve: float) -> Callable[[float], int]:
        clock = FakeClock()
        core = SchedulerCore(config(reserve), clock, id_prefix=f"l{reserve}")
        tickets: dict[int, str] = {}
        for _ in range(400):
            for cls, size in (("standard", 1_500), ("batch", 4_000)):
                tickets[core.submit_turn(turn(clock, cls, size))] = cls
        tickets[core.submit_turn(turn(clock, "interactive", 200))] = "interactive"
        # When the interactive class stays quiet for three windows
        admitted = run(core, clock, clock.now() + 3 * LIMITS.window_s, tickets)
        lower = [
            (d.waited_s, d.grant.reserved_tokens) for d in admitted if tickets[d.ticket] != "interactive"
        ]
        return lambda t: sum(tokens for at, tokens in lower if at <= t)  # granted by t s from the start

    held, control = granted_by(0.05), granted_by(0.0)

    def behind(start: float, end: float) -> float:
        """How far the lower classes were behind the control, on average over [start, end) s."""
        times = [start + 0.1 * i for i in range(int((end - start) * 10))]
        return statistics.mean(control(t) - held(t) for t in times)

    window = LIMITS.window_s
    # Then within the window of its request the lower classes left the reserve free (5 % of the limit:
    # 3,000 tokens, 3 s of refill), and once that window passed they had the whole limit again and caught
    # up: by the end they were granted what they were without the reserve (with the lapse taken away, the
    # top class always counting as recent, 167,000 against 174,500, and this failed)
    assert behind(10.0, window) >= 2_500
    assert held(3 * window) >= control(3 * window) - 1_000, (held(3 * window), control(3 * window))
