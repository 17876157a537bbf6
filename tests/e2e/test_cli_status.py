"""`ownerserve status` as an operator runs it (a child process) against the real router over
HTTP, in front of emulated workers (real processes): the workers with their health once one is
drained, the recent plans and the session holding KV, `--json`, and one line with exit status
2 when the token is refused or the router cannot be reached."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import orjson
import pytest

from loadgen.cluster import MODEL, EmulatedWorker
from ownerserve.ports import free_port
from tests.e2e.router_cluster import REPO, proxy_client, router_settings, workers_fixture

pytestmark = pytest.mark.timeout(120)

workers = workers_fixture(
    lambda: (EmulatedWorker("h0", "hybrid", speed=20), EmulatedWorker("h1", "hybrid", speed=20))
)

TOKEN = "adm-token"
# a session stays in its worker's working set through the whole test (its keep: 2 x 60 s)
RETENTION = {"retention_prior_gap_s": 60.0, "retention_max_gap_s": 120.0}


async def status(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`python -m ownerserve status ARGS` without blocking the router's event loop (it runs in
    this one): (exit status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ownerserve", "status", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def row(text: str, worker: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.split()[:1] == [worker]]
    return line.split()


async def test_status_shows_the_workers_health_after_one_is_drained(workers: Any) -> None:
    settings = router_settings(workers, server={"admin_token": TOKEN}, planner=RETENTION)
    async with proxy_client(settings) as (client, _):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}]}
        answer = await client.post(
            "/v1/chat/completions",
            json={**body, "max_tokens": 4},
            headers={"x-session-id": "ops-session"},
        )
        assert answer.status_code == 200
        drained = await client.post(
            "/admin/workers/h1/drain", headers={"authorization": f"Bearer {TOKEN}"}
        )
        assert drained.status_code == 200
        url = str(client.base_url)
        rc, text, err = await status("--url", url, "--admin-token", TOKEN)
        rc_json, as_json, err_json = await status(
            "--url", url, "--json", env={"OWNERSERVE_SERVER__ADMIN_TOKEN": TOKEN}
        )
    assert (rc, err) == (0, "")
    assert all(len(line) <= 100 for line in text.splitlines())
    h0, h1 = row(text, "h0"), row(text, "h1")
    assert h0[1:3] == ["hybrid", "up"]
    assert h1[1:3] == ["hybrid", "up,draining"]
    assert "2 workers, 1 taking requests" in text
    assert "last 1 plans:" in text
    assert "ops-session on" in text

    assert (rc_json, err_json) == (0, "")
    got = orjson.loads(as_json)
    by_id = {w["id"]: w for w in got["workers"]}
    assert set(by_id) == {"h0", "h1"}
    assert (by_id["h0"]["healthy"], by_id["h0"]["draining"]) == (True, False)
    assert (by_id["h1"]["healthy"], by_id["h1"]["draining"]) == (True, True)
    assert got["plans"]["recent"] == 1 and sum(got["plans"]["actions"].values()) == 1
    (top,) = got["top_sessions"]
    assert top["session"] == "ops-session" and top["tokens"] > 0
    home = by_id[top["worker"]]["admission"]
    assert home["working_set_tokens"] >= top["tokens"] and home["sessions"] == 1
    assert got["admission"]["enabled"] and got["admission"]["queued"] == 0
    assert got["requests_in_flight"] == 0


async def test_a_refused_token_is_one_line_and_exit_status_2(workers: Any) -> None:
    settings = router_settings(workers, server={"admin_token": TOKEN})
    async with proxy_client(settings) as (client, _):
        rc, out, err = await status("--url", str(client.base_url), "--admin-token", "wrong")
    assert (rc, out) == (2, "")
    assert len(err.splitlines()) == 1
    assert "refused the admin token" in err and "Traceback" not in err


def test_an_unreachable_router_is_one_line_and_exit_status_2() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "ownerserve", "status", "--url", url, "--admin-token", TOKEN],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.startswith(f"ownerserve status: cannot reach the router at {url}: ")
    assert len(proc.stderr.splitlines()) == 1


def test_help_names_the_options() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ownerserve", "status", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0
    for option in ("--url", "--admin-token", "--json", "--timeout"):
        assert option in proc.stdout
    assert "OWNERSERVE_SERVER__ADMIN_TOKEN" in proc.stdout
