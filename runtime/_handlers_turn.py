"""Handlers for the turn itself: turn starts, the model call of each CALLING_MODEL episode, the observations
appended from its reply, and the completion check run in FINALIZING.

Model usage is metered from the provider's report, and every attempt is charged, aborted ones included. Only
a reply that ended cleanly is appended to the context (quarantine), and only a tool_use reply proposes calls.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime._handlers_common import Handler, appended, charged, refuse, require_state
from runtime._replace import replace
from runtime.budget import Dimension, PriceTable, meter_model_call, meter_turn
from runtime.events import (
    CompletionChecked,
    Event,
    ModelCallCancelled,
    ModelCallFailed,
    ModelCallIntent,
    ModelCallSettled,
    ObservationAppended,
    ObservationKind,
    TrajectoryCreated,
    TurnAbandoned,
    TurnRequested,
    TurnStarted,
)
from runtime.ports import StopReason, Usage
from runtime.record import ModelCall, ModelOutcome, PromptAnchor, TrajectoryRecord, TurnRequestState
from runtime.states import ExitReason, TrajectoryState

S = TrajectoryState


def _model_charge(usage: Usage, dollars: float) -> dict[str, float]:
    # the event carries the dollars priced when it was decided; tokens are the provider's report
    spend = meter_model_call(usage, PriceTable(0.0, 0.0, 0.0))
    return {**spend.as_dict(), Dimension.DOLLARS: dollars}


def _created(rec: TrajectoryRecord, ev: TrajectoryCreated) -> TrajectoryRecord:
    return refuse(rec, ev, "already_created", "a log has exactly one trajectory_created, first")


def _completion_checked(rec: TrajectoryRecord, ev: CompletionChecked) -> TrajectoryRecord:
    require_state(rec, ev, S.FINALIZING)
    if ev.check != rec.contract.completion_check.name:
        refuse(rec, ev, "wrong_check", f"the contract names {rec.contract.completion_check.name!r}")
    if rec.check_passed is not None:
        refuse(rec, ev, "already_checked", "the completion check has a verdict")
    exit_reason = rec.exit_reason
    if exit_reason is ExitReason.COMPLETED and not ev.passed:
        exit_reason = ExitReason.COMPLETION_CHECK_FAILED
    return replace(rec, check_passed=ev.passed, exit_reason=exit_reason)


def _turn_requested(rec: TrajectoryRecord, ev: TurnRequested) -> TrajectoryRecord:
    require_state(rec, ev, S.READY)
    if rec.turn_request is not None:
        refuse(rec, ev, "turn_already_requested", f"request {rec.turn_request.request_id!r} stands")
    request = TurnRequestState(
        ev.request_id, ev.estimated_tokens, ev.max_tokens, ev.prompt_tokens, prompt_basis=ev.prompt_basis
    )
    return replace(rec, turn_request=request)


def _turn_abandoned(rec: TrajectoryRecord, ev: TurnAbandoned) -> TrajectoryRecord:
    if rec.turn_request is None or rec.turn_request.request_id != ev.request_id:
        refuse(rec, ev, "no_such_request", f"no standing turn request {ev.request_id!r}")
    return replace(rec, turn_request=None)


def _turn_started(rec: TrajectoryRecord, ev: TurnStarted) -> TrajectoryRecord:
    require_state(rec, ev, S.READY)
    if ev.turn != rec.turn_count + 1:
        refuse(rec, ev, "turn_out_of_order", f"next turn is {rec.turn_count + 1}, got {ev.turn}")
    return replace(rec, turn_count=ev.turn, spend=charged(rec, meter_turn().as_dict()), turn_request=None)


def _model_intent(rec: TrajectoryRecord, ev: ModelCallIntent) -> TrajectoryRecord:
    require_state(rec, ev, S.CALLING_MODEL)
    if rec.model_call is not None:
        refuse(rec, ev, "one_call_per_episode", "this CALLING_MODEL episode already made its call")
    if ev.model != rec.limits.model:
        refuse(rec, ev, "model_mismatch", f"the per-call limits name {rec.limits.model!r}")
    if ev.max_tokens > rec.limits.max_output_tokens:
        refuse(rec, ev, "max_tokens_above_limit", f"limit is {rec.limits.max_output_tokens}")
    if rec.deadline is not None and ev.deadline > rec.deadline:
        refuse(rec, ev, "deadline_beyond_trajectory", "inner deadlines are clamped to the trajectory's")
    call = ModelCall(
        ev.grant_id,
        ev.model,
        ev.max_tokens,
        ev.deadline,
        prompt_tokens=ev.prompt_tokens,
        prompt_basis=ev.prompt_basis,
    )
    return replace(rec, model_call=call)


def _model_ended(
    rec: TrajectoryRecord, ev: Event, outcome: ModelOutcome, usage: Usage, dollars: float
) -> TrajectoryRecord:
    require_state(rec, ev, S.CALLING_MODEL)
    if rec.model_call is None or rec.model_call.outcome is not None:
        refuse(rec, ev, "no_call_in_flight", "no model call is in flight")
    # Usage is metered from the provider's report; every attempt, aborted ones included, is charged.
    return replace(
        rec,
        model_call=replace(rec.model_call, outcome=outcome),
        spend=charged(rec, _model_charge(usage, dollars)),
    )


def _model_settled(rec: TrajectoryRecord, ev: ModelCallSettled) -> TrajectoryRecord:
    ended = _model_ended(rec, ev, ModelOutcome(ev.stop_reason.value), ev.usage, ev.dollars)
    refused = ev.stop_reason is StopReason.REFUSAL
    anchor = rec.prompt_anchor
    basis = rec.model_call.prompt_basis if rec.model_call is not None else 0
    if basis > 0 and ev.counted_prompt > 0:  # only the provider's own count anchors the next estimate
        anchor = PromptAnchor(basis, ev.counted_prompt)
    return replace(ended, model_failures=0, refusals=rec.refusals + refused, prompt_anchor=anchor)


def _model_cancelled(rec: TrajectoryRecord, ev: ModelCallCancelled) -> TrajectoryRecord:
    return _model_ended(rec, ev, ModelOutcome.CANCELED, ev.usage, ev.dollars)


def _model_failed(rec: TrajectoryRecord, ev: ModelCallFailed) -> TrajectoryRecord:
    ended = _model_ended(rec, ev, ModelOutcome.FAILED, ev.usage, ev.dollars)
    if not ev.rate_limited:
        return replace(ended, model_failures=rec.model_failures + 1)
    # A 429 is admission feedback, not a failure of the model (issue 15): the turn it consumed is given back
    # (whatever the provider billed stays charged), and the consecutive-failure count is untouched.
    turns = ended.spend.get(Dimension.TURNS)
    return replace(
        ended,
        turn_count=max(0, rec.turn_count - 1),
        spend=ended.spend.with_value(Dimension.TURNS, max(0.0, turns - 1.0)),
    )


_PARSED = frozenset(
    {ModelOutcome.END_TURN, ModelOutcome.MAX_TOKENS, ModelOutcome.TOOL_USE, ModelOutcome.REFUSAL}
)


def _observation(rec: TrajectoryRecord, ev: ObservationAppended) -> TrajectoryRecord:
    if ev.observation is ObservationKind.ASSISTANT:
        # Quarantine: only a reply that ended cleanly is appended, and only a tool_use reply carries calls.
        require_state(rec, ev, S.CALLING_MODEL)
        if rec.model_call is None or rec.model_call.outcome not in _PARSED:
            refuse(rec, ev, "reply_not_parseable", "an aborted or failed call has no reply to append")
        if ev.tool_calls and rec.model_call.outcome is not ModelOutcome.TOOL_USE:
            refuse(rec, ev, "truncated_reply_not_parsed", "only a tool_use reply proposes calls")
    return replace(rec, transcript=appended(rec.transcript, ev))


HANDLERS: Mapping[type, Handler] = {
    TrajectoryCreated: _created,
    CompletionChecked: _completion_checked,
    TurnRequested: _turn_requested,
    TurnAbandoned: _turn_abandoned,
    TurnStarted: _turn_started,
    ModelCallIntent: _model_intent,
    ModelCallSettled: _model_settled,
    ModelCallCancelled: _model_cancelled,
    ModelCallFailed: _model_failed,
    ObservationAppended: _observation,
}
"""The turn's rules, by event type, for ``runtime.fold.apply``."""
