"""RAG benchmark for chunk reuse on real vLLM CPU: the router (chunk reuse on:
missing chunks prefilled on their own, the rest loaded by the OwnerServe connector from the
worker's sidecar with K re-rotated) against the router without it (vLLM's prefix caching and
the connector's prefix artifacts alone), on one vLLM CPU worker serving the tiny random-weight
model, a few requests per run.

Prompts are `rag.py`'s (`Context ## doc ## ... ## question` as a chat user message, documents
warm with probability `hit`), smaller to fit the tiny model's 2048 tokens: 2-5 documents of
48-192 words. Reported per run: the prompt tokens vLLM computed (its `prompt_tokens_by_source`
`local_compute`, chunk prefills included), loaded from the chunk store (`external_kv_transfer`)
and hit in its prefix cache, and for chunk reuse the computed tokens the layout predicts: per
request the tokens after the last chunk, plus per chunk prefilled (a load span first seen) the
system segment's partial last block and the span.

    .venv/bin/python -m bench.chunks.rag_vllm [--hits 0.5 0.9] [--requests 8]
        [--vllm-url URL --sidecar-url URL]   # else it starts vLLM CPU and a sidecar itself
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.chunks.rag import SYSTEM, Docs, RagRun, every_run, parser_for, prompts, save
from ownerserve.chunks import load_spans
from ownerserve.config import Settings, settings_from_dict
from ownerserve.ports import free_port
from router.app import create_app
from router.backends.vllm import VllmClient, VllmLoad
from router.server import running_app
from workers.vllm_cpu.model import SERVED_NAME
from workers.vllm_cpu.server import VllmServer, VllmServerSpec
from workers.vllm_cpu.setup import ensure

BLOCK = 32
PLAN_HEADER = "x-ownerserve-plan"


@dataclass(frozen=True, slots=True)
class Run(RagRun):
    prompt_tokens: int
    computed: int
    loaded_from_chunk_store: int
    prefix_cache_hit: int
    predicted_computed: int | None
    chunks_reused: int
    chunks_prefilled: int


SMALL_DOCS = (48, 192)
"""Document lengths, the least and the most (`Docs`; the tiny model's context is 2048 tokens)."""


def settings(install_model: Path, url: str, sidecar: str, chunks: bool) -> Settings:
    model: dict[str, Any] = {
        "name": SERVED_NAME,
        "tokenizer": str(install_model / "tokenizer.json"),
        "block_size": BLOCK,
        "max_model_len": 2048,
    }
    if chunks:
        model["chunks"] = {"separator": "##"}
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5},
            "planner": {"policy": "ownerserve"},
            "models": [model],
            "workers": [
                {
                    "id": "c",
                    "url": url,
                    "kind": "vllm",
                    "models": [SERVED_NAME],
                    "sidecar_url": sidecar,
                }
            ],
        }
    )


def messages(docs: list[str], question: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": " ## ".join(["Context", *docs, question])}]


def by_source(before: VllmLoad, after: VllmLoad, key: str) -> int:
    a, b = after.prompt_tokens_by_source, before.prompt_tokens_by_source
    return int(a.get(key, 0.0) - b.get(key, 0.0))


async def one_run(args: argparse.Namespace, model_dir: Path, chunks: bool, hit: float) -> Run:
    docs = Docs(args.seed, SMALL_DOCS)
    warmup, measured = prompts(hit, args.requests, args.seed, args.warm_docs)
    warmup = [w[:4] for w in warmup]
    measured = [m[:5] for m in measured]
    vllm = VllmClient("c", args.vllm_url, connect_timeout_s=60.0)
    seen: set[int] = set()
    app = create_app(settings(model_dir, args.vllm_url, args.sidecar_url, chunks))
    # a different question text per mode keeps the two runs' prompts apart in vLLM's cache
    tag = "c" if chunks else "p"
    async with (
        running_app(app, "127.0.0.1", 0) as url,
        httpx.AsyncClient(base_url=url, timeout=300) as client,
    ):
        await asyncio.sleep(1.0)
        mt = app.state.router.tokenizers.get(SERVED_NAME) if chunks else None

        async def ask(msgs: list[dict[str, str]]) -> tuple[float, str]:
            body = {"model": SERVED_NAME, "messages": msgs, "max_tokens": 1, "temperature": 0}
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=body)
            took = time.perf_counter() - t0
            if r.status_code != 200:
                raise RuntimeError(r.text)
            return took, r.headers.get(PLAN_HEADER, "")

        def predicted(msgs: list[dict[str, str]]) -> int:
            assert mt is not None
            tok = mt.tokenize_chat(None, msgs, None)
            cp = mt.chunk_prompt(tok, msgs)
            assert cp is not None
            ids = list(tok.token_ids)
            spans = load_spans(ids, cp.system_end, cp.chunks)
            tail = cp.system_end - cp.system_end // BLOCK * BLOCK
            out = len(ids) - spans[-1].end
            for s in spans:
                if s.key not in seen:
                    seen.add(s.key)
                    out += tail + s.end - s.start
            return out

        for i, keys in enumerate(warmup):
            msgs = messages([docs(k) for k in keys], f"Warm-up {tag} {hit} {i}?")
            if chunks:
                predicted(msgs)
            await ask(msgs)
        before = await vllm.load()
        ttfts: list[float] = []
        prompt_tokens = 0
        guess = 0
        reused = prefilled = 0
        for i, keys in enumerate(measured):
            msgs = messages([docs(k) for k in keys], f"Question {tag} {hit} {i}: what?")
            if chunks:
                guess += predicted(msgs)
            took, plan = await ask(msgs)
            ttfts.append(took)
            fields = dict(f.split("=", 1) for f in plan.split(";") if "=" in f)
            if "chunks" in fields:
                r_, _, n_ = (int(x) for x in fields["chunks"].split("/"))
                reused, prefilled = reused + r_, prefilled + n_
        after = await vllm.load()
        for key in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            prompt_tokens += by_source(before, after, key)
    return Run(
        hit=hit,
        mode="chunk reuse" if chunks else "prefix caching",
        requests=len(ttfts),
        ttft_mean_ms=round(statistics.fmean(ttfts) * 1000, 1),
        prompt_tokens=prompt_tokens,
        computed=by_source(before, after, "local_compute"),
        loaded_from_chunk_store=by_source(before, after, "external_kv_transfer"),
        prefix_cache_hit=by_source(before, after, "local_cache_hit"),
        predicted_computed=guess if chunks else None,
        chunks_reused=reused,
        chunks_prefilled=prefilled,
    )


@contextlib.contextmanager
def started(args: argparse.Namespace) -> Iterator[Path]:
    """vLLM CPU (connector on) and its sidecar, unless both URLs were given; the model dir."""
    install = ensure()
    if args.vllm_url and args.sidecar_url:
        yield Path(install.model)
        return
    work = Path(tempfile.mkdtemp(prefix="ownerserve-rag-vllm-"))
    port = free_port()
    with (work / "sidecar.log").open("wb") as log:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "ownerserve", "worker", "sidecar", "--worker-id", "c",
             "--port", str(port), "--store-dir", str(work / "store")],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    args.sidecar_url = f"http://127.0.0.1:{port}"
    server = VllmServer(
        install,
        VllmServerSpec(name="rag", port=free_port(), sidecar_url=args.sidecar_url),
        work,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(args.sidecar_url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        server.start()
        server.wait_ready(600)
        server.warm_up(600)
        args.vllm_url = server.url
        yield Path(install.model)
    finally:
        server.stop()
        sidecar.terminate()
        sidecar.wait(10)


def table(runs: list[Run]) -> str:
    lines = [
        "| hit rate | mode | requests | prompt tokens | computed | predicted | loaded from chunk "
        "store | prefix-cache hit | chunks reused / prefilled | mean latency ms |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        pred = "–" if r.predicted_computed is None else f"{r.predicted_computed:,}"
        lines.append(
            f"| {r.hit:.0%} | {r.mode} | {r.requests} | {r.prompt_tokens:,} | {r.computed:,} | "
            f"{pred} | {r.loaded_from_chunk_store:,} | {r.prefix_cache_hit:,} | "
            f"{r.chunks_reused} / {r.chunks_prefilled} | {r.ttft_mean_ms:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = parser_for(__doc__, requests=8, warm_docs=16, out="chunks_rag_vllm.json")
    parser.add_argument("--vllm-url")
    parser.add_argument("--sidecar-url")
    args = parser.parse_args()
    with started(args) as model_dir:
        runs = asyncio.run(
            every_run(args.hits, lambda chunks, hit: one_run(args, model_dir, chunks, hit))
        )
    save(runs, args.out, table(runs))


if __name__ == "__main__":
    main()
