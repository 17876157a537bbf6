"""HeteroCache through the router: an emulated worker (a real process) serving the
DeepSeek-V4-like spec publishes KV events per KV cache group, the router's directory indexes the
attention chain and the restorable boundaries, the plan header shows what the worker can
restore and its bytes by state type, and the engine's metrics show how each resume restored its
state: under zero retention a warm resume is cut back to the last prompt boundary, under full
retention it is cached, and a cold resume (other sessions evicted it from HBM and its windows,
the CPU tier kept its prompt) loads the compressed KV and, by the model's off-GPU SWA policy,
loads the windows checkpointed there (full) or rebuilds them over n_win·L recomputed tokens
(zero). A P/D hand-over moves every group's state (sealed blocks, windows and tail
at their end) and the decode side resumes without recomputing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import settings_from_dict
from ownerserve.kvstate import StateType, load_spec
from router.state import Router
from tests.e2e.router_cluster import metric_value, plan_fields, proxy_client
from tests.waiting import until

MODEL = "deepseek-v4-like"  # an alias of configs/models/deepseek-v4.yaml
BS = 128
V4 = load_spec("deepseek-v4")
SEALED_BLOCK = 636096  # bytes of one 128-token block over CSA main, indexer and HCA


def doc(tag: str, lines: int = 200) -> str:
    """About 11,600 tokens (byte tokenizer) for 200 lines: 90 blocks of 128."""
    return "".join(
        f"{tag} line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(lines)
    )


NUM_BLOCKS = 120
"""HBM for one long session: two others evict it (the CPU tier, 1024 blocks, keeps it)."""


def worker(retention: str | None, swa_policy: str) -> EmulatedWorker:
    extra = [
        "--block-size", str(BS), "--num-blocks", str(NUM_BLOCKS), "--cpu-num-blocks", "1024",
        "--window-num-blocks", "2", "--output-len", "400",
    ]  # fmt: skip
    if retention is not None:
        extra += ["--prefix-cache-retention-interval", retention]
    extra += ["--swa-policy", swa_policy]
    return EmulatedWorker("h0", "hybrid", model=MODEL, speed=20.0, extra=tuple(extra))


def settings(w: EmulatedWorker, directory: dict[str, Any] | None = None) -> Any:
    data: dict[str, Any] = {
        "server": {"port": 0, "health_interval_s": 0.5, "admin_token": "adm"},
        "planner": {"policy": "ownerserve"},
        "models": [{"name": MODEL, "block_size": BS, "kv_spec": "deepseek-v4"}],
        "workers": [w.worker_settings()],
    }
    if directory is not None:
        data["directory"] = directory
    return settings_from_dict(data)


async def turn(
    client: httpx.AsyncClient, messages: list[dict[str, str]], session: str = "s1"
) -> tuple[dict[str, str], dict[str, Any]]:
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 300},
        headers={"x-session-id": session},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return plan_fields(resp.headers["x-ownerserve-plan"]), body["usage"]


async def events_in(router: Router, w: EmulatedWorker) -> None:
    """Wait until the router applied every KV event batch the worker published."""

    def caught_up() -> bool:
        published = metric_value(w.metrics(), "ownerserve_emulator_kv_events_published_total")
        sub = router.subscribers[0]
        return published > 0 and sub.stats.last_seq == published - 1

    await until(caught_up, timeout_s=30.0, poll_s=0.05, what="KV events applied")


def restore(fields: dict[str, str]) -> tuple[str, str, int, int, dict[str, int]]:
    who, tier, blocks = fields["restore"].split(":")
    done, sealed = blocks.split("/")
    by_type = dict(kv.split(":") for kv in fields["state_bytes"].split(","))
    return who, tier, int(done), int(sealed), {k: int(v) for k, v in by_type.items()}


@pytest.mark.parametrize(
    ("retention", "swa_policy", "warm", "backend"),
    [
        ("0", "zero", "truncated", "memory"),
        (None, "full", "cached", "memory"),
        ("0", "zero", "truncated", "redis"),
    ],
)
async def test_resumes_restore_by_the_retention_policy_and_show_their_state_bytes(
    retention: str | None,
    swa_policy: str,
    warm: str,
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    directory = None
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        directory = {"backend": "redis", "redis_url": server.url, "key_prefix": "hetero"}
    with emulated_workers(worker(retention, swa_policy)) as (w,):
        async with proxy_client(settings(w, directory)) as (client, router):
            messages = [
                {"role": "system", "content": doc("s1")},
                {"role": "user", "content": "summarise the document"},
            ]
            first, usage1 = await turn(client, messages)
            assert "restore" not in first  # nothing held yet
            await events_in(router, w)

            # a warm resume: the sealed groups hold the first turn's prompt and answer
            messages.append({"role": "user", "content": "and now in one line"})
            second, usage2 = await turn(client, messages)
            who, tier, done, sealed, by_type = restore(second)
            prompt_blocks = usage1["prompt_tokens"] // BS
            assert (who, tier) == ("h0", "gpu")
            assert sealed > prompt_blocks  # the answer's blocks are cached too
            # zero retention keeps the windows only at the first prompt's last boundary
            assert done == (prompt_blocks if retention == "0" else sealed)
            want = V4.state_bytes(0, sealed * BS)
            assert by_type == {t.value: n for t, n in want.items()}
            m = w.metrics()
            resumed = metric_value(m, "ownerserve_emulator_resumes_total", how=warm)
            assert resumed == 1
            cached = usage2["prompt_tokens_details"]["cached_tokens"]
            assert cached == done * BS  # the engine resumed where the header said
            assert metric_value(m, "ownerserve_emulator_window_rebuild_tokens_total") == 0

            # a cold resume: two other sessions evict it from HBM and the window pool (the
            # second takes the head blocks the first left: they are older than its own)
            for other in ("s2", "s3"):
                msgs = [{"role": "system", "content": doc(other, 150)},
                        {"role": "user", "content": "hi"}]  # fmt: skip
                await turn(client, msgs, other)
            await events_in(router, w)
            loaded_before = metric_value(m, "vllm:kv_offload_load_bytes_total")
            messages.append({"role": "user", "content": "one more time"})
            third, usage3 = await turn(client, messages)
            who, tier, done, sealed, by_type = restore(third)
            # the CPU tier holds the second prompt's sealed blocks, and its windows at every
            # boundary (full off-GPU policy) or none (zero)
            full = swa_policy == "full"
            assert (who, tier) == ("h0", "cpu")
            assert sealed == usage2["prompt_tokens"] // BS
            assert done == (sealed if full else 0)
            m = w.metrics()
            cold = "cached" if full else "rebuilt"
            resumes = metric_value(m, "ownerserve_emulator_resumes_total", how=cold)
            assert resumes == 1 + (cold == warm)
            # zero: the windows rebuilt over n_win·L = 128 x 61 tokens; full: loaded with the KV
            rebuilt = metric_value(m, "ownerserve_emulator_window_rebuild_tokens_total")
            assert rebuilt == (0 if full else 7808)
            loaded = metric_value(m, "vllm:kv_offload_load_bytes_total") - loaded_before
            windows = V4.mutable_bytes(sealed * BS) if full else 0
            assert loaded == sealed * SEALED_BLOCK + windows
            assert usage3["prompt_tokens_details"]["cached_tokens"] == sealed * BS
            hca = metric_value(m, "ownerserve_emulator_state_loaded_bytes_total", state_type="hca")
            assert hca == V4.state_bytes(0, sealed * BS)[StateType.COMPRESSED_HCA]
            # the admin API keeps the same, per plan
            resp = await client.get("/admin/plans", headers={"x-admin-token": "adm"})
            plans = resp.json()["plans"]
            shown = plans[-1]["restore"]
            assert (shown["worker"], shown["tier"], shown["blocks"]) == ("h0", "cpu", done)
            assert shown["sealed_blocks"] == sealed and shown["state_bytes"] == by_type
            # every worker's restorable units of the prompt: here h0's CPU tier only
            assert plans[-1]["restorable"] == [
                {"worker": "h0", "tier": "cpu", "blocks": done, "sealed_blocks": sealed}
            ]
            first_two = [p["restore"] is None for p in plans[:2]]
            assert first_two == [True, False]  # the first turn found nothing to restore


async def test_a_pd_hand_over_moves_every_groups_state_and_the_decode_side_resumes() -> None:
    extra = ("--block-size", str(BS), "--output-len", "50")
    p = EmulatedWorker("p0", "prefill", model=MODEL, speed=20.0, extra=extra)
    d = EmulatedWorker("d0", "decode", model=MODEL, speed=20.0, extra=extra)
    with emulated_workers(p, d):
        async with proxy_client(settings_pd(p, d)) as (client, _router):
            messages = [
                {"role": "system", "content": doc("pd")},
                {"role": "user", "content": "summarise the document"},
            ]
            fields, usage = await turn(client, messages)
            assert (fields["p"], fields["d"]) == ("p0", "d0")
            blocks = (usage["prompt_tokens"] - 1) // BS  # the last prompt token is computed
            m = d.metrics()
            # the pull carried the sealed groups' blocks and the windows and tail at their end
            want = blocks * SEALED_BLOCK + V4.mutable_bytes(blocks * BS)
            got = metric_value(m, "ownerserve_emulator_kv_received_bytes_total", kind="pd")
            sent = metric_value(p.metrics(), "ownerserve_emulator_kv_sent_bytes_total", kind="pd")
            assert got == sent == want
            assert metric_value(m, "ownerserve_emulator_resumes_total", how="cached") == 1
            assert metric_value(m, "ownerserve_emulator_window_rebuild_tokens_total") == 0


def settings_pd(p: EmulatedWorker, d: EmulatedWorker) -> Any:
    """Static P/D: every prompt is prefilled on p0 and handed over to d0."""
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5},
            "planner": {"policy": "static-pd"},
            "models": [{"name": MODEL, "block_size": BS, "kv_spec": "deepseek-v4"}],
            "workers": [p.worker_settings(), d.worker_settings()],
        }
    )
