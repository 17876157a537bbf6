"""Peer routers (vllm-router, sglang-router) installed in their own cached venvs, for the
benchmarks' comparisons.

The peers are comparators, never dependencies: each lives in its own virtualenv under
`${OWNERSERVE_CACHE:-~/.cache/ownerserve}/peers/<name>/`, installed once with pip and reused.
`peer_binary("vllm-router")` returns the path of its console script, installing it if needed
(`bench/peers/setup_peers.sh` installs them ahead of a run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Peer:
    """One peer router: the pip requirement that installs it and the console script it provides."""

    name: str
    requirement: str
    binary: str


PEERS: dict[str, Peer] = {
    "vllm-router": Peer("vllm-router", "vllm-router==0.1.17", "vllm-router"),
    "sglang-router": Peer("sglang-router", "sglang-router==0.3.2", "smg"),
}


class PeerUnavailableError(RuntimeError):
    """A peer router could not be installed here (no registry access, no wheel for this box)."""


def cache_dir() -> Path:
    """Where peer venvs live: `$OWNERSERVE_CACHE/peers`, default `~/.cache/ownerserve/peers`."""
    base = os.environ.get("OWNERSERVE_CACHE") or str(Path.home() / ".cache" / "ownerserve")
    return Path(base) / "peers"


def venv_dir(name: str) -> Path:
    return cache_dir() / name


def _stamp(name: str) -> Path:
    return venv_dir(name) / ".ownerserve-installed"


def _find_binary(peer: Peer) -> Path | None:
    bindir = venv_dir(peer.name) / "bin"
    for candidate in (peer.binary, peer.name, peer.name.replace("-", "_")):
        path = bindir / candidate
        if path.exists():
            return path
    return None


def installed(name: str) -> Path | None:
    """The peer's console script if its venv is complete, else None (never installs)."""
    peer = PEERS[name]
    if not _stamp(name).exists():
        return None
    return _find_binary(peer)


def install(name: str, *, timeout_s: float = 900.0, quiet: bool = True) -> Path:
    """Create the peer's venv and pip-install it (idempotent); return its console script."""
    peer = PEERS[name]
    found = installed(name)
    if found is not None:
        return found
    target = venv_dir(name)
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(target)
    # Few retries: without registry access this should fail in seconds, not minutes.
    cmd = [str(target / "bin" / "python"), "-m", "pip", "install", "--retries", "1",
           "--timeout", "20", peer.requirement]  # fmt: skip
    if quiet:
        cmd.insert(4, "-q")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise PeerUnavailableError(f"{peer.requirement}: pip install timed out") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise PeerUnavailableError(f"{peer.requirement}: pip install failed: {' | '.join(tail)}")
    binary = _find_binary(peer)
    if binary is None:
        raise PeerUnavailableError(f"{peer.requirement}: installed but no console script found")
    _stamp(name).write_text(peer.requirement + "\n")
    return binary


def peer_binary(name: str) -> Path:
    """The console script of peer `name` ("vllm-router" or "sglang-router"), installing it once."""
    if name not in PEERS:
        raise KeyError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    return install(name)
