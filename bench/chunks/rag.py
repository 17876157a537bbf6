"""RAG benchmark for position-independent chunk reuse: the router in front of
emulated workers at GPU timing, with chunk reuse against prefix caching alone.

A pool of documents; each prompt is `Context##doc##doc##...##question` (the plain-text format) with
4-16 documents of 256-1024 tokens in random order, each drawn from a warm set (computed once
before measuring) with probability `hit`, else never seen before. The same request sequence
runs through a router with the model's `chunks:` on and through one without (prefix caching
alone), on the same workers with their caches reset in between. Reported per run: TTFT (time
to the first streamed token, mean/p50/p90) and the prompt tokens the workers computed.

    .venv/bin/python -m bench.chunks.rag [--hits 0.5 0.9] [--requests 40] [--workers 2]

Its prompts, documents, run loop and shared options serve `bench.chunks.rag_vllm` too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from loadgen.cluster import MODEL, EmulatedWorker, emulated_workers
from loadgen.text import TextFactory
from ownerserve.config import ChunkSettings, ModelSettings, Settings, settings_from_dict
from router.app import create_app
from router.server import running_app

R = TypeVar("R", bound="RagRun")
SYSTEM = {"role": "system", "content": "Answer from the documents below.\n"}
RESULTS = Path(__file__).resolve().parents[1] / "results"


@dataclass(frozen=True, slots=True)
class RagRun:
    """What every RAG benchmark reports of a run: its hit rate, its mode ("prefix caching" or
    "chunk reuse"), the requests measured and their mean TTFT."""

    hit: float
    mode: str
    requests: int
    ttft_mean_ms: float


@dataclass(frozen=True, slots=True)
class Run(RagRun):
    ttft_p50_ms: float
    ttft_p90_ms: float
    prompt_tokens: int
    prefill_tokens_computed: int
    chunk_tokens: int
    chunk_tokens_reused: int
    chunk_tokens_fetched: int = 0
    """Chunk tokens pulled from another worker's chunk store (chunk fetch) before reuse."""


def prompts(
    hit: float, n: int, seed: int, warm_docs: int
) -> tuple[list[list[str]], list[list[str]]]:
    """(warm-up prompts' documents, measured prompts' documents), as document keys."""
    rng = random.Random(seed)
    warm = [f"warm-{hit}-{i}" for i in range(warm_docs)]
    warmup = [warm[i : i + 8] for i in range(0, warm_docs, 8)]
    measured = []
    fresh = 0
    for _ in range(n):
        docs = []
        for _ in range(rng.randint(4, 16)):
            if rng.random() < hit:
                docs.append(rng.choice(warm))
            else:
                fresh += 1
                docs.append(f"fresh-{hit}-{fresh}")
        measured.append(list(dict.fromkeys(docs)))  # a document once per prompt
    return warmup, measured


class Docs:
    """The document of each key, made once, of `length` (least, most) tokens drawn per document
    (`TextFactory.make`'s tokens: bytes of the byte tokenizer)."""

    def __init__(self, seed: int, length: tuple[int, int] = (256, 1024)) -> None:
        self.text = TextFactory(seed=seed)
        self.sizes = random.Random(seed + 1)
        self.length = length
        self._cache: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        doc = self._cache.get(key)
        if doc is None:
            doc = self._cache[key] = self.text.make(key, self.sizes.randint(*self.length))
        return doc


def settings(workers: tuple[EmulatedWorker, ...], chunks: bool) -> Settings:
    data: dict[str, Any] = {
        "server": {"port": 0, "health_interval_s": 0.5},
        "planner": {"policy": "ownerserve"},
        "models": [{"name": MODEL}],
        "workers": [w.worker_settings() for w in workers],
    }
    s = settings_from_dict(data)
    if chunks:
        s = s.model_copy(update={"models": (ModelSettings(name=MODEL, chunks=ChunkSettings()),)})
    return s


async def ask(client: httpx.AsyncClient, docs: list[str], question: str) -> float:
    """TTFT (s) of one streamed request."""
    content = "Context##" + "##".join(docs) + "##" + question
    body = {
        "model": MODEL,
        "messages": [SYSTEM, {"role": "user", "content": content}],
        "max_tokens": 2,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = 0.0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError((await resp.aread()).decode())
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and '"content"' in line and not ttft:
                ttft = time.perf_counter() - t0
    return ttft


def counter(workers: tuple[EmulatedWorker, ...], name: str) -> int:
    total = 0.0
    for w in workers:
        for line in w.metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rpartition(" ")[2])
    return int(total)


async def one_run(
    workers: tuple[EmulatedWorker, ...], chunks: bool, hit: float, args: argparse.Namespace
) -> Run:
    async with httpx.AsyncClient(timeout=60) as http:
        for w in workers:  # cold caches: prefix blocks, CPU tier and chunk store
            r = await http.post(w.url + "/reset_prefix_cache?reset_external=true")
            r.raise_for_status()
    docs = Docs(args.seed)
    warmup, measured = prompts(hit, args.requests, args.seed, args.warm_docs)
    app = create_app(settings(workers, chunks))
    async with (
        running_app(app, "127.0.0.1", 0) as url,
        httpx.AsyncClient(base_url=url, timeout=120) as client,
    ):
        await asyncio.sleep(1.0)  # the first health checks
        for i, warm_keys in enumerate(warmup):
            await ask(client, [docs(k) for k in warm_keys], f"Warm-up question {i}?")
        computed0 = counter(workers, "ownerserve_emulator_prefill_tokens_computed_total")
        prompt0 = counter(workers, "vllm:prompt_tokens_total")
        reused0 = counter(workers, "ownerserve_emulator_chunk_tokens_reused_total")
        fetched0 = counter(workers, "ownerserve_emulator_chunk_tokens_fetched_total")
        ttfts = []
        chunk_tokens = 0
        for i, keys in enumerate(measured):
            texts = [docs(k) for k in keys]
            chunk_tokens += sum(len(t) for t in texts)
            ttfts.append(await ask(client, texts, f"Question {i}: what do they say?"))
    ttfts.sort()
    ms = [t * 1000 for t in ttfts]
    return Run(
        hit=hit,
        mode="chunk reuse" if chunks else "prefix caching",
        requests=len(ms),
        ttft_mean_ms=round(statistics.fmean(ms), 2),
        ttft_p50_ms=round(statistics.median(ms), 2),
        ttft_p90_ms=round(ms[int(0.9 * (len(ms) - 1))], 2),
        prompt_tokens=counter(workers, "vllm:prompt_tokens_total") - prompt0,
        prefill_tokens_computed=counter(
            workers, "ownerserve_emulator_prefill_tokens_computed_total"
        )
        - computed0,
        chunk_tokens=chunk_tokens,
        chunk_tokens_reused=counter(workers, "ownerserve_emulator_chunk_tokens_reused_total")
        - reused0,
        chunk_tokens_fetched=counter(workers, "ownerserve_emulator_chunk_tokens_fetched_total")
        - fetched0,
    )


def table(runs: list[Run]) -> str:
    lines = [
        "| hit rate | mode | TTFT mean ms | p50 | p90 | prompt tokens | computed | chunk tokens "
        "reused | of them fetched | mean TTFT vs prefix caching |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = {r.hit: r for r in runs if r.mode == "prefix caching"}
    for r in runs:
        b = base.get(r.hit)
        ratio = f"{b.ttft_mean_ms / r.ttft_mean_ms:.2f}× lower" if b and r is not b else "1×"
        share = r.chunk_tokens_reused / r.chunk_tokens if r.chunk_tokens else 0.0
        lines.append(
            f"| {r.hit:.0%} | {r.mode} | {r.ttft_mean_ms:.1f} | {r.ttft_p50_ms:.1f} | "
            f"{r.ttft_p90_ms:.1f} | {r.prompt_tokens:,} | {r.prefill_tokens_computed:,} | "
            f"{r.chunk_tokens_reused:,} ({share:.0%}) | {r.chunk_tokens_fetched:,} | {ratio} |"
        )
    return "\n".join(lines)


async def every_run(hits: list[float], one: Callable[[bool, float], Awaitable[R]]) -> list[R]:
    """`one(chunks, hit)` for every hit rate, prefix caching alone first, then chunk reuse;
    each run printed as a JSON line when it ends."""
    runs: list[R] = []
    for hit in hits:
        for chunks in (False, True):
            run = await one(chunks, hit)
            print(json.dumps(asdict(run)), flush=True)
            runs.append(run)
    return runs


def parser_for(doc: str, requests: int, warm_docs: int, out: str) -> argparse.ArgumentParser:
    """The options every RAG benchmark takes, with its defaults; `out` names its results file."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--hits", type=float, nargs="+", default=[0.5, 0.9])
    parser.add_argument("--requests", type=int, default=requests, help="measured requests per run")
    parser.add_argument("--warm-docs", type=int, default=warm_docs, help="documents computed first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / out)
    return parser


def save(runs: Sequence[RagRun], out: Path, table_text: str) -> None:
    """The runs as JSON at `out`, and their table on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in runs], indent=2) + "\n")
    print(table_text)


async def main_async(args: argparse.Namespace) -> list[Run]:
    ws = tuple(
        EmulatedWorker(f"h{i}", "hybrid", profile=args.profile, speed=args.speed)
        for i in range(args.workers)
    )
    with emulated_workers(*ws) as workers:
        return await every_run(args.hits, lambda chunks, hit: one_run(workers, chunks, hit, args))


def main() -> None:
    parser = parser_for(__doc__, requests=40, warm_docs=40, out="chunks_rag.json")
    parser.add_argument("--workers", type=int, default=2, help="hybrid emulated workers")
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="emulated time runs this many times faster (TTFTs are reported as measured)",
    )
    args = parser.parse_args()
    runs = asyncio.run(main_async(args))
    save(runs, args.out, table(runs))


if __name__ == "__main__":
    main()
