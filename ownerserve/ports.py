"""Loopback TCP ports for the processes this project starts (emulated workers, routers, vLLM,
sidecars, test servers): the one `free_port`, and the bind check a server's port must pass."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_HANDED_OUT: set[int] = set()
_LOWEST = 20000


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (what binding port 0 and outgoing
    connections take)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now, below the ephemeral range.

    A port is often bound well after it is picked (vLLM binds its KV-event replay socket and
    NIXL side channel only after loading the model, minutes on a busy CPU box; an emulator
    binds after its imports); a port from the ephemeral range (what binding port 0 gives) can
    meanwhile become the local end of any process's outgoing connection, and the server then
    dies with "Address already in use". Ports below the range are never taken that way.
    Random within 20000..(range start - 1), checked free, never handed out twice by this
    process; binding port 0 is the fallback."""
    high = ephemeral_low() - 1
    for _ in range(64):
        port = random.randint(_LOWEST, high) if high > _LOWEST else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_bindable(host: str, port: int) -> None:
    """Raise `OSError` if a server could not bind `host:port` now.

    Binds with `SO_REUSEADDR`, as uvicorn (and asyncio's `create_server`) do: a port whose
    previous server's connections still sit in TIME_WAIT is bindable for them, and must be
    for this check too, or a restart right after a stop fails here although it would work."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
