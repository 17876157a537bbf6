"""Ports for vLLM servers come from below the ephemeral range: vLLM binds some of them minutes
after they are picked, and an ephemeral port can meanwhile become any outgoing connection's."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from workers.vllm_cpu.server import _ephemeral_low, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < low for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[0]))  # nothing holds it


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 20000 + free_port() % 1000))
        taken.listen()
        busy = taken.getsockname()[1]
        real = random.randint
        first = [True]

        def randint(a: int, b: int) -> int:  # the first pick hits the busy port
            if first.pop() if first else False:
                return int(busy)
            return real(a, b)

        monkeypatch.setattr(random, "randint", randint)
        assert free_port() != busy


def test_ephemeral_range_fallback(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert _ephemeral_low(str(f)) == 40000
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768
