"""Token buckets and the per-provider limiter with AIMD feedback ("Scheduling Concurrent Trajectories":
admit turns against a local token bucket set below the provider's rate limit).

Pure: every method takes ``now`` (monotonic seconds); nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping

from runtime.ports import RateLimitInfo
from scheduler.config import FeedbackConfig, ProviderLimits
from scheduler.learning import LearnedLimit, capacity_below
from scheduler.window import WindowLedger

__all__ = ["ProviderLimiter", "TokenBucket"]

# Float slack when comparing a level against a cost, so a bucket refilled to 99.99999999 of 100
# does not make the scheduler spin waiting for the last femto-token.
_EPS = 1e-9
# The smallest wait ``ready_at`` reports when the bucket does not cover yet (never "now" by rounding).
_MIN_WAIT_S = 1e-6


class TokenBucket:
    """A bucket of ``capacity`` units refilled continuously at ``rate`` units per second.

    Starts at ``level`` (default empty: a fresh or restarted scheduler never begins with a burst).
    The level may go negative after a debit (a turn used more than it reserved); the debt is paid
    back by refill before anything else is admitted.
    """

    def __init__(self, capacity: float, rate: float, now: float, level: float = 0.0) -> None:
        if capacity <= 0 or rate < 0:
            raise ValueError(f"bucket needs capacity > 0 and rate >= 0, got {capacity=} {rate=}")
        self.capacity = float(capacity)
        self.rate = float(rate)
        self._level = min(float(level), self.capacity)
        self._at = now

    def advance(self, now: float) -> None:
        """Refill up to ``now`` at the current rate. Time never runs backwards here."""
        if now > self._at:
            self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
            self._at = now

    def level(self, now: float) -> float:
        self.advance(now)
        return self._level

    def covers(self, cost: float, now: float) -> bool:
        return self.level(now) + _EPS >= cost

    def take(self, cost: float, now: float) -> None:
        """Remove ``cost`` units; the caller has checked ``covers``."""
        self.advance(now)
        self._level -= cost

    def adjust(self, delta: float, now: float) -> None:
        """Give back (``delta > 0``) or charge (``delta < 0``) units. A refund never lifts the level
        above capacity: capacity is the largest burst we allow, whatever was over-reserved."""
        self.advance(now)
        self._level = min(self.capacity, self._level + delta)

    def clamp(self, ceiling: float, now: float) -> None:
        """Lower the level to at most ``ceiling`` (never raise it)."""
        self.advance(now)
        self._level = min(self._level, ceiling)

    def ready_at(self, cost: float, now: float) -> float:
        """The monotonic time at which ``cost`` will be covered at the current rate (inf: never)."""
        level = self.level(now)
        if level + _EPS >= cost:
            return now
        if cost > self.capacity + _EPS or self.rate <= 0:
            return math.inf
        return now + max((cost - level) / self.rate, _MIN_WAIT_S)


class ProviderLimiter:
    """Both buckets of one provider key (tokens/min and requests/min) plus the provider's feedback.

    Each bucket is paired with a sliding-window ledger of the same capacity, so admissions in any
    window of ``window_s`` (a minute) never exceed it either: providers count per-minute limits over a
    sliding window, where a bucket alone would allow a full burst plus a full minute of refill. Two more
    ledgers keep every sub-window (``ProviderLimits.sub_window``) within the provider's share of it, and a
    third paces the requests within it (``sub_window_burst``): turns ready at once are granted a burst at a
    time (5 % of the share, at least one), the rest spaced evenly over the sub-window. Our ledgers date a
    call when it is granted, the provider when it arrives; a burst granted at once arrives spread out (its
    callers queue for the CPU, the node's model client sends one call after another), so the calls granted
    the moment its sub-window frees, sent at once, met its tail in the provider's second. Leased chunks are
    not paced: they are granted only to an uncontended key, within every window and sub-window.

    - The limit itself is learned (``scheduler.learning``): the buckets and ledgers are sized to the
      smallest of the configured limit, the provider's stated ``x-ratelimit-limit-*`` and the limit
      inferred from its ``remaining`` counts and 429s, less the headroom. A configured limit 10x too high
      is corrected by the first response that states the limit, or by the first 429s.
    - 429: admission on this key stops until the retry hint (``Retry-After`` or a gateway's form; else
      the reset of an exhausted count; else ``default_retry_after_s``); the refill rate is multiplied by
      ``decrease_factor`` (at most once per ``decrease_cooldown_s``) and the token level drops to
      at most zero, since the provider just told us our view was too optimistic.
    - ``x-ratelimit-remaining-*``: clamps the local levels to the provider's, less our headroom; a count
      at zero with a reset blocks the key until the reset.
    - While no 429 arrives, the rate recovers additively, never above the learned limit.
    - Our ledgers date a request when it is admitted, the provider when it arrives. When the time between
      the two varies by more than the headroom covers (a loaded gateway, a starved worker), requests
      admitted more than a window apart arrive within one window of the provider's. So a 429 reported with
      its call's admission time (``admitted_at``) also teaches that delay: the ledgers' window grows by the
      longest such delay of the last ``delay_memory_s`` (at most half a window), and the limit inferred
      from a 429 counts our admissions and rejections over that longer window too, so requests that
      arrived late are not taken for a smaller limit. Only a 429 the window refused teaches a delay: when
      the provider's ``remaining`` counts still had room for the call, a shorter window refused a burst
      (typically in a run's first second, as cold workers' first calls arrive together), a wider window
      would not have prevented it, and its start-up delay would slow the whole run.

    The refill over an interval uses the rate at the interval's start; the rate only grows between
    429s, so this under-refills slightly and never admits above the configured rate.
    """

    def __init__(self, limits: ProviderLimits, feedback: FeedbackConfig, now: float) -> None:
        self.limits = limits
        self.feedback = feedback
        window = limits.window_s
        self.tokens = TokenBucket(limits.token_capacity, limits.token_capacity / window, now)
        self.requests = TokenBucket(limits.request_capacity, limits.request_capacity / window, now)
        self.token_window = WindowLedger(limits.token_capacity, limits.window_s)
        self.request_window = WindowLedger(limits.request_capacity, limits.window_s)
        self.sub_token_window: WindowLedger | None = None
        self.sub_request_window: WindowLedger | None = None
        # the sub-window's pacing (ProviderLimits.sub_window_burst): a burst's requests per its share of time
        self.pace: WindowLedger | None = None
        if limits.sub_window > 0:
            span = limits.sub_window * (1.0 + limits.sub_window_margin)
            if limits.sub_window_tokens:
                self.sub_token_window = WindowLedger(
                    limits.sub_share(limits.tokens_per_minute), span, alone_fits=True
                )
            self.sub_request_window = WindowLedger(limits.sub_share(limits.requests_per_minute), span)
            if limits.sub_window_burst is not None:  # off: the sub-window ledger alone, no second copy of it
                self.pace = WindowLedger(1, span)
                self._pace_to(self.sub_request_window)
        self.rate_factor = 1.0
        self.blocked_until = -math.inf
        self.rate_limited_count = 0
        self.granted_count = 0
        # retry hints applied to blocked_until, by the header that carried them ("unnamed": not said)
        self.hints_honoured: Counter[str] = Counter()
        self.learned_requests = LearnedLimit(limits.requests_per_minute)
        self.learned_tokens = LearnedLimit(limits.tokens_per_minute)
        self._rejections: deque[float] = deque()  # when 429s arrived, for the inference
        # admission-to-report delays of 429s (when reported, seconds), and the margin they add to the windows
        self._delays: deque[tuple[float, float]] = deque()
        self.delay_margin_s = 0.0
        # request admissions (when, how many), for the inference's lookback beyond the ledger's window;
        # a lease is dated when its requests may last be used
        self._admissions: deque[tuple[float, float]] = deque()
        self._last_decrease = -math.inf
        self._at = now

    # ------------------------------------------------------------------ time

    def advance(self, now: float) -> None:
        if now <= self._at:
            return
        if self._delays and self._delays[0][0] <= now - self.feedback.delay_memory_s:
            self._set_margin(now)
        self.tokens.advance(now)
        self.requests.advance(now)
        if self.rate_factor < 1.0:
            self.rate_factor = min(1.0, self.rate_factor + self.feedback.recovery_per_s * (now - self._at))
            self._apply_rate()
        self._at = now

    def _apply_rate(self) -> None:
        self.tokens.rate = self.tokens.capacity / self.limits.window_s * self.rate_factor
        self.requests.rate = self.requests.capacity / self.limits.window_s * self.rate_factor

    def _resize(self, now: float) -> None:
        """Size buckets and ledgers to the learned limits (levels never rise by it)."""
        headroom = self.limits.headroom
        for bucket, ledger, learned in (
            (self.tokens, self.token_window, self.learned_tokens),
            (self.requests, self.request_window, self.learned_requests),
        ):
            capacity = capacity_below(learned.effective, headroom)
            bucket.advance(now)
            bucket.capacity = capacity
            bucket.clamp(capacity, now)
            ledger.capacity = capacity
        # the provider's per-sub-window share follows the learned per-window limit
        if self.sub_request_window is not None:
            self.sub_request_window.capacity = self.limits.sub_share(
                math.ceil(self.learned_requests.effective)
            )
            self._pace_to(self.sub_request_window)
        if self.sub_token_window is not None:
            self.sub_token_window.capacity = self.limits.sub_share(math.ceil(self.learned_tokens.effective))
        self._apply_rate()

    def _pace_to(self, sub: WindowLedger) -> None:
        """Pace the sub-window: ``burst`` requests per ``burst / share`` of it."""
        if self.pace is None:
            return
        share = round(sub.capacity)
        burst = self.limits.sub_burst(share)
        self.pace.capacity = burst
        self.pace.window_s = sub.window_s * burst / share

    # ------------------------------------------------------------------ admission

    def fits_ever(self, cost: int) -> bool:
        """False when ``cost`` exceeds the token bucket's capacity: waiting would never help."""
        return cost <= self.tokens.capacity + _EPS

    def can_admit(self, cost: int, now: float, reserve: float = 0.0) -> bool:
        """Whether a turn of ``cost`` tokens fits now. ``reserve``: leave that fraction of every bucket,
        window and sub-window free besides it (the top class's reserve, ``SchedulerConfig``); a turn too
        large to fit beside the reserve needs only its own room."""
        self.advance(now)
        if reserve > 0.0 and cost <= self.tokens.capacity * (1.0 - reserve):
            return self._fits_leaving(cost, reserve, now)  # else: too large to fit beside the reserve
        return (
            now >= self.blocked_until
            and self.tokens.covers(cost, now)
            and self.requests.covers(1, now)
            and self.token_window.covers(cost, now)
            and self.request_window.covers(1, now)
            and (self.sub_token_window is None or self.sub_token_window.covers(cost, now))
            and (self.sub_request_window is None or self.sub_request_window.covers(1, now))
            and (self.pace is None or self.pace.covers(1, now))
        )

    def _fits_leaving(self, cost: int, reserve: float, now: float) -> bool:
        if now < self.blocked_until or (self.pace is not None and not self.pace.covers(1, now)):
            return False
        limits: list[tuple[TokenBucket | WindowLedger, float]] = [
            (self.tokens, cost),
            (self.token_window, cost),
            (self.requests, 1.0),
            (self.request_window, 1.0),
        ]
        if self.sub_token_window is not None:
            limits.append((self.sub_token_window, cost))
        if self.sub_request_window is not None:
            limits.append((self.sub_request_window, 1.0))
        return all(limit.covers(amount + reserve * limit.capacity, now) for limit, amount in limits)

    def admit(self, cost: int, now: float) -> int:
        """Reserve ``cost`` tokens and one request; the caller has checked ``can_admit``.
        Returns the reservation's ledger id, needed to ``settle`` it."""
        self.advance(now)
        self.tokens.take(cost, now)
        self.requests.take(1, now)
        self.request_window.add(1, now)
        self._note_admission(now, 1.0)
        self.granted_count += 1
        ledger_id = self.token_window.add(cost, now)
        if self.sub_request_window is not None:
            self.sub_request_window.add(1, now)
        if self.pace is not None:
            self.pace.add(1, now)
        if self.sub_token_window is not None:
            self.sub_token_window.add(cost, now, entry_id=ledger_id)  # one id: settle corrects both
        return ledger_id

    def can_lease(self, tokens: int, requests: int, now: float, slack: float, reserve: float = 0.0) -> bool:
        """Whether a chunk of ``tokens`` and ``requests`` fits while leaving room for turns admitted
        one by one: it takes at most ``1 - slack`` of what is left in each bucket, window and sub-window
        (so chunks shrink as the key fills up), after ``reserve`` of each is set aside as ``can_admit``
        does. Never while the key is paused or slowed by a 429: then every turn goes through DRR one by
        one."""
        self.advance(now)
        share = 1.0 - slack
        rooms = [
            (self.tokens.level(now) - reserve * self.tokens.capacity, tokens),
            (self.requests.level(now) - reserve * self.requests.capacity, requests),
            (self.token_window.capacity * (1.0 - reserve) - self.token_window.used(now), tokens),
            (self.request_window.capacity * (1.0 - reserve) - self.request_window.used(now), requests),
        ]
        for window, amount in ((self.sub_token_window, tokens), (self.sub_request_window, requests)):
            if window is not None:
                rooms.append((window.capacity * (1.0 - reserve) - window.used(now), amount))
        return (
            now >= self.blocked_until
            and self.rate_factor >= 1.0
            and all(amount <= share * room + _EPS for room, amount in rooms)
        )

    def lease(self, tokens: int, requests: int, now: float, use_by: float) -> tuple[int, int, int]:
        """Reserve a chunk (the caller has checked ``can_lease``), dated ``use_by`` in the windows: its
        requests may reach the provider any time until then. Returns its ledger ids (token, request,
        sub-window request), needed to ``end_lease`` it."""
        self.advance(now)
        self.tokens.take(tokens, now)
        self.requests.take(requests, now)
        token_id = self.token_window.add(tokens, now, at=use_by)
        request_id = self.request_window.add(requests, now, at=use_by)
        self._note_admission(max(now, use_by), float(requests))
        if self.sub_token_window is not None:
            self.sub_token_window.add(tokens, now, entry_id=token_id, at=use_by)
        sub_request_id = 0
        if self.sub_request_window is not None:  # its ids are its own: single admissions add there too
            sub_request_id = self.sub_request_window.add(requests, now, at=use_by)
        return token_id, request_id, sub_request_id

    def end_lease(
        self,
        reserved: tuple[int, int],
        used: tuple[int, int],
        now: float,
        ledger_ids: tuple[int, int, int],
    ) -> None:
        """Replace a chunk's reservation by what its holder used: (tokens, requests) each."""
        self.advance(now)
        self.tokens.adjust(reserved[0] - used[0], now)
        self.requests.adjust(reserved[1] - used[1], now)
        self.granted_count += used[1]
        token_id, request_id, sub_request_id = ledger_ids
        self.token_window.correct(token_id, used[0])
        self.request_window.correct(request_id, used[1])
        if self.sub_token_window is not None:
            self.sub_token_window.correct(token_id, used[0])
        if self.sub_request_window is not None:
            self.sub_request_window.correct(sub_request_id, used[1])

    def ready_at(self, cost: int, now: float, reserve: float = 0.0) -> float:
        """Earliest monotonic time ``cost`` could be admitted (at the current rate), leaving ``reserve`` as
        ``can_admit`` does."""
        self.advance(now)
        if cost > self.tokens.capacity * (1.0 - reserve):
            reserve = 0.0  # too large to fit beside the reserve: its own room is enough

        def at(limit: TokenBucket | WindowLedger | None, amount: float) -> float:
            return -math.inf if limit is None else limit.ready_at(amount + reserve * limit.capacity, now)

        return max(
            self.blocked_until,
            at(self.tokens, cost),
            at(self.requests, 1),
            at(self.token_window, cost),
            at(self.request_window, 1),
            at(self.sub_token_window, cost),
            at(self.sub_request_window, 1),
            -math.inf if self.pace is None else self.pace.ready_at(1, now),
        )

    def settle(self, reserved: int, actual: int, now: float, ledger_id: int | None = None) -> None:
        """Replace the reservation by the provider-reported usage: refund or debit the difference."""
        self.advance(now)
        self.tokens.adjust(reserved - actual, now)
        if ledger_id is not None:
            self.token_window.correct(ledger_id, actual)
            if self.sub_token_window is not None:
                self.sub_token_window.correct(ledger_id, actual)

    # ------------------------------------------------------------------ feedback

    def on_rate_limited(
        self,
        retry_after: float | None,
        now: float,
        info: RateLimitInfo | None = None,
        admitted_at: float | None = None,
        reserved: int | None = None,
    ) -> None:
        """The provider answered 429: pause the key, slow down, and learn from it (class docstring).
        ``admitted_at`` (monotonic): when the refused call was admitted, and ``reserved`` the tokens it
        reserved, if known."""
        self.advance(now)
        self.rate_limited_count += 1
        if admitted_at is not None and admitted_at <= now and not _window_had_room(info, reserved):
            self._delays.append((now, now - admitted_at))
            self._set_margin(now)
        if retry_after is None and info is not None:
            retry_after = info.retry_after_s
        if retry_after is not None:
            source = info.hint_source if info is not None and info.hint_source else "unnamed"
            self.hints_honoured[source] += 1
            wait = max(0.0, retry_after)
        else:
            wait = self._exhausted_reset(info) or self.feedback.default_retry_after_s
        self.blocked_until = max(self.blocked_until, now + wait)
        self.tokens.clamp(0.0, now)
        if now - self._last_decrease >= self.feedback.decrease_cooldown_s:
            self.rate_factor = max(self.feedback.floor, self.rate_factor * self.feedback.decrease_factor)
            self._last_decrease = now
            self._apply_rate()
        if self.feedback.learn_limits:
            self._learn_from_rejection(info, now)

    def observe(self, info: RateLimitInfo, now: float) -> None:
        """What a response's headers said about the limits (429 or not): learn stated limits, bound the
        limit from ``remaining``, clamp the local levels, and wait for the reset of an exhausted count."""
        self.advance(now)
        if self.feedback.learn_limits:
            self._learn_from_headers(info, now)
        remaining = info.remaining()
        if remaining:
            self.observe_remaining(remaining, now)
        reset = self._exhausted_reset(info)
        if reset is not None:
            self.blocked_until = max(self.blocked_until, now + reset)

    def observe_remaining(self, remaining: Mapping[str, float], now: float) -> None:
        """Clamp to the provider's ``x-ratelimit-remaining-{tokens,requests}`` (header name or the bare
        suffix), minus the headroom we keep below its limit."""
        self.advance(now)
        headroom = self.limits.headroom
        for key, value in remaining.items():
            name = key.lower()
            if name.endswith("tokens"):
                self.tokens.clamp(value - self.learned_tokens.effective * headroom, now)
            elif name.endswith("requests"):
                self.requests.clamp(value - self.learned_requests.effective * headroom, now)

    # ------------------------------------------------------------------ learning

    def _learn_from_headers(self, info: RateLimitInfo, now: float) -> None:
        changed = False
        if info.limit_requests is not None:
            changed |= self.learned_requests.state(info.limit_requests)
        elif info.remaining_requests is not None:
            changed |= self.learned_requests.bound(self.request_window.used(now) + info.remaining_requests)
        # Tokens: only a stated limit. Providers count tokens their own way (OpenAI charges the prompt plus
        # max_tokens when the request arrives), not the usage our ledger settles to, so our count is no
        # upper bound of theirs and a bound inferred from it could starve the key.
        if info.limit_tokens is not None:
            changed |= self.learned_tokens.state(info.limit_tokens)
        if changed:
            self._resize(now)

    def _note_admission(self, when: float, requests: float) -> None:
        self._admissions.append((when, requests))
        horizon = when - 1.5 * self.limits.window_s  # the longest lookback: a window and a half
        while self._admissions[0][0] <= horizon:
            self._admissions.popleft()

    def _set_margin(self, now: float) -> None:
        """The ledgers' window: the provider's plus the longest recent admission-to-429 delay."""
        while self._delays and self._delays[0][0] <= now - self.feedback.delay_memory_s:
            self._delays.popleft()
        window = self.limits.window_s
        self.delay_margin_s = min(max((delay for _, delay in self._delays), default=0.0), window / 2.0)
        self.token_window.window_s = window + self.delay_margin_s
        self.request_window.window_s = window + self.delay_margin_s

    def _requests_in_lookback(self, now: float) -> float:
        """Our admissions the provider's window may have held: the ledger's without a delay margin (its
        entries corrected to what leases used), else all admitted in the last window plus margin (the
        ledger dropped some of those before its window grew)."""
        if self.delay_margin_s <= 0:
            return self.request_window.used(now)
        horizon = now - self.limits.window_s - self.delay_margin_s
        return sum(n for when, n in self._admissions if when > horizon)

    def _learn_from_rejection(self, info: RateLimitInfo | None, now: float) -> None:
        lookback = self.limits.window_s + self.delay_margin_s
        self._rejections.append(now)
        while self._rejections and self._rejections[0] <= now - 1.5 * self.limits.window_s:
            self._rejections.popleft()
        tokens_ran_out = (
            info is not None
            and info.remaining_tokens is not None
            and info.remaining_tokens <= 0
            and not (info.remaining_requests is not None and info.remaining_requests <= 0)
        )
        if tokens_ran_out:
            return  # a token 429 teaches no request limit; tokens are learned only from a stated limit
        if info is not None and info.remaining_requests is not None and info.remaining_requests > 0:
            # the window still had requests left: a shorter window refused this one (a provider's sub-minute
            # enforcement, which ``remaining`` does not show). Learning "accepted so far" as the limit
            # here shrank a 600 RPM key to the ~10 requests of its first second (a 50 s stall after one 429).
            return
        rejected = sum(1 for when in self._rejections if when > now - lookback)
        accepted = self._requests_in_lookback(now) - rejected
        if self.learned_requests.bound(accepted):
            self._resize(now)

    @staticmethod
    def _exhausted_reset(info: RateLimitInfo | None) -> float | None:
        """Seconds until an exhausted count resets, when the provider said both (else None)."""
        if info is None:
            return None
        resets = [
            reset
            for remaining, reset in (
                (info.remaining_requests, info.reset_requests_s),
                (info.remaining_tokens, info.reset_tokens_s),
            )
            if remaining is not None and remaining <= 0 and reset is not None
        ]
        return max(resets) if resets else None


def _window_had_room(info: RateLimitInfo | None, reserved: int | None) -> bool:
    """Whether a 429's headers show the provider's window still had room for the refused call: a request
    left and, when stated, at least the tokens we reserved for it; then a shorter window refused it. Never
    said when the request count is not stated: the unstated count may be the exhausted one."""
    if info is None or info.remaining_requests is None or info.remaining_requests <= 0:
        return False
    if info.remaining_tokens is None:
        return True
    return reserved is not None and info.remaining_tokens >= reserved
