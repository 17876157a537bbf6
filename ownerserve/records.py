"""Frozen dataclasses made as fast as plain ones.

A frozen dataclass's generated `__init__` sets every field with `object.__setattr__` (its own
`__setattr__` refuses), which costs about 7x a plain class's: a record of 8 fields takes
2.9 us to make on the 2-core VM, a mutable slotted one 0.4 us. `fast_init` gives a frozen,
slotted dataclass an `__init__` that sets each field through its slot's descriptor instead, as
fast as the mutable one's, and changes nothing else: the instance stays immutable, and
defaults, equality, hashing, `repr` and `dataclasses.replace` are the dataclass's own. For
records made on a hot path: the router's per-request records (request, session, tokens,
planner views, candidates, plan, directory match), KV events, the sidecar store's metadata.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, TypeVar

_T = TypeVar("_T")


def fast_init(cls: type[_T]) -> type[_T]:
    """Class decorator, placed above `@dataclass(frozen=True, slots=True)`. Fields with a
    `default_factory` or `init=False` are refused (`TypeError`): the generated `__init__`
    knows plain fields and plain defaults only."""
    if "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fast_init needs a slotted dataclass")
    positional: list[str] = []
    keyword: list[str] = []
    lines: list[str] = []
    scope: dict[str, object] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if not f.init or f.default_factory is not MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init takes plain fields only")
        param = f.name
        if f.default is not MISSING:
            scope[f"_default_{f.name}"] = f.default
            param += f"=_default_{f.name}"
        (keyword if f.kw_only else positional).append(param)
        scope[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        lines.append(f"    _set_{f.name}(self, {f.name})")
    params = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    exec(f"def __init__({params}):\n" + "\n".join(lines or ["    pass"]), scope)
    init: Any = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    setattr(cls, "__init__", init)  # noqa: B010 (mypy forbids assigning a method)
    return cls
