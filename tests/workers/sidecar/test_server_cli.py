"""`ownerserve worker sidecar` on the command line, and how `--transport` is resolved."""

from __future__ import annotations

import socket
import subprocess
import sys
import types

import pytest

from workers.sidecar import transports
from workers.sidecar.cli import _size
from workers.sidecar.transports import TCP, TransportUnavailable, select_transport


def test_help_lists_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ownerserve", "worker", "sidecar", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--worker-id", "--port", "--store-dir", "--memory-bytes", "--ssd-bytes", "--directory",
        "--transfer-port", "--transport", "--advertise-url", "--clear-ssd", "--probe-store-out",
    ):  # fmt: skip
        assert flag in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--worker-id", "a", "--directory", "postgres://x"], "redis://"),
        (["--worker-id", "a/b"], "--worker-id: expected a letter or digit"),
        (["--worker-id", "a", "--probe-store-out", "m.yaml"], "--probe-store-out needs --store"),
    ],
)
def test_bad_flags_exit_2_with_a_message(tmp_path: object, flags: list[str], message: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ownerserve", "worker", "sidecar", "--store-dir", str(tmp_path),
         *flags],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert run.returncode == 2 and message in run.stderr


def test_sizes() -> None:
    assert _size("0") == 0
    assert _size("2G") == 2 << 30
    assert _size("512MiB") == 512 << 20
    assert _size("1.5k") == 1536


def test_tcp_is_always_there() -> None:
    assert select_transport("tcp") is TCP
    assert TCP.name == "tcp"


def test_auto_follows_mooncake_availability() -> None:
    module, reason = transports.mooncake_status()
    chosen = select_transport("auto")
    if module is None:
        assert chosen is TCP and reason
    else:
        assert chosen.name == "mooncake"


def test_mooncake_unavailable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed module saying AVAILABLE = False (as on a machine without the engine's
    wheel; faked here because this machine may have it)."""
    fake = types.ModuleType(transports.MOONCAKE_MODULE)
    fake.AVAILABLE = False  # type: ignore[attr-defined]
    fake.UNAVAILABLE_REASON = "mooncake.engine does not import"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, transports.MOONCAKE_MODULE, fake)
    assert select_transport("auto") is TCP
    with pytest.raises(TransportUnavailable, match=r"mooncake\.engine does not import"):
        select_transport("mooncake")


def test_a_port_in_use_exits_1(tmp_path: object) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "ownerserve", "worker", "sidecar", "--worker-id", "a",
             "--store-dir", str(tmp_path), "--port", str(port), "--transport", "tcp"],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    assert run.returncode == 1 and "address already in use" in run.stderr
