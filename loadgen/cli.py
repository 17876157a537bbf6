"""`ownerserve loadgen`: drive any OpenAI-compatible endpoint with agentic traffic.

ownerserve loadgen run --target http://127.0.0.1:8000 --workload agentic [--seed 1] [--out DIR]
ownerserve loadgen run --target URL --workload trace:FILE --block-tokens 32 --time-scale 0.05
ownerserve loadgen export --workload mixed --out mixed.jsonl     # as a Mooncake-format trace
ownerserve loadgen stats --trace FILE                             # the trace's prefix sharing
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
from pathlib import Path

from loadgen.client import RunOptions, RunResult, run_workload
from loadgen.report import markdown_tables, summarize, write_records, write_report
from loadgen.trace import (
    TraceError,
    TraceRequest,
    TraceScaling,
    export_trace,
    load_trace,
    prefix_sharing,
    trace_workload,
    write_trace,
)
from loadgen.workloads import GENERATORS, Workload, generate
from ownerserve.errors import ConfigError

WORKLOAD_HELP = f"{'|'.join(sorted(GENERATORS))}|trace:FILE"


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """--seed and --scale: what `loadgen.workloads.generate` takes besides the workload's name."""
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply the session count (agentic-long: the token counts)",
    )


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="agentic", help=f"{WORKLOAD_HELP} (default agentic)")
    add_generate_arguments(p)
    g = p.add_argument_group("trace replay (--workload trace:FILE)")
    g.add_argument("--trace-start", type=int, default=0, help="first row to replay")
    g.add_argument("--trace-limit", type=int, default=None, help="replay at most this many rows")
    g.add_argument("--trace-stride", type=int, default=1, help="replay every Nth row")
    g.add_argument(
        "--block-tokens", type=int, default=512, help="tokens per hash id (512 = as recorded)"
    )
    g.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    g.add_argument("--max-output", type=int, default=None, help="cap output lengths")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="loadgen_command", metavar="SUBCOMMAND")
    run = sub.add_parser("run", help="replay a workload against an endpoint and report")
    run.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    _add_workload_args(run)
    run.add_argument("--model", default="ownerserve-tiny", help="model name to request")
    run.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply start times and tool gaps"
    )
    run.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    run.add_argument("--max-inflight", type=int, default=64, help="concurrent requests (64)")
    run.add_argument("--max-sessions", type=int, default=None, help="concurrent sessions")
    run.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    run.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    run.add_argument(
        "--no-session-header", action="store_true", help="do not send x-session-id headers"
    )
    run.add_argument("--header", action="append", default=[], help="extra header NAME:VALUE")
    run.add_argument("--api-key", default=None, help="bearer token for the endpoint")
    run.add_argument("--label", default=None, help="name of this run in the report")
    run.add_argument("--out", type=Path, default=None, help="write JSON/Markdown/plots here")
    run.add_argument("--records", action="store_true", help="also write every request (JSONL)")
    run.add_argument("--no-plots", action="store_true", help="skip PNG plots")
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    exp = sub.add_parser("export", help="write a generated workload as a Mooncake-format trace")
    _add_workload_args(exp)
    exp.add_argument("--out", type=Path, required=True, help="JSONL file to write")

    st = sub.add_parser("stats", help="a trace's size and prefix-sharing ratio")
    st.add_argument("--trace", type=Path, required=True)
    st.add_argument("--block-tokens", type=int, default=512)


def _trace_scaling(args: argparse.Namespace, time_scale: float = 1.0) -> TraceScaling:
    if args.block_tokens <= 0 or args.output_scale < 0:
        raise ConfigError("--block-tokens must be > 0 and --output-scale >= 0")
    return TraceScaling(
        block_tokens=args.block_tokens,
        output_scale=args.output_scale,
        max_output=args.max_output,
        time_scale=time_scale,
    )


def _load_rows(path: str, args: argparse.Namespace) -> list[TraceRequest]:
    try:
        return load_trace(
            path, start=args.trace_start, limit=args.trace_limit, stride=args.trace_stride
        )
    except (TraceError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def build_workload(args: argparse.Namespace, time_scale: float = 1.0) -> Workload:
    """The workload named by `--workload` (time-scaled for `run`)."""
    name: str = args.workload
    if name.startswith("trace:"):
        rows = _load_rows(name[len("trace:") :], args)
        if not rows:
            raise ConfigError(f"{name}: no rows selected")
        return trace_workload(rows, _trace_scaling(args, time_scale), seed=args.seed)
    if args.scale <= 0:
        raise ConfigError("--scale must be > 0")
    try:
        w = generate(name, args.seed, args.scale)
    except ValueError as exc:
        raise ConfigError(f"--workload: {exc}") from None
    return w.scaled(time_scale) if time_scale != 1.0 else w


def _headers(raw: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for h in raw:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise ConfigError(f"--header {h!r}: expected NAME:VALUE")
        out.append((name.strip(), value.strip()))
    return tuple(out)


def normalize_target(url: str) -> str:
    """A base URL without a trailing `/v1` (requests go to `/v1/chat/completions`)."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--target {url!r}: expected an http(s) URL")
    return url.removesuffix("/v1")


def _run(args: argparse.Namespace) -> int:
    if args.time_scale < 0 or args.max_inflight < 1:
        raise ConfigError("--time-scale must be >= 0 and --max-inflight >= 1")
    workload = build_workload(args, args.time_scale)
    opts = RunOptions(
        target=normalize_target(args.target),
        model=args.model,
        max_inflight=args.max_inflight,
        max_sessions=args.max_sessions,
        duration_s=args.duration,
        request_timeout_s=args.request_timeout,
        stream=not args.no_stream,
        session_header=not args.no_session_header,
        api_key=args.api_key,
        headers=_headers(args.header),
        progress=False if args.quiet else None,
        label=args.label or workload.name,
    )
    result: RunResult = asyncio.run(run_workload(workload, opts))
    summary = summarize(result, meta={"workload_arg": args.workload, "scale": args.scale})
    print(markdown_tables([summary]))
    if summary.error_kinds:
        print(f"errors: {summary.error_kinds}", file=sys.stderr)
    if args.out is not None:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        stem = f"loadgen_{workload.name}_{stamp}"
        cmd = "ownerserve " + " ".join(sys.argv[1:]) if sys.argv else ""
        header = f"`{cmd}` — {result.started_at}, target {opts.target}"
        images: dict[str, Path] = {}
        if not args.no_plots:
            from loadgen.plots import plot_runs  # matplotlib: only when plotting

            images = plot_runs([summary], [result], args.out, stem)
        paths = write_report([summary], args.out, stem, header=header, images=images)
        if args.records:
            write_records(result, args.out / f"{stem}_requests.jsonl")
        print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0 if summary.errors == 0 else 1


def _export(args: argparse.Namespace) -> int:
    rows = export_trace(build_workload(args))
    write_trace(rows, args.out)
    print(f"wrote {len(rows)} rows to {args.out} (prefix sharing {prefix_sharing(rows):.1%})")
    return 0


def _stats(args: argparse.Namespace) -> int:
    try:
        rows = load_trace(args.trace)
    except TraceError as exc:
        raise ConfigError(str(exc)) from None
    if not rows:
        raise ConfigError(f"{args.trace}: empty trace")
    scaling = TraceScaling(block_tokens=args.block_tokens)
    span = (rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1000.0
    tokens = sum(scaling.input_tokens(r) for r in rows)
    print(
        f"{len(rows)} requests over {span:.0f} s, {tokens:,} input tokens "
        f"(block {args.block_tokens}), prefix sharing {prefix_sharing(rows, scaling):.1%}"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "loadgen_command", None)
    if cmd == "run":
        return _run(args)
    if cmd == "export":
        return _export(args)
    if cmd == "stats":
        return _stats(args)
    print("usage: ownerserve loadgen {run,export,stats} ... (see --help)", file=sys.stderr)
    return 2
