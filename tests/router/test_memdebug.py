"""The memory debug view's descriptor accounting (`router/memdebug.py`) against real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import uvloop

from router.memdebug import descriptors
from tests.router.fake_worker import free_port
from tests.waiting import until


def test_a_refused_socket_still_open_is_counted_closed_with_its_holder() -> None:
    before = descriptors()["by_kind"].get("socket (closed tcp, fd open)", 0)
    sock = socket.socket()
    try:
        with contextlib.suppress(OSError):
            sock.connect(("127.0.0.1", free_port()))  # nothing listens: refused
        seen = descriptors()
        closed = [c for c in seen["closed_sockets"] if c["fd"] == sock.fileno()]
        assert seen["by_kind"]["socket (closed tcp, fd open)"] == before + 1
        assert closed and closed[0]["held_by"] == ["socket.socket"]
    finally:
        sock.close()
    assert descriptors()["by_kind"].get("socket (closed tcp, fd open)", 0) == before


def test_a_connection_is_counted_by_its_peer() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)), server.accept()[0]:
            peers = descriptors()["tcp_by_peer"]
            assert peers[f"127.0.0.1:{port} established"] == 1
            assert peers[f"listening :{port} listen"] == 1
            assert peers[f"client of :{port} established"] == 1


def test_a_reset_connection_is_counted_closed_with_the_uvloop_transport_holding_it() -> None:
    async def main() -> None:
        accepted: list[socket.socket] = []
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            transport, _ = await asyncio.get_running_loop().create_connection(
                asyncio.Protocol, "127.0.0.1", port
            )
            transport.pause_reading()  # it does not see the reset, so it stays open
            peer, _ = server.accept()
            accepted.append(peer)
            # close with a reset (linger 0): the connection leaves the kernel's TCP table
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()
            fd = transport.get_extra_info("socket").fileno()

            def closed() -> list[dict[str, Any]]:
                return [c for c in descriptors()["closed_sockets"] if c["fd"] == fd]

            await until(lambda: bool(closed()), what="the reset socket counted closed")
            (held_by,) = closed()[0]["held_by"]
            assert held_by.startswith("TCPTransport ")
            assert f"peer=('127.0.0.1', {port})" in held_by
            transport.close()

    uvloop.run(main())
