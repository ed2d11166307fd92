"""A per-trajectory prompt prefix cache, at message-block granularity.

Rule (documented for benchmarks): the cached part of a prompt is the longest run of leading blocks
(see :func:`testbed.provider.tokenizer.prompt_blocks`) that equals the leading blocks of a prompt
already processed for the same trajectory. Its tokens are reported as
``usage.prompt_tokens_details.cached_tokens``. Requests without a trajectory id are never cached.

Only prefix hashes are kept (one per distinct prefix length seen), and at most ``max_trajectories``
trajectories are remembered, least recently used evicted first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from testbed.provider.tokenizer import count_tokens

__all__ = ["PrefixCache", "PromptTokens"]


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """Token accounting of one prompt: ``cached <= total`` always."""

    total: int
    cached: int


class PrefixCache:
    """Remembers the prompt prefixes each trajectory has sent."""

    def __init__(self, max_trajectories: int = 100_000) -> None:
        if max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1, got {max_trajectories}")
        self._max = max_trajectories
        self._seen: OrderedDict[str, set[bytes]] = OrderedDict()

    def measure(self, trajectory_id: str | None, blocks: Sequence[str], extra_tokens: int) -> PromptTokens:
        """Count the prompt's tokens and how many of them are a cached prefix; then remember it.

        ``extra_tokens`` are tokens outside the blocks (reply priming): counted, never cached.
        """
        digest = hashlib.sha256()
        prefixes: list[bytes] = []
        counts: list[int] = []
        running = 0
        for block in blocks:
            digest.update(len(block).to_bytes(8, "little"))
            digest.update(block.encode("utf-8", "surrogatepass"))
            prefixes.append(digest.copy().digest())
            running += count_tokens(block)
            counts.append(running)
        total = running + extra_tokens
        if trajectory_id is None:
            return PromptTokens(total=total, cached=0)
        seen = self._seen.pop(trajectory_id, None) or set()
        cached = 0
        for prefix, upto in zip(prefixes, counts, strict=True):
            if prefix not in seen:
                break
            cached = upto
        seen.update(prefixes)
        self._seen[trajectory_id] = seen
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return PromptTokens(total=total, cached=cached)

    def clear(self) -> None:
        """Forget every trajectory (``POST /testbed/reset``)."""
        self._seen.clear()
