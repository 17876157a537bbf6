"""HeteroCache against a real hybrid engine: vLLM CPU serving the tiny Gemma-3 (5 sliding-window
layers of 64 tokens to 1 full-attention layer; `workers/vllm_cpu/model.py`) with its hybrid KV
cache manager, six KV cache groups (five windows, one full attention) publishing their own KV
events, behind the in-process router.

The directory holds per group what the engine's events say it stored and evicted; its
prediction of a request's prefix hit (the plan's reused tokens) is what the engine then reports
cached, also where the attention blocks alone (a dense view) reach further than the windows
let vLLM resume. The OwnerServe connector saves and loads every KV cache group: with the
manager on, each group's blocks under their own keys (the window groups' only while their window
holds them), a prompt evicted from the engine is loaded back for the boundary every group can
resume at, and the resume is exact; without the manager (one group, every layer's KV whole) it
is exact too. Exact is judged by the answer's top-k logprobs (the greedy tokens' own are 0.0
whatever the context, `TOP_K`), and a resume from another prompt's KV served under the prompt's
keys (the negative control) must be far from exact.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from ownerserve.config import Settings, settings_from_dict
from ownerserve.directory.base import EventApplyResult
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.directory.restorable import ATTENTION_KINDS, WINDOW_KINDS
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import chain_root, hash_block
from ownerserve.kvstate import load_spec
from ownerserve.kvstate.heads import heads_for_rank
from ownerserve.ports import free_port
from router.backends.kv_events import subscriber_for_source
from tests.e2e.router_cluster import metric_value, plan_fields, proxy_client
from tests.e2e.vllm.conftest import (
    BLOCK,
    READY_TIMEOUT_S,
    Sidecar,
    _start,
    present,
    serve_under,
    sidecar_http,
    start_sidecar,
    tokens_by_source,
    top_logprob_distance,
    until,
    until_saved,
    vllm_client,
    vllm_worker,
)
from workers.vllm_connector.plan import KVGroup, block_keys, chunk_hashes, group_tags
from workers.vllm_cpu.model import HYBRID_CONFIG, HYBRID_SERVED_NAME, HYBRID_WINDOW
from workers.vllm_cpu.server import VllmServer, VllmServerSpec
from workers.vllm_cpu.setup import VllmCpuInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = HYBRID_SERVED_NAME
KV_BLOCKS = 240
"""The engine's KV pool, shared by its six groups: a few 500-token prompts evict."""
MAX_MODEL_LEN = 1024
WINDOW_BLOCKS = -(-(HYBRID_WINDOW - 1) // BLOCK)
"""Blocks vLLM needs a window group to hold before a boundary to resume there."""
WORKER = "swa"


def _server_spec(
    install: VllmCpuInstall,
    work_dir: Path,
    *,
    name: str,
    kv_blocks: int = KV_BLOCKS,
    more_args: tuple[str, ...] = (),
    **more: Any,
) -> VllmServerSpec:
    return VllmServerSpec(
        name=name,
        port=free_port(),
        model=install.hybrid_model,
        served_model_name=MODEL,
        max_model_len=MAX_MODEL_LEN,
        extra_args=(
            "--num-gpu-blocks-override",
            str(kv_blocks),
            # float32: the connector's part compares logprobs within 1e-3
            "--dtype",
            "float32",
            "--enable-prompt-tokens-details",
            *more_args,
        ),
        **more,
    )


CONNECTOR_KV_BLOCKS = 64
"""The connector engine's pool, one group of 32-token blocks: 2,048 tokens, so that three
960-token prompts evict a prompt's blocks."""


@dataclass(frozen=True, slots=True)
class ConnectorServers:
    """The hybrid model on two engines with the OwnerServe connector, on one sidecar: with
    vLLM's hybrid KV cache manager (`hybrid`: the model's six KV cache groups) and without it
    (`single`: one KV cache group, every layer's KV kept whole).
    Their processes start (not awaited) with the module's first test, so that their starts
    overlap the other server's."""

    hybrid: VllmServer
    single: VllmServer
    sidecar: Sidecar


@pytest.fixture(scope="module")
def swa_connectors(vllm_install: VllmCpuInstall, vllm_work_dir: Path) -> Iterator[ConnectorServers]:
    sidecar = start_sidecar("swa", vllm_work_dir)
    servers = ConnectorServers(
        hybrid=VllmServer(
            vllm_install,
            _server_spec(
                vllm_install,
                vllm_work_dir,
                name="swa-connector-hma",
                cpu=1,
                sidecar_url=sidecar.url,
            ),
            vllm_work_dir,
        ),
        single=VllmServer(
            vllm_install,
            _server_spec(
                vllm_install,
                vllm_work_dir,
                name="swa-connector",
                kv_blocks=CONNECTOR_KV_BLOCKS,
                more_args=("--disable-hybrid-kv-cache-manager",),
                cpu=1,
                sidecar_url=sidecar.url,
            ),
            vllm_work_dir,
        ),
        sidecar=sidecar,
    )
    servers.hybrid.start()
    servers.single.start()
    yield servers
    servers.hybrid.stop()
    servers.single.stop()
    sidecar.stop()


@pytest.fixture(scope="module")
def swa_server(
    vllm_install: VllmCpuInstall, vllm_work_dir: Path, swa_connectors: ConnectorServers
) -> Iterator[VllmServer]:
    """The hybrid model on vLLM CPU, publishing KV events (ipc:// socket, replay socket)."""
    spec = _server_spec(
        vllm_install,
        vllm_work_dir,
        name="swa",
        kv_events_endpoint=f"ipc://{vllm_work_dir}/swa-kv-events.sock",
        kv_events_replay_port=free_port(),
        cpu=0,
    )
    server = VllmServer(vllm_install, spec, vllm_work_dir)
    _start([server])
    yield server
    server.stop()


def swa_settings(install: VllmCpuInstall, server: VllmServer) -> Settings:
    """The router in front of `server` alone, pricing the model by its own spec
    (`configs/models/tiny-gemma3-swa.yaml`)."""
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5, "connect_timeout_s": 5.0},
            "planner": {"policy": "ownerserve"},
            "models": [
                {
                    "name": MODEL,
                    "tokenizer": str(install.hybrid_model / "tokenizer.json"),
                    "block_size": BLOCK,
                    "max_model_len": MAX_MODEL_LEN,
                    "kv_spec": "tiny-gemma3-swa",
                }
            ],
            "workers": [vllm_worker(WORKER, server, models=[MODEL])],
        }
    )


@dataclass
class EngineRecord:
    """Every KV event batch the engine published, as a second subscriber got it: the engine's
    own account of what each group holds, read without the directory's placement logic."""

    directory: InMemoryDirectory = field(default_factory=InMemoryDirectory)
    batches: list[EventBatch] = field(default_factory=list)

    async def apply_events(self, worker: str, batch: EventBatch) -> EventApplyResult:
        self.batches.append(batch)
        return await self.directory.apply_events(worker, batch)

    async def drop_worker(self, worker: str) -> int:
        return await self.directory.drop_worker(worker)

    def groups(self) -> dict[int, str]:
        """Group index -> kind, as the stores named them."""
        return {
            e.group_idx: e.group_kind or ""
            for b in self.batches
            for e in b.events
            if isinstance(e, BlockStored) and e.group_idx is not None
        }

    def held(self) -> dict[int, set[int]]:
        """Group index -> engine hashes it holds on GPU (stores minus removals, in order)."""
        out: dict[int, set[int]] = {}
        for b in self.batches:
            for e in b.events:
                if isinstance(e, AllBlocksCleared):
                    out.clear()
                elif isinstance(e, BlockStored) and e.group_idx is not None:
                    out.setdefault(e.group_idx, set()).update(e.engine_hashes)
                elif isinstance(e, BlockRemoved) and e.group_idx is not None:
                    out.setdefault(e.group_idx, set()).difference_update(e.engine_hashes)
        return out

    def engine_hashes(self, chain: list[int], root: int) -> list[int | None]:
        """The engine's hash of each block of `chain`, from the attention group's stores
        (which name every block of their token range, in order)."""
        by_chain: dict[int, int] = {}
        chain_of: dict[int, int] = {}
        for b in self.batches:
            for e in b.events:
                if not isinstance(e, BlockStored) or e.group_kind not in ATTENTION_KINDS:
                    continue
                parent = (
                    root if e.parent_engine_hash is None else chain_of.get(e.parent_engine_hash)
                )
                for k, eh in enumerate(e.engine_hashes):
                    if parent is None:
                        break
                    h = hash_block(parent, e.token_ids[k * BLOCK : (k + 1) * BLOCK])
                    chain_of[eh], by_chain[h] = h, eh
                    parent = h
        return [by_chain.get(h) for h in chain]


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = ("agent", "reads", "file", "calls", "tool", "cache", "block", "window", "layer")
    return " ".join(f"{rng.choice(vocab)} {rng.randrange(1000)}" for _ in range(n))


def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }


@dataclass(frozen=True, slots=True)
class Reuse:
    """One request's prefix reuse: the router's counts (`ownerserve_prefix_tokens_total`) and
    the engine's (its answer's cached tokens, its own prefix-cache hit counter)."""

    prompt: int
    available: int
    predicted: int
    delivered: int
    cached_tokens: int
    engine_hits: int


async def through_router(
    client: httpx.AsyncClient,
    engine: Any,
    messages: list[dict[str, str]],
    session: str,
) -> tuple[Reuse, dict[str, str]]:
    async def counts() -> tuple[dict[str, float], float]:
        text = (await client.get("/metrics")).text
        kinds = ("prompt", "available", "predicted", "delivered")
        router = {
            k: metric_value(text, "ownerserve_prefix_tokens_total", worker=WORKER, kind=k)
            for k in kinds
        }
        return router, (await engine.load()).prefix_cache_hits

    before, hits_before = await counts()
    r = await client.post(
        "/v1/chat/completions", json=chat(messages), headers={"x-session-id": session}
    )
    assert r.status_code == 200, r.text
    cached = int((r.json()["usage"].get("prompt_tokens_details") or {})["cached_tokens"])
    plan = plan_fields(r.headers["x-ownerserve-plan"])
    after, hits_after = await counts()
    d = {k: int(after[k] - before[k]) for k in after}
    reuse = Reuse(
        d["prompt"],
        d["available"],
        d["predicted"],
        d["delivered"],
        cached,
        int(hits_after - hits_before),
    )
    print(f"\n{session}: {reuse}")  # the numbers bench/RESULTS.md quotes
    return reuse, plan


async def test_directory_holds_each_group_as_the_engine_and_predicts_its_hits(
    vllm_install: VllmCpuInstall, swa_server: VllmServer
) -> None:
    root = chain_root(MODEL)
    engine = vllm_client(WORKER, swa_server.url)
    record = EngineRecord()
    await record.directory.register_worker(WORKER, root, BLOCK)
    sub = subscriber_for_source(WORKER, (await engine.kv_event_sources())[0], record)
    await sub.start()
    try:
        async with proxy_client(swa_settings(vllm_install, swa_server)) as (client, router):
            client.timeout = httpx.Timeout(READY_TIMEOUT_S)
            tokenizer = router.tokenizers.get(MODEL)
            assert isinstance(router.directory, InMemoryDirectory)
            groups = router.directory.groups

            def chain_of(messages: list[dict[str, str]]) -> list[int]:
                return list(tokenizer.tokenize_chat(None, messages).chain)

            async def applied(chain: list[int], blocks: int) -> bool:
                """The router's directory has the batch that stored `blocks` of `chain` (every
                group's stores of a step come in one batch)."""
                return bool((await router.directory.lookup(chain)).longest(WORKER) >= blocks)

            # turn 1 of a session, cold
            system = {"role": "system", "content": "You are a coding agent."}
            task = words(1, 200)
            first = [system, {"role": "user", "content": task}]
            n1 = tokenizer.tokenize_chat(None, first).prompt_tokens
            chain1 = chain_of(first)
            reuse, plan = await through_router(client, engine, first, "swa-a")
            assert plan["d"] == WORKER and reuse.prompt == n1
            assert (
                reuse.predicted == reuse.delivered == reuse.cached_tokens == reuse.engine_hits == 0
            )
            await until(lambda: applied(chain1, len(chain1)))

            # (a) the directory's groups are the engine's: one full-attention group holding
            # every block, five window groups holding only the window at the last boundary
            # the engine can resume (vLLM's retention: the prompt's last token's block)
            info = groups.groups_of(WORKER)
            assert [g.kind for g in info] == ["sliding_window"] * 5 + ["full_attention"]
            assert {g.window for g in info if g.kind in WINDOW_KINDS} == {HYBRID_WINDOW}
            assert record.groups() == {g.index: g.kind for g in info}
            resume = (n1 - 1) // BLOCK
            window = set(range(resume - WINDOW_BLOCKS, resume))
            for g in info:
                held = groups.held_blocks(WORKER, g.index, chain1)
                want = (
                    [True] * len(chain1)
                    if g.attention
                    else [k in window for k in range(len(chain1))]
                )
                assert list(held) == want, (g, held)

            # turn 2 continues the session: the windows at turn 1's last boundary are held,
            # the engine resumes there, as the directory predicted
            second = [*first, {"role": "assistant", "content": "ok"}]
            second.append({"role": "user", "content": "Now run the tests."})
            reuse, plan = await through_router(client, engine, second, "swa-a")
            assert reuse.delivered == reuse.cached_tokens == reuse.engine_hits == resume * BLOCK
            assert reuse.predicted == reuse.delivered, (reuse, plan)
            chain2 = chain_of(second)
            await until(lambda: applied(chain2, len(chain2)))

            # (b) a branch sharing turn 1's first blocks: the full-attention group holds them
            # (a dense view: that many tokens reusable), but no window group holds the blocks
            # before any boundary in them, so vLLM recomputes the whole prompt; the directory's
            # prediction says so
            branch = [
                system,
                {"role": "user", "content": task[: len(task) * 2 // 3] + words(2, 30)},
            ]
            branch_chain = chain_of(branch)
            common = next(
                (k for k, (a, b) in enumerate(zip(chain1, branch_chain, strict=False)) if a != b),
                min(len(chain1), len(branch_chain)),
            )
            # past n_win·L (320 tokens): rebuilding the windows would cost less than computing
            assert common * BLOCK > load_spec("tiny-gemma3-swa").swa_recompute_tokens, common
            reuse, plan = await through_router(client, engine, branch, "swa-b")
            assert reuse.available >= common * BLOCK
            assert reuse.delivered == reuse.cached_tokens == reuse.engine_hits == 0
            assert reuse.predicted == reuse.delivered, (reuse, plan)
            await until(lambda: applied(branch_chain, len(branch_chain)))

            # (a) evictions: other prompts fill the pool until the engine evicts turn 1's
            # window blocks; each group's holdings in the directory stay the engine's own
            async def window_evicted() -> bool:
                return not any(
                    groups.held_blocks(WORKER, g.index, chain1)[resume - 1]
                    for g in info
                    if not g.attention
                )

            seed = 100
            while not await window_evicted():
                seed += 1
                assert seed < 120, "the engine never evicted turn 1's windows"
                filler = [system, {"role": "user", "content": words(seed, 120)}]
                await engine.post("/v1/chat/completions", chat(filler))
                fchain = chain_of(filler)

                async def filled(fchain: list[int] = fchain) -> bool:
                    return await applied(fchain, len(fchain)) or await window_evicted()

                await until(filled)

            removed = {
                e.group_idx
                for b in record.batches
                for e in b.events
                if isinstance(e, BlockRemoved) and e.group_idx is not None
            }
            assert removed & {g.index for g in info if not g.attention}

            async def directory_is_the_engine() -> bool:
                truth = record.held()
                for chain in (chain1, chain2, branch_chain):
                    engine_hashes = record.engine_hashes(chain, root)
                    for g in info:
                        held = groups.held_blocks(WORKER, g.index, chain)
                        want = [
                            eh is not None and eh in truth.get(g.index, ()) for eh in engine_hashes
                        ]
                        if list(held) != want:
                            return False
                return True

            await until(directory_is_the_engine)
    finally:
        await sub.close()
        await engine.aclose()


GROUPS = [KVGroup(window=HYBRID_WINDOW)] * 5 + [KVGroup()]
"""The hybrid engine's KV cache groups as the connector restores them (test (a) above checks
the engine's order: five windows, then full attention)."""
KV_HEADS = heads_for_rank(int(HYBRID_CONFIG["num_key_value_heads"]), 1, 0)


TOP_K = 5
"""Alternatives per answer token compared (`top_logprob_distance`): this random model's greedy
tokens have logprob 0.0 whatever the prompt's first 256 tokens (measured: the same 8 tokens,
all 0.0, for any of them changed), so only the alternatives' logprobs (~28 nats below) depend
on the KV the engine attends to."""
TOL = 1e-3
"""How far a resume's float32 top-k logprobs may be from computing the whole prompt."""
WRONG_SALT = "wrong-kv"


def _completion(prompt: list[int]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": TOP_K,
    }


def _salted_chain(prompt: list[int], salt: str) -> list[int]:
    """The connector's chain hashes of `prompt` asked with vLLM `cache_salt` `salt`
    (`ConnectorSettings.root`, no configured salt)."""
    return chunk_hashes(prompt, BLOCK, chain_root(MODEL, f"\x00{salt}"))


async def _resume_from_wrong_kv(
    http: httpx.AsyncClient,
    server: VllmServer,
    sidecar: Sidecar,
    prompt: list[int],
    moves: list[tuple[str, str]],
) -> tuple[dict[str, Any], dict[str, float]]:
    """The negative control: `prompt` asked with `WRONG_SALT` (no local prefix hit) after the
    sidecar was made to hold other KV (`moves`: another prompt's artifacts) under its keys, so
    the connector loads well-formed, checksum-valid, wrong KV. Returns the answer and its
    prompt tokens by source."""
    await serve_under(http, sidecar, moves, len(KV_HEADS))
    engine = vllm_client("wrong-kv", server.url)
    try:
        before = await engine.load()
        answer = await engine.post(
            "/v1/completions", {**_completion(prompt), "cache_salt": WRONG_SALT}
        )
        return answer, tokens_by_source(before, await engine.load())
    finally:
        await engine.aclose()


async def external_prefix_cache(http: httpx.AsyncClient, server: VllmServer) -> tuple[float, float]:
    """vLLM's connector prefix-cache counters (queried tokens, hit tokens) of `server`."""
    text = (await http.get(server.url + "/metrics")).text
    return (
        metric_value(text, "vllm:external_prefix_cache_queries_total"),
        metric_value(text, "vllm:external_prefix_cache_hits_total"),
    )


async def test_a_resume_through_the_connector_is_exact_with_the_hybrid_kv_cache_manager(
    swa_server: VllmServer, swa_connectors: ConnectorServers
) -> None:
    """With its hybrid KV cache manager on, the engine gives the connector the model's six KV
    cache groups: a prompt computed is saved group by group (each group's blocks under keys of
    its own), evicted from the engine by other prompts, then asked again: the connector loads
    back the full-attention group's blocks and each window group's last window before the
    boundary, vLLM counts them as an external hit, and the answer is the one computed (greedy
    tokens equal, float32 top-k logprobs within 1e-3). The negative control: the same resume
    from another prompt's KV (its artifacts served under this prompt's keys) gives top-k
    logprobs far from those, so the comparison does tell a wrong load from a right one."""
    server = swa_connectors.hybrid
    took = server.wait_ready(READY_TIMEOUT_S)
    server.warm_up(READY_TIMEOUT_S)
    print(f"\nvLLM swa-connector-hma ready in {took:.1f} s")
    log = server.log_path.read_text(errors="replace")
    assert "Hybrid KV cache manager is disabled" not in log
    assert "KV cache groups " + str(["window 64"] * 5 + ["full"]) in log
    rng = random.Random(11)
    prompt = [rng.randrange(4, 1800) for _ in range(8 * BLOCK + 5)]
    chain = chunk_hashes(prompt, BLOCK, chain_root(MODEL))
    tags = group_tags(GROUPS)

    def keys(group: int, blocks: range, chain: list[int] = chain) -> list[str]:
        return [k for b in blocks for k in block_keys(MODEL, chain[b], KV_HEADS, group=tags[group])]

    # what a resume after the prompt's 8 full blocks needs: every block of full attention, the
    # blocks covering the window before the boundary in each window group
    needed = [keys(g, range(group.first_needed(8, BLOCK), 8)) for g, group in enumerate(GROUPS)]
    assert [len(k) // len(KV_HEADS) for k in needed] == [WINDOW_BLOCKS] * 5 + [8]
    engine = vllm_client("connector-hma", server.url)
    http = sidecar_http()
    try:
        before = await engine.load()
        want = await engine.post("/v1/completions", _completion(prompt))
        await until_saved(http, swa_connectors.sidecar, [k for ks in needed for k in ks])
        # another prompt of the same length, saved group by group: the negative control's KV
        other = [rng.randrange(4, 1800) for _ in range(len(prompt))]
        other_chain = chunk_hashes(other, BLOCK, chain_root(MODEL))
        await engine.post("/v1/completions", {**_completion(other), "max_tokens": 1})
        firsts = [group.first_needed(8, BLOCK) for group in GROUPS]
        other_needed = [keys(g, range(f, 8), other_chain) for g, f in enumerate(firsts)]
        await until_saved(http, swa_connectors.sidecar, [k for ks in other_needed for k in ks])
        # the dense keys (one group: every layer) are another model's KV: never written here
        dense = [k for b in range(8) for k in block_keys(MODEL, chain[b], KV_HEADS)]
        assert not any(await present(http, swa_connectors.sidecar, dense))
        for seed in range(30, 34):
            filler = [random.Random(seed).randrange(4, 1800) for _ in range(30 * BLOCK)]
            await engine.post("/v1/completions", {**_completion(filler), "max_tokens": 1})
        middle = await engine.load()
        external_before = await external_prefix_cache(http, server)
        got = await engine.post("/v1/completions", _completion(prompt))
        after = await engine.load()
        external_after = await external_prefix_cache(http, server)
        wrong_chain = _salted_chain(prompt, WRONG_SALT)
        moves = [
            (src, dst)
            for g, f in enumerate(firsts)
            for src, dst in zip(other_needed[g], keys(g, range(f, 8), wrong_chain), strict=True)
        ]
        wrong, wrong_by_source = await _resume_from_wrong_kv(
            http, server, swa_connectors.sidecar, prompt, moves
        )
    finally:
        await engine.aclose()
        await http.aclose()
    # vLLM's connector prefix-cache counters: the whole prompt asked of the connector (no
    # local hit left), its 8 full blocks hit
    queries, hits = (a - b for a, b in zip(external_after, external_before, strict=True))
    assert (queries, hits) == (len(prompt), 8 * BLOCK), (queries, hits)
    assert tokens_by_source(before, middle)["external_kv_transfer"] == 0
    by_source = tokens_by_source(middle, after)
    assert by_source == {
        "local_compute": 5,
        "local_cache_hit": 0,
        "external_kv_transfer": 8 * BLOCK,
    }, by_source
    # The top-k logprobs, not the sampled ones: those are 0.0 whatever KV is loaded (`TOP_K`).
    diff = top_logprob_distance(got, want)
    print(f"hybrid resume: greedy tokens equal, top-{TOP_K} logprobs within {diff:.2e}")
    assert diff <= TOL
    # the negative control: every group loaded (the same counts), from the other prompt's KV
    assert wrong_by_source == by_source, wrong_by_source
    wrong_diff = top_logprob_distance(wrong, want)
    print(f"hybrid resume from another prompt's KV: top-{TOP_K} logprobs {wrong_diff:.2f} away")
    assert wrong_diff > 100 * TOL

    async def loaded_every_group() -> bool:
        """The engine's log has the resume's load of each group: a window's blocks, the full
        attention's 8."""
        text = server.log_path.read_text(errors="replace")
        return all(
            re.search(rf"loaded {n}/{n} blocks \(\d+ bytes\) of group {g} ", text)
            for g, n in enumerate([WINDOW_BLOCKS] * 5 + [8])
        )

    await until(loaded_every_group)


async def test_a_resume_through_the_connector_is_exact_without_the_hybrid_kv_cache_manager(
    swa_server: VllmServer, swa_connectors: ConnectorServers
) -> None:
    """The hybrid model on one KV cache group (`--disable-hybrid-kv-cache-manager`: every
    layer's KV kept whole): a prompt computed, saved to the sidecar by the connector, evicted
    from the engine by other prompts, then asked again: loaded back through the connector, its
    answer is the one computed (greedy tokens equal, float32 top-k logprobs within 1e-3); from
    another prompt's KV served under its keys (the negative control) it is far from that."""
    server = swa_connectors.single
    took = server.wait_ready(READY_TIMEOUT_S)
    server.warm_up(READY_TIMEOUT_S)
    print(f"\nvLLM swa-connector ready in {took:.1f} s")
    assert "Hybrid KV cache manager is disabled" in server.log_path.read_text(errors="replace")
    rng = random.Random(7)
    prompt = [rng.randrange(4, 1800) for _ in range(8 * BLOCK + 5)]
    other = [rng.randrange(4, 1800) for _ in range(len(prompt))]

    def keys(prompt: list[int], salt: str = "") -> list[str]:
        """One group (every layer): the 8 full blocks' keys, as a dense model's."""
        chain = (
            _salted_chain(prompt, salt) if salt else chunk_hashes(prompt, BLOCK, chain_root(MODEL))
        )
        return [k for b in range(8) for k in block_keys(MODEL, chain[b], KV_HEADS)]

    engine = vllm_client("connector", server.url)
    http = sidecar_http()
    try:
        before = await engine.load()
        want = await engine.post("/v1/completions", _completion(prompt))
        # another prompt of the same length, saved: the negative control's KV
        await engine.post("/v1/completions", {**_completion(other), "max_tokens": 1})
        await until_saved(http, swa_connectors.sidecar, keys(other))
        for seed in range(20, 23):
            filler = [random.Random(seed).randrange(4, 1800) for _ in range(30 * BLOCK)]
            await engine.post("/v1/completions", {**_completion(filler), "max_tokens": 1})
        middle = await engine.load()
        got = await engine.post("/v1/completions", _completion(prompt))
        after = await engine.load()
        moves = list(zip(keys(other), keys(prompt, WRONG_SALT), strict=True))
        wrong, wrong_by_source = await _resume_from_wrong_kv(
            http, server, swa_connectors.sidecar, prompt, moves
        )
    finally:
        await engine.aclose()
        await http.aclose()
    assert tokens_by_source(before, middle)["external_kv_transfer"] == 0
    by_source = tokens_by_source(middle, after)
    assert by_source == {
        "local_compute": 5,
        "local_cache_hit": 0,
        "external_kv_transfer": 8 * BLOCK,
    }, by_source
    diff = top_logprob_distance(got, want)
    print(f"resume: greedy tokens equal, top-{TOP_K} logprobs within {diff:.2e}")
    assert diff <= TOL
    assert wrong_by_source == by_source, wrong_by_source
    wrong_diff = top_logprob_distance(wrong, want)
    print(f"resume from another prompt's KV: top-{TOP_K} logprobs {wrong_diff:.2f} away")
    assert wrong_diff > 100 * TOL
