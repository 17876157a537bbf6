"""Request parsing: what routing needs is validated, everything else passes through."""

from __future__ import annotations

import orjson
import pytest

from ownerserve.errors import InvalidRequestError, error_body_for
from router.requests import DEFAULT_MAX_TOKENS, Endpoint, parse_request


def test_unknown_fields_are_kept_in_the_body_and_raw_bytes():
    raw = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "ls"}}],
            "tool_choice": "auto",
            "response_format": {"type": "json_object"},
            "vendor_extension": {"x": 1},
        }
    )
    req = parse_request(raw, Endpoint.CHAT)
    assert req.raw is raw
    assert req.body["vendor_extension"] == {"x": 1}
    assert req.body["tool_choice"] == "auto"
    assert req.max_tokens == DEFAULT_MAX_TOKENS and req.n == 1 and not req.stream


def test_max_completion_tokens_wins_over_max_tokens():
    raw = b'{"model":"m","prompt":"x","max_tokens":5,"max_completion_tokens":9,"n":2}'
    req = parse_request(raw, Endpoint.COMPLETIONS)
    assert (req.max_tokens, req.n) == (9, 2)


_C = Endpoint.COMPLETIONS


@pytest.mark.parametrize(
    "raw, endpoint, fragment, param",
    [
        (b"{not json", Endpoint.CHAT, "not valid JSON", None),
        (b"[1, 2]", Endpoint.CHAT, "JSON object", None),
        (b'{"messages": [{"role": "user"}]}', Endpoint.CHAT, "'model'", "model"),
        (b'{"model": "m", "messages": []}', Endpoint.CHAT, "'messages'", "messages"),
        (b'{"model": "m", "messages": ["hi"]}', Endpoint.CHAT, "messages[0]", "messages"),
        (b'{"model": "m"}', Endpoint.COMPLETIONS, "'prompt'", "prompt"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', _C, "'stream'", "stream"),
        (b'{"model": "m", "prompt": "x", "max_tokens": -1}', _C, "max_tokens", "max_tokens"),
        (b'{"model": "m", "prompt": "x", "n": 1.5}', _C, "'n'", "n"),
    ],
)  # fmt: skip
def test_bad_requests_raise_invalid_request_naming_the_field(raw, endpoint, fragment, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_request(raw, endpoint)
    assert fragment in str(info.value)
    assert info.value.status_code == 400
    assert error_body_for(info.value)["error"] == {
        "message": str(info.value),
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


def test_a_clients_control_plane_fields_are_removed_and_the_rest_kept():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_host": "10.0.0.9",
            "remote_port": 22,
            "ownerserve": {"chunk_save": {"key": "00", "start": 0, "end": 1, "position": 0}},
        },
        "bootstrap_host": "10.0.0.9",
        "bootstrap_port": 22,
        "bootstrap_room": 1,
        "bootstrap_pair_key": "k",
        "disagg_prefill_dp_rank": 0,
        "data_parallel_rank": 3,
        "decode_tp_size": 8,
        "request_id": "someone-elses-request",
        "rid": "someone-elses-request",
        "temperature": 0.5,
    }
    req = parse_request(orjson.dumps(body), Endpoint.CHAT)
    kept = {"model": "m", "messages": body["messages"], "temperature": 0.5}
    assert req.body == kept
    assert orjson.loads(req.raw) == kept  # the bytes the workers get


def test_a_clients_connector_opt_outs_are_all_that_stays_of_its_kv_transfer_params():
    ktp = {"ownerserve": {"load": False, "save": True, "chunks": []}, "remote_host": "h"}
    raw = orjson.dumps({"model": "m", "prompt": "x", "kv_transfer_params": ktp})
    req = parse_request(raw, Endpoint.COMPLETIONS)
    assert req.body["kv_transfer_params"] == {"ownerserve": {"load": False}}
    assert orjson.loads(req.raw) == req.body


def test_a_body_without_control_fields_keeps_its_own_bytes():
    raw = b'{"model": "m", "prompt": "x", "bootstrap": 1, "kv": 2, "data": 3}'
    assert parse_request(raw, Endpoint.COMPLETIONS).raw is raw
