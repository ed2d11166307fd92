"""The server's effect table: what each effect key has done, for dedupe, Probe and Cancel.

One entry per ``(tool, effect_key)``. The entry is the endpoint's correlated evidence about that
key (recovery chapter, settlement rule): APPLIED is established, ABSENT is established absent,
IN_FLIGHT and UNKNOWN settle nothing.

Fencing makes "absent" safe to say. A Probe or Cancel that finds no entry cannot know whether an
attempt is still in transit; it raises the key's *fence*, and any later attempt that carries a lower
fence is refused. So the answer "absent" stays true even when the original request arrives late
(the chapter's race: an environment instantiated seconds after someone concluded it was absent).

The table lives as long as the server process; a tool with durable state of its own should keep
the truth there too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import grpc

__all__ = ["EffectEntry", "EffectOutcome", "EffectState", "EffectTable"]

Key = tuple[str, str]  # (tool, effect key)


class EffectState(StrEnum):
    """What the server knows about one effect key."""

    IN_FLIGHT = "in_flight"  # running now (or joined by a duplicate attempt)
    APPLIED = "applied"  # committed; ``result_json`` is its result
    ABSENT = "absent"  # refused before any effect, or cancelled before it committed
    UNKNOWN = "unknown"  # the tool crashed mid-way: it may have applied part of the effect


@dataclass(frozen=True, slots=True)
class EffectOutcome:
    """What one effect task ended with. ``code``/``retry_after`` describe a refusal."""

    state: EffectState
    result_json: str = ""
    detail: str = ""
    code: grpc.StatusCode | None = None
    retry_after: float | None = None


@dataclass(slots=True)
class EffectEntry:
    """Mutable bookkeeping for one key; only the table writes it."""

    state: EffectState
    task: asyncio.Task[EffectOutcome] | None = None  # settles the entry; awaited by callers
    work: asyncio.Task[EffectOutcome] | None = None  # runs the tool; cancelled by Cancel
    result_json: str = ""
    detail: str = ""
    applications: int = 0  # how many effect tasks for this key committed (> 1 only when dedupe is off)
    cancellable: bool = False


@dataclass(slots=True)
class EffectTable:
    """Effect entries and fences. Single event loop; not thread-safe by design."""

    _entries: dict[Key, EffectEntry] = field(default_factory=dict)
    _fences: dict[Key, int] = field(default_factory=dict)

    def get(self, tool: str, effect_key: str) -> EffectEntry | None:
        """The entry for a key, if any attempt ever arrived."""
        return self._entries.get((tool, effect_key))

    def fence(self, tool: str, effect_key: str) -> int:
        """The current fence of a key (0 = never fenced)."""
        return self._fences.get((tool, effect_key), 0)

    def raise_fence(self, tool: str, effect_key: str) -> int:
        """Refuse every attempt carrying the current fence or lower; return the new fence."""
        key = (tool, effect_key)
        self._fences[key] = self._fences.get(key, 0) + 1
        return self._fences[key]

    def start(
        self, tool: str, effect_key: str, work: Coroutine[Any, Any, EffectOutcome], *, cancellable: bool
    ) -> asyncio.Task[EffectOutcome]:
        """Run ``work`` as the key's effect task and mark the key IN_FLIGHT.

        The task belongs to the table, not to an RPC: a caller whose deadline passes stops waiting,
        while the effect finishes (or refuses to commit) on its own terms and records the outcome.
        """
        key = (tool, effect_key)
        entry = self._entries.get(key)
        if entry is None:
            entry = EffectEntry(state=EffectState.IN_FLIGHT)
            self._entries[key] = entry
        entry.state = EffectState.IN_FLIGHT
        entry.cancellable = cancellable
        entry.detail = ""
        loop = asyncio.get_running_loop()
        # Two tasks: ``work`` runs the tool and is what Cancel cancels; the settling task is never
        # cancelled, so it always records the outcome (even for work cancelled before it started).
        work_task = loop.create_task(work, name=f"effect-work:{tool}:{effect_key}")
        task = loop.create_task(self._settle(entry, work_task), name=f"effect:{tool}:{effect_key}")
        entry.task, entry.work = task, work_task
        return task

    def cancel_work(self, tool: str, effect_key: str) -> bool:
        """Cancel the running tool of a key (the caller checked it is cancellable); False if none runs."""
        entry = self._entries.get((tool, effect_key))
        if entry is None or entry.work is None or entry.work.done():
            return False
        entry.work.cancel()
        return True

    @staticmethod
    async def _settle(entry: EffectEntry, work: asyncio.Task[EffectOutcome]) -> EffectOutcome:
        try:
            outcome = await work
        except asyncio.CancelledError:
            if not work.cancelled():
                raise  # this settling task itself was cancelled (loop shutdown): do not hide it
            outcome = EffectOutcome(
                EffectState.ABSENT, detail="cancelled before commit", code=grpc.StatusCode.ABORTED
            )
        if outcome.state is EffectState.APPLIED:
            entry.applications += 1
            entry.result_json = outcome.result_json
        # Only the newest task for a key speaks for it; evidence of an applied effect is never
        # overwritten by a later refusal (it happened, whatever came after).
        if entry.task is asyncio.current_task():
            entry.state = EffectState.APPLIED if entry.applications else outcome.state
            entry.detail = outcome.detail
        return outcome

    def items(self) -> Iterator[tuple[Key, EffectEntry]]:
        """Every entry, for inspection and tests."""
        return iter(list(self._entries.items()))

    async def drain(self) -> None:
        """Wait for every running effect task (used on server shutdown)."""
        tasks = [e.task for e in self._entries.values() if e.task is not None and not e.task.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
