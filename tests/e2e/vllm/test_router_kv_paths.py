"""The KV paths of real vLLM workers through the router. The router (the `ownerserve`
policy, each worker `kind: vllm` with its own `sidecar_url`) plans and executes them; vLLM
loads through the OwnerServe connector from its sidecar:

- artifact fetch: a prefix owned by A, asked for by a new session while A is busy, is pulled
  by B's sidecar from A's (`POST /ownerserve/kv/fetch`) and loaded by B's vLLM;
- state migration: a session resident on A moves to B, the same way, once A drains (a draining
  worker takes no request but still serves its KV);
- cold resume: a session whose KV vLLM evicted from A's cache comes back from A's sidecar;
- a corrupted artifact: A's sidecar drops it instead of serving it, so a fetch brings the
  prefix up to it (the plan header says how many blocks came) and B computes the rest; a
  resume's load is refused by the connector (vLLM's recompute path); the tokens stay those of
  a local compute.

Every answer is compared with the same prompt computed whole on one worker (a vLLM cache salt
misses both its prefix cache and, through the chain root, every artifact), and every fetched
artifact with the one it was fetched from, byte for byte. Which worker a turn
lands on is steered only through the router's admin API (drain / undrain) and through load:
the planner is the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from ownerserve.config import Settings
from ownerserve.hashing import chain_root
from router.backends.vllm import VllmClient
from tests.e2e.router_cluster import metric_value, plan_fields, proxy_client
from tests.e2e.vllm.conftest import (
    BLOCK,
    HEADS,
    HYBRID_KV_BLOCKS,
    LOGPROB_TOL,
    Sidecar,
    completion_body,
    present,
    same_artifacts,
    sidecar_http,
    tokens_by_source,
    until,
    until_saved,
    vllm_client,
    vllm_router_settings,
    vllm_worker,
)
from tests.e2e.vllm.test_router_vllm import body, complete, turn
from tests.e2e.vllm.test_sidecar_vllm import _flip_a_byte
from workers.vllm_connector.plan import chunk_hashes, loadable_blocks, lookup_keys
from workers.vllm_cpu.model import SERVED_NAME
from workers.vllm_cpu.server import VllmServer
from workers.vllm_cpu.setup import VllmCpuInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ADMIN_TOKEN = "kv-paths-admin"
ADMIN = {"x-admin-token": ADMIN_TOKEN}
PLAN_HEADER = "x-ownerserve-plan"
# Streamed generations that keep the busy worker's decode batch full while a turn is planned
# (vLLM's max_num_seqs is 8 here: they all run); as long as the model's context allows.
BUSY_MAX_TOKENS = 1900
# How long `busy` keeps opening streams until enough run at once.
BUSY_WITHIN_S = 120.0
# A request's `kv_transfer_params` that keeps the connector out of it (nothing loaded or saved).
NO_SIDECAR = {"ownerserve": {"load": False, "save": False}}


@dataclass(frozen=True, slots=True)
class Worker:
    """One router worker of these tests: a vLLM server with the connector and its sidecar."""

    worker_id: str
    server: VllmServer
    sidecar: Sidecar


def kv_router_settings(install: VllmCpuInstall, workers: Sequence[Worker]) -> Settings:
    """The router in front of `workers` (`kind: vllm`, their sidecars as KV API), the real
    `ownerserve` policy, and the admin API on."""
    entries = [vllm_worker(w.worker_id, w.server, sidecar_url=w.sidecar.url) for w in workers]
    return vllm_router_settings(install, entries, server={"admin_token": ADMIN_TOKEN})


@contextlib.asynccontextmanager
async def kv_router(
    install: VllmCpuInstall, workers: Sequence[Worker]
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """`proxy_client` of `kv_router_settings`, once every worker is healthy in its pool."""
    async with proxy_client(kv_router_settings(install, workers)) as (client, router):
        client.timeout = httpx.Timeout(300.0)

        async def healthy() -> bool:
            return all(router.pool.get(w.worker_id).healthy for w in workers)

        await until(healthy, 30.0)
        yield client, router


@pytest.fixture
def a_and_b(
    sidecar_a: Sidecar, sidecar_b: Sidecar, vllm_hybrid: VllmServer, vllm_hybrid_b: VllmServer
) -> tuple[Worker, Worker]:
    """Workers "a" and "b": the two hybrid servers, each with its sidecar (the sidecars come
    first: without the sidecar server the test skips before any vLLM starts)."""
    return Worker("a", vllm_hybrid, sidecar_a), Worker("b", vllm_hybrid_b, sidecar_b)


@contextlib.asynccontextmanager
async def ab_router(
    install: VllmCpuInstall, a_and_b: tuple[Worker, Worker]
) -> AsyncIterator[tuple[Worker, Worker, httpx.AsyncClient, Any, httpx.AsyncClient, VllmClient]]:
    """`kv_router` of workers a and b: (a, b, the router's client, the `Router`, a plain HTTP
    client, a client of b's vLLM for its load scrapes), the clients closed on exit."""
    a, b = a_and_b
    b_direct = vllm_client("b", b.server.url)
    try:
        async with kv_router(install, [a, b]) as (client, router), sidecar_http() as http:
            yield a, b, client, router, http, b_direct
    finally:
        await b_direct.aclose()


async def drain(client: httpx.AsyncClient, worker_id: str, draining: bool = True) -> None:
    verb = "drain" if draining else "undrain"
    r = await client.post(f"/admin/workers/{worker_id}/{verb}", headers=ADMIN)
    assert r.status_code == 200, r.text


@dataclass(frozen=True, slots=True)
class Prompt:
    """A chat prompt as the router and the connector see it."""

    messages: list[dict[str, Any]]
    token_ids: list[int]
    hashes: list[int]
    """The router's chain: the connector's chunk hashes of the same token ids (checked)."""

    @property
    def loadable(self) -> int:
        """Blocks the connector may load (never the prompt's last token)."""
        return loadable_blocks(len(self.token_ids), BLOCK)

    @property
    def keys(self) -> list[str]:
        """Every artifact of the loadable blocks, block by block, head by head."""
        return lookup_keys(SERVED_NAME, self.hashes[: self.loadable], HEADS)

    def key(self, block: int, head: int) -> str:
        return self.keys[block * len(HEADS) + head]


def prompt_of(router: Any, messages: list[dict[str, Any]]) -> Prompt:
    tok = router.tokenizers.get(SERVED_NAME).tokenize_chat(None, messages)
    ids = [int(t) for t in tok.token_ids]
    hashes = list(chunk_hashes(ids, BLOCK, chain_root(SERVED_NAME)))
    # block identity is one contract: what the router fetches is what the connector saved
    assert hashes == [int(h) for h in tok.chain]
    return Prompt(messages, ids, hashes)


async def chat(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], session: str
) -> tuple[dict[str, str], list[str], list[float]]:
    """One greedy 8-token chat turn through the router: (plan, tokens, logprobs)."""
    return await complete(client, body(messages, False), {"x-session-id": session})


def route_of(plan: dict[str, str]) -> tuple[str | None, str | None, str | None]:
    """The plan header's (action, source, decode worker); None where the plan names none, so
    an assertion on it shows the whole plan rather than a KeyError."""
    return plan.get("action"), plan.get("src"), plan.get("d")


async def computed_on_a(
    client: httpx.AsyncClient,
    router: Any,
    http: httpx.AsyncClient,
    sidecar: Sidecar,
    messages: list[dict[str, Any]],
    session: str,
) -> tuple[Prompt, list[str]]:
    """A `chat` turn that the router plans onto worker "a" (the caller leaves no other worker
    routable), once a's `sidecar` holds its prompt's blocks: (its prompt, its answer tokens)."""
    plan, answer, _ = await chat(client, messages, session)
    assert plan["d"] == "a", plan
    prompt = prompt_of(router, messages)
    await until_saved(http, sidecar, prompt.keys)
    return prompt, answer


async def prefix_on_a(
    client: httpx.AsyncClient, router: Any, http: httpx.AsyncClient, a: Worker, topic: str
) -> Prompt:
    """A first session's long prompt on `topic`, computed on a (b drained, and left so): the
    directory records a as the owner of its prefix, and a's sidecar holds it."""
    await drain(client, "b")
    prompt, _ = await computed_on_a(client, router, http, a.sidecar, turn(topic, 55), topic)
    return prompt


async def computed_whole(
    server: VllmServer, messages: list[dict[str, Any]], salt: str
) -> tuple[list[str], list[float]]:
    """The same turn computed whole on `server` directly: a cache salt of its own misses its
    prefix cache and every artifact."""
    direct = vllm_client("reference", server.url)
    try:
        answer = await direct.post(
            "/v1/chat/completions", {**body(messages, False), "cache_salt": salt}
        )
    finally:
        await direct.aclose()
    content = answer["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [float(c["logprob"]) for c in content]


def assert_same_answer(
    got: tuple[list[str], list[float]], reference: tuple[list[str], list[float]]
) -> None:
    """`got` (a turn whose prompt KV was partly loaded) is `reference` (computed whole): the
    same 8 tokens, logprobs within `LOGPROB_TOL`."""
    assert len(got[0]) == 8
    assert got[0] == reference[0]
    assert max(abs(x - y) for x, y in zip(got[1], reference[1], strict=True)) <= LOGPROB_TOL


@contextlib.asynccontextmanager
async def busy(
    client: httpx.AsyncClient, router: Any, worker: str, n: int, tag: str
) -> AsyncIterator[None]:
    """`n` long streamed generations through the router running at once, all planned onto
    `worker` (the caller leaves no other worker routable), until exit (closing a stream aborts
    it). The tiny model decodes fast: they run for seconds, so the caller plans its turn right
    away. On a starved machine a stream can end before the last one opened (CI saw 1 of 4
    still running): each one that ended is replaced by a new one until `n` run at the same
    time (the router counts them in flight), so the caller always finds `worker` as busy as it
    asked; `BUSY_WITHIN_S` bounds the trying."""

    async def one(i: int) -> httpx.Response:
        req = body(turn(f"{tag} {i}", 2), True, max_tokens=BUSY_MAX_TOKENS)
        req["kv_transfer_params"] = NO_SIDECAR  # their KV is of no interest
        headers = {"x-session-id": f"{tag}-{i}"}
        request = client.build_request("POST", "/v1/chat/completions", json=req, headers=headers)
        return await client.send(request, stream=True)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + BUSY_WITHIN_S
    streams: list[httpx.Response] = []
    try:
        while (running := router.pool.get(worker).inflight) < n:
            if loop.time() > deadline:
                raise AssertionError(
                    f"{running} of the {n} streams ran on {worker} at once, after "
                    f"{len(streams)} were opened in {BUSY_WITHIN_S:g} s"
                )
            if streams:
                print(f"busy {tag}: {running} of {n} streams running; opening more")
            opened = await asyncio.gather(
                *(one(len(streams) + k) for k in range(n - running)), return_exceptions=True
            )
            streams += [r for r in opened if isinstance(r, httpx.Response)]
            for r in opened:
                assert isinstance(r, httpx.Response), r
                assert r.status_code == 200, (await r.aread()).decode()
                assert plan_fields(r.headers[PLAN_HEADER])["d"] == worker
        yield
    finally:
        for r in streams:
            await r.aclose()


async def evict(server: VllmServer, tag: str) -> None:
    """Push everything out of `server`'s small KV cache (`HYBRID_KV_BLOCKS`): twice its size in
    fresh prompts, neither loaded from nor saved to its sidecar."""
    direct = vllm_client("evict", server.url)
    no_kv = {"kv_transfer_params": NO_SIDECAR}
    try:
        pushed, i = 0, 0
        while pushed < 2 * HYBRID_KV_BLOCKS * BLOCK:
            text = " ".join(f"{tag} filler {i} line {j} of the evicting log" for j in range(50))
            answer = await direct.post(
                "/v1/completions", completion_body(text, max_tokens=1, logprobs=None, **no_kv)
            )
            pushed += int(answer["usage"]["prompt_tokens"])
            i += 1
    finally:
        await direct.aclose()


# --- artifact fetch -----------------------------------------------------------------------------


async def test_a_prefix_owned_by_busy_a_is_fetched_onto_b_and_only_its_tail_is_computed(
    vllm_install: VllmCpuInstall, a_and_b: tuple[Worker, Worker]
) -> None:
    async with ab_router(vllm_install, a_and_b) as (a, b, client, router, http, b_direct):
        prompt = await prefix_on_a(client, router, http, a, "fetched prefix")
        assert prompt.loadable >= 20
        assert not any(await present(http, b.sidecar, prompt.keys))

        # A's decode batch is full when a second session with the same prefix comes
        async with busy(client, router, "a", 4, "fetch-busy"):
            await drain(client, "b", False)
            before = await b_direct.load()
            plan, tokens, lps = await chat(client, prompt.messages, "fetch-second")
            used = tokens_by_source(before, await b_direct.load())
        assert route_of(plan) == ("artifact_fetch", "a", "b"), plan
        assert plan["fetched"] == "1" and "fallback" not in plan, plan
        assert plan["fetched_blocks"] == f"{prompt.loadable}/{prompt.loadable}", plan
        assert all(await present(http, b.sidecar, prompt.keys))
        await same_artifacts(http, b.sidecar, a.sidecar, prompt.keys)
        fetched = prompt.loadable * BLOCK
        assert used["external_kv_transfer"] == fetched
        assert used["local_cache_hit"] == 0
        # only the tail is computed: the partial last block (or the whole last block when
        # the prompt ends on a boundary: its last token is always computed)
        assert used["local_compute"] == len(prompt.token_ids) - fetched <= BLOCK
        print(f"\nfetch: {len(prompt.token_ids)} prompt tokens, {used}")

        assert_same_answer((tokens, lps), await computed_whole(b.server, prompt.messages, "fetch"))


# --- state migration ----------------------------------------------------------------------------


async def test_a_session_resident_on_draining_a_migrates_to_b_which_computes_only_the_new_turn(
    vllm_install: VllmCpuInstall, a_and_b: tuple[Worker, Worker]
) -> None:
    await migrates_from_draining_a(vllm_install, a_and_b, "migrated session", "migrate")


async def migrates_from_draining_a(
    install: VllmCpuInstall, workers: tuple[Worker, Worker], topic: str, tag: str
) -> None:
    """A session's first turn on `topic` computed on a; a drains; its next turn moves to b
    by state migration, b loads the first turn's blocks and computes only the new turn, with
    the tokens of the turn computed whole (`tag`: its session and cache salt)."""
    async with ab_router(install, workers) as (a, b, client, router, http, b_direct):
        first = turn(topic, 50)
        await drain(client, "b")
        resident, answer = await computed_on_a(client, router, http, a.sidecar, first, tag)

        # A drains: it takes no request, but its KV (its sidecar) still serves its sessions
        await drain(client, "b", False)
        await drain(client, "a")
        second = [
            *first,
            {"role": "assistant", "content": "".join(answer)},
            {"role": "user", "content": "Now run the tests and report the failures."},
        ]
        prompt = prompt_of(router, second)
        before = await b_direct.load()
        plan, tokens, lps = await chat(client, second, tag)
        used = tokens_by_source(before, await b_direct.load())
        assert route_of(plan) == ("state_migration", "a", "b"), plan
        assert plan["fetched"] == "1" and "fallback" not in plan, plan
        got, planned = (int(x) for x in plan["fetched_blocks"].split("/"))
        assert got == planned >= resident.loadable
        assert all(await present(http, b.sidecar, resident.keys))
        await same_artifacts(http, b.sidecar, a.sidecar, resident.keys)
        # the first turn's prompt blocks moved; B computed the new turn (and the partial
        # block before it)
        assert used["external_kv_transfer"] >= resident.loadable * BLOCK
        assert used["local_cache_hit"] == 0
        assert used["local_compute"] == len(prompt.token_ids) - used["external_kv_transfer"]
        assert used["local_compute"] < len(prompt.token_ids) - len(resident.token_ids) + BLOCK
        blocks = plan["fetched_blocks"]
        print(f"\n{tag}: {len(prompt.token_ids)} prompt tokens, {blocks} blocks, {used}")

        reference = await computed_whole(b.server, second, tag)
        assert_same_answer((tokens, lps), reference)


# --- cold resume from the sidecar ---------------------------------------------------------------


async def _resume_after_eviction(
    client: httpx.AsyncClient,
    router: Any,
    http: httpx.AsyncClient,
    server: VllmServer,
    sidecar: Sidecar,
    tag: str,
    corrupt_block: int | None = None,
) -> tuple[Prompt, Prompt, dict[str, float], tuple[list[str], list[float]], str | None]:
    """A session's first turn on worker "a", its KV evicted from vLLM's cache, then its next
    turn: (first prompt, second prompt, the second's prompt tokens by source, its answer, the
    corrupted key if `corrupt_block`)."""
    first = turn(tag, 50)
    resident, answer = await computed_on_a(client, router, http, sidecar, first, tag)
    await evict(server, tag)
    bad_key = None
    if corrupt_block is not None:
        bad_key = resident.key(corrupt_block, 1)
        _flip_a_byte(sidecar.artifact_file(bad_key))

    second = [
        *first,
        {"role": "assistant", "content": "".join(answer)},
        {"role": "user", "content": "The tool finished; go on."},
    ]
    direct = vllm_client("a", server.url)
    try:
        before = await direct.load()
        plan, tokens, lps = await chat(client, second, tag)
        used = tokens_by_source(before, await direct.load())
    finally:
        await direct.aclose()
    assert plan["d"] == "a", plan
    return resident, prompt_of(router, second), used, (tokens, lps), bad_key


async def test_a_session_evicted_from_vllm_resumes_from_its_sidecar_with_the_same_tokens(
    sidecar_a: Sidecar, vllm_install: VllmCpuInstall, vllm_hybrid: VllmServer
) -> None:
    a = Worker("a", vllm_hybrid, sidecar_a)
    async with kv_router(vllm_install, [a]) as (client, router), sidecar_http() as http:
        resident, prompt, used, answer, _ = await _resume_after_eviction(
            client, router, http, vllm_hybrid, sidecar_a, "cold resume"
        )
        # nothing left in vLLM's cache: the first turn's blocks came back from the sidecar
        assert used["local_cache_hit"] == 0
        assert used["external_kv_transfer"] >= resident.loadable * BLOCK
        assert used["local_compute"] == len(prompt.token_ids) - used["external_kv_transfer"]
        print(f"\ncold resume: {len(prompt.token_ids)} prompt tokens, {used}")
        assert_same_answer(answer, await computed_whole(vllm_hybrid, prompt.messages, "resume"))


# --- a corrupted artifact -------------------------------------------------------------------------


async def corrupted_artifacts(http: httpx.AsyncClient, sidecar: Sidecar) -> float:
    """How many artifacts `sidecar` has dropped for failing their checksum (its metric)."""
    r = await http.get(sidecar.url + "/metrics")
    r.raise_for_status()
    return metric_value(r.text, "ownerserve_sidecar_corrupted_artifacts")


async def test_a_resume_whose_artifact_is_corrupted_recomputes_from_it_with_the_same_tokens(
    sidecar_a: Sidecar, vllm_install: VllmCpuInstall, vllm_hybrid: VllmServer
) -> None:
    a = Worker("a", vllm_hybrid, sidecar_a)
    async with kv_router(vllm_install, [a]) as (client, router), sidecar_http() as http:
        bad_block = 5
        caught = await corrupted_artifacts(http, sidecar_a)
        resident, prompt, used, answer, bad_key = await _resume_after_eviction(
            client, router, http, vllm_hybrid, sidecar_a, "corrupt resume", bad_block
        )
        # the sidecar caught the flipped byte by its checksum and dropped the artifact, never
        # serving it: at the resume's load (the connector then names it refused), or, on a
        # machine busy enough that a first load of the request timed out and vLLM scheduled it
        # again, at that first read (the second lookup then no longer offers it)
        assert await corrupted_artifacts(http, sidecar_a) == caught + 1
        log = vllm_hybrid.log_path.read_text(errors="replace")
        # the load stopped at it and vLLM recomputed from there (kv_load_failure_policy:
        # recompute); vLLM counts what the connector offered at scheduling
        assert f"loaded {bad_block}/" in log
        print(f"\nrefused at the load: {f'rejected artifact ({bad_key}' in log}")
        assert used["local_cache_hit"] == 0
        print(f"\ncorrupted resume: {len(prompt.token_ids)} prompt tokens, {used}")
        assert_same_answer(answer, await computed_whole(vllm_hybrid, prompt.messages, "corrupt"))
        # the refused block was recomputed and saved again, whole
        await until_saved(http, sidecar_a, resident.keys)


async def test_a_fetch_of_a_corrupted_artifact_brings_the_good_prefix_and_says_so(
    vllm_install: VllmCpuInstall, a_and_b: tuple[Worker, Worker]
) -> None:
    bad_block = 7

    async def corrupt(a: Worker, prompt: Prompt) -> None:
        _flip_a_byte(a.sidecar.artifact_file(prompt.key(bad_block, 2)))

    await fetch_stops_at_a_bad_artifact(
        vllm_install, a_and_b, "corrupted source", "corrupt", corrupt, bad_block
    )


async def fetch_stops_at_a_bad_artifact(
    install: VllmCpuInstall,
    workers: tuple[Worker, Worker],
    topic: str,
    tag: str,
    spoil: Callable[[Worker, Prompt], Awaitable[None]],
    bad_block: int,
) -> None:
    """A prefix on `topic` computed on a, then `spoil`ed there from `bad_block` on (an
    artifact corrupted or gone); a drains, and a new session with the prefix fetches it onto
    b: the fetch brings the good blocks before `bad_block` and says so, b computes the rest
    with the tokens of the prompt computed whole (`tag`: its session and cache salt), and b's
    connector saves what it computed, so b then holds the prefix whole."""
    async with ab_router(install, workers) as (a, b, client, router, http, b_direct):
        prompt = await prefix_on_a(client, router, http, a, topic)
        await spoil(a, prompt)

        # A drains: a new session with its prefix fetches it from A's KV
        await drain(client, "b", False)
        await drain(client, "a")
        before = await b_direct.load()
        plan, tokens, lps = await chat(client, prompt.messages, f"{tag}-second")
        used = tokens_by_source(before, await b_direct.load())
        assert route_of(plan) == ("artifact_fetch", "a", "b"), plan
        # what is read is checked: the bad artifact is dropped and answered missing, so B
        # gets the prefix up to it and says so; B computes the rest
        assert plan["fetched"] == "1", plan
        assert plan["fetched_blocks"].startswith(f"{bad_block}/"), plan
        assert "fallback" not in plan and "ran" not in plan, plan
        # the whole blocks before the dropped one reached B's sidecar and were loaded
        assert used["external_kv_transfer"] <= bad_block * BLOCK
        good = prompt.keys[: bad_block * len(HEADS)]
        assert all(await present(http, b.sidecar, good))
        await same_artifacts(http, b.sidecar, a.sidecar, good)
        assert used["local_compute"] == len(prompt.token_ids) - used["external_kv_transfer"]
        print(f"\n{tag} fetch: {len(prompt.token_ids)} prompt tokens, {used}, {plan}")
        assert_same_answer(
            (tokens, lps), await computed_whole(b.server, prompt.messages, f"{tag}-fetch")
        )
        # what B computed its connector saved: B now holds the prefix whole, good copies
        await until_saved(http, b.sidecar, prompt.keys)
