"""Mooncake-format traces: load, scale, replay as real prompts, and export generated workloads.

A trace row is `{timestamp (ms), input_length, output_length, hash_ids}`; each hash id names one
block of `TRACE_BLOCK_TOKENS` tokens and equal ids mean a shared prefix. `trace_workload` turns
every hash id into a fixed block of synthetic text (the same text wherever the id appears), so the
trace's prefix sharing becomes real prefix sharing at the server. The chat template's own tokens
are taken out of the first and last block, so the rendered prompt has exactly the row's
(scaled) input length and block boundaries fall where the trace puts them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.text import TextFactory, template_overhead
from loadgen.workloads import Msg, Session, Step, Workload
from ownerserve.hashing import block_hash_chain, chain_root, hash_block
from ownerserve.tokenizer import ByteTokenizer, ChatTemplate, Tokenizer

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One row of a Mooncake-format trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None

    def as_row(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "timestamp": int(self.timestamp_ms)
            if float(self.timestamp_ms).is_integer()
            else self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id is not None:
            row["session_id"] = self.session_id
        return row


class TraceError(ValueError):
    """A trace file that cannot be read as a Mooncake-format trace."""


def _parse_row(row: Any, where: str) -> TraceRequest:
    if not isinstance(row, dict):
        raise TraceError(f"{where}: a row must be a JSON object")
    try:
        hash_ids = tuple(int(h) for h in row["hash_ids"])
        req = TraceRequest(
            timestamp_ms=float(row["timestamp"]),
            input_length=int(row["input_length"]),
            output_length=int(row["output_length"]),
            hash_ids=hash_ids,
            session_id=None if row.get("session_id") is None else str(row["session_id"]),
        )
    except KeyError as exc:
        raise TraceError(f"{where}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: bad value: {exc}") from None
    if req.input_length <= 0 or req.output_length < 0 or not req.hash_ids:
        raise TraceError(f"{where}: needs input_length > 0, output_length >= 0 and hash_ids")
    return req


def load_trace(
    path: str | Path, *, start: int = 0, limit: int | None = None, stride: int = 1
) -> list[TraceRequest]:
    """Rows `start, start+stride, ...` of a JSONL trace (at most `limit` of them)."""
    if stride < 1 or start < 0:
        raise ValueError("stride must be >= 1 and start >= 0")
    out: list[TraceRequest] = []
    p = Path(path)
    try:
        f = p.open()
    except OSError as exc:
        raise TraceError(f"{p}: cannot read: {exc.strerror or exc}") from None
    with f:
        index = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            i, index = index, index + 1
            if i < start or (i - start) % stride:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{p}:{lineno}: invalid JSON: {exc.msg}") from None
            out.append(_parse_row(row, f"{p}:{lineno}"))
            if limit is not None and len(out) >= limit:
                break
    return out


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for r in requests:
            f.write(json.dumps(r.as_row(), separators=(", ", ": ")) + "\n")


@dataclass(frozen=True, slots=True)
class TraceScaling:
    """How a trace is shrunk to fit a small machine.

    `block_tokens`: tokens per hash id at the server (the trace's 512, or fewer to shrink every
    prompt by the same factor); `output_scale` and `max_output`: output lengths; `time_scale`:
    multiplies timestamps (0.1 replays ten times faster)."""

    block_tokens: int = TRACE_BLOCK_TOKENS
    output_scale: float = 1.0
    max_output: int | None = None
    min_output: int = 1
    time_scale: float = 1.0

    def input_tokens(self, req: TraceRequest) -> int:
        """The row's input length after shrinking each block to `block_tokens`."""
        n = len(req.hash_ids)
        last = min(TRACE_BLOCK_TOKENS, max(1, req.input_length - (n - 1) * TRACE_BLOCK_TOKENS))
        last_scaled = max(1, round(last * self.block_tokens / TRACE_BLOCK_TOKENS))
        return (n - 1) * self.block_tokens + min(self.block_tokens, last_scaled)

    def output_tokens(self, req: TraceRequest) -> int:
        out = max(self.min_output, round(req.output_length * self.output_scale))
        return min(out, self.max_output) if self.max_output is not None else out


def block_text(tf: TextFactory, hash_id: int, block_tokens: int) -> str:
    """The fixed text of one hash id's block (its prefixes are used for cut blocks)."""
    return tf.make(f"h{hash_id}", block_tokens)


def request_content(
    req: TraceRequest, scaling: TraceScaling, tf: TextFactory, head: int, tail: int
) -> str:
    """A user message whose rendered prompt (template head + content + tail) has exactly
    `scaling.input_tokens(req)` tokens, with block i's tokens taken from hash id i's text."""
    bt = scaling.block_tokens
    total = max(scaling.input_tokens(req), head + tail + 1)
    lo, hi = head, total - tail  # the content's span in the rendered prompt
    parts: list[str] = []
    for i, hid in enumerate(req.hash_ids):
        b_lo, b_hi = max(lo, i * bt), min(hi, (i + 1) * bt)
        if b_hi <= b_lo:
            continue
        text = block_text(tf, hid, bt)
        # block 0 loses the template head: its text starts at offset 0 regardless, so the same
        # hash id always renders the same leading characters
        parts.append(text[: b_hi - b_lo])
    return "".join(parts)


def trace_workload(
    requests: Sequence[TraceRequest],
    scaling: TraceScaling | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    template: ChatTemplate | None = None,
    seed: int = 0,
    name: str = "trace",
) -> Workload:
    """Each row becomes a one-step session starting at its (scaled) timestamp."""
    scaling = scaling or TraceScaling()
    tok = tokenizer or ByteTokenizer()
    tf = TextFactory(tok, seed=seed)
    over = template_overhead(tok, template)
    t0 = requests[0].timestamp_ms if requests else 0.0
    sessions = []
    for i, req in enumerate(requests):
        content = request_content(req, scaling, tf, over.head, over.tail)
        step = Step((Msg("user", content),), scaling.output_tokens(req), 0.0, "", "trace")
        start = (req.timestamp_ms - t0) / 1000.0 * scaling.time_scale
        group = req.session_id or f"h{req.hash_ids[0]}"
        sessions.append(Session(f"{name}-{i}", round(start, 6), (step,), "trace", group))
    return Workload(name, seed, tuple(sessions))


def prefix_sharing(requests: Sequence[TraceRequest], scaling: TraceScaling | None = None) -> float:
    """Fraction of input tokens whose block was seen before in an earlier row (a prefix cache
    of unbounded size, in trace order): the hit rate an ideal single server would report."""
    scaling = scaling or TraceScaling()
    bt = scaling.block_tokens
    seen: set[int] = set()
    hit = total = 0
    for req in requests:
        n_in = scaling.input_tokens(req)
        reused = 0
        for h in req.hash_ids:
            if h not in seen:
                break
            reused += 1
        hit += min(reused * bt, n_in)
        total += n_in
        seen.update(req.hash_ids)
    return hit / total if total else 0.0


def workload_prompts(
    workload: Workload, template: ChatTemplate | None = None
) -> list[tuple[float, Session, int, str]]:
    """Every request's rendered prompt: `(planned send time, session, step index, prompt)`.

    The send time assumes zero service time (session start plus the gaps so far)."""
    tpl = template or ChatTemplate()
    out = []
    for s in workload.sessions:
        messages: list[dict[str, Any]] = []
        t = s.start_s
        for k, step in enumerate(s.steps):
            t += step.gap_s
            messages.extend(m.as_dict() for m in step.new_messages)
            out.append((t, s, k, tpl.render(messages)))
            reply = step.reply_message()
            if reply is not None:
                messages.append(reply)
    out.sort(key=lambda x: x[0])
    return out


def export_trace(
    workload: Workload,
    *,
    tokenizer: Tokenizer | None = None,
    template: ChatTemplate | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """The workload as Mooncake-format rows: blocks of the rendered prompts' tokens numbered in
    order of first appearance (chained, so equal ids mean equal prefixes)."""
    tok = tokenizer or ByteTokenizer()
    root = chain_root("loadgen-export")
    ids: dict[int, int] = {}
    rows = []
    for t, session, k, prompt in workload_prompts(workload, template):
        tokens = tok.encode(prompt)
        chain = block_hash_chain(tokens, block_tokens, root)
        if len(tokens) % block_tokens:  # the partial last block gets an id of its own
            parent = chain[-1] if chain else root
            chain.append(hash_block(parent, tokens[len(chain) * block_tokens :]))
        hash_ids = tuple(ids.setdefault(h, len(ids)) for h in chain)
        rows.append(
            TraceRequest(
                timestamp_ms=round(t * 1000.0),
                input_length=len(tokens),
                output_length=session.steps[k].max_tokens,
                hash_ids=hash_ids,
                session_id=session.session_id,
            )
        )
    return rows
