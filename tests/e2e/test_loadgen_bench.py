"""`ownerserve bench agentic` end to end on a tiny cluster: workers, the proxy, the replay, worker
metrics and the report files (one policy, no peers, so it stays short)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from loadgen.cluster import REPO_ROOT


def test_bench_agentic_runs_a_policy_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\n## Someone else's section\n\nkept\n")
    cmd = [
        sys.executable,
        "-m",
        "ownerserve",
        "bench",
        "agentic",
        "--policies",
        "ownerserve,static-pd",
        "--no-peers",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--hybrid",
        "1",
        "--profile",
        "fast-test",
        "--num-blocks",
        "20000",
        "--scale",
        "0.1",
        "--time-scale",
        "0.2",
        "--trace-limit",
        "30",
        "--out-dir",
        str(out),
        "--results-md",
        str(md),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (mixed,) = out.glob("agentic_mixed_*.json")
    (trace,) = out.glob("agentic_mooncake-trace_*.json")
    runs = json.loads(mixed.read_text())
    assert [r["label"] for r in runs] == ["ownerserve", "static-pd"]
    for r in runs + json.loads(trace.read_text()):
        assert r["errors"] == 0 and r["sessions_completed"] == r["sessions"] > 0
        c = r["cluster"]
        assert c["prefill_tokens_computed"] > 0
        assert c["duplicate_factor"] is not None and c["duplicate_factor"] >= 1.0
        assert r["actions"]  # the proxy's plan headers were read
    # static-pd moves every prefill's KV from P to D
    assert runs[1]["cluster"]["kv_bytes_pd"] > 0
    assert len(list(out.glob("*.png"))) == 4
    text = md.read_text()
    assert "kept" in text and "## Agentic benchmark, " in text
    # the section's image links resolve from the file it was appended to
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(links) == 4 and all((md.parent / link).is_file() for link in links)
    assert "| ownerserve | " in text and "goal (ownerserve)" in text
    assert len(list((tmp_path / "logs").glob("records_*.jsonl"))) == 4
