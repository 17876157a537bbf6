"""Real vLLM workers with the OwnerServe KV connector and real sidecar processes.
Sidecar fixtures come first in each signature: without the sidecar server the tests skip before
any vLLM starts.

Worker A (`vllm_hybrid` + `sidecar_a`) computes a session prefix and its connector saves the
sealed blocks to A's sidecar; B's sidecar fetches them from A's (`POST /ownerserve/kv/fetch`); B's
vLLM (`vllm_hybrid_b` + `sidecar_b`) then loads the prefix through its connector, reports it as
externally loaded, recomputes none of it, and answers with the greedy tokens (and logprobs) of
computing the whole prompt on B; loaded from another prompt's KV served under its keys (the
negative control), B's answer is not that one. A corrupted artifact is refused and its blocks
recomputed. The P/D decode instance runs MultiConnector [NixlConnector, OwnerServe] and serves
P/D requests.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kernels.rope import RopeSpec, apply_rope
from ownerserve.hashing import chain_root
from router.backends.vllm import VllmClient, with_transfer_params
from tests.e2e.vllm.conftest import (
    BLOCK,
    HEADS,
    LOGPROB_TOL,
    PDPair,
    Sidecar,
    completion_body,
    present,
    serve_under,
    tokens_and_logprobs,
    tokens_by_source,
    until_saved,
    vllm_client,
)
from workers.vllm_connector.plan import chunk_hashes, loadable_blocks, lookup_keys
from workers.vllm_cpu.model import CONFIG, SERVED_NAME
from workers.vllm_cpu.server import VllmServer
from workers.vllm_cpu.setup import VllmCpuInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LAYERS = CONFIG["num_hidden_layers"]
HEAD_DIM = CONFIG["head_dim"]


def _prompt(tag: str, n: int = 70) -> str:
    return " ".join(f"{tag} agent step {i} tool result ok" for i in range(n))


async def _token_ids(http: httpx.AsyncClient, server: VllmServer, prompt: str) -> list[int]:
    r = await http.post(server.url + "/tokenize", json={"model": SERVED_NAME, "prompt": prompt})
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


class Session:
    """One prompt's identity as the router and the sidecars see it (asked with vLLM
    `cache_salt` `salt`, which the connector joins to its chain root)."""

    def __init__(self, token_ids: list[int], salt: str = "") -> None:
        self.token_ids = token_ids
        root = chain_root(SERVED_NAME, f"\x00{salt}" if salt else "")
        self.hashes = chunk_hashes(token_ids, BLOCK, root)
        # The connector leaves the prompt's last token to vLLM.
        self.loadable = loadable_blocks(len(token_ids), BLOCK)
        self.keys = lookup_keys(SERVED_NAME, self.hashes[: self.loadable], HEADS)


async def _computed_and_saved_on(
    http: httpx.AsyncClient, worker: VllmClient, sidecar: Sidecar, session: Session, prompt: str
) -> dict[str, Any]:
    answer = await worker.post("/v1/completions", completion_body(prompt))
    await until_saved(http, sidecar, session.keys)
    return answer


async def _fetch(
    http: httpx.AsyncClient, dst: Sidecar, src: Sidecar, session: Session
) -> dict[str, Any]:
    body = {
        "source_url": src.url,
        "source_worker": src.worker_id,
        "model": SERVED_NAME,
        "block_hashes": session.hashes[: session.loadable],
        "token_ids": session.token_ids,
        "block_size": BLOCK,
    }
    r = await http.post(dst.url + "/ownerserve/kv/fetch", json=body, timeout=120.0)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def _bf16_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tiny model's weights (all bf16), read without the safetensors package."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        data = bytearray(raw[8 + n + start : 8 + n + end])
        out[name] = torch.frombuffer(data, dtype=torch.bfloat16).view(meta["shape"])
    return out


def _layer0_kv(model_dir: Path, token_ids: list[int], first: int) -> tuple[torch.Tensor, ...]:
    """Layer 0's K (RoPE'd at its positions) and V `[tokens, heads, head_dim]` of
    `token_ids[first : first + BLOCK]`, recomputed from the weights as Llama does."""
    w = _bf16_safetensors(model_dir / "model.safetensors")
    ids = torch.tensor(token_ids[first : first + BLOCK])
    x = w["model.embed_tokens.weight"][ids].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG["rms_norm_eps"])
    x = x.to(torch.bfloat16) * w["model.layers.0.input_layernorm.weight"]
    shape = (BLOCK, len(HEADS), HEAD_DIM)
    k = (x @ w["model.layers.0.self_attn.k_proj.weight"].T).view(shape)
    v = (x @ w["model.layers.0.self_attn.v_proj.weight"].T).view(shape)
    rope = RopeSpec(HEAD_DIM, base=CONFIG["rope_theta"])
    return apply_rope(k, torch.arange(first, first + BLOCK), rope).float(), v.float()


async def _check_payload_layout(
    http: httpx.AsyncClient, sidecar: Sidecar, session: Session, install: VllmCpuInstall
) -> None:
    """An artifact saved by real vLLM is `[layers, K/V, tokens, head_dim]` of one KV head,
    token-major: layer 0 equals K and V recomputed from the weights (bf16 rounding aside)."""
    block = 1
    k, v = _layer0_kv(install.model, session.token_ids, block * BLOCK)
    for head in HEADS:
        key = session.keys[block * len(HEADS) + head]
        r = await http.get(f"{sidecar.url}/ownerserve/kv/artifacts/{key}")
        assert r.status_code == 200
        unit = torch.frombuffer(bytearray(r.content), dtype=torch.bfloat16)
        unit = unit.view(LAYERS, 2, BLOCK, HEAD_DIM).float()
        assert (unit[0, 0] - k[:, head]).abs().max() <= 0.02 * k.abs().max()
        assert (unit[0, 1] - v[:, head]).abs().max() <= 0.02 * v.abs().max()


async def test_a_prefix_computed_on_a_is_fetched_by_b_and_loaded_without_recompute(
    sidecar_a: Sidecar,
    sidecar_b: Sidecar,
    vllm_install: VllmCpuInstall,
    vllm_hybrid: VllmServer,
    vllm_hybrid_b: VllmServer,
) -> None:
    a = vllm_client("a", vllm_hybrid.url)
    b = vllm_client("b", vllm_hybrid_b.url)
    async with httpx.AsyncClient(timeout=60.0) as http:
        try:
            prompt = _prompt("fetch")
            session = Session(await _token_ids(http, vllm_hybrid, prompt))
            assert len(session.token_ids) % BLOCK and session.loadable >= 8
            on_a = await _computed_and_saved_on(http, a, sidecar_a, session, prompt)
            await _check_payload_layout(http, sidecar_a, session, vllm_install)
            assert not any(await present(http, sidecar_b, session.keys))

            # B computing the whole prompt itself: a vLLM cache salt misses B's prefix cache and
            # (the connector hashes it into the chain root) every artifact.
            before = await b.load()
            alone = await b.post("/v1/completions", completion_body(prompt, cache_salt="b-alone"))
            computed = tokens_by_source(before, await b.load())
            assert computed["local_compute"] == len(session.token_ids)
            assert computed["external_kv_transfer"] == 0

            fetched = await _fetch(http, sidecar_b, sidecar_a, session)
            assert fetched["blocks"] == session.loadable
            assert all(await present(http, sidecar_b, session.keys))

            before = await b.load()
            loaded = await b.post("/v1/completions", completion_body(prompt))
            used = tokens_by_source(before, await b.load())
            external = session.loadable * BLOCK
            assert used["external_kv_transfer"] == external
            assert used["local_cache_hit"] == 0
            # Only the partial last block is computed: none of the fetched blocks.
            assert used["local_compute"] == len(session.token_ids) - external < BLOCK

            for reference in (alone, on_a):
                assert _same_answer(loaded, reference)

            # The negative control: B loads another prompt's KV (B's own, computed under a
            # salt, served under this prompt's keys for another salt), well-formed and
            # checksum-valid; its answer must fail the comparison above.
            other_prompt = _prompt("other", 80)
            other = Session(await _token_ids(http, vllm_hybrid_b, other_prompt), "b-other")
            assert other.loadable >= session.loadable
            await b.post("/v1/completions", completion_body(other_prompt, cache_salt="b-other"))
            await until_saved(http, sidecar_b, other.keys)
            wrong = Session(session.token_ids, "b-wrong")
            moves = list(zip(other.keys, wrong.keys, strict=False))
            await serve_under(http, sidecar_b, moves, len(HEADS))
            before = await b.load()
            wrong_kv = await b.post(
                "/v1/completions", completion_body(prompt, cache_salt="b-wrong")
            )
            assert tokens_by_source(before, await b.load()) == used
            assert not _same_answer(wrong_kv, alone)
        finally:
            await a.aclose()
            await b.aclose()


def _same_answer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two answers are the same as a loaded prefix must keep them: equal greedy tokens,
    logprobs within `LOGPROB_TOL`."""
    a_tokens, a_lp = tokens_and_logprobs(a)
    b_tokens, b_lp = tokens_and_logprobs(b)
    return a_tokens == b_tokens and all(
        abs(x - y) <= LOGPROB_TOL for x, y in zip(a_lp, b_lp, strict=True)
    )


def _flip_a_byte(store_file: Path) -> None:
    """Make one bf16 element of the payload huge (its high byte: sign and exponent), so a
    loaded copy would visibly change the answer."""
    raw = bytearray(store_file.read_bytes())
    raw[-1] ^= 0x7F
    store_file.write_bytes(bytes(raw))


async def test_a_corrupted_artifact_is_never_loaded_and_vllm_recomputes_the_same_tokens(
    sidecar_a: Sidecar, sidecar_b: Sidecar, vllm_hybrid: VllmServer, vllm_hybrid_b: VllmServer
) -> None:
    a = vllm_client("a", vllm_hybrid.url)
    b = vllm_client("b", vllm_hybrid_b.url)
    async with httpx.AsyncClient(timeout=60.0) as http:
        try:
            prompt = _prompt("corrupt", 50)
            session = Session(await _token_ids(http, vllm_hybrid, prompt))
            await _computed_and_saved_on(http, a, sidecar_a, session, prompt)
            alone = await b.post("/v1/completions", completion_body(prompt, cache_salt="b-alone"))
            await _fetch(http, sidecar_b, sidecar_a, session)

            bad_block, bad_head = session.loadable // 2, 2
            bad_key = session.keys[bad_block * len(HEADS) + bad_head]
            _flip_a_byte(sidecar_b.artifact_file(bad_key))

            loaded = await b.post("/v1/completions", completion_body(prompt))
            assert tokens_and_logprobs(loaded)[0] == tokens_and_logprobs(alone)[0]
            l_lp, r_lp = tokens_and_logprobs(loaded)[1], tokens_and_logprobs(alone)[1]
            assert max(abs(x - y) for x, y in zip(l_lp, r_lp, strict=True)) <= LOGPROB_TOL
            log = vllm_hybrid_b.log_path.read_text(errors="replace")
            assert f"rejected artifact ({bad_key}" in log
            assert f"loaded {bad_block}/{session.loadable} blocks" in log

            # The refused blocks were recomputed and saved again, whole.
            await until_saved(http, sidecar_b, session.keys)
        finally:
            await a.aclose()
            await b.aclose()


async def test_multiconnector_nixl_and_ownerserve_serve_a_pd_request_and_save_its_blocks(
    sidecar_d: Sidecar, vllm_pd_pair: PDPair
) -> None:
    """The decode instance runs MultiConnector [NixlConnector, OwnerServeConnector]: the P/D
    request's KV arrives over NIXL, and the OwnerServe half saves its blocks to the sidecar."""
    prefill = vllm_client("prefill", vllm_pd_pair.prefill.url)
    decode = vllm_client("decode", vllm_pd_pair.decode.url)
    async with httpx.AsyncClient(timeout=60.0) as http:
        try:
            prompt = _prompt("multi", 40)
            session = Session(await _token_ids(http, vllm_pd_pair.decode, prompt))
            body = completion_body(prompt)
            before = await decode.load()
            params = await prefill.prefill_for_remote_decode("/v1/completions", body)
            await decode.post("/v1/completions", with_transfer_params(body, params))
            pulled = tokens_by_source(before, await decode.load())["external_kv_transfer"]
            assert pulled >= len(session.token_ids) - 1
            await until_saved(http, sidecar_d, session.keys)
        finally:
            await prefill.aclose()
            await decode.aclose()
