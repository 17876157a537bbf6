"""`ownerserve.records.fast_init`: a frozen dataclass with the faster `__init__` behaves as the
dataclass itself would."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from ownerserve.records import fast_init


@dataclass(frozen=True, slots=True)
class Plain:
    a: str
    b: int = 2
    c: tuple[int, ...] = ()
    d: float = dataclasses.field(default=1.5, kw_only=True)


@fast_init
@dataclass(frozen=True, slots=True)
class Fast:
    a: str
    b: int = 2
    c: tuple[int, ...] = ()
    d: float = dataclasses.field(default=1.5, kw_only=True)


def fields_of(x: Plain | Fast) -> tuple[object, ...]:
    return dataclasses.astuple(x)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(("x",), {}), (("x", 5), {}), (("x", 5, (1,)), {"d": 0.0}), ((), {"a": "y", "c": (2,)})],
)
def test_same_values_as_the_dataclass_init(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    fast = Fast(*args, **kwargs)  # type: ignore[arg-type]
    assert fields_of(fast) == fields_of(Plain(*args, **kwargs))  # type: ignore[arg-type]


def test_same_argument_errors_as_the_dataclass_init() -> None:
    for bad_args, bad_kwargs in [((), {}), (("x", 1, (), 2.0), {}), (("x",), {"e": 1})]:
        with pytest.raises(TypeError):
            Plain(*bad_args, **bad_kwargs)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            Fast(*bad_args, **bad_kwargs)  # type: ignore[arg-type]


def test_immutability_equality_hash_repr_and_replace_are_the_dataclasses() -> None:
    f = Fast("x", 5)
    assert f == Fast("x", 5) and f != Fast("x", 6) and hash(f) == hash(Fast("x", 5))
    assert repr(f) == "Fast(a='x', b=5, c=(), d=1.5)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.a = "y"  # type: ignore[misc]
    g = dataclasses.replace(f, b=7, d=0.5)
    assert fields_of(g) == ("x", 7, (), 0.5) and fields_of(f) == ("x", 5, (), 1.5)


def test_refuses_what_it_cannot_generate() -> None:
    with pytest.raises(TypeError, match="plain fields"):

        @fast_init
        @dataclass(frozen=True, slots=True)
        class WithFactory:
            a: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match="slotted"):

        @fast_init
        @dataclass(frozen=True)
        class NoSlots:
            a: int = 0
