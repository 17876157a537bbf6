"""`workers.vllm_connector.graphs`: the per-shape slots (taken by one user at a time, a few per
shape, the least recently used shape dropped) and `Captured` on CPU tensors (its function run
every time: a graph is captured only on a CUDA stream, measured on the device)."""

from __future__ import annotations

import torch

from workers.vllm_connector.graphs import Captured, Slots


def test_a_slot_is_taken_by_one_user_at_a_time_and_a_shape_holds_a_few() -> None:
    made: list[str] = []

    def make(key: object) -> str:
        made.append(f"{key}{len(made)}")
        return made[-1]

    slots: Slots[str] = Slots(make, per_key=2, keys=2)
    a, b = slots.take("x"), slots.take("x")
    assert (a, b) == ("x0", "x1") and a is not None
    assert slots.take("x") is None  # both taken: the caller goes without
    slots.give("x", a)
    assert slots.take("x") == "x0"  # given back: reused, not built again
    assert made == ["x0", "x1"]


def test_the_least_recently_used_shape_is_dropped_once_free() -> None:
    slots: Slots[int] = Slots(lambda key: hash(key), per_key=1, keys=2)
    for key in ("a", "b"):
        got = slots.take(key)
        assert got is not None
        slots.give(key, got)
    held = slots.take("c")  # three shapes: "a", the oldest and free, goes
    assert held is not None
    slots.give("a", 0)  # a shape no longer kept takes nothing back
    assert slots.take("a") == hash("a")


def test_captured_runs_its_launches_every_time_on_cpu_tensors() -> None:
    out = torch.zeros(3)
    run = Captured(lambda: out.add_(1), torch.device("cpu"))
    for _ in range(3):
        run.run()
    assert out.tolist() == [3.0, 3.0, 3.0] and not run.captured
