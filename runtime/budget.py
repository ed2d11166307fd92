"""Per-trajectory budgets: ceilings, metered spend, the share rho and the staged escalation.

Harness chapter, "Budgets and Ceilings": a trajectory's budget is a vector of ceilings
``B = <H_max, N_max, T_max, C_max>`` on turns, tokens, wall-clock seconds and dollars, extensible with
deployment dimensions such as sandbox-seconds. Spend is *metered*, never estimated: after every call the
harness reads the provider's usage (uncached input, cached input, output tokens) and prices it, and adds
any direct tool charge. Every attempt is charged, retries included (reliability guide §5.4).

The budget reduces to one number per turn, ``rho = max_d u_d / B_d`` (the share of the tightest ceiling
used), and Table 12 maps rho to a stage: nominal, steer (≥ 0.70), restrict (≥ 0.90), halt (≥ 1.00).
The thresholds are illustrative in the chapter, so they are configurable here.

Ceilings and spend are keyed by plain ``str`` so a deployment can add dimensions; the standard four are
the members of :class:`Dimension` (a ``StrEnum``, so ``Dimension.TURNS == "turns"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from runtime.errors import InputError
from runtime.ports import Usage

__all__ = [
    "BudgetAssessment",
    "BudgetCeilings",
    "BudgetConfigError",
    "BudgetStage",
    "Dimension",
    "PriceTable",
    "Spend",
    "StageThresholds",
    "assess",
    "meter_model_call",
    "meter_tool_call",
    "meter_turn",
    "stage_for",
]

_PER_MILLION = 1_000_000.0


class BudgetConfigError(InputError):
    """A budget, price table or threshold set was malformed (names the field)."""


class Dimension(StrEnum):
    """The four standard budget dimensions. Any other ``str`` is a valid extra dimension."""

    TURNS = "turns"
    TOKENS = "tokens"
    WALL_SECONDS = "wall_seconds"
    DOLLARS = "dollars"


_STANDARD_ORDER: dict[str, int] = {d.value: i for i, d in enumerate(Dimension)}


def _dimension_order(name: str) -> tuple[int, str]:
    """Standard dimensions first in declaration order, then extras alphabetically (stable tie-breaks)."""
    return (_STANDARD_ORDER.get(name, len(_STANDARD_ORDER)), name)


def _frozen_vector(
    values: Mapping[str, float], *, where: str, allow_zero: bool
) -> MappingProxyType[str, float]:
    """Validate and freeze a dimension->amount mapping; keys become plain ``str``."""
    out: dict[str, float] = {}
    for raw_key, raw_value in values.items():
        if not isinstance(raw_key, str) or not raw_key:
            raise BudgetConfigError(
                "dimension names must be non-empty strings", where=f"{where}[{raw_key!r}]"
            )
        key = str(raw_key.value) if isinstance(raw_key, StrEnum) else raw_key
        if isinstance(raw_value, bool) or not isinstance(raw_value, int | float):
            raise BudgetConfigError(f"expected a number, got {raw_value!r}", where=f"{where}.{key}")
        value = float(raw_value)
        if not math.isfinite(value):
            raise BudgetConfigError(f"must be finite, got {value!r}", where=f"{where}.{key}")
        if value < 0 or (value == 0 and not allow_zero):
            bound = "≥ 0" if allow_zero else "> 0"
            raise BudgetConfigError(f"must be {bound}, got {value!r}", where=f"{where}.{key}")
        if key in out:
            raise BudgetConfigError("dimension given twice", where=f"{where}.{key}")
        out[key] = value
    return MappingProxyType(dict(sorted(out.items(), key=lambda kv: _dimension_order(kv[0]))))


@dataclass(frozen=True, slots=True, init=False)
class BudgetCeilings:
    """The per-trajectory ceiling vector. Dimensions not listed are unbounded.

    Build with a mapping (``BudgetCeilings({Dimension.TURNS: 40, "sandbox_seconds": 600})``) or keywords
    (``BudgetCeilings.of(turns=40, tokens=2_000_000, wall_seconds=900, dollars=3.5)``).
    """

    limits: Mapping[str, float]

    def __init__(self, limits: Mapping[str, float]) -> None:
        frozen = _frozen_vector(limits, where="budget.ceilings", allow_zero=False)
        if not frozen:
            raise BudgetConfigError("at least one ceiling is required", where="budget.ceilings")
        object.__setattr__(self, "limits", frozen)

    @classmethod
    def of(cls, **limits: float) -> BudgetCeilings:
        """Keyword constructor: ``BudgetCeilings.of(turns=40, dollars=3.5)``."""
        return cls(limits)

    def __getitem__(self, dimension: str) -> float:
        return self.limits[str(dimension)]

    def __contains__(self, dimension: object) -> bool:
        return isinstance(dimension, str) and str(dimension) in self.limits

    def __iter__(self) -> Iterator[str]:
        return iter(self.limits)

    def __hash__(self) -> int:
        return hash(tuple(self.limits.items()))

    def as_dict(self) -> dict[str, float]:
        """A plain dict (for encoding into events)."""
        return dict(self.limits)


@dataclass(frozen=True, slots=True, init=False)
class Spend:
    """Measured (or reserved) use per dimension; absent dimensions are zero.

    Spend is additive (:meth:`add`), except wall-clock seconds, which the caller sets from the clock with
    :meth:`with_value` because elapsed time is a gauge, not a sum of charges.
    """

    amounts: Mapping[str, float]

    def __init__(self, amounts: Mapping[str, float] | None = None) -> None:
        object.__setattr__(self, "amounts", _frozen_vector(amounts or {}, where="spend", allow_zero=True))

    @classmethod
    def of(cls, **amounts: float) -> Spend:
        """Keyword constructor: ``Spend.of(tokens=1200, dollars=0.01)``."""
        return cls(amounts)

    @classmethod
    def zero(cls) -> Spend:
        return cls()

    def get(self, dimension: str) -> float:
        """Use of ``dimension`` (0.0 when never charged)."""
        return self.amounts.get(str(dimension), 0.0)

    def __getitem__(self, dimension: str) -> float:
        return self.get(dimension)

    def __iter__(self) -> Iterator[str]:
        return iter(self.amounts)

    def __hash__(self) -> int:
        return hash(tuple(self.amounts.items()))

    def add(self, other: Spend) -> Spend:
        """Element-wise sum over the union of dimensions."""
        if not other.amounts:
            return self
        if not self.amounts:
            return other
        sums = dict(self.amounts)
        for key, value in other.amounts.items():
            sums[key] = sums.get(key, 0.0) + value
        # both were validated: the sum is valid unless it overflowed, which the full check reports
        if all(math.isfinite(v) for v in sums.values()):
            return Spend._valid(sums)
        return Spend(sums)

    @classmethod
    def _valid(cls, amounts: dict[str, float]) -> Spend:
        """A spend of amounts known valid (non-negative finite floats by dimension name), unchecked."""
        spend = object.__new__(cls)
        ordered = dict(sorted(amounts.items(), key=lambda kv: _dimension_order(kv[0])))
        object.__setattr__(spend, "amounts", MappingProxyType(ordered))
        return spend

    def __add__(self, other: Spend) -> Spend:
        return self.add(other)

    def with_value(self, dimension: str, value: float) -> Spend:
        """A copy with one dimension set (used for elapsed wall-clock seconds)."""
        updated = dict(self.amounts)
        updated[str(dimension)] = value
        return Spend(updated)

    @staticmethod
    def total(spends: Iterable[Spend]) -> Spend:
        """Sum of many spends (e.g. the outstanding liability of every unsettled operation)."""
        acc = Spend()
        for s in spends:
            acc = acc.add(s)
        return acc

    def as_dict(self) -> dict[str, float]:
        return dict(self.amounts)


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Dollar prices per million tokens, split the way providers bill them."""

    uncached_input_per_million: float
    cached_input_per_million: float
    output_per_million: float

    def __post_init__(self) -> None:
        for name in ("uncached_input_per_million", "cached_input_per_million", "output_per_million"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BudgetConfigError(f"expected a number, got {value!r}", where=f"prices.{name}")
            if not math.isfinite(value) or value < 0:
                raise BudgetConfigError(f"must be finite and ≥ 0, got {value!r}", where=f"prices.{name}")

    def cost(self, usage: Usage) -> float:
        """Dollars for one call's reported usage (harness chapter's metering equation)."""
        return (
            usage.uncached_input * self.uncached_input_per_million
            + usage.cached_input * self.cached_input_per_million
            + usage.output * self.output_per_million
        ) / _PER_MILLION


def meter_model_call(usage: Usage, prices: PriceTable) -> Spend:
    """Tokens and dollars of one model-call *attempt*, from the provider's reported usage.

    Charge every attempt, including retries and calls cancelled mid-stream (their billed usage), because
    the provider bills them. The turn itself is counted separately with :func:`meter_turn`.
    """
    return Spend({Dimension.TOKENS: float(usage.total), Dimension.DOLLARS: prices.cost(usage)})


def meter_turn() -> Spend:
    """One turn (one admitted model call, counted once however many attempts it took)."""
    return Spend({Dimension.TURNS: 1.0})


def meter_tool_call(charge: float, **extra: float) -> Spend:
    """A tool call's direct dollar charge (e.g. a paid search) plus any extra dimensions it used,
    e.g. ``meter_tool_call(0.01, sandbox_seconds=12.5)``. Charged per attempt."""
    return Spend({Dimension.DOLLARS: charge, **extra})


class BudgetStage(StrEnum):
    """Table 12 stages, from harmless to final."""

    NOMINAL = "nominal"  # ordinary per-call ceilings only
    STEER = "steer"  # budget notice + context compaction: a request, guarantees nothing
    RESTRICT = "restrict"  # grant narrowed to read-only tools, no subagents: no new effects
    HALT = "halt"  # FINALIZING with BUDGET_EXCEEDED and the binding dimension: no further spend


@dataclass(frozen=True, slots=True)
class StageThresholds:
    """Lower bounds (inclusive) of the steer, restrict and halt bands of rho."""

    steer: float = 0.70
    restrict: float = 0.90
    halt: float = 1.00

    def __post_init__(self) -> None:
        for name in ("steer", "restrict", "halt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise BudgetConfigError(f"must be a finite number, got {value!r}", where=f"thresholds.{name}")
        if not 0 < self.steer < self.restrict < self.halt:
            raise BudgetConfigError(
                f"need 0 < steer < restrict < halt, got {self.steer} / {self.restrict} / {self.halt}",
                where="thresholds",
            )


def stage_for(rho: float, thresholds: StageThresholds = StageThresholds()) -> BudgetStage:
    """Table 12: band boundaries are inclusive from below (rho = 0.70 is already STEER)."""
    if rho >= thresholds.halt:
        return BudgetStage.HALT
    if rho >= thresholds.restrict:
        return BudgetStage.RESTRICT
    if rho >= thresholds.steer:
        return BudgetStage.STEER
    return BudgetStage.NOMINAL


@dataclass(frozen=True, slots=True)
class BudgetAssessment:
    """rho, its stage, the dimension that sets rho, every share, and what is left under each ceiling."""

    rho: float
    stage: BudgetStage
    binding_dimension: str
    shares: Mapping[str, float]
    remaining: Mapping[str, float]


def assess(
    ceilings: BudgetCeilings, spend: Spend, thresholds: StageThresholds = StageThresholds()
) -> BudgetAssessment:
    """rho = max over bounded dimensions of use/ceiling. Spend in a dimension without a ceiling is
    unbounded and does not count. Ties pick the first dimension in standard order (turns, tokens,
    wall_seconds, dollars, then extras by name), so the binding dimension is deterministic."""
    shares = {d: spend.get(d) / limit for d, limit in ceilings.limits.items()}
    rho = max(shares.values())
    # ceilings.limits is kept in standard order, so the first maximal share is the deterministic pick.
    binding = next(d for d, share in shares.items() if share == rho)
    remaining = {d: max(0.0, limit - spend.get(d)) for d, limit in ceilings.limits.items()}
    return BudgetAssessment(
        rho=rho,
        stage=stage_for(rho, thresholds),
        binding_dimension=binding,
        shares=MappingProxyType(shares),
        remaining=MappingProxyType(remaining),
    )
