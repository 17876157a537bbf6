"""Predicted against delivered prefix hits through the router, per KV state spec: a short
multi-turn agentic load on emulated workers (real processes) serving a dense, an SWA-hybrid
and a V4-like model; per request, the prefix the plan counted on its worker against the
cached tokens the engine then reports (`usage.prompt_tokens_details.cached_tokens`).

Usage: .venv/bin/python -m bench.heterocache.hits [--sessions 6] [--turns 5] [--out bench/results]

Predicted, from the plan's record (`GET /admin/plans`): for a hybrid model the restorable
unit the directory shows on the plan's worker (`restore`, GPU tier: every KV cache group down
to that boundary), else the blocks the plan counted as reused (`reused_blocks`); in tokens,
at most the prompt less one token rounded down to a block, as an engine never caches the
prompt's last token. The router waits for each worker's KV events to be applied before the
next request, so a prediction reads what the engine published. Error per spec:
|Σ predicted − Σ delivered| / Σ delivered, and the share of requests that differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import settings_from_dict
from ownerserve.kvstate import load_spec
from router.app import create_app
from router.server import running_app
from router.state import Router

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


def predicted_tokens(record: dict[str, Any], prompt_tokens: int, bs: int) -> int:
    chosen = record["chosen"]
    worker = chosen["decode_worker"]
    restore = record.get("restore")
    if restore is not None and restore["worker"] == worker and restore["tier"] == "gpu":
        blocks = int(restore["blocks"])
    else:
        blocks = int(chosen.get("reused_blocks", 0))
    cap = (prompt_tokens - 1) // bs * bs
    return min(blocks * bs, cap)


async def run_spec(spec_name: str, model: str, sessions: int, turns: int) -> dict[str, Any]:
    spec = load_spec(spec_name)
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
                    rows.append(
                        {
                            "session": s,
                            "turn": t,
                            "prompt_tokens": n,
                            "worker": record["chosen"]["decode_worker"],
                            "action": record["chosen"]["action"],
                            "predicted": predicted_tokens(record, n, bs),
                            "delivered": delivered,
                        }
                    )
    pred = sum(r["predicted"] for r in rows)
    got = sum(r["delivered"] for r in rows)
    differ = sum(1 for r in rows if r["predicted"] != r["delivered"])
    return {
        "spec": spec_name,
        "model": model,
        "block_tokens": bs,
        "requests": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "predicted_tokens": pred,
        "delivered_tokens": got,
        "error": abs(pred - got) / got if got else (0.0 if pred == 0 else float("inf")),
        "requests_differing": differ,
        "rows": rows,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for spec_name, model in SPECS:
        res = await run_spec(spec_name, model, args.sessions, args.turns)
        print(
            f"{spec_name:14s} requests={res['requests']} predicted={res['predicted_tokens']}"
            f" delivered={res['delivered_tokens']} error={res['error']:.4f}"
            f" differing={res['requests_differing']}",
            flush=True,
        )
        out.append(res)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
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
