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
from dataclasses import dataclass, field
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
from runtime.record import PromptAnchor

__all__ = ["anchored_estimate", "build_messages", "context_of", "estimate_from_chars", "estimate_tokens"]

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


def _answer_of(ev: Event) -> tuple[str, str, bool] | None:
    """The answer ``ev`` gives a call: (call id, the tool message's text, whether it replaces an earlier
    answer). Results replace earlier answers (a retried call's last attempt wins); a timeout, a cancel
    or a stopped child answers only a call nothing answered yet."""
    if isinstance(ev, ToolResultAccepted):
        return ev.call_id, _tool_result_text(ev), True
    if isinstance(ev, ToolCallTimedOut):
        text = json.dumps(
            {"status": "TIMED_OUT", "message": "No result before the deadline; outcome unknown."}
        )
        return ev.call_id, text, False
    if isinstance(ev, ToolCallCancelled):
        text = json.dumps({"status": "IN_DOUBT", "message": f"Cancelled ({ev.reason}); outcome unknown."})
        return ev.call_id, text, False
    if isinstance(ev, OperationSettled) and ev.call_id is not None:
        body: dict[str, Any] = {"status": ev.settlement.value.upper(), "recovered": ev.evidence}
        if ev.settlement is Settlement.ESTABLISHED:
            body["result"] = ev.result
        return ev.call_id, json.dumps(body, sort_keys=True, ensure_ascii=False, default=str), True
    if isinstance(ev, ChildSettled):  # issue 12: a delegated call's answer is its child's report
        return ev.call_id, json.dumps(dict(ev.report), sort_keys=True, ensure_ascii=False, default=str), True
    if isinstance(ev, ChildCancelled):
        text = json.dumps({"status": "CANCELLED", "message": f"The child was stopped ({ev.reason})."})
        return ev.call_id, text, False
    if isinstance(ev, ObservationAppended) and ev.observation is ObservationKind.REFUSAL:
        assert ev.call_id is not None  # guaranteed by ObservationAppended's own validation
        return ev.call_id, ev.content, True
    return None


def _message_of(ev: ObservationAppended) -> dict[str, Any] | None:
    kind = ev.observation
    if kind is ObservationKind.USER:
        return {"role": "user", "content": ev.content}
    if kind is ObservationKind.NOTICE:
        return {"role": "user", "content": f"[harness notice] {ev.content}"}
    if kind is ObservationKind.ERROR:
        return {"role": "user", "content": f"[harness error] {ev.content}"}
    if kind is ObservationKind.ASSISTANT:
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
        return msg
    return None


def _tool_message(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def build_messages(events: Iterable[Event], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """OpenAI chat messages for the next model call, from the trajectory's events in log order."""
    events = list(events)
    answers: dict[str, str] = {}
    for ev in events:
        answer = _answer_of(ev)
        if answer is not None:
            call_id, text, replaces = answer
            if replaces or call_id not in answers:
                answers[call_id] = text
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    for ev in events:
        if not isinstance(ev, ObservationAppended):
            continue
        msg = _message_of(ev)
        if msg is None:
            continue
        messages.append(msg)
        for call in ev.tool_calls if ev.observation is ObservationKind.ASSISTANT else ():
            messages.append(_tool_message(call.call_id, answers.get(call.call_id, _NOT_EXECUTED)))
    return messages


def _chars(message: Mapping[str, Any]) -> int:
    return len(json.dumps(message, ensure_ascii=False, default=str))


def estimate_tokens(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> int:
    """A deliberately high estimate of prompt tokens (about 3 characters per token plus framing).

    Admission reserves this plus ``max_tokens``; settlement corrects it with the provider's report, so
    overestimating costs only brief over-reservation while underestimating could overrun a ceiling.
    """
    chars = sum(_chars(m) for m in messages) + sum(_chars(t) for t in tools)
    return estimate_from_chars(chars, len(messages))


def estimate_from_chars(chars: int, n_messages: int) -> int:
    """``estimate_tokens`` from the JSON characters of the messages and tools and the number of messages."""
    return chars // 3 + 8 * n_messages + 16


def anchored_estimate(plain: int, anchor: PromptAnchor | None) -> int:
    """The prompt estimate admission reserves, given its plain estimate and the last metered prompt.

    A turn's prompt is the previous prompt plus what the transcript gained, so once the provider has
    counted the previous one, the estimate is that count plus the plain estimate of the growth. Characters
    over-count JSON transcripts about threefold (keys, quoting, call ids), and a reservation that large
    leaves the shared bucket's margin unused; the provider's count is exact for the prefix and calibrates
    to its tokenizer in both directions. With nothing metered (the first turn, a provider that reports no
    usage), or a prompt smaller than the metered one (its prefix changed), the plain estimate stands.
    """
    if anchor is None or anchor.basis <= 0 or plain < anchor.basis:
        return plain
    return anchor.reported + (plain - anchor.basis)


@dataclass(slots=True)
class _Context:
    """The messages built so far for one trajectory's transcript, kept to extend on the next turn."""

    transcript: tuple[object, ...]
    system_prompt: str | None
    messages: list[dict[str, Any]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # each message's JSON characters
    chars: int = 0
    answers: dict[str, str] = field(default_factory=dict)
    tool_at: dict[str, list[int]] = field(default_factory=dict)  # call id -> its tool messages

    def add(self, message: dict[str, Any]) -> None:
        size = _chars(message)
        self.messages.append(message)
        self.sizes.append(size)
        self.chars += size

    def put(self, i: int, message: dict[str, Any]) -> None:
        size = _chars(message)
        self.chars += size - self.sizes[i]
        self.messages[i], self.sizes[i] = message, size

    def extend(self, events: Iterable[object]) -> None:
        for ev in events:
            answer = _answer_of(ev)  # type: ignore[arg-type]
            if answer is not None:
                call_id, text, replaces = answer
                if replaces or call_id not in self.answers:
                    self.answers[call_id] = text
                    # a new dict for each: the ones handed out with an earlier turn stay as they were
                    for i in self.tool_at.get(call_id, ()):
                        self.put(i, _tool_message(call_id, text))
            if not isinstance(ev, ObservationAppended):
                continue
            msg = _message_of(ev)
            if msg is None:
                continue
            self.add(msg)
            for call in ev.tool_calls if ev.observation is ObservationKind.ASSISTANT else ():
                self.tool_at.setdefault(call.call_id, []).append(len(self.messages))
                self.add(_tool_message(call.call_id, self.answers.get(call.call_id, _NOT_EXECUTED)))


# One entry per trajectory, keyed by its transcript's first event (held, so its id cannot be reused).
_CONTEXTS: dict[int, tuple[object, _Context]] = {}
_CONTEXTS_MAX = 4096


def context_of(
    transcript: tuple[object, ...], system_prompt: str | None = None
) -> tuple[list[dict[str, Any]], int]:
    """``build_messages(transcript, system_prompt)`` and the JSON characters of those messages, extended
    from the previous turn's build when ``transcript`` extends the transcript it was built from (each
    turn then costs what it added, not the whole transcript again). The list is fresh; its dicts are
    shared with later builds and must not be changed."""
    key = id(transcript[0]) if transcript else None
    known = _CONTEXTS.get(key) if key is not None else None
    built = known[1] if known is not None and known[0] is transcript[0] else None
    n = len(built.transcript) if built is not None else 0
    if (
        built is None
        or built.system_prompt != system_prompt
        or len(transcript) < n
        or transcript[:n] != built.transcript
    ):
        built = _Context((), system_prompt)
        if system_prompt:
            built.add({"role": "system", "content": system_prompt})
        n = 0
    built.extend(transcript[n:])
    if key is None:
        return list(built.messages), built.chars
    built.transcript = transcript
    if len(_CONTEXTS) >= _CONTEXTS_MAX and key not in _CONTEXTS:
        _CONTEXTS.clear()
    _CONTEXTS[key] = (transcript[0], built)
    return list(built.messages), built.chars
