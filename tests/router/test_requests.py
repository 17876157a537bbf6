"""Request parsing: what routing needs is validated, everything else passes through."""

from __future__ import annotations

import orjson
import pytest

from ownerserve.errors import InvalidRequestError
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


@pytest.mark.parametrize(
    "raw, endpoint, fragment",
    [
        (b"{not json", Endpoint.CHAT, "not valid JSON"),
        (b"[1, 2]", Endpoint.CHAT, "JSON object"),
        (b'{"messages": [{"role": "user"}]}', Endpoint.CHAT, "'model'"),
        (b'{"model": "m", "messages": []}', Endpoint.CHAT, "'messages'"),
        (b'{"model": "m", "messages": ["hi"]}', Endpoint.CHAT, "messages[0]"),
        (b'{"model": "m"}', Endpoint.COMPLETIONS, "'prompt'"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', Endpoint.COMPLETIONS, "'stream'"),
        (b'{"model": "m", "prompt": "x", "max_tokens": -1}', Endpoint.COMPLETIONS, "max_tokens"),
        (b'{"model": "m", "prompt": "x", "n": 1.5}', Endpoint.COMPLETIONS, "'n'"),
    ],
)
def test_bad_requests_raise_invalid_request(raw, endpoint, fragment):
    with pytest.raises(InvalidRequestError) as info:
        parse_request(raw, endpoint)
    assert fragment in str(info.value)
    assert info.value.status_code == 400
