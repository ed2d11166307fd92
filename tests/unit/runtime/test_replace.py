"""``runtime._replace.replace``: the values ``dataclasses.replace`` makes, on the classes the fold uses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from runtime import _replace
from runtime._replace import replace
from runtime.events import TrajectoryCreated
from runtime.fold import fold
from runtime.record import CallLimits, CompletionCheck, Grants, TaskContract, TrajectoryRecord


def _record() -> TrajectoryRecord:
    created = TrajectoryCreated(
        trajectory_id="t-1",
        parent_id=None,
        tenant="team",
        contract=TaskContract("goal", CompletionCheck("always")),
        limits=CallLimits("sim", 64, 30.0),
        ceilings={"turns": 10},
        grants=Grants(tools=frozenset({"sleep"}), read_only_tools=frozenset()),
        priority_class="standard",
        created_at=0.0,
        deadline=100.0,
        context_ref="ctx:t-1",
    )
    return fold([created])


def test_the_record_copy_equals_dataclasses_replace_and_leaves_the_original_alone() -> None:
    record = _record()
    copy = replace(record, log_position=7, tenant="other")
    assert copy == dataclasses.replace(record, log_position=7, tenant="other")
    assert type(copy) is TrajectoryRecord and copy is not record
    assert (record.log_position, record.tenant) == (1, "team")
    assert _replace._COPIERS[TrajectoryRecord] is not None  # the compiled copy, not the fallback, ran
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.tenant = "x"  # type: ignore[misc]


def test_an_unknown_field_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="no field 'nope'"):
        replace(_record(), nope=1)


@dataclass(frozen=True)
class Checked:
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must be >= 0")


@dataclass(frozen=True)
class Derived:
    n: int
    twice: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "twice", 2 * self.n)


def test_a_class_that_validates_or_derives_goes_through_dataclasses_replace() -> None:
    with pytest.raises(ValueError, match="n must be >= 0"):
        replace(Checked(1), n=-1)
    assert replace(Derived(2), n=5).twice == 10
    assert _replace._COPIERS[Checked] is None and _replace._COPIERS[Derived] is None


@dataclass(frozen=True)
class Plain:  # no slots: the copy stores through object.__setattr__
    a: int
    b: str = "b"


@dataclass(frozen=True, slots=True)
class Slotted:  # slots: the copy stores through each slot's descriptor
    a: int
    b: str = "b"


@pytest.mark.parametrize("cls", [Plain, Slotted])
def test_slotted_and_plain_classes_copy_as_dataclasses_replace_does(cls: type[Plain] | type[Slotted]) -> None:
    original = cls(1)
    assert replace(original, b="c") == dataclasses.replace(original, b="c") == cls(1, "c")
    assert original == cls(1) and _replace._COPIERS[cls] is not None
    with pytest.raises(TypeError, match="no field 'c'"):
        replace(original, c=3)
