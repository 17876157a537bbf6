"""P/D between two real SGLang CPU servers through the router: the same request goes to the
prefill and the decode server at once with the router's bootstrap room, the decode side pulls
the prompt's KV from the prefill side over Mooncake's TCP transport, and the answer is token for
token the one a colocated SGLang server gives, streamed or not, on a prefill-side prefix cache
hit too."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.router_cluster import proxy_client
from tests.e2e.sglang.conftest import sglang_router_settings
from tests.e2e.sglang.test_router_sglang import answer, chat, completion, turn
from workers.sglang_cpu.server import SglangServer
from workers.sglang_cpu.setup import SglangCpuInstall

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]


async def test_remote_prefill_gives_the_colocated_servers_answer(
    sglang_install: SglangCpuInstall,
    sglang_pd_pair: tuple[SglangServer, SglangServer],
    sglang_pair: tuple[SglangServer, SglangServer],
) -> None:
    reference = sglang_pair[0]
    settings = sglang_router_settings(sglang_install, sglang_pd_pair, policy="static-pd")
    calls = [
        ("/v1/chat/completions", chat(turn("pd", 12))),
        ("/v1/chat/completions", chat(turn("pd", 12), stream=True)),  # P holds this prefix now
        ("/v1/completions", completion("the agent edits the file and saves it " * 8)),
        ("/v1/completions", completion("the agent edits the file and saves it " * 8, True)),
    ]
    async with (
        proxy_client(settings) as (client, _),
        httpx.AsyncClient(base_url=reference.url, timeout=300) as colocated,
    ):
        client.timeout = httpx.Timeout(300.0)
        for path, body in calls:
            text, usage, plan = await answer(client, path, body)
            assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "sp0", "sd0")
            want, want_usage, _ = await answer(colocated, path, body)
            assert text == want, (path, body["stream"])
            assert usage["completion_tokens"] == want_usage["completion_tokens"] == 8
            assert usage["prompt_tokens"] == want_usage["prompt_tokens"]
