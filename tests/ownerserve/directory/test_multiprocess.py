"""Two router processes sharing one Redis directory: claim races and fencing of a stale owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ownerserve.directory.base import Artifact
from ownerserve.directory.redis import RedisDirectory
from tests.conftest import RedisServer
from tests.ownerserve.directory.router_proc import chain_for

REPO = Path(__file__).resolve().parents[3]


class Router:
    """A `router_proc` child process and its JSON lines."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ownerserve.directory.router_proc", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        assert text, f"router exited with {self.proc.wait()}"
        out: dict[str, Any] = json.loads(text)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def routers() -> Iterator[list[Router]]:
    started: list[Router] = []
    yield started
    for r in started:
        r.stop()


@pytest.fixture
async def directory(redis_server: RedisServer) -> Any:
    d = RedisDirectory.from_url(redis_server.url, f"mp-{uuid.uuid4().hex[:8]}", socket_timeout_s=10)
    yield d
    await d.flush_namespace()
    await d.close()


async def test_two_routers_racing_for_the_same_prefixes_agree_on_one_owner(
    redis_server: RedisServer, directory: RedisDirectory, routers: list[Router]
) -> None:
    n = 40
    for worker in ("router-a", "router-b"):
        routers.append(Router("race", redis_server.url, directory.namespace, worker, str(n)))
    for r in routers:
        assert r.line() == {"ready": True}
    await directory.client.set(directory.key("race-start"), 1)
    a, b = (r.line()["leases"] for r in routers)
    assert a == b  # both saw the same single owner and epoch for every prefix
    for i, (aid, worker, epoch) in enumerate(a):
        m = await directory.lookup(chain_for(i)[:8])
        assert (m.owner, m.owner_epoch, m.owner_blocks, m.owner_artifact_id) == (
            worker,
            epoch,
            8,
            aid,
        )
    assert len({e for _, _, e in a}) == n  # one fresh epoch per prefix: nobody claimed twice


async def test_paused_owner_loses_its_lease_and_is_fenced(
    redis_server: RedisServer, directory: RedisDirectory, routers: list[Router]
) -> None:
    lease_s = 0.6
    owner = Router("hold", redis_server.url, directory.namespace, "router-a", str(lease_s))
    routers.append(owner)
    aid, worker, epoch = owner.line()["claimed"]
    assert worker == "router-a"
    os.kill(owner.proc.pid, signal.SIGSTOP)  # a long GC pause / partition: no renewals
    try:
        time.sleep(lease_s + 0.3)
        new = await directory.claim(Artifact(chain_for(1)[:8]), "router-b", 30.0)
    finally:
        os.kill(owner.proc.pid, signal.SIGCONT)
    assert (new.artifact_id, new.worker) == (aid, "router-b")
    assert new.epoch > epoch
    assert owner.line()["renew"] == "refused"
    assert owner.line() == {"commit": "refused"}
    m = await directory.lookup(chain_for(1)[:12])
    assert (m.owner, m.owner_epoch, m.owner_blocks) == ("router-b", new.epoch, 8)


async def test_killed_owner_lease_expires_then_a_new_claim_wins_a_higher_epoch(
    redis_server: RedisServer, directory: RedisDirectory, routers: list[Router]
) -> None:
    lease_s = 1.5  # long enough that the first claim below surely meets the live lease
    owner = Router("hold", redis_server.url, directory.namespace, "router-a", str(lease_s))
    routers.append(owner)
    aid, _, epoch = owner.line()["claimed"]
    owner.proc.kill()
    owner.proc.wait(10)
    artifact = Artifact(chain_for(1)[:8])
    still = await directory.claim(artifact, "router-b", 30.0)
    assert (still.worker, still.epoch) == ("router-a", epoch)  # lease not over yet
    time.sleep(lease_s)
    new = await directory.claim(artifact, "router-b", 30.0)
    assert (new.artifact_id, new.worker) == (aid, "router-b")
    assert new.epoch > epoch
