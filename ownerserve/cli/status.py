"""`ownerserve status --url URL`: a running router's state on one screen — its workers' health,
load, KV fill and the working set admission decides by, the admission queue, the mix of the
recent plans, the sessions holding the most KV — read from its admin API (`GET /admin/status`);
`--json` prints that answer. An unreachable router or a refused token is one line on stderr and
exit status 2."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any
from urllib.parse import urlparse

import httpx
import orjson

DEFAULT_URL = "http://127.0.0.1:8000"
TOKEN_ENV = "OWNERSERVE_SERVER__ADMIN_TOKEN"
"""Where the token comes from without `--admin-token`: the variable that sets `server.admin_token`
for `ownerserve serve`."""
WIDTH = 100
"""The screen's columns: no line is longer."""


class StatusError(Exception):
    """Why there is no status to show, in one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"the router's base URL (default {DEFAULT_URL})"
    )
    parser.add_argument(
        "--admin-token",
        help=f"the router's server.admin_token (default: ${TOKEN_ENV}, as `serve` reads it)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the router's GET /admin/status answer as JSON"
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the router (default 5)"
    )


def run(args: argparse.Namespace) -> int:
    token = args.admin_token or os.environ.get(TOKEN_ENV)
    try:
        status = fetch(args.url, token, args.timeout)
    except StatusError as exc:
        print(f"ownerserve status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(status, args.url.rstrip("/")))
    return 0


def fetch(url: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """`GET {url}/admin/status` with the admin token; `StatusError` when the router cannot be
    reached, refuses the token or answers something else."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise StatusError(f"not an http(s) URL: {url!r}")
    if not token:
        raise StatusError(f"no admin token: pass --admin-token or set {TOKEN_ENV}")
    base = url.rstrip("/")
    try:
        resp = httpx.get(
            f"{base}/admin/status",
            headers={"authorization": f"Bearer {token}"},
            timeout=timeout_s,
        )
    except (httpx.HTTPError, OSError) as exc:
        raise StatusError(f"cannot reach the router at {base}: {_one_line(exc)}") from None
    if resp.status_code == 401:
        raise StatusError(f"the router at {base} refused the admin token: {_message(resp)}")
    if resp.status_code == 404:
        raise StatusError(f"{base} has no /admin/status: not an OwnerServe router, or an older one")
    if resp.status_code != 200:
        raise StatusError(f"the router at {base} answered {resp.status_code}: {_message(resp)}")
    try:
        body = orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        raise StatusError(f"the router at {base} answered something not JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
        raise StatusError(f"the router at {base} answered no status")
    return body


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


def _message(resp: httpx.Response) -> str:
    """The error message of an OpenAI-shaped error body, else its first words."""
    try:
        body = orjson.loads(resp.content)
        message = body["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = resp.text
    return " ".join(str(message).split())[:200] or "(no message)"


# --- the screen ------------------------------------------------------------------------------


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _tokens(n: int) -> str:
    if n < 1000:
        return str(n)
    if n < 1_000_000:
        return f"{n / 1e3:.1f}K"
    return f"{n / 1e6:.1f}M"


def _pct(share: float) -> str:
    return f"{share * 100:.0f}%"


def _state(w: dict[str, Any]) -> str:
    """`up`/`down`, then what keeps it from new work: draining, its breaker, admission."""
    words = ["up" if w["healthy"] else "down"]
    if w["draining"]:
        words.append("draining")
    if w["breaker"] != "closed":
        words.append(w["breaker"].replace("_", "-"))
    a = w["admission"]
    if a["paused"]:
        words.append("paused")
    if a["closed"]:
        words.append("closed")
    return ",".join(words)


_ROW = "{:<12} {:<7} {:<16} {:>4} {:>4} {:>5} {:>6} {:>13} {:>4} {:>9} {:>6}"
_HEADER = _ROW.format(
    "worker", "role", "state", "run", "wait", "kv", "admit", "ws/budget", "sess", "cal p/d", "nic_s"
)


def _row(w: dict[str, Any]) -> str:
    a = w["admission"]
    cal = w["calibration"]
    return _ROW.format(
        _cut(w["id"], 12),
        _cut(w["role"], 7),
        _cut(_state(w), 16),
        w["running"],
        w["waiting"],
        _pct(w["kv_usage"]),
        _pct(a["kv_usage"]),
        f"{_tokens(a['working_set_tokens'])}/{_tokens(a['budget_tokens'])}",
        a["sessions"],
        "-" if cal is None else _cut(f"{cal['prefill']:.1f}/{cal['decode']:.1f}", 9),
        f"{w['nic_backlog_s']:.2f}",
    )


def _mix(counts: dict[str, int], total: int) -> str:
    return " · ".join(f"{k} {n} ({n * 100 // max(total, 1)}%)" for k, n in counts.items())


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="    ", break_on_hyphens=False)


def render(status: dict[str, Any], url: str) -> str:
    """The status as plain text, no line over `WIDTH` columns."""
    workers = status["workers"]
    up = sum(1 for w in workers if w["healthy"] and not w["draining"])
    lines = _wrapped(f"OwnerServe router at {url} · policy {status['policy']}")
    lines += _wrapped(
        f"{len(workers)} workers, {up} taking requests · "
        f"{status['requests_in_flight']} requests in flight"
    )
    d = status.get("directory")
    if d is not None:
        health = "healthy" if d["healthy"] else f"UNHEALTHY {d.get('detail') or ''}".rstrip()
        lines += _wrapped(f"directory {d['backend']}: {health}")
    a = status["admission"]
    if a["enabled"]:
        full = "yes" if a["cluster_full"] else "no"
        lines += _wrapped(
            f"admission on: {a['queued']} queued (max {a['max_queued']}) · a worker pauses at "
            f"{_pct(a['high_watermark'])} KV, resumes below {_pct(a['low_watermark'])} · "
            f"cluster full: {full}"
        )
    else:
        lines.append("admission off")
    lines.append("")
    if workers:
        lines.append(_HEADER)
        lines += [_row(w) for w in workers]
        lines.append(
            "  kv: the worker's KV pool in use as it reports it · admit: as admission counts it "
            "(the router's"
        )
        lines.append(
            "  requests since) · ws/budget: the sessions' working set against KV pool + CPU tier"
        )
    else:
        lines.append("no workers")
    lines.append("")
    p = status["plans"]
    total = p["recent"]
    if total:
        lines += _wrapped(f"last {total} plans: {_mix(p['actions'], total)}")
        lines += _wrapped(f"  classes: {_mix(p['classes'], total)}")
        lines += _wrapped(
            f"  policies: {_mix(p['policies'], total)} · fell back {p['fallbacks']} · "
            f"continued a moved answer {p['migrated']}"
        )
    else:
        lines.append("no plans yet")
    top = status["top_sessions"]
    if top:
        held = " · ".join(
            f"{_cut(s['session'], 24)} on {_cut(s['worker'], 12)} {_tokens(s['tokens'])}"
            for s in top
        )
        lines += _wrapped(f"sessions holding the most KV: {held}")
    return "\n".join(lines)
