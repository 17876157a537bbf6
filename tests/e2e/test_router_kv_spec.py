"""The router prices a request with its model's KV state spec (`models[].kv_spec`, by default
the spec of the model's name): the same prompt handed from a prefill to a decode worker (real
emulated processes) moves a V4-like model's compressed KV and windows, a small share of what a
dense model of the profile's K bytes a token moves, and the plan header shows it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import settings_from_dict
from ownerserve.kvstate import load_spec
from ownerserve.profiles import load_profile
from tests.e2e.router_cluster import plan_fields, proxy_client

MODEL = "deepseek-v4-like"  # an alias of configs/models/deepseek-v4.yaml
BS = 128
PROMPT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(80))


def workers() -> tuple[EmulatedWorker, EmulatedWorker]:
    extra = ("--block-size", str(BS), "--num-blocks", "400")
    return (
        EmulatedWorker("p0", "prefill", model=MODEL, speed=20.0, extra=extra),
        EmulatedWorker("d0", "decode", model=MODEL, speed=20.0, extra=extra),
    )


def settings(ws: tuple[EmulatedWorker, ...], model: dict[str, Any]) -> Any:
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5},
            "planner": {"policy": "static-pd"},
            "models": [{"name": MODEL, "block_size": BS, **model}],
            "workers": [w.worker_settings() for w in ws],
        }
    )


async def plan_of(client: httpx.AsyncClient) -> tuple[dict[str, str], int]:
    """The first request's plan header and its prompt tokens."""
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4},
    )
    assert resp.status_code == 200, resp.text
    return plan_fields(resp.headers["x-ownerserve-plan"]), resp.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("model", "spec"),
    [({}, "deepseek-v4"), ({"kv_spec": "deepseek-v4"}, "deepseek-v4"), ({"kv_spec": None}, None)],
    ids=["spec-by-name", "spec-named", "dense"],
)
async def test_a_hand_over_is_priced_by_the_models_kv_spec(
    model: dict[str, Any], spec: str | None
) -> None:
    ws = workers()
    with emulated_workers(*ws) as started:
        async with proxy_client(settings(started, model)) as (client, _):
            fields, n = await plan_of(client)
    assert fields["action"] == "remote_prefill", fields
    # M_HBM of a hand-over: the prompt P computes and holds until it moves to D, N·K + M(N)
    # (planner/README.md): with the V4-like spec its compressed KV, windows and tail (~5 KB a
    # token), without one the profile's dense K (128 KiB a token)
    if spec is None:
        want: float = n * load_profile("h100-llama3-8b").kv_bytes_per_token
    else:
        sigma = load_spec(spec)
        want = n * sigma.bytes_per_token() + sigma.mutable_bytes(n)
    assert float(fields["m_hbm"]) == pytest.approx(want, rel=1e-5), (fields, n)
