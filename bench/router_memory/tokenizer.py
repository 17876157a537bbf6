"""Where a router's memory grows under the chaos bench's agent sessions: the request path's
tokenize stage (`router/tokens.py` `ModelTokenizer`, each turn of each session, its
messages as the client sends them) run in-process under tracemalloc, snapshots diffed
between the first and last quarter of the sessions, the top lines by bytes gained; with
the caches bounded only by count (as before `server.tokenizer_cache_mib`) and by bytes.

    .venv/bin/python -m bench.router_memory.tokenizer [--sessions 1400] [--mib 32]

1,400 sessions is what each replica of a 10-minute `ownerserve bench chaos` run serves.
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc
from typing import Any

from loadgen.chaos.load import chaos_params
from loadgen.workloads import agentic
from ownerserve.config import ModelSettings
from router.tokens import ModelTokenizer


def sessions_messages(n: int, seed: int = 0) -> list[list[list[dict[str, Any]]]]:
    """Each session's prompts, turn by turn, as the chaos load sends them."""
    out: list[list[list[dict[str, Any]]]] = []
    batch = 0
    while len(out) < n:
        for s in agentic(chaos_params(), seed=seed + batch).sessions:
            messages: list[dict[str, Any]] = []
            turns = []
            for step in s.steps:
                messages.extend(m.as_dict() for m in step.new_messages)
                turns.append(list(messages))
                reply = step.reply_message()
                if reply is not None:
                    messages.append(reply)
            out.append(turns)
        batch += 1
    return out[:n]


def run(sessions: int, max_bytes: int, label: str, top: int) -> None:
    work = sessions_messages(sessions)
    mt = ModelTokenizer(ModelSettings(name="chaos", block_size=16), max_bytes=max_bytes)
    quarter = sessions // 4
    tracemalloc.start(1)
    first = None
    for i, turns in enumerate(work):
        if i == quarter:
            gc.collect()
            first = tracemalloc.take_snapshot()
        for messages in turns:
            mt.tokenize_chat(f"sess-{i}", messages)
    gc.collect()
    last = tracemalloc.take_snapshot()
    tracemalloc.stop()
    assert first is not None
    diff = last.compare_to(first, "lineno")
    gained = sum(d.size_diff for d in diff)
    stats = mt.cache_stats()
    per = gained / max(1, sessions - quarter) / 1024
    print(
        f"## {label}: {sessions} sessions, heap +{gained / 2**20:.1f} MiB over the last "
        f"{sessions - quarter} ({per:.1f} KiB a session)\n"
    )
    print(f"caches: {stats}\n")
    print("| bytes gained | allocated at |")
    print("| ---: | --- |")
    for d in diff[:top]:
        frame = d.traceback[0]
        print(
            f"| {d.size_diff / 2**20:+.2f} MiB | {frame.filename.split('/work/main/')[-1]}:"
            f"{frame.lineno} |"
        )
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=1400)
    ap.add_argument("--mib", type=int, default=32, help="the byte bound's MiB (the chaos run's)")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    run(args.sessions, 1 << 50, "bounded by count only (8,192 sessions, 65,536 messages)", args.top)
    run(args.sessions, args.mib * 2**20, f"bounded by bytes too ({args.mib} MiB)", args.top)


if __name__ == "__main__":
    main()
