"""In-memory ``LogStore``: the unit-test stand-in for the Redis log store, with the same contract.

The contract (checked by ``tests/integration/test_log_store_contract.py`` against both stores):

- ``append`` returns an entry id once the entry is stored; ids are Redis-stream shaped (``"<ms>-<seq>"``)
  and strictly increasing per trajectory in that order, so code that compares or logs ids behaves the
  same against either store.
- ``read(after)`` returns every entry with an id greater than ``after`` in append order; ``after=None``
  reads from the start; an id that was never issued is a position, not an error.
- a trajectory id is 1..200 printable characters without whitespace (it becomes part of a Redis key);
  a malformed trajectory or entry id raises ``InputError`` naming it.

This module is pure: no Redis, no clock. Entry ids use a per-store counter rather than time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from runtime.errors import DependencyError, InputError

__all__ = [
    "LOG_KEY_PREFIX",
    "MemoryLogStore",
    "check_trajectory_id",
    "parse_entry_id",
]

# Shared with cluster.log_store so both stores agree on naming and validation.
LOG_KEY_PREFIX = "tether:log:"
_TRAJECTORY_ID = re.compile(r"[!-~]{1,200}")  # printable ASCII, no space: safe inside a Redis key
_ENTRY_ID = re.compile(r"(\d{1,20})-(\d{1,20})")


def check_trajectory_id(trajectory_id: str) -> str:
    """Return ``trajectory_id`` unchanged, or raise ``InputError`` saying why it cannot name a log."""
    if not isinstance(trajectory_id, str) or not _TRAJECTORY_ID.fullmatch(trajectory_id):
        raise InputError(
            f"trajectory id must be 1..200 printable ASCII characters without spaces, got {trajectory_id!r}",
            where="trajectory_id",
        )
    return trajectory_id


def parse_entry_id(entry_id: str, where: str = "after") -> tuple[int, int]:
    """``"<ms>-<seq>"`` as a comparable pair, or ``InputError`` naming the bad id."""
    match = _ENTRY_ID.fullmatch(entry_id) if isinstance(entry_id, str) else None
    if match is None:
        raise InputError(f"log entry id must look like '<int>-<int>', got {entry_id!r}", where=where)
    return int(match.group(1)), int(match.group(2))


class MemoryLogStore:
    """A ``runtime.ports.LogStore`` kept in a dict; durable only for the life of the object.

    ``unavailable`` simulates a store outage for tests of the caller's error handling: while it is
    set, every call raises ``DependencyError`` with that text and nothing is stored.
    """

    def __init__(self) -> None:
        self._logs: dict[str, list[tuple[tuple[int, int], bytes]]] = {}
        self._seq = 0
        self.unavailable: str | None = None
        self.appends = 0  # count of acknowledged appends, for tests that check what was written

    def _check_available(self) -> None:
        if self.unavailable is not None:
            raise DependencyError(f"memory log store unavailable: {self.unavailable}", scope="log_store")

    async def append(self, trajectory_id: str, payload: bytes) -> str:
        """Store ``payload`` at the end of the trajectory's log and return its entry id."""
        check_trajectory_id(trajectory_id)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise InputError(f"log payload must be bytes, got {type(payload).__name__}", where="payload")
        self._check_available()
        # A single store-wide counter keeps ids increasing per trajectory and unique across them.
        self._seq += 1
        key = (0, self._seq)
        self._logs.setdefault(trajectory_id, []).append((key, bytes(payload)))
        self.appends += 1
        return f"{key[0]}-{key[1]}"

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        """Append every payload in order, all or none (validated before any is stored)."""
        check_trajectory_id(trajectory_id)
        for i, payload in enumerate(payloads):
            if not isinstance(payload, bytes | bytearray | memoryview):
                raise InputError(
                    f"log payload must be bytes, got {type(payload).__name__}", where=f"payloads[{i}]"
                )
        self._check_available()
        return [await self.append(trajectory_id, payload) for payload in payloads]

    async def read(self, trajectory_id: str, after: str | None = None) -> list[tuple[str, bytes]]:
        """Entries with an id greater than ``after`` (all of them when ``None``), in append order."""
        check_trajectory_id(trajectory_id)
        floor = parse_entry_id(after) if after is not None else None
        self._check_available()
        entries = self._logs.get(trajectory_id, [])
        return [(f"{k[0]}-{k[1]}", data) for k, data in entries if floor is None or k > floor]

    async def trim(self, trajectory_id: str, before: str) -> int:
        """Drop every entry older than ``before`` (the entry itself stays, as does everything after it)."""
        check_trajectory_id(trajectory_id)
        floor = parse_entry_id(before, where="before")
        self._check_available()
        entries = self._logs.get(trajectory_id, [])
        kept = [(k, data) for k, data in entries if k >= floor]
        if trajectory_id in self._logs:
            self._logs[trajectory_id] = kept
        return len(entries) - len(kept)

    async def exists(self, trajectory_id: str) -> bool:
        """Whether the trajectory has at least one entry."""
        check_trajectory_id(trajectory_id)
        self._check_available()
        return bool(self._logs.get(trajectory_id))

    async def list_trajectories(self) -> list[str]:
        """Ids of every trajectory that has a log, sorted."""
        self._check_available()
        return sorted(tid for tid, entries in self._logs.items() if entries)
