"""`ownerserve bench agentic` with every worker's KV short of the load: P/D routes
queue for blocks on the decode side instead of hanging until the run's time limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadgen.cluster import REPO_ROOT


def test_pd_with_kv_short_of_the_load_completes_every_request_that_fits(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "ownerserve", "bench", "agentic", "--policies", "static-pd",
           "--no-peers", "--no-trace", "--prefill", "1", "--decode", "1", "--hybrid", "0",
           "--num-blocks", "1500", "--scale", "0.3", "--run-limit", "240", "--no-results-md",
           "--out-dir", str(tmp_path / "results"), "--log-dir", str(logs)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    records = [json.loads(line) for line in (logs / "records_mixed_static-pd.jsonl").open()]
    assert records
    failed = [r for r in records if r["status"] != 200 or r.get("error") is not None]
    # Only prompts larger than a worker's whole cache fail, at once, with a 400.
    assert all(r["status"] == 400 and "does not fit" in str(r["error"]) for r in failed), failed
    assert len(failed) < len(records) / 4
