"""A router's bounds come from its settings: the tokenizer's session cache and the working
sets' tables are built with the configured sizes; its prefix reuse counters start at 0 for
every worker and model it serves."""

from __future__ import annotations

from ownerserve.config import settings_from_dict
from router.state import Router

MODEL = "ownerserve-tiny"


def _router(**bounds: int) -> Router:
    server = {k: v for k, v in bounds.items() if k.startswith("tokenizer_")}
    planner = {k: v for k, v in bounds.items() if k.startswith("retention_")}
    return Router(
        settings_from_dict(
            {
                "server": {"port": 0, **server},
                "planner": planner,
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [{"id": "w0", "url": "http://127.0.0.1:9", "role": "hybrid"}],
            }
        )
    )


def _turns(n: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"turn {k} of a session, long enough for blocks"}
        for k in range(n)
    ]


def test_the_tokenizer_keeps_as_many_sessions_as_configured() -> None:
    tokenizer = _router(tokenizer_cache_sessions=3).tokenizers.get(MODEL)
    assert tokenizer is not None
    for s in range(4):
        tokenizer.tokenize_chat(f"s{s}", _turns(1))
    # the oldest of four was forgotten: its next turn is tokenized whole; the newest reuses
    assert tokenizer.tokenize_chat("s0", _turns(2)).previous_chain_len == 0
    assert tokenizer.tokenize_chat("s3", _turns(2)).previous_chain_len > 0


def test_the_working_sets_take_the_configured_table_sizes() -> None:
    config = _router(retention_max_sessions=7, retention_max_tools=5).working_sets.config
    assert (config.max_sessions, config.max_tools) == (7, 5)
    default = _router().working_sets.config
    assert (default.max_sessions, default.max_tools) == (65_536, 1_024)


def test_prefix_reuse_counters_start_at_zero_for_each_worker_and_the_models_it_serves() -> None:
    router = Router(
        settings_from_dict(
            {
                "models": [{"name": MODEL, "block_size": 4}, {"name": "other"}],
                "workers": [
                    {"id": "w0", "url": "http://127.0.0.1:9"},
                    {"id": "w1", "url": "http://127.0.0.1:10", "models": ["other"]},
                ],
            }
        )
    )
    text = router.metrics.exposition().decode()
    series = {
        line.split(" ")[0]
        for line in text.splitlines()
        if line.startswith("ownerserve_prefix_tokens_total{")
    }
    expected = {
        f'ownerserve_prefix_tokens_total{{kind="{kind}",model="{model}",worker="{worker}"}}'
        for worker, models in (("w0", (MODEL, "other")), ("w1", ("other",)))
        for model in models
        for kind in ("prompt", "available", "predicted", "delivered", "reported")
    }
    assert series == expected
