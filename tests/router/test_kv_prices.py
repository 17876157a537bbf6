"""The router's KV transport prices: a probe's measurements file (`planner.kv_measurements`)
read once at start-up, its measured prices planned with and shown (`GET /admin/status`'s
`kv_prices`, the plan header's `kv_prices=`); a missing file leaves the configured ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ownerserve.config import settings_from_dict
from ownerserve.types import KVTransport
from router.state import Router
from router.status import kv_prices

MODEL = "tiny"


def _router(measurements: Path | None) -> Router:
    planner: dict[str, Any] = {}
    if measurements is not None:
        planner["kv_measurements"] = str(measurements)
    return Router(
        settings_from_dict(
            {
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [{"id": "w0", "url": "http://127.0.0.1:9"}],
                "admission": {"enabled": False},
                "planner": planner,
            }
        )
    )


def test_a_measured_store_price_is_planned_with_and_shown(tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    f.write_text("store_tcp: {bps: 6.0e+8, latency_s: 0.004}\n")
    router = _router(f)
    prof = router.planner.model.profiles["h100-llama3-8b"]
    assert prof.link.path(KVTransport.STORE_TCP).bps == 6e8
    shown = {p["transport"]: p for p in kv_prices(router)}
    assert shown["store_tcp"] == {
        "transport": "store_tcp",
        "bps": 6e8,
        "latency_s": 0.004,
        "source": "measured",
        "detail": "probe",
    }
    assert shown["store_rdma"]["source"] == "configured"
    assert shown["store_rdma"]["bps"] == 2.5e10
    assert router.services.stream.kv_prices == "kv_prices=store_tcp:measured"


def test_without_a_usable_measurement_every_price_is_configured_and_the_header_is_silent(
    tmp_path: Path,
) -> None:
    missing = _router(tmp_path / "absent.yaml")
    shown = kv_prices(missing)
    assert {p["source"] for p in shown} == {"configured"}
    assert all("cannot read KV measurements" in p["detail"] for p in shown)
    assert missing.services.stream.kv_prices == ""
    unset = _router(None)
    assert {p["detail"] for p in kv_prices(unset)} == {"no measurement configured"}
