"""The router's KV transport prices: a probe's measurements file (`planner.kv_measurements`)
read once at start-up, its measured prices planned with and shown (`GET /admin/status`'s
`kv_prices`, the plan header's `kv_prices=`); a missing file leaves the configured ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ownerserve.config import settings_from_dict
from ownerserve.kvprobe import PriceSource, TransportPrice
from ownerserve.profiles import TransportTiming
from ownerserve.types import KVTransport
from planner.explain import parse_plan_header
from planner.policies import get_policy
from router.plans import kv_prices_field, plan_header
from router.state import Router
from router.status import kv_prices
from tests.planner.util import UNIT_CONFIG, example, unit_model

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


def test_the_plan_header_names_the_measured_transports_only_when_there_are_some() -> None:
    req, cl = example()
    plan = get_policy("ownerserve", UNIT_CONFIG, unit_model()).plan(req, cl)
    measured = (
        TransportPrice(KVTransport.STORE_TCP, TransportTiming(6e8, 4e-3), PriceSource.MEASURED),
        TransportPrice(KVTransport.STORE_RDMA, TransportTiming(1e10, 1e-3), PriceSource.CONFIGURED),
    )
    field = kv_prices_field(measured)
    assert field == "kv_prices=store_tcp:measured"
    shown = parse_plan_header(plan_header(plan, kv_prices=field).decode())
    assert shown["kv_prices"] == "store_tcp:measured"
    assert kv_prices_field(measured[1:]) == ""
    assert "kv_prices" not in parse_plan_header(plan_header(plan).decode())
