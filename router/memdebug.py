"""Where a live router's memory and descriptors go, for `GET /admin/debug/memory` (served only
with `server.debug_memory`): the heap as the allocators hold it (pymalloc's blocks in use and
arenas, glibc malloc's in use and held: a heap flat under a growing RSS is memory the allocators
keep), with `server.debug_memory_frames` > 0 the traced heap and its top allocation sites
against a baseline and live objects by type, asyncio tasks by coroutine, open descriptors by
kind and TCP sockets by peer (Linux `/proc`)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import os
import re
import socket
import sys
import tempfile
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TCP_STATES = {"01": "established", "06": "time_wait", "08": "close_wait", "0A": "listen"}


def _rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_stats() -> dict[str, float]:
    """glibc malloc's bytes in use and held from the system (`mallinfo2`, glibc >= 2.33),
    in MiB; empty elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _MallInfo2
    m = mallinfo2()
    mib = 2**20
    return {
        "in_use_mb": round((m.uordblks + m.hblkhd) / mib, 2),
        "held_mb": round((m.arena + m.hblkhd) / mib, 2),
        "free_held_mb": round(m.fordblks / mib, 2),
    }


_PYMALLOC_LINES = {
    "# bytes in allocated blocks": "in_use_mb",
    "# bytes in available blocks": "free_in_pools_mb",
    "# arenas allocated current": "arenas",
}


def _pymalloc_stats() -> dict[str, float]:
    """pymalloc's bytes in allocated blocks, free in its pools, and arenas held (1 MiB each
    on 3.10+), parsed from `sys._debugmallocstats`, which writes to the C-level stderr: fd 2
    points at a temporary file meanwhile. Empty while tracemalloc traces (its hooks stand in
    front of pymalloc, which then reports nothing)."""
    stats: dict[str, float] = {}
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    for line in text.splitlines():
        name, _, value = line.partition("=")
        key = _PYMALLOC_LINES.get(name.strip())
        if key is not None and (digits := re.sub(r"[^0-9]", "", value)):
            n = int(digits)
            stats[key] = n if key == "arenas" else round(n / 2**20, 2)
    return stats


def _hex_addr(text: str) -> tuple[str, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc prints an IPv6 address as four host-order 32-bit words
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, words)
    return ip, int(port, 16)


def _tcp_by_inode() -> dict[str, tuple[tuple[str, int], tuple[str, int], str]]:
    """Socket inode -> (local address, remote address, state), from /proc/self/net/tcp{,6}."""
    out: dict[str, tuple[tuple[str, int], tuple[str, int], str]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            state = _TCP_STATES.get(parts[3], parts[3])
            out[parts[9]] = (_hex_addr(parts[1]), _hex_addr(parts[2]), state)
    return out


def descriptors() -> dict[str, Any]:
    """Open descriptors by kind, and the TCP ones by peer: `client of :PORT` for a connection
    accepted on one of this process's listening ports, else the remote `HOST:PORT`."""
    kinds: Counter[str] = Counter()
    inodes: list[str] = []
    fd_dir = Path("/proc/self/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return {"by_kind": {}, "tcp_by_peer": {}}
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            kinds["socket"] += 1
            inodes.append(target[8:-1])
        elif target.startswith("/"):
            kinds["file"] += 1
        else:
            kinds[target.split(":", 1)[0]] += 1
    tcp = _tcp_by_inode()
    mine = [tcp[i] for i in inodes if i in tcp]
    listening = {local[1] for local, _, state in mine if state == "listen"}
    peers: Counter[str] = Counter()
    for local, remote, state in mine:
        if state == "listen":
            peer = f"listening :{local[1]}"
        elif local[1] in listening:
            peer = f"client of :{local[1]}"
        else:
            peer = f"{remote[0]}:{remote[1]}"
        peers[f"{peer} {state}"] += 1
    unix = _unix_inodes()
    orphans = {i for i in inodes if i not in tcp and i not in unix}
    kinds["socket (unix)"] = sum(1 for i in inodes if i in unix)
    # a TCP socket closed (reset, refused) but whose descriptor is still open is in no table
    kinds["socket (closed tcp, fd open)"] = len(orphans)
    return {
        "by_kind": dict(kinds),
        "tcp_by_peer": dict(peers.most_common()),
        "closed_sockets": _socket_owners(orphans, fd_dir) if orphans else [],
    }


def _unix_inodes() -> set[str]:
    try:
        lines = Path("/proc/self/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {parts[6] for line in lines if len(parts := line.split()) > 6}


def _is_uvloop_transport(obj: object) -> bool:
    # uvloop's transports are not subclasses of asyncio's
    cls = type(obj)
    return cls.__module__ == "uvloop.loop" and cls.__qualname__.endswith("Transport")


def _socket_owners(orphans: set[str], fd_dir: Path) -> list[dict[str, Any]]:
    """Who holds each descriptor of `orphans` (socket inodes): the Python objects whose
    `fileno()` is its fd (a `socket.socket`, or a transport's socket), with the transport's
    protocol and the peer it was opened to."""
    fds: dict[int, str] = {}
    for entry in fd_dir.iterdir():
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(entry)
            if target[8:-1] in orphans:
                fds[int(entry.name)] = target[8:-1]
    owners: dict[int, list[str]] = {fd: [] for fd in fds}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, socket.socket):
                fd, what = obj.fileno(), "socket.socket"
            elif isinstance(obj, asyncio.BaseTransport) or _is_uvloop_transport(obj):
                sock = obj.get_extra_info("socket")
                if sock is None:
                    continue
                fd = sock.fileno()
                proto = obj.get_protocol() if hasattr(obj, "get_protocol") else None
                closing = obj.is_closing()
                peer = obj.get_extra_info("peername")
                what = (
                    f"{type(obj).__qualname__} protocol={type(proto).__qualname__} "
                    f"closing={closing} peer={peer}"
                )
            else:
                continue
        except Exception:  # a half-closed object may refuse any of these
            continue
        if fd in owners:
            owners[fd].append(what)
    return [{"fd": fd, "inode": fds[fd], "held_by": owners[fd]} for fd in sorted(fds)]


def tasks() -> dict[str, int]:
    """The running loop's tasks by the qualified name of their coroutine."""
    names: Counter[str] = Counter()
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        names[getattr(coro, "__qualname__", type(coro).__qualname__)] += 1
    return dict(names.most_common())


def _type_counts() -> Counter[str]:
    return Counter(type(o).__qualname__ for o in gc.get_objects())


@dataclass(slots=True)
class MemoryDebug:
    """Tracemalloc with `frames` frames a trace from `start` (0: none), and the baseline each
    report diffs against (the first report's, or the one `reset` takes)."""

    frames: int
    _base: tracemalloc.Snapshot | None = None
    _base_types: Counter[str] = field(default_factory=Counter)
    _started: bool = False

    def start(self) -> None:
        if self.frames > 0 and not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
            self._started = True

    def stop(self) -> None:
        """Stop the tracing `start` began (not one someone else's)."""
        if self._started:
            tracemalloc.stop()
            self._started = False
        self._base = None

    def report(self, top: int = 25, reset: bool = False) -> dict[str, Any]:
        """The heap traced now against the baseline (top `top` sites by bytes gained, each
        site's frames most recent first), live objects by type gained, tasks, descriptors and
        RSS."""
        gc.collect()
        body: dict[str, Any] = {
            "rss_mb": round(_rss_mb(), 2),
            "pymalloc": _pymalloc_stats(),
            "malloc": _malloc_stats(),
            "allocated_blocks": sys.getallocatedblocks(),
        }
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)]
            )
            traced, peak = tracemalloc.get_traced_memory()
            body["traced_mb"] = round(traced / 2**20, 2)
            body["traced_peak_mb"] = round(peak / 2**20, 2)
            body["tracemalloc_overhead_mb"] = round(tracemalloc.get_tracemalloc_memory() / 2**20, 2)
            if self._base is None or reset:
                self._base = snap
                self._base_types = _type_counts()
                body["baseline"] = "taken now"
            else:
                key = "traceback" if self.frames > 1 else "lineno"
                diff = snap.compare_to(self._base, key)
                body["traced_gained_mb"] = round(sum(d.size_diff for d in diff) / 2**20, 3)
                body["sites"] = [
                    {
                        "kib_gained": round(d.size_diff / 1024, 1),
                        "blocks_gained": d.count_diff,
                        "kib_now": round(d.size / 1024, 1),
                        "at": [f"{f.filename}:{f.lineno}" for f in reversed(d.traceback)],
                    }
                    for d in diff[:top]
                ]
                types = _type_counts()
                gained = ((types[t] - self._base_types.get(t, 0), t) for t in types)
                body["objects_gained"] = {t: n for n, t in sorted(gained, reverse=True)[:top]}
        body["tasks"] = tasks()
        body["tasks_total"] = sum(body["tasks"].values())
        body["descriptors"] = descriptors()
        return body
