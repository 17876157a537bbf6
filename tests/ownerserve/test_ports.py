"""Ports come from below the ephemeral range (a server may bind its port minutes after it is
picked, and an ephemeral port can meanwhile become any outgoing connection's), and a port whose
last server's connections sit in TIME_WAIT counts as bindable, as it is for a server."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from ownerserve.ports import check_bindable, ephemeral_low, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = ephemeral_low()
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
    assert ephemeral_low(str(f)) == 40000
    assert ephemeral_low(str(tmp_path / "missing")) == 32768


def test_a_port_in_time_wait_is_bindable_for_a_server() -> None:
    """The server side closes first (as a server does at shutdown): its port's connection sits
    in TIME_WAIT. A bind without SO_REUSEADDR fails then; a server (and `check_bindable`)
    binds. (Linux lets it only if the closed connection had SO_REUSEADDR too: a server's
    accepted connections inherit it from its listening socket, as here.)"""
    port = free_port()
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the active close: TIME_WAIT on the server's side
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    check_bindable("127.0.0.1", port)
    with socket.socket() as taken:  # a server listens there again: not bindable
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(OSError):
            check_bindable("127.0.0.1", port)
