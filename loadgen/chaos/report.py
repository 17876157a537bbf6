"""The chaos bench's report: what the load saw (requests by outcome, sessions completed or lost),
what each fault did, what the directory kept naming each dead worker and for how long, whether
the workers and routers went back to idle, and the replicas' memory and sockets; as JSON
(`chaos_latest.json` and a dated copy) and a readable Markdown table (`chaos_latest.md`)."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadgen.chaos.load import CLEAN, Attempt, LoadResult
from loadgen.chaos.schedule import ScheduledFault, slope_per_min

if TYPE_CHECKING:
    from loadgen.chaos.run import ChaosPlan, Death, FaultRecord

WINDOW_BEFORE_S = 0.5
WINDOW_AFTER_S = 5.0
"""A failed request is put down to a fault when it overlaps the fault's time widened by these
(the routers need a health probe or two to notice a death)."""


def _fault_of(a: Attempt, records: Sequence[FaultRecord]) -> str:
    end = a.sent_s + a.e2e_s
    for r in records:
        if a.sent_s <= r.ended_s + WINDOW_AFTER_S and end >= r.started_s - WINDOW_BEFORE_S:
            return r.fault.kind
    return "none"


def _requests(attempts: Sequence[Attempt], records: Sequence[FaultRecord]) -> dict[str, Any]:
    outcomes = Counter(a.outcome for a in attempts)
    statuses = Counter(str(a.status) for a in attempts if a.outcome == "status")
    by_fault: dict[str, Counter[str]] = {}
    status_by_fault: dict[str, Counter[str]] = {}
    for a in attempts:
        if a.ok:
            continue
        kind = _fault_of(a, records)
        by_fault.setdefault(kind, Counter())[a.outcome] += 1
        if a.outcome == "status":
            status_by_fault.setdefault(kind, Counter())[str(a.status)] += 1
    return {
        "sent": len(attempts),
        "completed": outcomes["ok"],
        "failed_clean": sum(outcomes[o] for o in CLEAN),
        "failed_connect": outcomes["connect"],
        "failed_transport": outcomes["transport"],
        "truncated": outcomes["truncated"],
        "bad": outcomes["bad"],
        "hung": outcomes["hung"],
        "streamed": sum(1 for a in attempts if a.stream),
        "by_outcome": dict(outcomes),
        "by_status": dict(statuses),
        "failed_by_fault": {k: dict(v) for k, v in sorted(by_fault.items())},
        "status_by_fault": {k: dict(v) for k, v in sorted(status_by_fault.items())},
        "examples": {
            o: next(a.as_dict() for a in attempts if a.outcome == o)
            for o in sorted(outcomes)
            if o != "ok"
        },
    }


FETCH_ACTIONS = ("artifact_fetch", "state_migration")
"""Plans that move a prefix between workers (through their sidecars, when they have them)."""


def _kv_fetches(attempts: Sequence[Attempt], records: Sequence[FaultRecord]) -> dict[str, Any]:
    """The answered requests whose plan fetched a prefix: how many, how many found their fetch
    cut (`fetched=0`: recomputed instead) or ran something else (`fallback=`, shown in the plan
    header), overall and by the fault whose window they overlap."""

    def tally(group: Sequence[Attempt]) -> dict[str, int]:
        plans = [a.plan_fields() for a in group]
        fetches = [p for p in plans if p.get("action") in FETCH_ACTIONS]
        return {
            "plans": len(fetches),
            "fetched": sum(1 for p in fetches if p.get("fetched") == "1"),
            "cut_recomputed": sum(1 for p in fetches if p.get("fetched") == "0"),
            "fallback": sum(1 for p in fetches if "fallback" in p),
        }

    answered = [a for a in attempts if a.ok]
    by_fault: dict[str, list[Attempt]] = {}
    for a in answered:
        by_fault.setdefault(_fault_of(a, records), []).append(a)
    return {
        **tally(answered),
        "by_fault": {k: tally(v) for k, v in sorted(by_fault.items())},
    }


def _sidecar_checks(plan: ChaosPlan, records: Sequence[FaultRecord]) -> list[dict[str, Any]]:
    """The checks of the KV-store faults that ran: a dead sidecar's replicas and a restarted
    master's lost objects out of the directory within one replica TTL, puts taken again."""
    kills = [r for r in records if r.fault.kind == "sidecar_kill"]
    masters = [r for r in records if r.fault.kind == "store_master_kill"]
    out = []
    if kills:
        named = [r.detail.get("replicas_named_past_stop_s") for r in kills]
        gone = [r.detail.get("replicas_gone_s") for r in kills]
        never = any(g is None for g in gone) or any(n is None for n in named)
        out.append(
            _check(
                "a dead sidecar's replicas leave the directory within one TTL",
                not never and all(n is not None and n <= plan.replica_ttl_s for n in named),
                "max "
                + ("never" if never else f"{max(n for n in named if n is not None):.1f} s")
                + " past its stop",
                f"{plan.replica_ttl_s:g} s",
            )
        )
    if masters:
        resumed = [r.detail.get("puts_resumed_s") for r in masters]
        never = any(x is None for x in resumed)
        out.append(
            _check(
                "every sidecar takes puts again after the store master's restart",
                not never,
                "never"
                if never
                else f"max {max(x for x in resumed if x is not None):.1f} s after its start",
                "60 s",
            )
        )
        counts = [r.detail.get("lost_blocks_named_after_ttl") or {} for r in masters]
        stale = sum(n or 0 for c in counts for n in c.values())
        unread = sorted({w for c in counts for w, n in c.items() if n is None})
        out.append(
            _check(
                "no block the restarted master lost is still named one TTL later",
                stale == 0 and not unread,
                f"{stale}" + (f" (not read: {', '.join(unread)})" if unread else ""),
                "0",
            )
        )
    return out


def _replica_memory(samples: Sequence[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in sorted({s["replica"] for s in samples}):
        mine = [s for s in samples if s["replica"] == name]
        last_gen = max(s["generation"] for s in mine)
        life = [s for s in mine if s["generation"] == last_gen]
        half = [s for s in life if s["t_s"] >= duration_s / 2]
        out[name] = {
            "restarts": last_gen - 1,
            "rss_mb_first": mine[0]["rss_mb"],
            "rss_mb_last": mine[-1]["rss_mb"],
            "rss_mb_max": max(s["rss_mb"] for s in mine),
            "sockets_first": mine[0]["sockets"],
            "sockets_last": mine[-1]["sockets"],
            "sockets_max": max(s["sockets"] for s in mine),
            "slope_mb_per_min": _round(slope_per_min([(s["t_s"], s["rss_mb"]) for s in life])),
            "slope_mb_per_min_second_half": _round(
                slope_per_min([(s["t_s"], s["rss_mb"]) for s in half])
            ),
            "slope_over_s": round(life[-1]["t_s"] - life[0]["t_s"], 1) if life else 0.0,
        }
    return out


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def build_report(
    *,
    plan: ChaosPlan,
    command: str,
    schedule: Sequence[ScheduledFault],
    skipped: dict[str, str],
    result: LoadResult,
    records: Sequence[FaultRecord],
    deaths: Sequence[Death],
    baseline: dict[str, dict[str, float] | None],
    end_gauges: dict[str, dict[str, float] | None],
    settle_s: float | None,
    stale_leases: dict[str, int],
    samples: Sequence[dict[str, Any]],
    start_stats: dict[str, dict[str, Any] | None],
    end_stats: dict[str, dict[str, Any] | None],
    router_counters: dict[str, dict[str, float] | None],
    workers: dict[str, str],
    redis_slow: dict[str, Any],
    notes: Sequence[str],
) -> dict[str, Any]:
    """Everything one run found, as JSON-ready data, with its checks and verdict."""
    requests = _requests(result.attempts, records)
    sessions = Counter(s.state for s in result.sessions)
    ran = Counter(r.fault.kind for r in records)
    planned = Counter(f.kind for f in schedule)
    deaths_out = [
        {
            "worker": d.worker,
            "fault": d.fault,
            "killed_s": round(d.killed_s, 2),
            "owner_gone_s": _round(d.owner_gone_s, 2),
            "bound_s": plan.lease_s,
            "within_bound": d.owner_gone_s is not None and d.owner_gone_s <= plan.lease_s,
            "named_at_kill": d.named_at_kill.as_dict(),
            "named_at_restart": d.named_at_restart.as_dict(),
        }
        for d in deaths
    ]
    stale_at_restart = sum(d.named_at_restart.total for d in deaths)
    stale_total = stale_at_restart + sum(stale_leases.values())
    gone = [d.owner_gone_s for d in deaths if d.owner_gone_s is not None]
    never = len(gone) < len(deaths)
    settled = settle_s is not None
    checks = [
        _check("no request hung", requests["hung"] == 0, requests["hung"], "0"),
        _check("no session lost", sessions["lost"] == 0, sessions["lost"], "0"),
        _check(
            "a dead worker is no owner within one lease",
            all(d["within_bound"] for d in deaths_out),
            "max " + ("never" if never else f"{max(gone, default=0.0):.1f} s"),
            f"{plan.lease_s:g} s",
        ),
        _check("no stale directory entry after recovery", stale_total == 0, stale_total, "0"),
        _check(
            "workers and routers back to idle (no KV or lease held)",
            settled,
            "never" if settle_s is None else f"after {settle_s:.1f} s",
            f"{plan.settle_s:g} s",
        ),
        _check(
            "every planned fault ran",
            all(ran[k] >= n for k, n in planned.items()),
            ", ".join(f"{k} {ran[k]}/{n}" for k, n in sorted(planned.items())),
            f"{plan.repeats} each",
        ),
        _check(
            "no fault failed to apply",
            not any("the fault failed" in p for r in records for p in r.problems),
            sum(1 for r in records for p in r.problems if "the fault failed" in p),
            "0",
        ),
        *_sidecar_checks(plan, records),
    ]
    unexplained = sum(requests["failed_by_fault"].get("none", {}).values())
    findings = [p for r in records for p in r.problems]
    if unexplained:
        findings.append(
            f"{unexplained} failed requests overlapped no fault's window: "
            f"{requests['failed_by_fault']['none']}"
        )
    for kind, statuses in requests["status_by_fault"].items():
        fives = {s: n for s, n in statuses.items() if s.startswith("5")}
        if fives:
            findings.append(f"5xx answers around {kind}: {fives}")
    worst = _worst_stall_ms(redis_slow)
    if worst >= 1000:
        findings.append(
            f"Redis stalled {worst} ms on one command: past the replicas' Redis socket timeout "
            "(1 s), so their directory calls failed over to the local view meanwhile"
        )
    unclean = requests["failed_transport"] + requests["truncated"] + requests["bad"]
    if unclean:
        findings.append(
            f"{unclean} requests failed without a clean error (transport "
            f"{requests['failed_transport']}, truncated {requests['truncated']}, bad "
            f"{requests['bad']}): {requests['failed_by_fault']}"
        )
    return {
        "command": command,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "topology": {
            "workers": workers,
            "routers": 2,
            "redis": "redis-server, append-only file (a restart keeps the dataset)",
            "profile": plan.profile,
            "speed": plan.speed,
            "lease_s": plan.lease_s,
            "kv_sidecars": plan.sidecar_mode(),
            "replica_ttl_s": plan.replica_ttl_s,
        },
        "load": {
            "duration_s": plan.duration_s,
            "wall_s": round(result.wall_s, 1),
            "concurrent_sessions": plan.sessions,
            "seed": plan.seed,
            "stream_share": plan.stream_share,
            "hang_s": plan.hang_s,
            "recover_s": plan.recover_s,
        },
        "requests": requests,
        "kv_fetches": _kv_fetches(result.attempts, records),
        "sessions": {
            "started": len(result.sessions),
            "completed": sessions["completed"],
            "lost": sessions["lost"],
            "cut_at_end": sessions["cut"],
            "lost_detail": [
                {"session": s.session_id, "error": s.error}
                for s in result.sessions
                if s.state == "lost"
            ],
        },
        "faults": [r.as_dict() for r in records],
        "faults_ran": dict(ran),
        "faults_not_reached": [
            {"kind": f.kind, "target": f.target, "planned_s": f.at_s}
            for f in schedule[len(records) :]
        ],
        "faults_skipped": skipped,
        "deaths": deaths_out,
        "stale_entries_after_recovery": stale_total,
        "stale_leases_at_end": stale_leases,
        "end_state": {
            "settled": settled,
            "settle_s": _round(settle_s, 2),
            "baseline": baseline,
            "end": end_gauges,
        },
        "routers": {
            "start": start_stats,
            "end": end_stats,
            "memory": _replica_memory(samples, plan.duration_s),
            "counters": router_counters,
        },
        "redis_stalls": redis_slow,
        "samples": list(samples),
        "checks": checks,
        "findings": findings,
        "notes": list(notes),
        "pass": all(c["ok"] for c in checks),
    }


def _worst_stall_ms(redis_slow: dict[str, Any]) -> int:
    """The longest stall the Redis latency monitor saw (ms; 0 when none or unread)."""
    events = redis_slow.get("latency_events") or {}
    latest = events.get("latest", []) if isinstance(events, dict) else events
    return max((int(e[3]) for e in latest), default=0)


def _check(name: str, ok: bool, value: object, bound: str) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "value": value, "bound": bound}


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: the checks, then the numbers behind them."""
    rq, ss, load = report["requests"], report["sessions"], report["load"]
    lines = [
        f"## Chaos run {report['date']}: {'PASS' if report['pass'] else 'FAIL'}",
        "",
        f"Command: `{report['command']}`  ",
        f"Load: {load['concurrent_sessions']} concurrent sessions for {load['duration_s']:g} s "
        f"(wall {load['wall_s']:g} s) over {report['topology']['routers']} router replicas "
        f"sharing one Redis directory, workers "
        + ", ".join(f"{w} ({role})" for w, role in report["topology"]["workers"].items())
        + f", lease "
        f"{report['topology']['lease_s']:g} s"
        + (
            f", KV sidecars: {report['topology']['kv_sidecars']}."
            if report["topology"].get("kv_sidecars", "off") != "off"
            else "."
        ),
        "",
        "| check | ok | value | bound |",
        "| --- | --- | --- | --- |",
        *(
            f"| {c['check']} | {'yes' if c['ok'] else '**no**'} | {c['value']} | {c['bound']} |"
            for c in report["checks"]
        ),
        "",
        "| requests | sent | completed | failed (clean) | no connection | transport | "
        "truncated | hung |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| | {rq['sent']} | {rq['completed']} | {rq['failed_clean']} | {rq['failed_connect']} "
        f"| {rq['failed_transport']} | {rq['truncated']} | {rq['hung']} |",
        "",
        "| sessions | started | completed | lost | cut at the end |",
        "| --- | --- | --- | --- | --- |",
        f"| | {ss['started']} | {ss['completed']} | {ss['lost']} | {ss['cut_at_end']} |",
        "",
        *_fetch_lines(report),
        "| fault | target | at s | took s | what happened | problems |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in report["faults"]:
        detail = {
            k: v
            for k, v in f.items()
            if k not in ("kind", "target", "planned_s", "started_s", "ended_s", "problems")
        }
        lines.append(
            f"| {f['kind']} | {f['target']} | {f['started_s']:.0f} | "
            f"{f['ended_s'] - f['started_s']:.1f} | {_short(detail)} | "
            f"{'; '.join(f['problems']) or '-'} |"
        )
    for kind, why in report["faults_skipped"].items():
        lines.append(f"| {kind} | - | - | - | skipped: {why} | - |")
    lines += [
        "",
        "| replica | restarts | RSS first → last MB | max MB | slope MB/min (2nd half) | "
        "sockets first → last (max) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in report["routers"]["memory"].items():
        lines.append(
            f"| {name} | {m['restarts']} | {m['rss_mb_first']:.1f} → {m['rss_mb_last']:.1f} | "
            f"{m['rss_mb_max']:.1f} | {_num(m['slope_mb_per_min'])} "
            f"({_num(m['slope_mb_per_min_second_half'])}) | "
            f"{m['sockets_first']} → {m['sockets_last']} ({m['sockets_max']}) |"
        )
    worst = _worst_stall_ms(report.get("redis_stalls") or {})
    lines += ["", f"Redis: longest stall {worst} ms (latency monitor, since its last restart)."]
    if report["findings"]:
        lines += ["", "Findings:", *(f"- {x}" for x in report["findings"])]
    if report["notes"]:
        lines += ["", "Notes:", *(f"- {x}" for x in report["notes"])]
    return "\n".join(lines) + "\n"


def _fetch_lines(report: dict[str, Any]) -> list[str]:
    kv = report.get("kv_fetches")
    if not kv:
        return []
    lines = [
        "| fetch plans (answered) | plans | fetched | cut: recomputed | ran a fallback |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, t in [("all", kv), *kv["by_fault"].items()]:
        lines.append(
            f"| {name} | {t['plans']} | {t['fetched']} | {t['cut_recomputed']} | {t['fallback']} |"
        )
    return [*lines, ""]


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3f}"


def _short(detail: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in detail.items()).replace("|", "/")


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """`chaos_latest.json` (and a dated copy) and `chaos_latest.md` in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2, default=str)
    stamp = report["date"].replace(":", "").replace("-", "").replace("+0000", "Z")
    latest = out_dir / "chaos_latest.json"
    latest.write_text(text)
    (out_dir / f"chaos_{stamp}.json").write_text(text)
    md = out_dir / "chaos_latest.md"
    md.write_text(markdown(report))
    return latest, md
