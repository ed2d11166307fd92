"""Scoped circuit breaker: a pure state machine over classified outcomes of dispatched calls.

Rules (recovery chapter §12.7.1, equation 7 and table 7):

- The window holds the classified outcomes of calls *dispatched* to this scope. Client/domain rejections
  returned by the endpoint are non-failures in it; local rejections (schema, grants, the gate itself) never
  reach the breaker at all, so they cannot enter it.
- CLOSED trips to OPEN when ``len(window) >= min_samples`` and the failure fraction reaches the threshold.
- OPEN withholds new calls and answers with ``BreakerOpen`` naming the scope and the estimated cooldown.
- After the cooldown exactly one probe permit is claimed (HALF_OPEN); everything else is still withheld.
- Only an outcome carrying the current ``breaker_generation`` changes state. A failed probe reopens, bumps
  the generation and lengthens the cooldown (``min(multiplier * cooldown, cap)``); a successful probe closes.
  A late result of an older generation changes nothing here: it settles its own operation in the caller's
  operation table.
- A successful probe proves only that one isolated request was handled, so regular traffic comes back
  gradually (§12.7.1): for ``restore_s`` after the close, ``admission_share`` grows linearly from
  ``restore_start_share`` to 1, and the caller scales its concurrency cap by it (``breakers.scope_guard``
  scales the bulkhead). A trip during the restore is a failed trial, not a fresh one: it lengthens the
  cooldown as a failed probe does. The cooldown resets only when the restore has run its course.

The generation increments on every entry into OPEN (trip or reopen), so each trial cycle has its own
generation: calls admitted before a trip, and a probe that failed, carry an older number than the probe of
the next cycle. The class performs no I/O and reads time only from the injected clock (monotonic axis);
callers that share it across tasks or threads serialise access themselves (see ``breakers.guard``).

Metrics (issue 7, "breakers: state per scope, trips, probes"): an optional injected
``runtime.metrics.Metrics`` sees every state change (``tether_breaker_state``), every CLOSED -> OPEN trip
(``tether_breaker_trips``) and every probe's end (``tether_breaker_probes`` with outcome ``success``,
``failure`` or ``abandoned``). A failed probe reopens the scope but is not a new trip: trips count how often
a healthy scope went bad, probes how its recovery attempts went. Recording never changes a decision.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.clock import Clock
from runtime.errors import BreakerOpen
from runtime.metrics import Metrics
from runtime.ports import OutcomeClass

__all__ = ["Breaker", "BreakerPolicy", "BreakerState", "BreakerTicket", "RecordEffect", "should_trip"]

_log = logging.getLogger(__name__)


class BreakerState(StrEnum):
    """Gate-level state of one dependency scope (table 7), distinct from trajectory states."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerPolicy(BaseModel):
    """Policy parameters of equation 7 and the cooldown backoff. Defaults follow exercise 4."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    window_size: int = Field(50, ge=1, description="how many recent classified outcomes the window keeps")
    min_samples: int = Field(20, ge=1, description="no trip before the window holds this many outcomes")
    trip_threshold: float = Field(0.5, gt=0.0, le=1.0, description="failure fraction that trips the breaker")
    cooldown_s: float = Field(5.0, gt=0.0, description="first OPEN interval before a probe may be claimed")
    cooldown_multiplier: float = Field(2.0, ge=1.0, description="1.0 keeps a fixed cooldown")
    max_cooldown_s: float = Field(80.0, gt=0.0, description="cap on the lengthened cooldown")
    window_age_s: float | None = Field(
        None, gt=0.0, description="outcomes older than this leave the window (None: count-based only)"
    )
    restore_s: float = Field(
        10.0, ge=0.0, description="after a successful probe, traffic returns over this long (0: at once)"
    )
    restore_start_share: float = Field(
        0.1, gt=0.0, le=1.0, description="share of the concurrency cap admitted right after the close"
    )

    @model_validator(mode="after")
    def _consistent(self) -> BreakerPolicy:
        if self.min_samples > self.window_size:
            raise ValueError(
                f"min_samples ({self.min_samples}) exceeds window_size ({self.window_size}): "
                "the breaker could never trip"
            )
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError(
                f"max_cooldown_s ({self.max_cooldown_s}) is below cooldown_s ({self.cooldown_s})"
            )
        return self


@dataclass(frozen=True, slots=True)
class BreakerTicket:
    """What the breaker granted: the generation to carry back with the outcome, and whether this call
    is the single half-open probe."""

    generation: int
    probe: bool


class RecordEffect(StrEnum):
    """What recording an outcome did to the breaker (for metrics and tests)."""

    COUNTED = "counted"  # entered the CLOSED window, no transition
    TRIPPED = "tripped"  # CLOSED -> OPEN
    CLOSED = "closed"  # successful probe: HALF_OPEN -> CLOSED
    REOPENED = "reopened"  # failed probe: HALF_OPEN -> OPEN, generation bumped, cooldown lengthened
    STALE = "stale"  # older generation: settles its own operation, changes nothing here
    IGNORED = "ignored"  # current generation but no state to change (e.g. a non-probe in HALF_OPEN)


@dataclass(frozen=True, slots=True)
class _Observation:
    at: float
    failure: bool


def should_trip(window_size: int, failures: int, policy: BreakerPolicy) -> bool:
    """Equation 7: ``|W| >= min_samples`` and ``failures / |W| >= trip_threshold``."""
    if failures < 0 or failures > window_size:
        raise ValueError(f"failures ({failures}) must lie in [0, window size {window_size}]")
    return window_size >= policy.min_samples and failures / window_size >= policy.trip_threshold


class Breaker:
    """The breaker of one dependency scope, e.g. ``"env-service/tenant-a"``."""

    def __init__(
        self, scope: str, policy: BreakerPolicy, clock: Clock, metrics: Metrics | None = None
    ) -> None:
        self.scope = scope
        self.policy = policy
        self._clock = clock
        self._metrics = metrics if metrics is not None else Metrics()
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._window: deque[_Observation] = deque(maxlen=policy.window_size)
        self._cooldown_s = policy.cooldown_s
        self._opened_at = 0.0
        self._restoring_since: float | None = None
        self._probes_claimed = 0
        self._observe(None)  # the scope shows up, CLOSED

    # ------------------------------------------------------------------ observation

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def cooldown_s(self) -> float:
        """The cooldown of the current (or next) OPEN interval; while restoring, of the last one."""
        self._restore_progress()
        return self._cooldown_s

    @property
    def restoring(self) -> bool:
        """CLOSED after a successful probe, with regular traffic still coming back (``restore_s``)."""
        return self._restore_progress() < 1.0

    def admission_share(self) -> float:
        """The share of the scope's concurrency that regular traffic may use now: 1.0, except while
        restoring after a close (linear from ``restore_start_share`` to 1 over ``restore_s``). What the gate
        withholds while OPEN or HALF_OPEN is ``withholding``'s answer, not this one's."""
        progress = self._restore_progress()
        start = self.policy.restore_start_share
        return start + (1.0 - start) * progress

    @property
    def probes_claimed(self) -> int:
        """How many probe permits this breaker has handed out since it was created."""
        return self._probes_claimed

    def window_counts(self) -> tuple[int, int]:
        """``(outcomes in the window, counted failures among them)``."""
        self._age_out()
        return len(self._window), sum(1 for o in self._window if o.failure)

    def failure_fraction(self) -> float:
        """Equation 7's failure fraction over the current window (0.0 when empty)."""
        size, failures = self.window_counts()
        return failures / size if size else 0.0

    def remaining_cooldown(self) -> float:
        """Seconds until a probe may be claimed (0 when CLOSED or the cooldown has elapsed)."""
        if self._state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self._cooldown_s - self._clock.now())

    # ------------------------------------------------------------------ transitions

    def admit(self) -> BreakerTicket:
        """Decide whether one call may be dispatched now.

        Raises ``BreakerOpen`` while OPEN, and in HALF_OPEN for everything but the single probe. The probe
        permit is claimed inside this call, so under any serialised caller exactly one claimant wins it.
        """
        refusal = self.withholding()
        if refusal is not None:
            raise refusal
        if self._state is BreakerState.CLOSED:
            return BreakerTicket(self._generation, probe=False)
        self._state = BreakerState.HALF_OPEN  # OPEN with its cooldown over: this caller is the probe
        self._probes_claimed += 1
        self._observe(None)
        return BreakerTicket(self._generation, probe=True)

    def withholding(self) -> BreakerOpen | None:
        """The refusal ``admit`` would raise now, or None; claims nothing."""
        if self._state is BreakerState.CLOSED:
            return None
        if self._state is BreakerState.OPEN:
            remaining = self.remaining_cooldown()
            return BreakerOpen(self.scope, remaining, self._generation) if remaining > 0.0 else None
        # HALF_OPEN: the probe's answer is due. If it succeeds the scope reopens to traffic at once, so the
        # estimate is the base cooldown; quoting the lengthened one would park callers long after a recovery.
        return BreakerOpen(self.scope, self.policy.cooldown_s, self._generation)

    def record(self, ticket: BreakerTicket, outcome: OutcomeClass) -> RecordEffect:
        """Feed back the classified outcome of a dispatched call admitted with ``ticket``."""
        effect = self._record(ticket, outcome)
        self._observe(effect)
        return effect

    def _record(self, ticket: BreakerTicket, outcome: OutcomeClass) -> RecordEffect:
        if ticket.generation != self._generation:
            return RecordEffect.STALE
        failure = outcome is OutcomeClass.INFRASTRUCTURE_FAILURE
        if self._state is BreakerState.CLOSED:
            if ticket.probe:  # a probe of this generation after the breaker closed: already counted
                return RecordEffect.IGNORED
            self._window.append(_Observation(self._clock.now(), failure))
            return RecordEffect.TRIPPED if self._maybe_trip() else RecordEffect.COUNTED
        if self._state is BreakerState.HALF_OPEN and ticket.probe:
            if failure:
                self._reopen(lengthen=True)
                return RecordEffect.REOPENED
            # A client/domain rejection is still an answer from a dependency that handled the request.
            self._close()
            return RecordEffect.CLOSED
        return RecordEffect.IGNORED

    def abandon_probe(self, ticket: BreakerTicket) -> RecordEffect:
        """The probe ended without an outcome (released unrecorded, holder died, lease expired).

        No evidence of health is no evidence: treat it as a failed probe so the scope cannot stay HALF_OPEN
        forever with its only slot held by nobody.
        """
        if not ticket.probe:
            return RecordEffect.IGNORED
        effect = self._record(ticket, OutcomeClass.INFRASTRUCTURE_FAILURE)
        self._observe(effect, "abandoned")
        return effect

    # ------------------------------------------------------------------ metrics

    def _observe(self, effect: RecordEffect | None, failed_probe: str = "failure") -> None:
        """Record what ``effect`` did (None: only the state); ``failed_probe`` names how a reopening probe
        ended. An exporter problem must never change what the breaker decides, so nothing here raises."""
        m, scope = self._metrics, self.scope
        try:
            if effect is RecordEffect.TRIPPED:
                m.breaker_tripped(scope)
            elif effect is RecordEffect.REOPENED:
                m.breaker_probed(scope, failed_probe)
            elif effect is RecordEffect.CLOSED:
                m.breaker_probed(scope, "success")
            elif effect is not None:
                return  # counted, stale or ignored: no state changed
            m.breaker_state(scope, self._state.value)
        except Exception:
            _log.warning("breaker %s: metric not recorded", scope, exc_info=True)

    # ------------------------------------------------------------------ internals

    def _age_out(self) -> None:
        max_age = self.policy.window_age_s
        if max_age is None:
            return
        horizon = self._clock.now() - max_age
        while self._window and self._window[0].at < horizon:
            self._window.popleft()

    def _maybe_trip(self) -> bool:
        size, failures = self.window_counts()
        if should_trip(size, failures, self.policy):
            # Tripping while regular traffic was still coming back: the probe's success did not hold, so
            # this is the next failed trial of the same outage, lengthened like a failed probe's cooldown.
            self._reopen(lengthen=self.restoring)
            return True
        return False

    def _restore_progress(self) -> float:
        """How far the restore after the last close has come (1.0: done, or none under way); completing it
        resets the cooldown, since only then has the scope shown itself healthy under regular traffic."""
        since = self._restoring_since
        if since is None:
            return 1.0
        if self._state is BreakerState.CLOSED:
            elapsed = self._clock.now() - since
            if elapsed < self.policy.restore_s:
                return max(0.0, elapsed / self.policy.restore_s)
            self._cooldown_s = self.policy.cooldown_s
        self._restoring_since = None
        return 1.0

    def _reopen(self, *, lengthen: bool) -> None:
        if lengthen:
            lengthened = self._cooldown_s * self.policy.cooldown_multiplier
            self._cooldown_s = min(lengthened, self.policy.max_cooldown_s)
        self._restoring_since = None
        self._state = BreakerState.OPEN
        self._generation += 1
        self._opened_at = self._clock.now()
        self._window.clear()

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        self._window.clear()
        if self.policy.restore_s > 0.0:
            self._restoring_since = self._clock.now()  # the cooldown resets when the restore completes
        else:
            self._cooldown_s = self.policy.cooldown_s
