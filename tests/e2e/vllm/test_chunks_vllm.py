"""Chunk reuse on real vLLM CPU: chunk KV computed in isolation by chunk
prefills, saved by the connector into the sidecar under its content key, loaded into prompts
that hold the chunks at other positions with K re-rotated; the first token's logprobs equal the
float32 torch reference with chunk-isolated attention (`chunk_reference.py`) within 1e-3.

`vllm_chunks` runs float32 (the reference's precision) with the connector on `sidecar_c`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ownerserve.chunks import (
    CHUNK_CACHE_SALT,
    Chunk,
    ChunkedPrompt,
    chunk_artifact_key,
    chunk_hash,
    chunk_prefills,
    layout_params,
    load_spans,
    system_hash,
)
from ownerserve.hashing import chain_root
from tests.e2e.vllm.chunk_reference import TinyLlama
from tests.e2e.vllm.conftest import (
    BLOCK,
    Sidecar,
    tokens_by_source,
    vllm_client,
    vllm_router_settings,
    vllm_worker,
)
from workers.vllm_cpu.model import SERVED_NAME
from workers.vllm_cpu.server import VllmServer
from workers.vllm_cpu.setup import VllmCpuInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TOL = 1e-3
TOP = 5
# ids above the tokenizer's special tokens, drawn at random (a random-weight model is happy
# with any ids)
_FIRST_ID, _LAST_ID = 16, 1000
SEP = (7, 9)  # two ids standing for the separator: the default `##`


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_FIRST_ID, _LAST_ID) for _ in range(n)]


def chunked_prompt(
    system: Sequence[int], chunks: Sequence[Sequence[int]], question: Sequence[int]
) -> tuple[list[int], ChunkedPrompt]:
    """`system SEP c1 SEP c2 ... SEP question` and its layout, hashed as the router does."""
    ids = list(system)
    spans = []
    for c in chunks:
        ids += SEP
        spans.append((len(ids), len(ids) + len(c)))
        ids += c
    ids += SEP
    question_start = len(ids)
    ids += question
    sh = system_hash(chain_root(SERVED_NAME, ""), system)
    out = tuple(Chunk(lo, hi, chunk_hash(sh, ids[lo:hi])) for lo, hi in spans)
    return ids, ChunkedPrompt(len(system), out, question_start, sh)


async def complete(
    http: httpx.AsyncClient, url: str, ids: Sequence[int], **extra: Any
) -> dict[str, Any]:
    body = {
        "model": SERVED_NAME,
        "prompt": list(ids),
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": TOP,
        **extra,
    }
    r = await http.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def first_logprobs(answer: dict[str, Any], vocab: Any) -> dict[int, float]:
    """The first generated token's top logprobs by token id (`token_id:N` strings from
    `return_tokens_as_token_ids`)."""
    top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(tok.split(":", 1)[1]): float(lp) for tok, lp in top.items()}


def max_diff(got: dict[int, float], ref: torch.Tensor) -> float:
    return max(abs(lp - float(ref[tid])) for tid, lp in got.items())


async def complete_with_chunks(
    http: httpx.AsyncClient, url: str, ids: Sequence[int], params: dict[str, Any]
) -> dict[str, Any]:
    """`complete` with the connector's chunk `params` (a chunk prefill's, or a chunked prompt's
    `layout_params`), salted as the router salts chunk requests, token ids as answer tokens."""
    return await complete(
        http,
        url,
        ids,
        cache_salt=CHUNK_CACHE_SALT,
        kv_transfer_params={"ownerserve": params},
        return_tokens_as_token_ids=True,
    )


async def prefill_chunks(
    http: httpx.AsyncClient, url: str, ids: Sequence[int], cp: ChunkedPrompt
) -> None:
    """What the router does for a vLLM worker before a chunked request: every chunk's load
    span computed on its own after the system segment, saved by the connector."""
    for p in chunk_prefills(ids, cp, BLOCK):
        await complete_with_chunks(http, url, p.prompt, p.params)


@pytest.fixture(scope="module")
def reference(vllm_install: VllmCpuInstall) -> TinyLlama:
    return TinyLlama(Path(vllm_install.model))


async def test_chunks_reused_at_two_positions_match_the_isolated_attention_reference(
    sidecar_c: Sidecar, vllm_chunks: VllmServer, reference: TinyLlama
) -> None:
    rng = random.Random(26)
    system = _ids(rng, 45)  # a partial last block: its tail comes from the chunk artifact
    a, b, c = _ids(rng, 40), _ids(rng, 27), _ids(rng, 52)
    question = _ids(rng, 12)
    ids1, cp1 = chunked_prompt(system, [a, b, c], question)
    ids2, cp2 = chunked_prompt(system, [c, a, b], question)  # the same chunks, moved
    client = vllm_client("chunks", vllm_chunks.url)
    async with httpx.AsyncClient(timeout=300.0) as http:
        await prefill_chunks(http, vllm_chunks.url, ids1, cp1)
        keys = [
            chunk_artifact_key(SERVED_NAME, s.key)
            for s in load_spans(ids1, cp1.system_end, cp1.chunks)
        ]
        r = await http.post(f"{sidecar_c.url}/ownerserve/kv/lookup", json={"keys": keys})
        assert r.json()["present"] == [True, True, True]

        for ids, cp in ((ids1, cp1), (ids2, cp2)):
            before = await client.load()
            answer = await complete_with_chunks(http, vllm_chunks.url, ids, layout_params(cp))
            used = tokens_by_source(before, await client.load())
            got = first_logprobs(answer, None)
            spans = [(s.start, s.end) for s in load_spans(ids, cp.system_end, cp.chunks)]
            ref = reference.chunked_logprobs(ids, cp.system_end, spans)
            causal = reference.causal_logprobs(ids)
            diff = max_diff(got, ref)
            print(f"\nchunked prompt: max |logprob - reference| = {diff:.2e}")
            assert diff <= TOL, (got, ref[list(got)])
            # isolation is visible: plain causal attention answers otherwise
            assert max_diff(got, causal) > 0.05
            # past vLLM's local hit (the system blocks, a chunk's blocks that a prefill shares
            # with this prompt), every token up to the last chunk's end came from the chunk store
            local, loaded = used["local_cache_hit"], used["external_kv_transfer"]
            assert loaded > 0 and local + loaded == spans[-1][1], (local, loaded)

        # chunk reuse off (no layout): the answer is normal vLLM's, i.e. plain causal
        plain = await complete(http, vllm_chunks.url, ids1, return_tokens_as_token_ids=True)
        diff = max_diff(first_logprobs(plain, None), reference.causal_logprobs(ids1))
        print(f"\nplain prompt: max |logprob - causal reference| = {diff:.2e}")
        assert diff <= TOL


async def test_a_corrupted_chunk_artifact_is_refused_recomputed_by_vllm_and_reported(
    sidecar_c: Sidecar, vllm_chunks: VllmServer, reference: TinyLlama
) -> None:
    """Past the router's verify (straight to vLLM): the connector refuses the artifact, vLLM
    recomputes from its first block on, and the answer says `chunk_fallback: refused`."""
    from tests.e2e.vllm.test_sidecar_vllm import _flip_a_byte

    rng = random.Random(27)
    system = _ids(rng, 45)
    a, b = _ids(rng, 40), _ids(rng, 50)
    question = _ids(rng, 10)
    ids, cp = chunked_prompt(system, [a, b], question)
    async with httpx.AsyncClient(timeout=300.0) as http:
        await prefill_chunks(http, vllm_chunks.url, ids, cp)
        spans = load_spans(ids, cp.system_end, cp.chunks)
        _flip_a_byte(sidecar_c.artifact_file(chunk_artifact_key(SERVED_NAME, spans[1].key)))
        # vLLM's cache holds the system blocks and a's first block (a's prefill): a's rest
        # and b's span are loaded, b's artifact refused
        answer = await complete_with_chunks(http, vllm_chunks.url, ids, layout_params(cp))
        assert answer["kv_transfer_params"] == {"ownerserve": {"chunk_fallback": "refused"}}
        # recomputed, not loaded: b's span attended to a as well, so the isolated reference
        # no longer holds, plain causal attention does
        ref_spans = [(s.start, s.end) for s in spans]
        got = first_logprobs(answer, None)
        assert max_diff(got, reference.chunked_logprobs(ids, cp.system_end, ref_spans)) > 0.05
        assert max_diff(got, reference.causal_logprobs(ids)) <= TOL


# --- through the router ---------------------------------------------------------------------

PLAN_HEADER = "x-ownerserve-plan"
WORDS = ("cache", "token", "prefix", "router", "model", "latency", "owner", "chunk")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n))


def chunk_router_settings(install: VllmCpuInstall, server: VllmServer, sidecar: Sidecar) -> Any:
    """One `kind: vllm` worker with its sidecar, the model's chunk reuse on (`##`)."""
    worker = vllm_worker("c", server, sidecar_url=sidecar.url)
    return vllm_router_settings(install, [worker], model={"chunks": {"separator": "##"}})


def plan_chunks(resp: httpx.Response) -> str:
    fields = dict(f.split("=", 1) for f in resp.headers[PLAN_HEADER].split(";") if "=" in f)
    return fields["chunks"]


async def test_chunked_prompts_through_the_router_prefill_missing_chunks_and_match_the_reference(
    sidecar_c: Sidecar,
    vllm_install: VllmCpuInstall,
    vllm_chunks: VllmServer,
    reference: TinyLlama,
) -> None:
    from tests.e2e.router_cluster import proxy_client
    from tests.e2e.vllm.test_sidecar_vllm import _flip_a_byte

    rng = random.Random(2026)
    system, question = _text(rng, 20), _text(rng, 6)
    a, b, c, d = (_text(rng, n) for n in (18, 11, 25, 14))

    def prompt(*chunks: str) -> str:
        return " ## ".join((system, *chunks, question))

    settings = chunk_router_settings(vllm_install, vllm_chunks, sidecar_c)
    async with proxy_client(settings) as (client, router):
        client.timeout = httpx.Timeout(300.0)
        mt = router.tokenizers.get(SERVED_NAME)

        async def ask(text: str, expect: str) -> None:
            r = await client.post(
                "/v1/completions",
                json={
                    "model": SERVED_NAME,
                    "prompt": text,
                    "max_tokens": 1,
                    "temperature": 0,
                    "logprobs": TOP,
                    "return_tokens_as_token_ids": True,
                },
            )
            assert r.status_code == 200, r.text
            assert plan_chunks(r) == expect, r.headers[PLAN_HEADER]
            tok = mt.tokenize_prompt(None, text)
            cp = mt.chunk_prompt(tok, None)
            assert cp is not None
            ids = [int(t) for t in tok.token_ids]
            spans = [(s.start, s.end) for s in load_spans(ids, cp.system_end, cp.chunks)]
            ref = reference.chunked_logprobs(ids, cp.system_end, spans)
            diff = max_diff(first_logprobs(r.json(), None), ref)
            print(f"\nrouter, chunks={expect}: max |logprob - reference| = {diff:.2e}")
            assert diff <= TOL
            assert max_diff(first_logprobs(r.json(), None), reference.causal_logprobs(ids)) > 0.05

        await ask(prompt(a, b, c), "0/0/3")  # every chunk prefilled on its own first
        await ask(prompt(c, a, b), "3/0/0")  # the same chunks elsewhere: all reused
        await ask(prompt(d, b), "1/0/1")  # a new chunk: only it is prefilled
        # a corrupted artifact: the sidecar's verify drops it, the router prefills it again
        ids = [int(t) for t in mt.tokenize_prompt(None, prompt(a, d)).token_ids]
        tok = mt.tokenize_prompt(None, prompt(a, d))
        cp = mt.chunk_prompt(tok, None)
        assert cp is not None
        span_a = load_spans(ids, cp.system_end, cp.chunks)[0]
        _flip_a_byte(sidecar_c.artifact_file(chunk_artifact_key(SERVED_NAME, span_a.key)))
        await ask(prompt(a, d), "1/0/1")
