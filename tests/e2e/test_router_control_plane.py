"""The router owns the control plane, against real processes (the router in-process, emulated
engines as children): a client's KV hand-over fields (vLLM's `kv_transfer_params`, SGLang's
`bootstrap_host`/`bootstrap_port`/`bootstrap_room`) never make a worker connect where the client
says, on any route and in colocated and P/D plans alike; a worker's failed KV pull reaches the
client without hosts, ports or engine ids; an empty or repeated API key is refused by the config
and matches nothing in the router."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.cluster import MODEL, EmulatedWorker
from ownerserve.config import Settings, settings_from_dict
from ownerserve.ports import free_port
from tests.e2e.router_cluster import REPO, plan_fields, proxy_client, workers_fixture

pytestmark = pytest.mark.timeout(120)

POLICY = "x-ownerserve-policy"
COLOCATED = {POLICY: "colocated"}
PD = {POLICY: "static-pd"}
_STORIES = itertools.count()
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


class Listener:
    """A real listening socket on loopback that counts the connections made to it (each closed
    at once): where a client's fields would send a worker."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def _accept(self, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[Listener]:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            self._server.close()
            await self._server.wait_closed()


def settings_for(
    workers: tuple[EmulatedWorker, ...], overrides: dict[str, dict[str, Any]] | None = None
) -> Settings:
    """The router in front of `workers`, each worker's entry changed by `overrides[its id]`."""
    entries = [w.worker_settings() | (overrides or {}).get(w.worker_id, {}) for w in workers]
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5},
            "planner": {"allow_policy_header": True},  # the tests pick colocated or P/D plans
            "models": [{"name": MODEL}],
            "workers": entries,
        }
    )


def body_for(route: str, fields: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    """A short request on `route` carrying the client's `fields` beside its own; a prompt of
    its own each time (a new session: no plan continues an earlier one)."""
    text = f"Tell me story {next(_STORIES)} ({route})."
    if route == "/v1/completions":
        own: dict[str, Any] = {"prompt": text, "max_tokens": 4}
    elif route == "/v1/responses":
        own = {"input": text, "max_output_tokens": 4, "store": False}
    else:  # chat completions, Anthropic messages
        own = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return {"model": MODEL, **own, **fields, **({"stream": True} if stream else {})}


async def send(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], headers: dict[str, str]
) -> httpx.Response:
    """The whole answer (a stream read to its end)."""
    async with client.stream("POST", route, json=body, headers=headers) as resp:
        await resp.aread()
    return resp


def vllm_fields(port: int) -> dict[str, Any]:
    """A decode side's `kv_transfer_params` naming a prefill at 127.0.0.1:`port`."""
    return {
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_engine_id": "engine-of-the-clients-choice",
            "remote_request_id": "someone-elses-request",
            "remote_block_ids": [1, 2, 3],
        }
    }


def sglang_fields(port: int) -> dict[str, Any]:
    """SGLang's rendezvous at a room on 127.0.0.1:`port`."""
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 4242}


vllm_pd = workers_fixture(
    lambda: (EmulatedWorker("p0", "prefill", speed=50), EmulatedWorker("d0", "decode", speed=50))
)
sglang_pd = workers_fixture(
    lambda: (
        EmulatedWorker("sp0", "prefill", kind="sglang", speed=50),
        EmulatedWorker("sd0", "decode", kind="sglang", speed=50),
    )
)


async def _nothing_reaches_the_listener(
    settings: Settings, fields_of: Any, prefill: str, decode: str
) -> None:
    """Every route, colocated on `decode` (the client's body is what it gets) and P/D from
    `prefill` (the router's own hand-over), streamed and not: each answers 200 with the plan
    asked for, and nothing ever connects to the listener the client's fields name."""
    async with Listener().listening() as listener, proxy_client(settings) as (client, _):
        fields = fields_of(listener.port)
        for route in ROUTES:
            for headers, action in ((COLOCATED, "colocated_prefill"), (PD, "remote_prefill")):
                for stream in (False, True):
                    resp = await send(client, route, body_for(route, fields, stream), headers)
                    # the answer is whole: a worker that followed the client's fields would
                    # have connected before answering (it pulls the KV first)
                    assert listener.connections == 0, (route, headers, stream, resp.text)
                    assert resp.status_code == 200, (route, headers, resp.text)
                    plan = plan_fields(resp.headers["x-ownerserve-plan"])
                    assert (plan["action"], plan["d"]) == (action, decode), (route, plan)
                    if action == "remote_prefill":
                        assert plan["p"] == prefill, (route, plan)


async def test_a_clients_kv_transfer_params_reach_no_worker(vllm_pd):
    await _nothing_reaches_the_listener(settings_for(vllm_pd), vllm_fields, "p0", "d0")


async def test_a_clients_bootstrap_fields_reach_no_sglang_worker(sglang_pd):
    await _nothing_reaches_the_listener(settings_for(sglang_pd), sglang_fields, "sp0", "sd0")


# --- a worker's failed KV pull ------------------------------------------------------------------

_ADDRESS = re.compile(r"\d{1,3}(\.\d{1,3}){3}|://|localhost|:\d{2,5}\b")


def assert_no_internals(text: str, workers: tuple[EmulatedWorker, ...]) -> None:
    """`text` names no address, none of the workers' ports and no engine id."""
    assert not _ADDRESS.search(text), text
    for w in workers:
        for port in (w.port, w.bootstrap_port):
            assert str(port) not in text, (port, text)
        assert not re.search(rf"{re.escape(w.worker_id)}-[0-9a-f]{{8}}", text), text


unreachable_prefill = workers_fixture(
    lambda: (
        # the prefill side tells the decode side to pull from an address nothing listens on
        EmulatedWorker("p1", "prefill", speed=50, extra=("--advertise-host", "127.0.0.2")),
        EmulatedWorker("d1", "decode", speed=50),
    )
)


async def test_a_failed_vllm_protocol_pull_runs_colocated_and_shows_no_addresses(
    unreachable_prefill,
):
    # the decode side's refusal (its error names the address it could not pull from) never
    # reaches the client: the prompt runs colocated on the decode worker, reported as such
    colocated = 0
    async with proxy_client(settings_for(unreachable_prefill)) as (client, _):
        for route in ROUTES:
            resp = await send(client, route, body_for(route, {}), PD)
            if resp.status_code != 200:
                # once p1's failed hand-overs open its breaker, a forced P/D plan has no prefill
                # worker left: a clean error, in the route's shape, naming nothing internal
                assert 400 <= resp.status_code < 600, resp.text
                assert_no_internals(resp.text, unreachable_prefill)
                continue
            if "x-ownerserve-plan" in resp.headers:  # the front doors translate the answer
                fields = plan_fields(resp.headers["x-ownerserve-plan"])
                assert fields["action"] == "remote_prefill"
                assert (fields["fallback"], fields["reason"]) == ("colocated", "kv_transfer_failed")
            # a JSON answer has numbers after colons: look for the address and ports themselves
            assert "://" not in resp.text and "127.0.0.2" not in resp.text, resp.text
            for w in unreachable_prefill:
                assert f":{w.port}" not in resp.text and f":{w.bootstrap_port}" not in resp.text
            colocated += 1
    assert colocated >= 1  # the first request, before any breaker opened, ran colocated


async def test_a_failed_sglang_rendezvous_reaches_the_client_without_addresses(sglang_pd):
    closed = free_port()  # the router is told a bootstrap port nothing listens on
    settings = settings_for(sglang_pd, {"sp0": {"bootstrap_port": closed}})
    async with proxy_client(settings) as (client, _):
        for route in ROUTES:
            resp = await send(client, route, body_for(route, {}), PD)
            assert plan_fields(resp.headers["x-ownerserve-plan"])["action"] == "remote_prefill"
            assert 400 <= resp.status_code < 600, resp.text
            assert resp.json()["error"]["message"], resp.text
            assert_no_internals(resp.text, sglang_pd)
            assert str(closed) not in resp.text


# --- API keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "fragment"),
    [('["sk-ok", ""]', "key 1 is empty"), ('["sk-ok", "sk-ok"]', "key 1 repeats")],
)
def test_serve_refuses_an_empty_or_repeated_api_key(tmp_path: Path, keys: str, fragment: str):
    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"server: {{host: 127.0.0.1, port: {free_port()}, api_keys: {keys}}}\n"
        f"workers: [{{id: h0, url: 'http://127.0.0.1:{free_port()}'}}]\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ownerserve", "serve", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    err = proc.stderr.decode().strip()
    assert proc.returncode == 2, err
    assert err.count("\n") == 0 and "server.api_keys" in err and fragment in err, err


async def test_an_empty_key_in_the_settings_lets_no_request_in(vllm_pd):
    # settings made in code without validation (`model_copy` does not validate): the router
    # itself must still never match an empty key
    settings = settings_for(vllm_pd)
    server = settings.server.model_copy(update={"api_keys": ("sk-ok", "")})
    settings = settings.model_copy(update={"server": server})
    body = body_for("/v1/chat/completions", {})
    async with proxy_client(settings) as (client, _):
        for auth in ({}, {"authorization": "Bearer"}, {"authorization": "Basic c2stb2s6"}):
            resp = await client.post("/v1/chat/completions", json=body, headers=auth)
            assert resp.status_code == 401, (auth, resp.text)
        ok = {"authorization": "Bearer sk-ok", **COLOCATED}
        resp = await client.post("/v1/chat/completions", json=body, headers=ok)
        assert resp.status_code == 200, resp.text
