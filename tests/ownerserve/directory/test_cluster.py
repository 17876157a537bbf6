"""The key layout on a real Redis Cluster (3 masters on loopback): every script of a namespace
runs in one hash slot, and namespaces spread over the masters."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import key_slot

from ownerserve.config import DirectorySettings
from ownerserve.directory import open_directory
from ownerserve.directory.base import Artifact, Holding, HoldKind
from ownerserve.directory.redis import RedisDirectory
from ownerserve.directory.resilient import ResilientDirectory
from ownerserve.errors import StaleEpochError
from ownerserve.events import BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.ports import free_port
from ownerserve.types import Tier
from tests.conftest import RedisServer, find_redis_binary

BS = 4
ROOT = chain_root("cluster-model")
TOKENS = list(range(64 * BS))
CHAIN = tuple(block_hash_chain(TOKENS, BS, ROOT))


def _node_slots(port: int) -> list[tuple[int, int, int]]:
    """(first slot, last slot, master port) of every slot range, from CLUSTER SLOTS."""
    client = redis.Redis(port=port)
    try:
        reply = client.execute_command("CLUSTER SLOTS")
    finally:
        client.close()
    return [(int(r[0]), int(r[1]), int(r[2][1])) for r in reply]


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            port -= 20000
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    pytest.skip("no free port pair for a cluster node")


@pytest.fixture(scope="module")
def cluster(redis_binary: str) -> Iterator[list[RedisServer]]:
    cli = find_redis_binary("redis-cli")
    if cli is None:
        pytest.skip("no redis-cli to create a cluster")
    nodes: list[RedisServer] = []
    try:
        for _ in range(3):
            server = RedisServer(
                redis_binary,
                port=cluster_port(),
                extra=(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000",
                ),
            )  # fmt: skip
            nodes.append(server.start())
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        create = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if create.returncode != 0:
            pytest.skip(f"cannot create a Redis Cluster here: {create.stdout[-300:]}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-p", str(n.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                for n in nodes
            ]
            if all("cluster_state:ok" in s for s in states):
                break
            time.sleep(0.2)
        else:
            pytest.skip("the Redis Cluster never reached cluster_state:ok")
        yield nodes
    finally:
        for n in nodes:
            n.cleanup()


def namespaces_on_every_master(nodes: list[RedisServer]) -> dict[int, str]:
    ranges = _node_slots(nodes[0].port)
    found: dict[int, str] = {}
    for i in range(1000):
        ns = f"model-{i}"
        slot = key_slot(("{" + ns + "}:own").encode())
        port = next(p for a, b, p in ranges if a <= slot <= b)
        found.setdefault(port, ns)
        if len(found) == len(nodes):
            break
    return found


async def scenario(d: RedisDirectory) -> None:
    """Every script once, on one namespace of the cluster."""
    await d.register_worker("w1", ROOT, BS)
    engine = tuple(range(100, 106))
    r = await d.apply_events(
        "w1", EventBatch(1, 0.0, (BlockStored(engine, None, tuple(TOKENS[: 6 * BS]), BS),))
    )
    assert r.stored == 6
    lease = await d.claim(Artifact(CHAIN[:8], size_bytes=10), "w2", 30.0)
    delta = await d.claim(Artifact(CHAIN[:12], start=8), "w2", 30.0, fence_epoch=lease.epoch)
    await d.renew(lease.artifact_id, "w2", lease.epoch, 30.0)
    with pytest.raises(StaleEpochError):
        await d.renew(lease.artifact_id, "w2", lease.epoch + 100, 30.0)
    await d.add_replica(CHAIN[7], "w3", Tier.CPU, 30.0)
    await d.set_session_owner("s1", "w2", 30.0)
    assert await d.add_fork_ref(CHAIN[7], "b1") == 1
    m = await d.lookup(CHAIN[:16], "s1")
    assert m.holdings == (
        Holding("w2", Tier.GPU, 12, HoldKind.OWNER),
        Holding("w3", Tier.CPU, 8, HoldKind.REPLICA),
        Holding("w1", Tier.GPU, 6, HoldKind.CACHED),
    )
    assert (m.owner, m.owner_epoch, m.session_owner) == ("w2", delta.epoch, "w2")
    info = await d.artifact_info(CHAIN[7])
    assert info is not None and info.fork_refs == 1 and info.reuse_count == 1
    await d.release(delta.artifact_id, "w2", delta.epoch)
    assert await d.drop_worker("w2") == 2  # the remaining lease and the session
    assert await d.sweep() == 0
    assert (await d.lookup(CHAIN[:16], "s1")).owner is None
    moved = await d.claim(Artifact(CHAIN[:4]), "w5", 30.0)
    assert await d.transfer(CHAIN[:4], "w5", "w6", 30.0, 30.0, Tier.CPU) == 4
    m = await d.lookup(CHAIN[:4])
    assert (m.owner, m.longest("w5", Tier.CPU)) == ("w6", 4) and m.owner_epoch > moved.epoch
    assert await d.boot_token("t") == "t"
    assert await d.raise_epoch(10**6) == 10**6


async def test_every_script_runs_on_a_cluster_and_namespaces_spread(
    cluster: list[RedisServer],
) -> None:
    by_master = namespaces_on_every_master(cluster)
    assert len(by_master) == 3
    url = f"redis://127.0.0.1:{cluster[0].port}?cluster=1"
    for ns in by_master.values():
        d = RedisDirectory.from_url(url, ns, socket_timeout_s=10.0)
        try:
            await scenario(d)
        finally:
            await d.close()
    # each master holds only the keys of its own namespace, all in that namespace's slot
    for port, ns in by_master.items():
        node = RedisDirectory.from_url(f"redis://127.0.0.1:{port}/0", ns)
        try:
            keys = [k async for k in node.client.scan_iter(count=1000)]
            assert keys and all(k.startswith("{" + ns + "}:") for k in keys)
            assert len({key_slot(k.encode()) for k in keys}) == 1
        finally:
            await node.close()


async def test_open_directory_on_a_cluster_url(cluster: list[RedisServer]) -> None:
    settings = DirectorySettings(
        backend="redis", redis_url=f"redis://127.0.0.1:{cluster[1].port}?cluster=1", key_prefix="r"
    )
    d = open_directory(settings)
    assert isinstance(d, ResilientDirectory)
    try:
        lease = await d.claim(Artifact(CHAIN[:4]), "w1", 30.0)
        m = await d.lookup(CHAIN[:4])
        assert (m.owner, m.owner_epoch) == ("w1", lease.epoch)
        assert (await d.health()).healthy
    finally:
        await d.close()
