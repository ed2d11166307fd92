"""``replace`` for the rulebook's frozen values: what ``dataclasses.replace`` does, in a third of its time.

Folding an event builds the next ``TrajectoryRecord`` (45 fields) about twice, and a tool turn folds about
17 events: ``dataclasses.replace`` (it gathers every field into keyword arguments and runs ``__init__``) was
a tenth of a turn's own compute (``benchmarks/turn_overhead.py``). For a class whose fields are all set by
``__init__`` and that has no ``__post_init__`` (so ``__init__`` only stores its arguments), the copy is
made directly: a new instance, every field copied (through each slot's descriptor when the class has
slots), the changes written over. Any other class goes through
``dataclasses.replace`` unchanged, so the result is always what it would have been.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["replace"]

T = TypeVar("T")

_Copier = Callable[[Any, dict[str, Any]], Any]
_COPIERS: dict[type, _Copier | None] = {}


def replace(obj: T, /, **changes: Any) -> T:
    """A copy of the dataclass instance ``obj`` with ``changes``; ``TypeError`` for an unknown field."""
    cls = type(obj)
    try:
        copier = _COPIERS[cls]
    except KeyError:
        copier = _COPIERS[cls] = _copier_for(cls)
    if copier is None:
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    result: T = copier(obj, changes)
    return result


def _copier_for(cls: type) -> _Copier | None:
    """A copier for ``cls``, or None when only ``dataclasses.replace`` is faithful."""
    if not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__"):
        return None
    fields = dataclasses.fields(cls)
    # InitVars and ClassVars are not among fields(); a pseudo-field only __init__ takes rules the copy out
    init_params = [p for p in _init_parameters(cls) if p != "self"]
    names = [f.name for f in fields]
    if any(not f.init for f in fields) or init_params != names:
        return None
    # The copy is compiled per class, as dataclasses compiles __init__: one attribute read and one store
    # per field, then the changes over them. A slotted class stores through each slot's own descriptor,
    # bound once (object.__setattr__ finds the descriptor on every call: 2.5x the time for the record).
    slots = [inspect.getattr_static(cls, name, None) for name in names]
    if all(isinstance(slot, types.MemberDescriptorType) for slot in slots):
        setters = {name: slot.__set__ for name, slot in zip(names, slots, strict=True)}
        scope: dict[str, Any] = {f"s{i}": setter for i, setter in enumerate(setters.values())}
        scope["put"] = setters
        store = [f"    s{i}(out, obj.{name})" for i, name in enumerate(names)]
        change = "        put[name](out, value)"
    else:
        scope = {"set_field": object.__setattr__}
        store = [f"    set_field(out, {name!r}, obj.{name})" for name in names]
        change = "        set_field(out, name, value)"
    lines = ["def copy(obj, changes):", "    out = new(cls)", *store]
    lines += [
        "    for name, value in changes.items():",
        "        if name not in known:",
        "            raise TypeError(f'{cls.__name__} has no field {name!r}')",
        change,
        "    return out",
    ]
    scope.update({"new": object.__new__, "cls": cls, "known": frozenset(names)})
    exec("\n".join(lines), scope)
    copier: _Copier = scope["copy"]
    return copier


def _init_parameters(cls: type) -> list[str]:
    code = getattr(cls.__init__, "__code__", None)  # type: ignore[misc]
    if code is None:
        return []
    return list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
