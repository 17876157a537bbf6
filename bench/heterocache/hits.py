"""Predicted against delivered prefix hits through the router, per KV state spec: a short
multi-turn agentic load on emulated workers (real processes) serving a dense, an SWA-hybrid
and a V4-like model; per request, the prefix the plan counted on its worker against the
cached tokens the engine then reports (`usage.prompt_tokens_details.cached_tokens`).

Usage: .venv/bin/python -m bench.heterocache.hits [--sessions 6] [--turns 5]
[--specs SPEC ...] [--out bench/results]

Scored, from the plan's record (`GET /admin/plans`) alone, never the engine's answer:
`planner_priced`, the blocks the planner itself priced as reused on the plan's worker
(`reused_blocks`: for a hybrid model where its resume rule puts the hit, given each worker's
restorable boundary; for a fetch or a migration what it holds and what moves in, resumed
there), and `predicted` (`predicted_tokens`), the resume rule (`ownerserve.kvstate.resume`,
the engine's own) applied again over those blocks with the directory's restorable boundary on
the plan's worker (`restorable`; a fetch brings no windows, so a move's destination resumes
where its own are): what the router expects, a check of the planner's record. In tokens, at
most the prompt less one token rounded down to a block, as an engine never caches the
prompt's last token. The router waits for each worker's KV events to be applied before the
next request, so a prediction reads what the engine published. Error:
|Σ predicted − Σ delivered| / Σ delivered and the share of requests that differ, per spec,
per action and per outcome (`outcome`: as planned, a partial fetch, or a fallback and its
reason, scored apart; `as_planned` alone), for both. Beside them, what the peers' prefix-aware
routers would have credited the same requests with on the same workers (`PEER_CREDITS`,
`peers`), scored on the requests that moved no KV (no fetch, migration or P/D hand-over).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from loadgen.cluster import DEFAULT_PROFILE, EmulatedWorker, emulated_workers
from ownerserve.config import settings_from_dict
from ownerserve.kvfetch import FETCH_BRINGS_WINDOWS
from ownerserve.kvstate import KVStateSpec, ResumeRule, load_spec, moved_windows, resume_point
from ownerserve.profiles import TimingProfile, load_profile
from ownerserve.types import Tier
from router.app import create_app
from router.server import running_app
from router.state import Router
from router.tokens import ModelTokenizer
from router.views import held_by_worker

# (spec, a model name it is found by, emulator flags)
SPECS: tuple[tuple[str, str], ...] = (
    ("llama3-8b", "ownerserve-tiny"),
    ("qwen3-8b-swa", "qwen3-hybrid-swa"),
    ("deepseek-v4", "deepseek-v4-like"),
)
ADMIN = "adm"


def tool_output(session: int, turn: int, lines: int) -> str:
    return "".join(
        f"s{session} t{turn} result {i}: the quick brown fox jumps over the lazy dog.\n"
        for i in range(lines)
    )


def workers(model: str, bs: int) -> tuple[EmulatedWorker, ...]:
    extra = ("--block-size", str(bs), "--num-blocks", str(max(400, 60000 // bs)),
             "--output-len", "40")  # fmt: skip
    return tuple(
        EmulatedWorker(w, "hybrid", model=model, speed=20.0, extra=extra) for w in ("h0", "h1")
    )


async def events_applied(router: Router, ws: tuple[EmulatedWorker, ...]) -> None:
    """Until the router applied every KV event batch each worker published (its metrics)."""
    deadline = time.monotonic() + 60.0
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            done = True
            for w in ws:
                text = (await client.get(w.url + "/metrics")).text
                published = 0.0
                for line in text.splitlines():
                    if line.startswith("ownerserve_emulator_kv_events_published_total"):
                        published = float(line.split()[-1])
                sub = next(s for s in router.subscribers if s.worker == w.worker_id)
                if published > 0 and sub.stats.last_seq != published - 1:
                    done = False
            if done:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("KV events not applied within 60 s")
            await asyncio.sleep(0.02)


MOVES = ("artifact_fetch", "state_migration")


def resume_blocks(spec: KVStateSpec, profile: TimingProfile, k: int, sealed: int) -> int:
    """Where an engine resumes a hybrid prompt whose sealed groups are cached for `sealed`
    blocks and whose windows are cached at boundary `k` <= sealed: the resume rule
    (`ownerserve.kvstate.resume.resume_point`, the emulator's `HybridKV.choose` without a
    CPU tier)."""
    return resume_point(ResumeRule.of(spec), profile.prefill, sealed, k).blocks


def unit(record: dict[str, Any], worker: str) -> dict[str, Any] | None:
    """The GPU restorable unit the directory showed on `worker` (`restorable`), if any."""
    for u in record.get("restorable") or ():
        if u["worker"] == worker and u["tier"] == "gpu":
            return dict(u)
    return None


def predicted_tokens(
    record: dict[str, Any],
    prompt_tokens: int,
    spec: KVStateSpec,
    profile: TimingProfile,
    planner_only: bool = False,
) -> int:
    """What the router expects the engine to report as cached for the plan it chose, from the
    plan's record alone. The blocks the planner priced as reused on the plan's worker
    (`reused_blocks`, alone when `planner_only`); for a hybrid model, where the engine's
    resume rule puts a hit over them (`resume_blocks`) with the windows at the directory's
    restorable boundary on the plan's worker (`restorable`; after a move the destination's
    own, as a fetch brings none: `FETCH_BRINGS_WINDOWS`). In tokens, at most the prompt less
    one token rounded down to a block (an engine never caches the prompt's last token); for a
    remote prefill all of that: its decode worker reports the KV it pulled as cached (the
    planner priced moving the whole prompt to it, `kv_to_decode`)."""
    chosen = record["chosen"]
    bs = spec.block_tokens
    cap = (prompt_tokens - 1) // bs * bs
    if chosen["action"] == "remote_prefill":
        # its decode worker pulls the prompt's KV (what it lacks) and reports it as cached,
        # as vLLM counts KV transfers: every full block short of the last token
        return cap
    blocks = int(chosen.get("reused_blocks", 0))
    if not planner_only and ResumeRule.of(spec).hybrid:
        u = unit(record, chosen["decode_worker"])  # none: it holds nothing of the prompt
        own = 0 if u is None else int(u["blocks"])
        moved = chosen["action"] in MOVES
        k = moved_windows(own, blocks, moved and FETCH_BRINGS_WINDOWS)
        blocks = resume_blocks(spec, profile, k, blocks)
    return min(blocks * bs, cap)


def outcome(record: dict[str, Any]) -> str:
    """How the plan ran, from its record: `as_planned`, `partial_fetch` (the fetch brought
    fewer blocks than planned: `fetched_blocks` GOT < PLANNED) or `fallback:REASON` (its
    hop given up: `fallback`)."""
    fb = record.get("fallback")
    if fb is not None:
        return f"fallback:{fb['reason']}"
    got = record.get("fetched_blocks")
    if got is not None and got[0] < got[1]:
        return "partial_fetch"
    return "as_planned"


def error(pred: int, got: int) -> float:
    return abs(pred - got) / got if got else (0.0 if pred == 0 else float("inf"))


PEER_CREDITS = {
    "kv_events_credit": "llm-d precise prefix / Dynamo KV router (the KV events' sealed blocks)",
    "approx_tree_credit": "sglang-router / vllm-router (approximate tree of the prompts sent)",
}
"""What the peers' prefix-aware routers would credit a request with on the worker the plan
chose: the sealed GPU blocks the worker's KV events show (llm-d's precise-prefix-cache
scorer, Dynamo's KV router: no notion of windows), or the longest prefix of the prompt's
chain the router sent that worker (SGLang's and vLLM's routers' approximate radix tree, no
word from the engine, no eviction here: their tree's default bound is far above this run)."""


def peer_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per peer crediting rule, over the requests computed where they ran on what that worker
    held (no fetch or migration: the peers move no KV; no P/D hand-over: its decode worker
    reports the prompt it pulled as cached): tokens credited, delivered, error, requests
    differing."""
    stay = [r for r in rows if r["action"] not in MOVES and r["action"] != "remote_prefill"]
    got = sum(r["delivered"] for r in stay)
    out: dict[str, Any] = {}
    for key in PEER_CREDITS:
        credit = sum(r[key] for r in stay)
        out[key] = {
            "requests": len(stay),
            "credited_tokens": credit,
            "delivered_tokens": got,
            "error": error(credit, got),
            "requests_differing": sum(1 for r in stay if r[key] != r["delivered"]),
        }
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests, tokens, |Σ predicted − Σ delivered| / Σ delivered and requests differing."""
    pred = sum(r["predicted"] for r in rows)
    got = sum(r["delivered"] for r in rows)
    priced = sum(r["planner_priced"] for r in rows)
    return {
        "requests": len(rows),
        "predicted_tokens": pred,
        "delivered_tokens": got,
        "error": error(pred, got),
        "requests_differing": sum(1 for r in rows if r["predicted"] != r["delivered"]),
        "planner_priced_tokens": priced,
        "planner_priced_error": error(priced, got),
        "planner_priced_differing": sum(1 for r in rows if r["planner_priced"] != r["delivered"]),
    }


async def run_spec(spec_name: str, model: str, sessions: int, turns: int) -> dict[str, Any]:
    spec = load_spec(spec_name)
    profile = load_profile(DEFAULT_PROFILE)  # the emulated workers' and the planner's
    bs = spec.block_tokens
    rows: list[dict[str, Any]] = []
    with emulated_workers(*workers(model, bs)) as ws:
        settings = settings_from_dict(
            {
                "server": {"port": 0, "health_interval_s": 0.5, "admin_token": ADMIN},
                "planner": {"policy": "ownerserve"},
                "models": [{"name": model, "block_size": bs}],
                "workers": [w.worker_settings() for w in ws],
            }
        )
        app = create_app(settings)
        router: Router = app.state.router
        tok = ModelTokenizer(settings.models[0])  # the router's tokenization, its own caches
        sent: dict[str, set[int]] = {}  # per worker, the blocks of every prompt sent there
        async with (
            running_app(app, "127.0.0.1", 0) as url,
            httpx.AsyncClient(base_url=url, timeout=120) as client,
        ):
            convs: list[list[dict[str, str]]] = [
                [{"role": "system", "content": f"agent {s}: " + tool_output(s, 0, 60)}]
                for s in range(sessions)
            ]
            for t in range(turns):
                for s in range(sessions):
                    msgs = convs[s]
                    msgs.append({"role": "user", "content": tool_output(s, t + 1, 20 + 10 * t)})
                    await events_applied(router, ws)
                    # what the peers' prefix-aware routers would credit, before the request
                    chain = tok.tokenize_chat(f"s{s}", msgs).chain
                    assert router.directory is not None
                    held = held_by_worker(await router.directory.lookup(chain), router.pool)
                    resp = await client.post(
                        "/v1/chat/completions",
                        json={"model": model, "messages": msgs, "max_tokens": 40},
                        headers={"x-session-id": f"s{s}"},
                    )
                    resp.raise_for_status()
                    body = resp.json()
                    msgs.append(
                        {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
                    )
                    plans = await client.get(
                        "/admin/plans", headers={"authorization": f"Bearer {ADMIN}"}
                    )
                    plans.raise_for_status()
                    record = plans.json()["plans"][-1]
                    usage = body["usage"]
                    n = int(usage["prompt_tokens"])
                    delivered = int(
                        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    )
                    worker = record["chosen"]["decode_worker"]
                    cap = (n - 1) // bs * bs
                    events_blocks = held.get(worker, {}).get(Tier.GPU, 0)
                    mine = sent.setdefault(worker, set())
                    tree_blocks = next(
                        (i for i, h in enumerate(chain) if h not in mine), len(chain)
                    )
                    mine.update(chain)
                    rows.append(
                        {
                            "session": s,
                            "turn": t,
                            "prompt_tokens": n,
                            "worker": record["chosen"]["decode_worker"],
                            "action": record["chosen"]["action"],
                            "outcome": outcome(record),
                            "predicted": predicted_tokens(record, n, spec, profile),
                            "planner_priced": predicted_tokens(
                                record, n, spec, profile, planner_only=True
                            ),
                            "delivered": delivered,
                            "chain_blocks": len(chain),
                            "kv_events_credit": min(events_blocks * bs, cap),
                            "approx_tree_credit": min(tree_blocks * bs, cap),
                            "record": {
                                k: record.get(k)
                                for k in (
                                    "chosen",
                                    "restore",
                                    "restorable",
                                    "fetched",
                                    "fetched_blocks",
                                    "fallback",
                                    "ran",
                                )
                            },
                        }
                    )
    by_action: dict[str, list[dict[str, Any]]] = {}
    by_outcome: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_action.setdefault(r["action"], []).append(r)
        by_outcome.setdefault(r["outcome"], []).append(r)
    return {
        "spec": spec_name,
        "model": model,
        "block_tokens": bs,
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        **summary(rows),
        "as_planned": summary(by_outcome.get("as_planned", [])),
        "by_action": {a: summary(rs) for a, rs in sorted(by_action.items())},
        "by_outcome": {o: summary(rs) for o, rs in sorted(by_outcome.items())},
        "peers": peer_rows(rows),
        "rows": rows,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for spec_name, model in SPECS:
        if args.specs and spec_name not in args.specs:
            continue
        res = await run_spec(spec_name, model, args.sessions, args.turns)
        planned = res["as_planned"]
        print(
            f"{spec_name:14s} requests={res['requests']} predicted={res['predicted_tokens']}"
            f" delivered={res['delivered_tokens']} error={res['error']:.4f}"
            f" differing={res['requests_differing']}"
            f" | as planned: requests={planned['requests']} error={planned['error']:.4f}"
            f" differing={planned['requests_differing']}"
            f" | planner priced: {res['planner_priced_tokens']}"
            f" error={res['planner_priced_error']:.4f}"
            f" differing={res['planner_priced_differing']}",
            flush=True,
        )
        for name, part in (*res["by_action"].items(), *res["by_outcome"].items()):
            print(
                f"  {name:28s} requests={part['requests']} predicted={part['predicted_tokens']}"
                f" delivered={part['delivered_tokens']} error={part['error']:.4f}"
                f" differing={part['requests_differing']}"
                f" | planner priced: error={part['planner_priced_error']:.4f}"
                f" differing={part['planner_priced_differing']}",
                flush=True,
            )
        for key, part in res["peers"].items():
            print(
                f"  peer {key:23s} requests={part['requests']} credited={part['credited_tokens']}"
                f" delivered={part['delivered_tokens']} error={part['error']:.4f}"
                f" differing={part['requests_differing']}",
                flush=True,
            )
        out.append(res)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--specs", nargs="*", default=None, help="only these specs (default: all)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    results = asyncio.run(main_async(args))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.out / f"heterocache_hits_{stamp}.json"
    path.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "specs": results}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
