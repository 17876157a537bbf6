"""The vLLM backend's pure parts: `/metrics` parsing and the P/D request bodies."""

from __future__ import annotations

from pathlib import Path

import pytest

from ownerserve.errors import UpstreamError
from router.backends import parse_load_metrics
from router.backends.vllm import (
    REMOTE_DECODE_PARAMS,
    for_remote_decode,
    parse_metrics,
    transfer_params_of,
    with_transfer_params,
)

DATA = Path(__file__).parent / "data"


def test_parses_a_real_vllm_0_32_metrics_page() -> None:
    load = parse_metrics((DATA / "vllm-0.32-metrics.txt").read_text())
    assert load.num_requests_running == 0
    assert load.prefix_cache_queries == 177
    assert load.prefix_cache_hits == 0
    assert load.prompt_tokens_by_source == {
        "local_compute": 177,
        "local_cache_hit": 0,
        "external_kv_transfer": 0,
    }


def test_sums_series_over_engines_and_computes_hit_rate() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 3.0',
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            "# TYPE vllm:prefix_cache_queries counter",
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 60.0',
            "# TYPE vllm:prefix_cache_hits counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0',
            "# TYPE vllm:prompt_tokens_by_source counter",
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 40.0',
            'vllm:prompt_tokens_by_source_total{engine="1",source="local_cache_hit"} 8.0',
            "",
        ]
    )
    load = parse_metrics(text)
    assert load.num_requests_running == 5
    assert load.num_requests_waiting == 4
    assert load.kv_cache_usage_perc == 0.25
    assert load.prefix_cache_hit_rate == pytest.approx(40 / 160)
    assert load.prompt_tokens_by_source == {"local_cache_hit": 48}


def test_prefill_body_asks_for_one_token_and_a_remote_decode() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = for_remote_decode(body)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == REMOTE_DECODE_PARAMS
    assert body["stream"] is True  # the client's body is left alone


def test_decode_body_carries_the_prefills_params_unchanged() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_port": 5600}
    body = {"model": "m", "prompt": "x", "max_tokens": 8}
    assert transfer_params_of({"kv_transfer_params": params}) == params
    assert with_transfer_params(body, params) == dict(body, kv_transfer_params=params)
    with pytest.raises(UpstreamError):
        transfer_params_of({"choices": []})


def test_the_pool_size_comes_from_vllms_cache_config_info() -> None:
    # vLLM's info gauge carries every CacheConfig field as a label (loggers.log_metrics_info)
    text = "\n".join(
        [
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
            'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2048",'
            'prefix_caching_hash_algo="sha256"} 1.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
        ]
    )
    load = parse_load_metrics(text)
    assert load.kv_capacity_tokens == 2048 * 16 and load.kv_usage == 0.5
    # before the engine has profiled its memory the count is "None": unknown, not zero blocks
    unknown = text.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="None"')
    assert parse_load_metrics(unknown).kv_capacity_tokens == 0
