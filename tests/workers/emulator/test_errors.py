"""Bad input gets an OpenAI-shaped error with the right status, never a crash or a hang."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from typing import Any

import httpx
import orjson
import pytest

from tests.workers.emulator.conftest import StartEmulator

MESSAGES = [{"role": "user", "content": "hi"}]


def assert_openai_error(resp: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"]
    return dict(err)


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, ["nope"]),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, ["nope"]),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -1}, 400, ["max_tokens"]),
        ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, ["max_tokens"]),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, 400, ["n"]),
        ("/v1/chat/completions", {"messages": []}, 400, ["messages"]),
        ("/v1/chat/completions", {"messages": "hi"}, 400, ["messages"]),
        ("/v1/completions", {"prompt": []}, 400, ["prompt"]),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, ["vocabulary"]),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, ["context length"]),
        ("/v1/chat/completions", [1, 2], 400, ["object"]),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_host": "h",
                    "remote_port": "abc",
                    "remote_request_id": "r",
                },
            },
            400,
            ["remote_port"],
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "stop": [1]}, 400, ["stop"]),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "a"}}],
                "tool_choice": {"type": "function", "function": {"name": "b"}},
            },
            400,
            ["tool_choice"],
        ),
        ("/tokenize", {"nothing": 1}, 400, ["prompt"]),
        ("/ownerserve/kv/fetch", {"source_url": "ftp://x", "block_hashes": []}, 400, ["url"]),
        ("/ownerserve/kv/read", {"block_hashes": [-1]}, 400, ["block_hashes"]),
        ("/ownerserve/kv/pull", {"transfer_id": "t", "block_hashes": []}, 404, ["unknown"]),
    ],
)
async def test_invalid_requests_get_openai_errors(
    start_emulator: StartEmulator,
    http: httpx.AsyncClient,
    path: str,
    body: Any,
    status: int,
    words: list[str],
) -> None:
    server = await start_emulator()
    resp = await http.post(server.url + path, json=body)
    err = assert_openai_error(resp, status, *words)
    if status == 404 and "model" in path:
        assert err["code"] == "model_not_found"


async def test_malformed_json_oversized_body_and_unknown_routes(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator(max_body_bytes=10_000)
    url = server.url
    headers = {"content-type": "application/json"}
    resp = await http.post(url + "/v1/chat/completions", content=b'{"messages": [', headers=headers)
    assert_openai_error(resp, 400, "not valid JSON")
    big = {"messages": [{"role": "user", "content": "x" * 20_000}]}
    assert_openai_error(await http.post(url + "/v1/chat/completions", json=big), 413)

    async def chunks() -> Any:  # no content-length: the limit applies while reading
        for _ in range(30):
            yield b" " * 1000

    resp = await http.post(url + "/v1/completions", content=chunks(), headers=headers)
    assert_openai_error(resp, 413)
    assert_openai_error(await http.get(url + "/v1/nothing"), 404)
    assert_openai_error(await http.get(url + "/v1/chat/completions"), 405)
    # The server is still healthy afterwards.
    assert (await http.get(url + "/health")).status_code == 200
    ok = await http.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert ok.status_code == 200


def _urllib_post(url: str, body: bytes) -> tuple[int, bytes]:
    """POST with `urllib`: the whole body goes out before the answer is read, and the server
    is asked to close the connection after it (`connection: close`)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def test_a_64_mib_body_from_urllib_gets_the_413_not_a_reset(
    start_emulator: StartEmulator,
) -> None:
    server = await start_emulator(max_body_bytes=1 << 20)
    url = server.url + "/v1/chat/completions"
    status, body = await asyncio.to_thread(_urllib_post, url, b"x" * (64 << 20))
    assert status == 413
    assert orjson.loads(body)["error"]["code"] == "payload_too_large"
