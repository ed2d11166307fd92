"""The model's context, rebuilt from the trajectory's events.

The transcript is what the model reads; the record is what the harness reads. The harness keeps no
separate transcript: the chat messages for the next call are a projection of the same log the record
folds from, so a restarted actor sends exactly the context it would have sent.

Rules of the projection:
- observations become messages (user, assistant with its proposed calls, notices, errors);
- every proposed call gets exactly one ``tool`` message (the OpenAI protocol requires it): the last
  accepted result for its call id, else its timeout / cancellation / refusal, else "not executed";
- a truncated, refused or aborted reply was never parsed into calls, so it carries none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from runtime.events import (
    ChildCancelled,
    ChildSettled,
    Event,
    ObservationAppended,
    ObservationKind,
    OperationSettled,
    ToolCallCancelled,
    ToolCallTimedOut,
    ToolResultAccepted,
)
from runtime.ports import Settlement

__all__ = ["build_messages", "estimate_tokens"]

_NOT_EXECUTED = json.dumps({"status": "NOT_EXECUTED", "message": "This call was not dispatched."})


# Every turn rebuilds the context from the whole transcript: each (immutable) result event is rendered once
# and remembered by identity (the event is held, so its id cannot be reused), in a bounded table.
_RENDERED: dict[int, tuple[ToolResultAccepted, str]] = {}
_RENDERED_MAX = 20_000


def _tool_result_text(ev: ToolResultAccepted) -> str:
    known = _RENDERED.get(id(ev))
    if known is not None and known[0] is ev:
        return known[1]
    text = _render_result(ev)
    if len(_RENDERED) >= _RENDERED_MAX:
        _RENDERED.clear()
    _RENDERED[id(ev)] = (ev, text)
    return text


def _render_result(ev: ToolResultAccepted) -> str:
    body: dict[str, Any] = {"status": ev.settlement.value.upper()}
    if ev.error:
        body["error"] = ev.error
    if ev.settlement is Settlement.ESTABLISHED and ev.error is None:
        body["result"] = ev.result
    return json.dumps(body, sort_keys=True, ensure_ascii=False, default=str)


def build_messages(events: Iterable[Event], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """OpenAI chat messages for the next model call, from the trajectory's events in log order."""
    events = list(events)
    # The answer to each call id: results replace earlier answers (a retried call's last attempt wins).
    answers: dict[str, str] = {}
    for ev in events:
        if isinstance(ev, ToolResultAccepted):
            answers[ev.call_id] = _tool_result_text(ev)
        elif isinstance(ev, ToolCallTimedOut):
            answers.setdefault(
                ev.call_id,
                json.dumps(
                    {"status": "TIMED_OUT", "message": "No result before the deadline; outcome unknown."}
                ),
            )
        elif isinstance(ev, ToolCallCancelled):
            answers.setdefault(
                ev.call_id,
                json.dumps({"status": "IN_DOUBT", "message": f"Cancelled ({ev.reason}); outcome unknown."}),
            )
        elif isinstance(ev, OperationSettled) and ev.call_id is not None:
            body: dict[str, Any] = {"status": ev.settlement.value.upper(), "recovered": ev.evidence}
            if ev.settlement is Settlement.ESTABLISHED:
                body["result"] = ev.result
            answers[ev.call_id] = json.dumps(body, sort_keys=True, ensure_ascii=False, default=str)
        elif isinstance(ev, ChildSettled):  # issue 12: a delegated call's answer is its child's report
            answers[ev.call_id] = json.dumps(dict(ev.report), sort_keys=True, ensure_ascii=False, default=str)
        elif isinstance(ev, ChildCancelled):
            answers.setdefault(
                ev.call_id,
                json.dumps({"status": "CANCELLED", "message": f"The child was stopped ({ev.reason})."}),
            )
        elif isinstance(ev, ObservationAppended) and ev.observation is ObservationKind.REFUSAL:
            assert ev.call_id is not None  # guaranteed by ObservationAppended's own validation
            answers[ev.call_id] = ev.content

    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    for ev in events:
        if not isinstance(ev, ObservationAppended):
            continue
        kind = ev.observation
        if kind is ObservationKind.USER:
            messages.append({"role": "user", "content": ev.content})
        elif kind is ObservationKind.NOTICE:
            messages.append({"role": "user", "content": f"[harness notice] {ev.content}"})
        elif kind is ObservationKind.ERROR:
            messages.append({"role": "user", "content": f"[harness error] {ev.content}"})
        elif kind is ObservationKind.ASSISTANT:
            msg: dict[str, Any] = {"role": "assistant", "content": ev.content or None}
            if ev.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.tool, "arguments": call.raw_arguments},
                    }
                    for call in ev.tool_calls
                ]
            messages.append(msg)
            for call in ev.tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.call_id,
                        "content": answers.get(call.call_id, _NOT_EXECUTED),
                    }
                )
    return messages


def estimate_tokens(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> int:
    """A deliberately high estimate of prompt tokens (about 3 characters per token plus framing).

    Admission reserves this plus ``max_tokens``; settlement corrects it with the provider's report, so
    overestimating costs only brief over-reservation while underestimating could overrun a ceiling.
    """
    chars = sum(len(json.dumps(m, ensure_ascii=False, default=str)) for m in messages)
    chars += sum(len(json.dumps(t, ensure_ascii=False, default=str)) for t in tools)
    return chars // 3 + 8 * len(messages) + 16
