"""Retention policies: which boundaries keep their window state, and where a prefix can be
restored from under each."""

from __future__ import annotations

import pytest

from ownerserve.errors import ConfigError
from ownerserve.kvstate.retention import FULL, ZERO, Retention, periodic, restorable_boundary


def test_full_keeps_every_boundary() -> None:
    assert FULL.kept_boundaries(128, last_prompt_boundary=640, upto=1024) == list(
        range(128, 1025, 128)
    )


def test_periodic_keeps_multiples_and_the_last_prompt_boundary() -> None:
    p = periodic(512)
    assert p.kept_boundaries(128, last_prompt_boundary=640, upto=1280) == [512, 640, 1024]
    assert p.name == "periodic:512"


def test_zero_keeps_only_the_last_prompt_boundary() -> None:
    assert ZERO.kept_boundaries(128, last_prompt_boundary=640, upto=1280) == [640]
    assert not ZERO.keeps(0, 0)


@pytest.mark.parametrize(
    ("value", "want"),
    [(None, None), ("full", None), ("zero", 0), (0, 0), ("4096", 4096), (256, 256)],
)
def test_parse(value: str | int | None, want: int | None) -> None:
    assert Retention.parse(value).interval == want


@pytest.mark.parametrize("bad", ["-1", "often", -5])
def test_parse_rejects_bad_values(bad: str | int) -> None:
    with pytest.raises(ConfigError):
        Retention.parse(bad)


def test_restorable_boundary_needs_the_whole_window() -> None:
    held = {0, 1, 2, 5, 6}  # window blocks cached
    # window of 2 blocks: boundary 3 (blocks 1, 2) and 7 (blocks 5, 6) are restorable
    assert restorable_boundary(8, held.__contains__, 2) == 7
    assert restorable_boundary(6, held.__contains__, 2) == 3
    # a window of 1 block: boundary 6 (block 5)
    assert restorable_boundary(6, held.__contains__, 1) == 6
    # the sealed groups hold only 4 blocks: boundary 3
    assert restorable_boundary(4, held.__contains__, 2) == 3
    assert restorable_boundary(5, set().__contains__, 1) == 0
    # a short prefix needs only the blocks it has
    assert restorable_boundary(1, {0}.__contains__, 4) == 1
