"""The prompt estimate a turn reserves is anchored to the provider's count of the previous prompt.

Each turn's prompt is the previous one plus what the transcript gained. Once the provider has reported how
many tokens the previous prompt was, the next turn reserves that count plus the character estimate of the
growth, rather than re-estimating the whole prompt from characters (about 3x too high for JSON-heavy
transcripts, which leaves tokens of the shared bucket unused at the margin). A reply whose usage the
provider did not report anchors nothing: that is the control, where every turn reserves the plain estimate.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from runtime.clock import FakeClock
from runtime.context import anchored_estimate
from runtime.effects import RequestAdmission
from runtime.events import ModelCallIntent, ModelCallSettled, TurnRequested
from runtime.ports import ModelReply, StopReason, ToolCallProposal, Usage
from runtime.record import PromptAnchor
from runtime.states import TrajectoryState

from .sim import Sim, created, tool_results


def counted(prompt_of: Callable[[int], int], *, calls: int = 3, reported: bool = True):  # type: ignore[no-untyped-def]
    """A script that runs the tests ``calls`` times, then finishes; the k-th reply reports ``prompt_of(k)``
    prompt tokens (or, with ``reported=False``, carries the adapter's estimate instead of a report)."""

    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        k = tool_results(messages)
        usage = Usage(prompt_of(k), 0, 20)
        if k < calls:
            proposal = ToolCallProposal(f"call-{k}", "run_tests", json.dumps({"suite": f"s{k}"}))
            return ModelReply(StopReason.TOOL_USE, "", [proposal], usage, usage_estimated=not reported)
        return ModelReply(StopReason.END_TURN, "done", [], usage, usage_estimated=not reported)

    return script


def requests_of(sim: Sim) -> list[TurnRequested]:
    return [e for e in sim.log if isinstance(e, TurnRequested)]


def run(script: Any) -> Sim:
    clock = FakeClock()
    sim = Sim(script, clock)
    sim.start(created(clock))
    assert sim.run().state is TrajectoryState.COMPLETED
    return sim


def test_after_the_first_turn_each_turn_reserves_the_reported_prompt_plus_its_growth() -> None:
    reported = [130, 175, 221, 260]
    sim = run(counted(lambda k: reported[k]))
    asked = requests_of(sim)
    assert len(asked) == 4
    # the first turn has nothing metered yet: it reserves the plain character estimate
    assert asked[0].prompt_tokens == asked[0].prompt_basis > 0
    for k in range(1, 4):
        growth = asked[k].prompt_basis - asked[k - 1].prompt_basis
        assert growth > 0
        assert asked[k].prompt_tokens == reported[k - 1] + growth
        assert asked[k].prompt_tokens < asked[k].prompt_basis  # tighter than the character estimate
        assert asked[k].estimated_tokens == asked[k].prompt_tokens + asked[k].max_tokens
    # what admission was asked for is the anchored reservation, and the intent carries both figures
    admissions = [e for e in sim.effects if isinstance(e, RequestAdmission)]
    assert [a.request.estimated_tokens for a in admissions] == [r.estimated_tokens for r in asked]
    intents = [e for e in sim.log if isinstance(e, ModelCallIntent)]
    assert [(i.prompt_tokens, i.prompt_basis) for i in intents] == [
        (r.prompt_tokens, r.prompt_basis) for r in asked
    ]


def test_control_unreported_usage_anchors_nothing() -> None:
    sim = run(counted(lambda k: 100 + k, reported=False))
    asked = requests_of(sim)
    assert len(asked) == 4
    assert all(r.prompt_tokens == r.prompt_basis for r in asked)


def test_a_provider_that_counts_more_than_the_estimate_raises_the_reservation() -> None:
    # A tokenizer denser than three characters per token: the anchor follows the count up, not only down.
    sim = run(counted(lambda k: 5_000 + 100 * k))
    asked = requests_of(sim)
    assert all(r.prompt_tokens > 5_000 > r.prompt_basis for r in asked[1:])


def test_the_anchor_survives_a_restart() -> None:
    reported = [130, 175, 221, 260]
    clock = FakeClock()
    sim = Sim(counted(lambda k: reported[k]), clock, hold_model=True)
    sim.start(created(clock))
    sim.run()
    sim.release_model()  # the first call settles and is logged; the second is then held in flight
    sim.run()
    before = sim.rec.prompt_anchor
    assert before is not None and before.reported == reported[0]
    sim.hold_model = False
    restarted_at = len(sim.log)
    sim.restart()
    assert sim.rec.prompt_anchor == before
    assert sim.run(until=clock.wall() + 1).state is TrajectoryState.COMPLETED
    # every request after the restart is anchored to the call settled last before it
    assert any(isinstance(e, ModelCallSettled) for e in sim.log[restarted_at:])
    intent: ModelCallIntent | None = None
    anchor: PromptAnchor | None = None
    for event in sim.log:
        if isinstance(event, ModelCallIntent):
            intent = event
        elif isinstance(event, ModelCallSettled) and intent is not None:
            anchor = PromptAnchor(intent.prompt_basis, event.usage.uncached_input)
        elif isinstance(event, TurnRequested) and anchor is not None:
            assert event.prompt_tokens == anchor.reported + event.prompt_basis - anchor.basis


@pytest.mark.parametrize(
    ("plain", "anchor", "expected"),
    [
        (900, None, 900),  # nothing metered yet
        (900, PromptAnchor(basis=0, reported=300), 900),  # an anchor without a basis is unusable
        (900, PromptAnchor(basis=600, reported=200), 500),  # the count plus the growth since
        (900, PromptAnchor(basis=900, reported=200), 200),  # nothing added since
        (500, PromptAnchor(basis=600, reported=200), 500),  # the prompt shrank: its prefix changed
    ],
)
def test_anchored_estimate(plain: int, anchor: PromptAnchor | None, expected: int) -> None:
    assert anchored_estimate(plain, anchor) == expected
