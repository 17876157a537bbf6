"""`ownerserve worker emulate` and `python -m workers.emulator` start a real serving process."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx

from ownerserve.ports import free_port
from workers.emulator.config import add_arguments, config_from_args


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy after {timeout_s}s")


def test_ownerserve_worker_emulate_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "ownerserve", "worker", "emulate", "--role", "decode",
           "--port", str(port), "--profile", "fast-test", "--speed", "4",
           "--worker-id", "d7"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        info = httpx.get(url + "/server_info").json()
        assert info["disaggregation_mode"] == "decode" and info["worker_id"] == "d7"
        resp = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert resp.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_bad_profile_is_a_one_line_error_with_exit_code_2() -> None:
    for cmd in (
        [sys.executable, "-m", "workers.emulator", "--profile", "no-such-profile"],
        [sys.executable, "-m", "ownerserve", "worker", "emulate", "--profile", "no-such-profile"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "no-such-profile" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_kv_lease_duration_defaults_to_vllms_and_is_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).kv_lease_s == 30.0  # NixlConnector's default
    assert config_from_args(parser.parse_args(["--kv-lease-duration", "2.5"])).kv_lease_s == 2.5
