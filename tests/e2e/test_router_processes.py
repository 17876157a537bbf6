"""`ownerserve serve --processes N` as real processes on one port (SO_REUSEPORT) over a real
redis-server: both processes serve, a session keeps its worker whichever process answers, a
burst through both keeps a worker's in-flight bound, a killed process is restarted, the
in-process directory is refused, SIGTERM drains."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import DirectorySettings
from ownerserve.directory import open_directory
from ownerserve.ports import free_port
from tests.e2e.router_cluster import MODEL, REPO, plan_fields
from tests.waiting import until_sync

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis]

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _config(path: Path, port: int, workers: list[dict[str, Any]], extra: str = "") -> Path:
    lines = "\n".join(
        f"  - {{id: {w['id']}, url: '{w['url']}', role: hybrid, kind: {w['kind']}, "
        f"models: [{MODEL}]}}"
        for w in workers
    )
    path.write_text(
        f"server: {{host: 127.0.0.1, port: {port}, health_interval_s: 0.5}}\n"
        f"models: [{{name: {MODEL}}}]\n"
        f"workers:\n{lines}\n{extra}"
    )
    return path


def _redis(url: str) -> str:
    prefix = f"procs-{uuid.uuid4().hex[:8]}"
    return f"directory: {{backend: redis, redis_url: '{url}', key_prefix: {prefix}}}\n"


class Served:
    """`ownerserve serve --processes N` as a process, its output in files."""

    def __init__(self, config: Path, processes: int, tmp: Path) -> None:
        self.out = (tmp / "serve.out").open("wb")
        self.err_path = tmp / "serve.err"
        self.err = self.err_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ownerserve", "serve", "--config", str(config),
             "--processes", str(processes), "--log-level", "info",
             "--request-log-level", "warning"],
            cwd=REPO, stdout=self.out, stderr=self.err,
        )  # fmt: skip

    def log(self) -> str:
        return self.err_path.read_text()

    def children(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError):
            return [int(p) for p in path.read_text().split()]
        return []

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        finally:
            self.out.close()
            self.err.close()
        return code


@contextlib.contextmanager
def served(config: Path, processes: int, tmp: Path) -> Iterator[Served]:
    s = Served(config, processes, tmp)
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.stop()


def _pid_of(client: httpx.Client) -> int | None:
    """The pid of the process `client`'s connection reached (None: refused)."""
    with contextlib.suppress(httpx.HTTPError):
        return int(client.get("/health").json()["process"]["pid"])
    return None


def connection_to(url: str, pid: int) -> httpx.Client:
    """A client whose keep-alive connection the process `pid` accepted."""
    found: list[httpx.Client] = []

    def reached() -> bool:
        client = httpx.Client(base_url=url, timeout=30)
        if _pid_of(client) == pid:
            found.append(client)
            return True
        client.close()
        return False

    until_sync(reached, timeout_s=60, what=f"a connection to process {pid}")
    return found[0]


def all_listening(url: str, s: Served, n: int) -> list[int]:
    """Wait until `n` processes answer on the port; their pids."""
    seen: set[int] = set()

    def every() -> bool:
        assert s.proc.poll() is None, f"the supervisor exited {s.proc.returncode}: {s.log()}"
        with httpx.Client(base_url=url, timeout=5) as client:
            pid = _pid_of(client)
        if pid is not None:
            seen.add(pid)
        return len(seen) >= n

    until_sync(every, timeout_s=90, what=f"{n} router processes answering")
    return sorted(seen)


def _stats_are(gated: str, expected: dict[str, int]) -> bool:
    return bool(httpx.get(gated + "/stats").json() == expected)


@pytest.fixture
def gated() -> Iterator[str]:
    """A gated backend (`tests.e2e.gated_backend`) in its own process: its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.gated_backend", "--port", str(port), "--model", MODEL],
        cwd=REPO,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=1).status_code == 200
        return False

    try:
        until_sync(up, timeout_s=60, what="the gated backend")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_two_processes_on_one_port_both_serve(tmp_path: Path, redis_server):
    with emulated_workers(EmulatedWorker("h0", "hybrid", speed=200)) as (h0,):
        port = free_port()
        workers = [{"id": "h0", "url": h0.url, "kind": "emulator"}]
        config = _config(tmp_path / "c.yaml", port, workers, _redis(redis_server.url))
        with served(config, 2, tmp_path) as s:
            url = f"http://127.0.0.1:{port}"
            pids = all_listening(url, s, 2)
            assert sorted(s.children()) == pids
            for pid in pids:
                with contextlib.closing(connection_to(url, pid)) as client:
                    resp = client.post("/v1/chat/completions", json=BODY)
                    assert resp.status_code == 200, resp.text
                    assert _pid_of(client) == pid  # the same connection, the same process
            assert s.stop() == 0, s.log()


def test_a_session_keeps_its_worker_whichever_process_answers(tmp_path: Path, redis_server):
    workers = (EmulatedWorker("h0", "hybrid", speed=200), EmulatedWorker("h1", "hybrid", speed=200))
    with emulated_workers(*workers) as ws:
        port = free_port()
        prefix = f"procs-{uuid.uuid4().hex[:8]}"
        directory = {"backend": "redis", "redis_url": redis_server.url, "key_prefix": prefix}
        extra = (
            f"directory: {{backend: redis, redis_url: '{redis_server.url}', "
            f"key_prefix: {prefix}}}\n"
        )
        listed = [{"id": w.worker_id, "url": w.url, "kind": "emulator"} for w in ws]
        config = _config(tmp_path / "c.yaml", port, listed, extra)
        with served(config, 2, tmp_path) as s:
            url = f"http://127.0.0.1:{port}"
            first_pid, second_pid = all_listening(url, s, 2)
            headers = {"x-session-id": "procs-session"}
            messages = [{"role": "user", "content": "Explain the retry logic of the router. " * 8}]
            body = {**BODY, "messages": messages}
            with contextlib.closing(connection_to(url, first_pid)) as a:
                first = a.post("/v1/chat/completions", json=body, headers=headers)
            assert first.status_code == 200, first.text
            owner = plan_fields(first.headers["x-ownerserve-plan"])["d"]

            observer = open_directory(DirectorySettings.model_validate(directory))

            async def session_owner() -> str | None:
                return (await observer.lookup([], "procs-session")).session_owner

            loop = asyncio.new_event_loop()
            try:
                until_sync(
                    lambda: loop.run_until_complete(session_owner()) == owner,
                    what="the session's owner in Redis",
                )
            finally:
                loop.run_until_complete(observer.close())
                loop.close()
            answer = first.json()["choices"][0]["message"]["content"]
            turn2 = [*messages, {"role": "assistant", "content": answer}]
            turn2.append({"role": "user", "content": "and the timeouts?"})
            for _ in range(3):  # every turn, through the other process, on the owner
                with contextlib.closing(connection_to(url, second_pid)) as b:
                    resp = b.post(
                        "/v1/chat/completions", json={**body, "messages": turn2}, headers=headers
                    )
                assert resp.status_code == 200, resp.text
                assert plan_fields(resp.headers["x-ownerserve-plan"])["d"] == owner


def test_a_burst_through_two_processes_keeps_a_workers_inflight_bound(
    tmp_path: Path, redis_server, gated: str
):
    port = free_port()
    workers = [{"id": "g0", "url": gated, "kind": "vllm"}]
    extra = _redis(redis_server.url) + "admission: {max_inflight_per_worker: 1}\n"
    config = _config(tmp_path / "c.yaml", port, workers, extra)
    with served(config, 2, tmp_path) as s:
        url = f"http://127.0.0.1:{port}"
        pids = all_listening(url, s, 2)
        clients = [connection_to(url, pid) for pid in pids for _ in range(3)]
        statuses: list[int] = []

        def send(client: httpx.Client) -> None:
            statuses.append(client.post("/v1/chat/completions", json=BODY).status_code)

        threads = [threading.Thread(target=send, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        try:
            for served_before in range(len(clients)):
                # one request at a time reaches the worker, whichever process sent it
                alone: dict[str, int] = {"current": 1, "peak": 1, "served": served_before}
                until_sync(
                    functools.partial(_stats_are, gated, alone),
                    what=f"request {served_before + 1} held at the worker alone",
                )
                httpx.post(gated + "/release")
        finally:
            for _ in clients:  # nothing left held should the bound fail
                httpx.post(gated + "/release")
            for t in threads:
                t.join(timeout=30)
            for c in clients:
                c.close()
        assert statuses == [200] * len(clients)
        assert httpx.get(gated + "/stats").json()["peak"] == 1


def test_a_killed_process_is_restarted_and_requests_keep_succeeding(tmp_path: Path, redis_server):
    with emulated_workers(EmulatedWorker("h0", "hybrid", speed=200)) as (h0,):
        port = free_port()
        workers = [{"id": "h0", "url": h0.url, "kind": "emulator"}]
        config = _config(tmp_path / "c.yaml", port, workers, _redis(redis_server.url))
        with served(config, 2, tmp_path) as s:
            url = f"http://127.0.0.1:{port}"
            before = all_listening(url, s, 2)
            victim = before[0]
            os.kill(victim, signal.SIGKILL)
            until_sync(lambda: victim not in s.children(), what="the killed process reaped")
            for _ in range(6):  # the other process takes the new connections meanwhile
                resp = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30)
                assert resp.status_code == 200, resp.text
            until_sync(
                lambda: len(s.children()) == 2 and victim not in s.children(),
                what="the killed process started again",
            )
            after = all_listening(url, s, 2)
            assert victim not in after and before[1] in after
            assert "restarting it" in s.log()
            for pid in after:
                with contextlib.closing(connection_to(url, pid)) as client:
                    assert client.post("/v1/chat/completions", json=BODY).status_code == 200
            assert s.stop() == 0, s.log()


def test_the_in_process_directory_with_several_processes_is_refused(tmp_path: Path):
    listed = [{"id": "h0", "url": "http://127.0.0.1:9", "kind": "vllm"}]
    config = _config(tmp_path / "c.yaml", free_port(), listed)
    proc = subprocess.run(
        [sys.executable, "-m", "ownerserve", "serve", "--config", str(config), "--processes", "2"],
        cwd=REPO, capture_output=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert "--processes 2 needs a shared directory" in err
    assert "directory.backend: redis" in err


def test_sigterm_drains_the_requests_in_flight(tmp_path: Path, redis_server, gated: str):
    port = free_port()
    workers = [{"id": "g0", "url": gated, "kind": "vllm"}]
    config = _config(tmp_path / "c.yaml", port, workers, _redis(redis_server.url))
    with served(config, 2, tmp_path) as s:
        url = f"http://127.0.0.1:{port}"
        pids = all_listening(url, s, 2)
        clients = [connection_to(url, pid) for pid in pids]
        statuses: list[int] = []

        def send(client: httpx.Client) -> None:
            statuses.append(client.post("/v1/chat/completions", json=BODY).status_code)

        threads = [threading.Thread(target=send, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        until_sync(
            lambda: httpx.get(gated + "/stats").json()["current"] == len(clients),
            what="a request in flight through each process",
        )
        s.proc.send_signal(signal.SIGTERM)

        def refusing() -> bool:  # every process stopped listening: the drain began
            try:
                httpx.get(url + "/health", timeout=1)
            except httpx.ConnectError:
                return True
            return False

        until_sync(refusing, what="the port closed to new connections")
        for _ in clients:
            httpx.post(gated + "/release")
        for t in threads:
            t.join(timeout=30)
        for c in clients:
            c.close()
        assert statuses == [200] * len(clients)
        assert s.stop() == 0, s.log()
