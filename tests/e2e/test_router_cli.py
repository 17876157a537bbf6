"""`ownerserve serve --config FILE` as a process: serves the cluster in the file, stops cleanly
on SIGTERM; a bad config is a one-line error with exit code 2."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.ports import free_port
from tests.e2e.router_cluster import MODEL, REPO
from tests.waiting import until_sync

pytestmark = pytest.mark.timeout(120)


def test_serve_runs_the_config_and_stops_on_sigterm(tmp_path: Path):
    with emulated_workers(EmulatedWorker("h0", "hybrid", speed=50)) as (h0,):
        port = free_port()
        config = tmp_path / "cluster.yaml"
        config.write_text(
            f"server: {{host: 127.0.0.1, port: {port}}}\n"
            f"models: [{{name: {MODEL}}}]\n"
            f"workers:\n  - {{id: h0, url: '{h0.url}', role: hybrid, kind: emulator}}\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "ownerserve", "serve", "--config", str(config)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"

            def serving() -> bool:
                assert proc.poll() is None, f"ownerserve serve exited {proc.returncode}"
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(url + "/health", timeout=1).status_code == 200
                return False

            until_sync(serving, timeout_s=60, what="the router serving /health")
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            assert resp.status_code == 200
            assert "d=h0" in resp.headers["x-ownerserve-plan"]
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err.decode()
        assert b"serving the OpenAI API" in out
        # the request's log line, at INFO though the rest logs at WARNING (the default)
        rid = resp.headers["x-request-id"]
        assert f"INFO:ownerserve.requests:rid={rid} ".encode() in err, err.decode()


def test_serve_with_a_bad_config_is_a_one_line_error(tmp_path: Path):
    config = tmp_path / "bad.yaml"
    config.write_text("server: {port: 99999999}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ownerserve", "serve", "--config", str(config)],
        cwd=REPO, capture_output=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    err = proc.stderr.decode().strip()
    assert err.count("\n") == 0 and "server.port" in err
