"""`ownerserve bench chaos`, a short soak: two router replicas on one Redis directory under a
small agentic load while a worker is SIGKILLed and restarted, another SIGSTOPped and resumed,
and Redis killed and restarted. Nothing may hang, no session may be lost, the dead worker must
stop being an owner within one lease, no directory entry may keep naming it, and every worker
and router must be back to idle once the load stops. The fault schedule is time-based inside
the bench (that is what it measures); the test itself only waits for the command to exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.cluster import REPO_ROOT
from workers.mooncake_store import MasterUnavailable
from workers.mooncake_store.master import find_master_binary

pytestmark = [pytest.mark.timeout(420), pytest.mark.redis]


def test_a_short_soak_under_cheap_faults_loses_nothing(redis_binary: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ownerserve", "bench", "chaos", "--duration", "50",
           "--sessions", "2", "--prefill", "0", "--decode", "1", "--hybrid", "2",
           "--faults", "worker_kill,worker_stop,redis_restart", "--repeats", "1",
           "--stop-s", "6", "--quiet", "--out-dir", str(out),
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=390)
    assert (out / "chaos_latest.json").is_file(), proc.stderr[-3000:]
    report = json.loads((out / "chaos_latest.json").read_text())
    failed = [c for c in report["checks"] if not c["ok"]]
    assert proc.returncode == 0 and report["pass"], (failed, report["findings"])

    requests, sessions = report["requests"], report["sessions"]
    assert requests["hung"] == 0 and sessions["lost"] == 0
    assert requests["completed"] > 0 and sessions["completed"] > 0
    assert sessions["started"] == sessions["completed"] + sessions["cut_at_end"]
    assert report["faults_ran"] == {"worker_kill": 1, "worker_stop": 1, "redis_restart": 1}
    (death,) = report["deaths"]
    assert death["within_bound"] and death["owner_gone_s"] <= death["bound_s"] == 10.0
    assert report["stale_entries_after_recovery"] == 0
    assert report["end_state"]["settled"]
    for gauges in report["end_state"]["end"].values():
        assert gauges is not None and not any(gauges.values()), report["end_state"]
    for name in ("A", "B"):
        memory = report["routers"]["memory"][name]
        assert memory["rss_mb_last"] > 0 and memory["sockets_last"] > 0
    assert "chaos_latest.md" in {p.name for p in out.iterdir()}
    assert "| no request hung | yes | 0 | 0 |" in (out / "chaos_latest.md").read_text()


def test_a_short_soak_with_kv_sidecars_survives_a_sidecar_and_the_store_master_dying(
    redis_binary: str, tmp_path: Path
) -> None:
    """Each emulated worker with its own sidecar on one `mooncake_master`: a sidecar SIGKILLed
    (mid-fetch when one runs) and the master SIGKILLed and restarted. Nothing hangs or is lost,
    the dead sidecar's replicas and the lost objects leave the directory within one TTL, the
    sidecars take puts again, and every sidecar is back to no fetch in flight."""
    try:
        find_master_binary()
    except MasterUnavailable as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc}")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ownerserve", "bench", "chaos", "--duration", "30",
           "--sessions", "3", "--prefill", "0", "--decode", "1", "--hybrid", "2",
           "--faults", "sidecar_kill,store_master_kill", "--repeats", "1", "--lease-s", "5",
           "--replica-ttl-s", "5", "--kv-sidecars", "store", "--quiet", "--out-dir", str(out),
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=390)
    assert (out / "chaos_latest.json").is_file(), proc.stderr[-3000:]
    report = json.loads((out / "chaos_latest.json").read_text())
    failed = [c for c in report["checks"] if not c["ok"]]
    assert proc.returncode == 0 and report["pass"], (failed, report["findings"])
    assert report["topology"]["kv_sidecars"] == "store"
    assert report["faults_ran"] == {"sidecar_kill": 1, "store_master_kill": 1}
    assert report["requests"]["hung"] == 0 and report["sessions"]["lost"] == 0
    names = {c["check"] for c in report["checks"]}
    assert {
        "a dead sidecar's replicas leave the directory within one TTL",
        "every sidecar takes puts again after the store master's restart",
        "no block the restarted master lost is still named one TTL later",
    } <= names
    kill = next(f for f in report["faults"] if f["kind"] == "sidecar_kill")
    assert kill["replicas_before"] > 0 and kill["replicas_named_past_stop_s"] <= 5.0
    master = next(f for f in report["faults"] if f["kind"] == "store_master_kill")
    assert sum(master["replica_blocks_at_kill"].values()) > 0
    assert not any(master["lost_blocks_named_after_ttl"].values())
    end = report["end_state"]["end"]
    sidecars = [k for k in end if k.startswith("sidecar ")]
    assert len(sidecars) == 3 and all(end[k] == {"fetches_in_flight": 0.0} for k in sidecars)
