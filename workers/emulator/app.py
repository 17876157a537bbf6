"""The emulated engine's HTTP server: vLLM's OpenAI API, SGLang's probes, OwnerServe's KV API.

A plain ASGI application (no framework on the hot path: one dict lookup routes a request, orjson
writes every body, a stream chunk carries every token produced since the client last read).

| endpoint | what it serves |
| --- | --- |
| `POST /v1/chat/completions`, `/v1/completions` | generation, streamed or not, P/D both ways |
| `GET /v1/models`, `/health`, `/metrics`, `POST /tokenize`, `/detokenize` | as vLLM |
| `GET /server_info`, `/model_info`, `/get_load` (+ `/get_*` aliases) | SGLang's probes |
| `GET /kv_blocks`, `POST /reset_prefix_cache` | held block hashes; drop the prefix cache |
| `POST /reset_prefix_cache?reset_external=true` | drop the CPU tier too (as vLLM's connector) |
| `POST /ownerserve/kv/pull`, `/ownerserve/kv/read` | a peer pulls held KV (P->D, fetch source) |
| `POST /ownerserve/kv/heartbeat` | a decode side renews the lease on KV held for it here |
| `POST /ownerserve/kv/fetch` (alias `/ownerserve/fetch`) | pull blocks from `source_url` here |

Every error, wherever raised, leaves as the OpenAI error shape via `ownerserve.http`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs

import orjson

from ownerserve.chunks import PARAMS_KEY as CHUNK_PARAMS_KEY
from ownerserve.chunks import Chunk, parse_layout
from ownerserve.errors import (
    ClientDisconnected,
    ConfigError,
    InvalidRequestError,
    MethodNotAllowedError,
    ModelNotFoundError,
    NotFoundError,
    OwnerServeError,
)
from ownerserve.hashing import chain_root, hash_block
from ownerserve.http import (
    json_object,
    read_request_body,
    send_body,
    send_error,
    send_json,
    sse_error_event,
)
from ownerserve.kvfetch import CHUNK_FETCH_PATH, FETCH_PATH, KVChunkFetchRequest, KVFetchRequest
from ownerserve.profiles import TimingProfile
from ownerserve.tokenizer import ChatTemplate, Tokenizer, load_chat_template, load_tokenizer
from ownerserve.types import Role
from workers.emulator.chunk_store import ChunkStore
from workers.emulator.config import EmulatorConfig
from workers.emulator.engine import Engine, RemotePrefill, SamplingParams, Sequence
from workers.emulator.kv_cache import BlockPool, HostPool, prompt_block_hashes
from workers.emulator.kv_events import KVEventPublisher
from workers.emulator.metrics import EngineMetrics
from workers.emulator.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    completion_prompts,
    open_final_message,
    parse_chat,
    parse_completion,
    stop_strings,
    usage,
)
from workers.emulator.sidecar_tier import SidecarTier
from workers.emulator.textgen import (
    OutputText,
    ToolCallShape,
    Vocabulary,
    text_seed,
    tool_call_shape,
)
from workers.emulator.transfer import CHUNK_READ_PATH, KVMover

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998
_NDJSON = (b"content-type", b"application/x-ndjson")
T = TypeVar("T")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE = b"data: [DONE]\n\n"


class EngineAbortError(OwnerServeError):
    status_code = 500
    error_type = "aborted"


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def forced_tool(req: ChatCompletionRequest) -> str | None:
    """The function the model must call: `tool_choice` "required" (first tool) or named."""
    if not req.tools:
        return None
    choice = req.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("tool_choice: a named choice needs function.name")
        if not any((t.get("function") or {}).get("name") == name for t in req.tools):
            raise InvalidRequestError(f"tool_choice: no tool named {name!r}")
        return name
    if choice == "required":
        name = (req.tools[0].get("function") or {}).get("name")
        return name if isinstance(name, str) and name else "tool"
    return None


def auto_tool(req: ChatCompletionRequest, every: int) -> str | None:
    """The tool-calling mode (`--tool-call-every k`): when tools are offered and the model
    may choose (`tool_choice` auto or absent), every k-th user turn is answered with a call
    (the turn's number picks the tool); a turn that ends with tool results is answered in
    text, so an agent's tool loop ends."""
    if every <= 0 or not req.tools or req.tool_choice not in (None, "auto"):
        return None
    if req.messages[-1].get("role") != "user":
        return None
    turns = sum(1 for m in req.messages if m.get("role") == "user")
    if turns % every:
        return None
    tool = req.tools[(turns // every - 1) % len(req.tools)].get("function")
    name = tool.get("name") if isinstance(tool, dict) else None
    return name if isinstance(name, str) and name else None


def call_shape(req: ChatCompletionRequest, name: str, seed: int) -> ToolCallShape:
    """How the call of tool `name` looks: arguments drawn from its parameters schema."""
    fns = [t.get("function") for t in req.tools or ()]
    fn = next((f for f in fns if isinstance(f, dict) and f.get("name") == name), None)
    parameters = fn.get("parameters") if fn is not None else None
    return tool_call_shape(name, parameters, seed)


def tool_call(gen: _Generation, seq: Sequence, arguments: str) -> dict[str, Any]:
    """A deterministic tool call whose arguments wrap the choice's pseudo-text."""
    assert gen.tool is not None
    return {
        "id": f"call_{gen.request_id[-12:]}{seq.index}",
        "type": "function",
        "function": {"name": gen.tool.name, "arguments": arguments},
    }


@dataclass(slots=True)
class _Generation:
    """One generation request in flight: its sequences (prompts x n) and how to answer."""

    request_id: str
    chat: bool
    model: str
    created: int
    prompts: list[list[int]]
    prompt_texts: list[str]
    seqs: list[Sequence]
    notify: asyncio.Event
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    echo: bool
    hold_key: str | None = None
    tool: ToolCallShape | None = None
    emitted: list[int] = field(default_factory=list)
    emitted_chars: list[int] = field(default_factory=list)


class EmulatorApp:
    """ASGI app of one emulated engine; `create_app` builds it from an `EmulatorConfig`."""

    def __init__(
        self,
        config: EmulatorConfig,
        *,
        profile: TimingProfile | None = None,
        tokenizer: Tokenizer | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.config = config
        self.profile = profile or config.timing()
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer)
        self.template = chat_template or load_chat_template(config.chat_template)
        self.vocab = Vocabulary(self.tokenizer)
        self.worker_id = config.name
        self.engine_id = f"{self.worker_id}-{uuid.uuid4().hex[:8]}"
        self.root_hash = chain_root(config.model, config.salt)
        self.kv_spec = config.kv_state_spec()
        self.capacity_blocks = config.capacity_blocks(self.profile, self.kv_spec)
        self.metrics = EngineMetrics(
            config.model, self.worker_id, config.role.value, self.profile.name
        )
        self.hybrid = config.hybrid_kv(self.kv_spec, self.capacity_blocks)
        self.metrics.hybrid = self.hybrid is not None
        self.pool = BlockPool(self.capacity_blocks, config.block_size)
        self.host: HostPool | None = None
        if config.cpu_kv_blocks:
            if self.profile.link.cpu_load_bps <= 0:
                raise ConfigError(f"profile {self.profile.name}: a CPU tier needs cpu_load_bps > 0")
            self.host = HostPool(config.cpu_kv_blocks, config.block_size)
        chunk_tokens = config.chunk_capacity_tokens(self.profile)
        self.chunk_store = ChunkStore(chunk_tokens) if chunk_tokens else None
        self.engine = Engine(
            self.profile,
            self.pool,
            self.metrics,
            root_hash=self.root_hash,
            speed=config.speed,
            max_num_seqs=config.max_num_seqs,
            max_batched_tokens=config.max_batched_tokens,
            transfer_timeout_s=config.transfer_timeout_s,
            publish=self._publish,
            host=self.host,
            chunks=self.chunk_store,
            chunk_recompute_tokens=config.chunk_recompute_tokens,
            hybrid=self.hybrid,
        )
        self.mover = KVMover(self.engine, config.node, self.worker_id, config.kv_lease_s)
        self.sidecar: SidecarTier | None = None
        if config.sidecar_url is not None:
            self.sidecar = SidecarTier(config.sidecar_url, config.model)
            self.engine.saver = self.sidecar.save
            self.metrics.sidecar = self.sidecar
        self.publisher: KVEventPublisher | None = None
        self._started = False
        self.routes: dict[tuple[str, str], Handler] = {}
        for method, path, handler in (
            ("POST", "/v1/chat/completions", self.chat_completions),
            ("POST", "/v1/completions", self.completions),
            ("GET", "/v1/models", self.models),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health),
            ("GET", "/ping", self.health),
            ("GET", "/metrics", self.prometheus),
            ("GET", "/version", self.version),
            ("POST", "/tokenize", self.tokenize),
            ("POST", "/detokenize", self.detokenize),
            ("GET", "/server_info", self.server_info),
            ("GET", "/get_server_info", self.server_info),
            ("GET", "/model_info", self.model_info),
            ("GET", "/get_model_info", self.model_info),
            ("GET", "/get_load", self.get_load),
            ("GET", "/kv_blocks", self.kv_blocks),
            ("POST", "/reset_prefix_cache", self.reset_prefix_cache),
            ("POST", "/ownerserve/kv/pull", self.kv_pull),
            ("POST", "/ownerserve/kv/heartbeat", self.kv_heartbeat),
            ("POST", "/ownerserve/kv/read", self.kv_read),
            ("POST", FETCH_PATH, self.kv_fetch),
            ("POST", "/ownerserve/fetch", self.kv_fetch),
            ("POST", CHUNK_READ_PATH, self.kv_read_chunks),
            ("POST", CHUNK_FETCH_PATH, self.kv_fetch_chunks),
        ):
            self.routes[(method, path)] = handler
        self._paths = {p for _m, p in self.routes}

    # --- lifecycle -----------------------------------------------------------------------------

    def startup(self) -> None:
        """Bind the KV event publisher and start the engine (idempotent; needs a running loop)."""
        if self._started:
            return
        self._started = True
        c = self.config
        if c.kv_events_port is not None and self.publisher is None:
            replay = None
            if c.kv_events_replay_port is not None:
                replay = f"tcp://{c.kv_events_host}:{c.kv_events_replay_port}"
            self.publisher = KVEventPublisher(
                f"tcp://{c.kv_events_host}:{c.kv_events_port}",
                topic=c.kv_events_topic,
                replay_endpoint=replay,
            )
            self.publisher.start()
        self.engine.start()

    async def shutdown(self) -> None:
        await self.engine.close()
        await self.mover.close()
        if self.sidecar is not None:
            await self.sidecar.close()
        if self.publisher is not None:
            self.engine.flush_events()
            await self.publisher.close()
            self.publisher = None
        self._started = False

    def _publish(self, events: list[Any]) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)
            self.metrics.kv_events_published += 1

    # --- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._started:
            self.startup()
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        path = scope["path"]
        handler = self.routes.get((scope["method"], path))
        try:
            if handler is None:
                if path in self._paths:
                    raise MethodNotAllowedError(f"method {scope['method']} not allowed on {path}")
                raise NotFoundError(f"no route {path}")
            await handler(scope, receive, tracked)
        except ClientDisconnected:
            return
        except Exception as exc:  # the server must answer, not crash
            if not started:
                await send_error(send, exc)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        return await read_request_body(scope, receive, self.config.max_body_bytes)

    async def _json_body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        return json_object(await self._body(scope, receive))

    def _check_model(self, model: str | None) -> str:
        if model is None or model == self.config.model:
            return self.config.model
        raise ModelNotFoundError(f"The model `{model}` does not exist.")

    # --- generation ----------------------------------------------------------------------------

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = parse_chat(await self._json_body(scope, receive))
        model = self._check_model(req.model)
        text = self.template.render(
            req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt
        )
        if req.continue_final_message:
            text = open_final_message(text, req.messages[-1])
        ids = self.tokenizer.encode(text)
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens or req.max_tokens
        name = forced_tool(req) or auto_tool(req, self.config.tool_call_every)
        tool = None
        if name is not None:
            tool = call_shape(req, name, text_seed(hash_block(self.root_hash, ids), req.seed, 0))
        await self._generate(
            receive, send, req, True, model, [ids], [text], max_tokens, top, echo=False,
            tool=tool,
        )  # fmt: skip

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = parse_completion(await self._json_body(scope, receive))
        model = self._check_model(req.model)
        prompts: list[list[int]] = []
        texts: list[str] = []
        for p in completion_prompts(req):
            if isinstance(p, str):
                prompts.append(self.tokenizer.encode(p))
                texts.append(p)
            else:
                if any(t < 0 or t >= self.tokenizer.vocab_size for t in p):
                    raise InvalidRequestError("prompt: token id out of vocabulary")
                prompts.append(p)
                texts.append(self.tokenizer.decode(p) if req.echo else "")
        await self._generate(
            receive,
            send,
            req,
            False,
            model,
            prompts,
            texts,
            req.max_tokens,
            req.logprobs,
            echo=req.echo,
        )

    def _params(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_len: int,
        max_tokens: int | None,
    ) -> SamplingParams:
        c = self.config
        room = c.max_model_len - prompt_len
        if prompt_len == 0:
            raise InvalidRequestError("prompt: must contain at least one token")
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = prompt_len + (max_tokens or 0)
            raise InvalidRequestError(
                f"This model's maximum context length is {c.max_model_len} tokens. However, you "
                f"requested {asked} tokens ({prompt_len} in the messages, {max_tokens or 0} in "
                "the completion). Please reduce the length of the messages or completion."
            )
        fits = self.capacity_blocks * c.block_size - prompt_len
        if fits <= 0:
            raise InvalidRequestError(
                f"prompt of {prompt_len} tokens does not fit this worker's KV cache "
                f"({self.capacity_blocks} blocks of {c.block_size})"
            )
        limit = min(max_tokens if max_tokens is not None else room, fits)
        return SamplingParams(
            max_tokens=limit,
            min_tokens=min(req.min_tokens, limit),
            ignore_eos=req.ignore_eos,
            stop=stop_strings(req.stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
        )

    async def _generate(
        self,
        receive: Receive,
        send: Send,
        req: ChatCompletionRequest | CompletionRequest,
        chat: bool,
        model: str,
        prompts: list[list[int]],
        prompt_texts: list[str],
        max_tokens: int | None,
        logprobs: int | None,
        *,
        echo: bool,
        tool: ToolCallShape | None = None,
    ) -> None:
        c = self.config
        arrival = time.perf_counter()
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ktp = req.kv_transfer_params or {}
        remote_decode = bool(ktp.get("do_remote_decode"))
        remote_prefill = bool(ktp.get("do_remote_prefill"))
        room = req.bootstrap_room
        sglang_prefill = room is not None and c.role == Role.PREFILL
        sglang_decode = room is not None and c.role == Role.DECODE
        hold_key: str | None = None
        if remote_decode or sglang_prefill:
            hold_key = f"room:{room}" if sglang_prefill else f"req:{request_id}"
            if len(prompts) != 1 or req.n != 1:
                self.engine.holds.fail(hold_key, "the prefill request was rejected")
                raise InvalidRequestError("a prefill for remote decode takes one prompt and n=1")
            max_tokens = 1
        if remote_prefill and sglang_decode:
            raise InvalidRequestError("kv_transfer_params and bootstrap_room are exclusive")
        try:
            params = [self._params(req, len(p), max_tokens) for p in prompts]
        except OwnerServeError as exc:
            if hold_key is not None:  # a decode waiting on this room learns at once
                self.engine.holds.fail(hold_key, f"the prefill request was rejected: {exc}")
            raise

        bs = c.block_size
        hashes = [prompt_block_hashes(p, bs, self.root_hash) for p in prompts]
        chunks: tuple[Chunk, ...] = ()
        layout = ktp.get(CHUNK_PARAMS_KEY)
        if layout is not None and self.chunk_store is not None:
            if len(prompts) != 1:
                raise InvalidRequestError("a chunk layout takes one prompt")
            chunks = parse_layout(layout, len(prompts[0]))
        remote: RemotePrefill | None = None
        if remote_prefill or sglang_decode:
            if len(prompts) != 1:
                raise InvalidRequestError("a remote-prefilled decode takes one prompt")
            remote = self._remote_prefill(req, ktp, sglang_decode)

        if self.sidecar is not None and remote is None:
            for h in hashes:
                await self._load_from_sidecar(h)

        notify = asyncio.Event()
        seqs: list[Sequence] = []
        for i, (p, h, sp) in enumerate(zip(prompts, hashes, params, strict=True)):
            prompt_key = hash_block(self.root_hash, p)
            natural = sp.max_tokens if sp.ignore_eos else max(c.output_len, sp.min_tokens + 1)
            for j in range(req.n):
                seq = Sequence(
                    request_id,
                    i * req.n + j,
                    p,
                    h,
                    sp,
                    OutputText(self.vocab, text_seed(prompt_key, req.seed, j), natural),
                    notify,
                    arrival,
                )
                seqs.append(seq)
        every = c.stream_interval if req.stream else 0
        for seq in seqs:
            seq.notify_every = every
        seqs[0].remote = remote
        for seq in seqs:
            seq.chunks = chunks
        seqs[0].hold_key = hold_key
        seqs[0].hold_s = c.transfer_timeout_s if sglang_prefill else c.kv_lease_s

        gen = _Generation(
            request_id=request_id,
            chat=chat,
            model=model,
            created=int(time.time()),
            prompts=prompts,
            prompt_texts=prompt_texts,
            seqs=seqs,
            notify=notify,
            stream=bool(req.stream),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            continuous_usage=bool(
                req.stream_options
                and req.stream_options.include_usage
                and req.stream_options.continuous_usage_stats
            ),
            logprobs=logprobs,
            echo=echo,
            hold_key=hold_key,
            tool=tool,
            emitted=[0] * len(seqs),
            emitted_chars=[0] * len(seqs),
        )
        engine = self.engine
        watcher = asyncio.ensure_future(receive())

        def on_disconnect(task: asyncio.Future[dict[str, Any]]) -> None:
            if task.cancelled():
                return
            for seq in seqs:
                engine.abort(seq)

        watcher.add_done_callback(on_disconnect)
        try:
            for seq in seqs:
                engine.submit(seq)
            if remote is not None:
                self.mover.track(remote)
                # The pull runs once the scheduler has blocks for it; its failure is a 400.
                await seqs[0].remote_ready.wait()
                if seqs[0].error is not None:
                    raise seqs[0].error
            if gen.stream:
                await self._stream(gen, send)
            else:
                await self._respond(gen, send)
        finally:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()
            for seq in seqs:
                if not seq.finished:
                    engine.abort(seq)

    def _remote_prefill(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        ktp: dict[str, Any],
        sglang: bool,
    ) -> RemotePrefill:
        """Where this decode request's prompt KV lies; malformed parameters are a 400 now."""
        c = self.config
        if sglang:
            host = req.bootstrap_host
            if not host:
                raise InvalidRequestError("bootstrap_room given without bootstrap_host")
            port = req.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT
            return RemotePrefill(
                f"http://{host}:{port}",
                f"room:{req.bootstrap_room}",
                None,
                wait_s=c.transfer_timeout_s,
                what=f"bootstrap room {req.bootstrap_room}",
                renews_lease=False,
            )
        missing = [k for k in ("remote_host", "remote_port", "remote_request_id") if not ktp.get(k)]
        if missing:
            raise InvalidRequestError(
                f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)}"
            )
        host, port = ktp["remote_host"], ktp["remote_port"]
        if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
            raise InvalidRequestError(
                "kv_transfer_params: remote_host must be a string and remote_port a port number"
            )
        return RemotePrefill(
            f"http://{host}:{port}",
            f"req:{ktp['remote_request_id']}",
            ktp.get("remote_engine_id"),
            wait_s=0.0,
            what="kv_transfer_params",
            renews_lease=True,
        )

    def _transfer_params(self, gen: _Generation) -> dict[str, Any] | None:
        if gen.hold_key is None or not gen.hold_key.startswith("req:"):
            return None
        hold = self.engine.holds.get(gen.hold_key)
        if hold is None:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": hold.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_host": self.config.public_host,
            "remote_port": self.config.port,
            "remote_request_id": gen.request_id,
            "tp_size": 1,
        }

    def _usage(self, gen: _Generation) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in gen.prompts)
        completion = sum(len(s.out_ids) for s in gen.seqs)
        n = len(gen.seqs) // len(gen.prompts)
        cached = sum(max(0, gen.seqs[i * n].cached_tokens) for i in range(len(gen.prompts)))
        return usage(prompt_tokens, completion, cached)

    async def _load_from_sidecar(self, hashes: list[int]) -> None:
        """Load the prompt blocks past the HBM hit that its sidecar holds into the cache (a
        connector's load before the scheduler sees the request), after the modelled copy
        time of their bytes; the scheduler then finds them as a prefix hit."""
        assert self.sidecar is not None
        pool = self.pool
        hit = next((i for i, h in enumerate(hashes) if not pool.contains(h)), len(hashes))
        if hit == len(hashes):
            return
        blocks = await self.sidecar.load(hashes[hit:])
        parent = hashes[hit - 1] if hit else None
        if not blocks or blocks[0].parent_hash != parent:
            return
        nbytes = len(blocks) * self.engine.block_bytes
        await self.mover.wait_for_link(nbytes, self.config.node)
        ids = pool.insert(blocks)
        pool.free(ids)  # resident and reusable; the request about to be scheduled hits them
        self.metrics.kv_received_bytes["sidecar"] += nbytes
        self.metrics.kv_received_blocks["sidecar"] += len(blocks)
        self.engine.flush_events()

    async def _respond(self, gen: _Generation, send: Send) -> None:
        seqs = gen.seqs
        while not all(s.finished for s in seqs):
            await gen.notify.wait()
            gen.notify.clear()
        if any(s.finish_reason == "abort" for s in seqs):
            # The client went away (nothing is sent then) or the engine dropped the request.
            raise EngineAbortError(f"request {gen.request_id} was aborted")
        choices = []
        n = len(seqs) // len(gen.prompts)
        for seq in seqs:
            text = seq.output_text()
            choice: dict[str, Any] = {"index": seq.index}
            finish = seq.finish_reason
            if gen.chat and gen.tool is not None:
                call = tool_call(gen, seq, gen.tool.arguments(text))
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
                choice["logprobs"] = None
                finish = "tool_calls" if finish == "stop" else finish
            elif gen.chat:
                choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
                choice["logprobs"] = (
                    chat_logprobs(seq.out_ids, seq.pieces, gen.logprobs)
                    if gen.logprobs is not None
                    else None
                )
            else:
                prefix = gen.prompt_texts[seq.index // n] if gen.echo else ""
                choice["text"] = prefix + text
                choice["logprobs"] = (
                    completion_logprobs(seq.out_ids, seq.pieces, gen.logprobs, len(prefix))
                    if gen.logprobs is not None
                    else None
                )
            choice["finish_reason"] = finish
            choice["stop_reason"] = seq.stop_reason
            choices.append(choice)
        body = {
            "id": gen.request_id,
            "object": "chat.completion" if gen.chat else "text_completion",
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
            "usage": self._usage(gen),
        }
        ktp = self._transfer_params(gen)
        if ktp is not None:
            body["kv_transfer_params"] = ktp
        await send_json(send, 200, body)

    def _new_output(self, gen: _Generation, k: int, seq: Sequence) -> tuple[str, int, int]:
        """Text not yet sent for choice `k`, and the token range it covers."""
        start = gen.emitted[k]
        end = len(seq.out_ids)
        if not seq.params.stop:
            text = "".join(seq.pieces[start:end])
            gen.emitted[k] = end
            return text, start, end
        full = seq.output_text()
        limit = len(full)
        if not seq.finished:
            limit -= max(len(s) for s in seq.params.stop) - 1
        sent = gen.emitted_chars[k]
        if limit <= sent:
            return "", start, start
        gen.emitted_chars[k] = limit
        gen.emitted[k] = end
        return full[sent:limit], start, end

    async def _stream(self, gen: _Generation, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        rid, created, model = gen.request_id, gen.created, gen.model
        obj = "chat.completion.chunk" if gen.chat else "text_completion"
        seqs = gen.seqs
        n = len(seqs) // len(gen.prompts)

        def chunk_of(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
            }

        out = bytearray()
        if gen.chat:
            for seq in seqs:
                role = {"role": "assistant", "content": ""}
                first = {"index": seq.index, "delta": role, "logprobs": None, "finish_reason": None}
                out += _sse(chunk_of([first]))
        elif gen.echo:
            for seq in seqs:
                text = gen.prompt_texts[seq.index // n]
                first = {"index": seq.index, "text": text, "logprobs": None, "finish_reason": None}
                out += _sse(chunk_of([first]))
        # the role (or echo) chunks go out with the first tokens, as vLLM's do (it sends them
        # on the first output of its engine): a client, or a router counting a prefill as
        # queued until its first bytes, sees nothing before the prefill is done
        head = bytes(out)
        done = [False] * len(seqs)
        while True:
            await gen.notify.wait()
            gen.notify.clear()
            out = bytearray()
            for k, seq in enumerate(seqs):
                if done[k]:
                    continue
                if seq.finish_reason == "abort":
                    event = sse_error_event(EngineAbortError(f"request {rid} was aborted"))
                    await send({"type": "http.response.body", "body": event})
                    return
                text, lo, hi = self._new_output(gen, k, seq)
                finished = seq.finished
                if not text and not finished:
                    continue
                choice: dict[str, Any] = {"index": seq.index}
                lp = None
                if gen.logprobs is not None and hi > lo:
                    ids, pieces = seq.out_ids[lo:hi], seq.pieces[lo:hi]
                    lp = (
                        chat_logprobs(ids, pieces, gen.logprobs)
                        if gen.chat
                        else completion_logprobs(ids, pieces, gen.logprobs, 0)
                    )
                finish = seq.finish_reason
                if gen.chat and gen.tool is not None:
                    shape = gen.tool
                    args = shape.piece(text)
                    if lo == 0:
                        args = shape.head + args
                    if finished:
                        args += shape.tail
                        finish = "tool_calls" if finish == "stop" else finish
                    call: dict[str, Any] = {"index": 0, "function": {"arguments": args}}
                    if lo == 0:
                        call = tool_call(gen, seq, args) | {"index": 0}
                    choice["delta"] = {"tool_calls": [call]}
                    lp = None
                elif gen.chat:
                    choice["delta"] = {"content": text} if text else {}
                else:
                    choice["text"] = text
                choice["logprobs"] = lp
                choice["finish_reason"] = finish if finished else None
                if finished:
                    choice["stop_reason"] = seq.stop_reason
                    done[k] = True
                chunk = chunk_of([choice])
                if gen.continuous_usage:
                    chunk["usage"] = self._usage(gen)
                out += _sse(chunk)
            last = all(done)
            if last:
                if gen.include_usage:
                    out += _sse(chunk_of([]) | {"usage": self._usage(gen)})
                out += _DONE
            if out:
                if head:
                    out[0:0] = head
                    head = b""
                more = not last
                await send({"type": "http.response.body", "body": bytes(out), "more_body": more})
            if last:
                return

    # --- small endpoints -----------------------------------------------------------------------

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        c = self.config
        card = {
            "id": c.model,
            "object": "model",
            "created": 0,
            "owned_by": "ownerserve-emulator",
            "root": c.model,
            "parent": None,
            "max_model_len": c.max_model_len,
        }
        await send_json(send, 200, {"object": "list", "data": [card]})

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]}
        )
        await send({"type": "http.response.body", "body": b""})

    async def version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"version": "0.1.0-ownerserve-emulator"})

    def gauges(self) -> dict[str, float]:
        pool = self.pool
        host = self.host
        return {
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
            "kv_usage": pool.usage,
            "blocks_held": pool.num_cached,
            "blocks_in_use": pool.num_blocks - pool.num_free,
            "capacity": pool.num_blocks,
            "block_size": self.config.block_size,
            "block_bytes": self.engine.block_bytes,
            "evicted": pool.evicted_blocks,
            "held_transfers": len(self.engine.holds),
            "expired_transfers": self.engine.holds.expired,
            "cpu_capacity": 0 if host is None else host.num_blocks,
            "cpu_held": 0 if host is None else host.num_cached,
            "cpu_usage": 0.0 if host is None else host.usage,
            "cpu_evicted": 0 if host is None else host.evicted_blocks,
            "cpu_stored": 0 if host is None else host.stored_blocks,
            "cpu_store_failures": 0 if host is None else host.store_failures,
            "chunk_tokens": 0 if self.chunk_store is None else self.chunk_store.used_tokens,
            "chunk_capacity": 0 if self.chunk_store is None else self.chunk_store.capacity_tokens,
        }

    async def prometheus(self, scope: Scope, receive: Receive, send: Send) -> None:
        text = self.metrics.render(self.gauges)
        await send_body(send, 200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(scope, receive)
        self._check_model(body.get("model"))
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise InvalidRequestError("messages: must be a list")
            text = self.template.render(
                messages,
                tools=body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            )
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise InvalidRequestError("tokenize needs 'prompt' (a string) or 'messages'")
        ids = self.tokenizer.encode(text)
        await send_json(
            send,
            200,
            {
                "count": len(ids),
                "max_model_len": self.config.max_model_len,
                "tokens": ids,
                "token_strs": None,
            },
        )

    async def detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(scope, receive)
        self._check_model(body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise InvalidRequestError("tokens: must be a list of token ids")
        await send_json(send, 200, {"prompt": self.tokenizer.decode(tokens)})

    def _disaggregation_mode(self) -> str:
        return {Role.PREFILL: "prefill", Role.DECODE: "decode"}.get(self.config.role, "null")

    async def server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        c = self.config
        # No model_path/tokenizer_path: sglang-router would try to download that tokenizer.
        info = {
            "served_model_name": c.model,
            "disaggregation_mode": self._disaggregation_mode(),
            "disaggregation_bootstrap_port": c.bootstrap_port,
            "dp_size": 1,
            "tp_size": 1,
            "page_size": c.block_size,
            "max_total_num_tokens": self.capacity_blocks * c.block_size,
            "max_running_requests": self.engine.max_num_seqs,
            "chunked_prefill_size": self.engine.max_batched_tokens,
            "context_length": c.max_model_len,
            "internal_states": [{"last_gen_throughput": 0.0}],
            "version": "0.1.0-ownerserve-emulator",
            "worker_id": self.worker_id,
            "role": c.role.value,
        }
        await send_json(send, 200, info)

    async def model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        c = self.config
        info = {
            "served_model_name": c.model,
            "is_generation": True,
            "max_model_len": c.max_model_len,
            "max_req_input_len": c.max_model_len,
        }
        await send_json(send, 200, info)

    async def get_load(self, scope: Scope, receive: Receive, send: Send) -> None:
        e = self.engine
        tokens = sum(s.num_tokens for s in e.running)
        await send_json(
            send,
            200,
            {
                "load": e.num_running + e.num_waiting,
                "num_reqs": e.num_running,
                "num_waiting_reqs": e.num_waiting,
                "num_tokens": tokens,
                "kv_cache_usage": self.pool.usage,
            },
        )

    async def kv_blocks(self, scope: Scope, receive: Receive, send: Send) -> None:
        c = self.config
        body: dict[str, Any] = {
            "worker_id": self.worker_id,
            "model": c.model,
            "node": c.node,
            "block_size": c.block_size,
            "capacity_blocks": self.capacity_blocks,
            "block_bytes": self.engine.block_bytes,
            "blocks_held": self.pool.num_cached,
            "block_hashes": self.pool.cached_hashes(),
        }
        if self.hybrid is not None:
            body.update(self.hybrid.describe())
        if self.host is not None:
            body["cpu_capacity_blocks"] = self.host.num_blocks
            body["cpu_blocks_held"] = self.host.num_cached
            body["cpu_block_hashes"] = self.host.cached_hashes()
        if self.chunk_store is not None:
            body["chunk_capacity_tokens"] = self.chunk_store.capacity_tokens
            body["chunk_tokens_held"] = self.chunk_store.used_tokens
            body["chunk_hashes"] = [f"{h:016x}" for h in self.chunk_store.hashes()]
        await send_json(send, 200, body)

    async def reset_prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._body(scope, receive)
        if not self.pool.reset():
            raise InvalidRequestError("cannot reset the prefix cache while requests hold blocks")
        if self.hybrid is not None and self.hybrid.pool is not None:
            self.hybrid.pool.reset()  # nothing runs: no window block is referenced either
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        external = query.get("reset_external", ["false"])[-1].lower() in ("true", "1", "yes", "on")
        if external and self.host is not None:
            self.host.reset()  # vLLM's connector reset publishes no events of its own
            if self.hybrid is not None and self.hybrid.host is not None:
                self.hybrid.host.reset()
        if self.chunk_store is not None:
            self.chunk_store.clear()
        self.engine.flush_events()
        await send_json(send, 200, {"status": "ok"})

    # --- the worker-side KV API ------------------------------------------------------------------

    @staticmethod
    def _hash_list(body: dict[str, Any], key: str = "block_hashes") -> list[int]:
        value = body.get(key)
        if not isinstance(value, list) or not all(
            isinstance(h, int) and 0 <= h < 1 << 64 for h in value
        ):
            raise InvalidRequestError(f"{key}: must be a list of unsigned 64-bit block hashes")
        return value

    async def kv_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A decode side takes the KV a prefill here holds for it, and the hold is released:
        at once, or with `until_read` once the decode side closes the answer's connection (its
        transfer is over; the answer is its first line)."""
        body = await self._json_body(scope, receive)
        key = body.get("transfer_id")
        if not isinstance(key, str) or not key:
            raise InvalidRequestError("transfer_id: required")
        wanted = self._hash_list(body)
        engine_id = body.get("engine_id")
        if engine_id is not None and engine_id != self.engine_id:
            raise NotFoundError(
                f"stale kv_transfer_params: engine {engine_id!r} is not this worker's "
                f"(now {self.engine_id!r}; restarted?)"
            )
        try:
            wait_s = min(float(body.get("wait_s") or 0.0), self.config.transfer_timeout_s)
        except (TypeError, ValueError):
            raise InvalidRequestError("wait_s: must be a number") from None
        until_read = body.get("until_read") is True
        holds = self.engine.holds
        hold = await holds.wait(key, wait_s)
        if hold is None:
            reason = holds.failure(key)
            if reason is not None:
                raise InvalidRequestError(f"transfer {key!r}: {reason}")
            raise NotFoundError(
                f"transfer {key!r} is unknown or expired on worker {self.worker_id!r}"
            )
        try:
            held = set(hold.block_hashes)
            served: list[int] = []
            for h in wanted:
                if h not in held:
                    break
                served.append(h)
            answer = {"block_hashes": served}
            # a hybrid model's windows and tail at the last block served go with the blocks
            state = 0
            if served:
                state = self.engine.state_bytes_at(hold.block_hashes.index(served[-1]) + 1)
            await self._send_kv(
                send, "pd", len(served), answer, streamed=until_read, extra_bytes=state
            )
            if until_read:
                await self._while_read(receive, send)
        finally:
            self.pool.free(hold.block_ids)
            self.engine.poke()

    async def _while_read(self, receive: Receive, send: Send) -> None:
        """Keep a pull's blocks referenced while the decode side reads them: until it closes
        the connection (its transfer is over: NIXL's consumer notifies the producer), at most
        one lease (`kv_lease_s`), after which the answer ends and the reader's transfer fails."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.kv_lease_s):
                while (await receive())["type"] != "http.disconnect":
                    pass
                return
        await send({"type": "http.response.body", "body": b""})

    async def _send_kv(
        self,
        send: Send,
        kind: str,
        blocks: int,
        answer: dict[str, Any],
        tokens: int | None = None,
        streamed: bool = False,
        extra_bytes: int = 0,
    ) -> None:
        """Answer a read of KV by another worker: count what is sent (`blocks` blocks, or
        `tokens` tokens of chunk KV) under transfer `kind`, and send `answer` with this
        worker's id, node and the bytes (`extra_bytes` beside the blocks: a hybrid model's
        windows and tail); `streamed`: as the first line of a response left open (a P->D
        pull's, `_while_read` ends it)."""
        if tokens is None:
            nbytes = blocks * self.engine.block_bytes + extra_bytes
        else:
            nbytes = tokens * self.profile.kv_bytes_per_token
        self.metrics.kv_sent_bytes[kind] += nbytes
        self.metrics.kv_sent_blocks[kind] += blocks
        body = {"worker_id": self.worker_id, "node": self.config.node, **answer}
        body["num_bytes"] = nbytes
        if not streamed:
            await send_json(send, 200, body)
            return
        # the answer's first line; the rest of the response is its end (`_while_read`)
        start = {"type": "http.response.start", "status": 200, "headers": [_NDJSON]}
        await send(start)
        line = orjson.dumps(body) + b"\n"
        await send({"type": "http.response.body", "body": line, "more_body": True})

    async def kv_heartbeat(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A decode side's requests still wait on these transfers: extend their holds by 2/3
        of the lease (vLLM NixlConnector's heartbeat handling)."""
        body = await self._json_body(scope, receive)
        ids = body.get("transfer_ids")
        if not isinstance(ids, list) or not all(isinstance(k, str) for k in ids):
            raise InvalidRequestError("transfer_ids: must be a list of transfer ids")
        extension = self.config.kv_lease_s * 2 / 3
        renewed = sum(self.engine.holds.renew(k, extension) for k in ids)
        await send_json(send, 200, {"renewed": renewed})

    async def kv_read(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Another worker copies cached blocks from here (artifact fetch source side)."""
        body = await self._json_body(scope, receive)
        wanted = self._hash_list(body)
        blocks = []
        missing = []
        for h, b in zip(wanted, self.pool.read(wanted), strict=True):
            if b is None:
                missing.append(h)
            else:
                blocks.append({"hash": h, "parent": b.parent_hash, "token_ids": b.token_ids})
        await self._send_kv(send, "fetch", len(blocks), {"blocks": blocks, "missing": missing})

    async def kv_fetch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pull `block_hashes` from the worker at `source_url` into this worker's cache."""
        req = KVFetchRequest.from_json(await self._json_body(scope, receive))
        if req.model is not None:
            self._check_model(req.model)
        if req.block_size is not None and req.block_size != self.config.block_size:
            raise InvalidRequestError(
                f"block_size: {req.block_size} differs from this worker's {self.config.block_size}"
            )
        result = await _unless_gone(
            receive,
            self.mover.fetch(
                req.source_url, list(req.block_hashes), self.config.transfer_timeout_s
            ),
        )
        await send_json(send, 200, result.as_json())

    async def kv_read_chunks(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Another worker copies chunk KV from this worker's chunk store (chunk fetch source
        side): each requested chunk held, with its token count."""
        body = await self._json_body(scope, receive)
        hashes = body.get("chunk_hashes")
        if not isinstance(hashes, list) or not all(
            type(h) is int and 0 <= h < 1 << 64 for h in hashes
        ):
            raise InvalidRequestError("chunk_hashes: must be a list of unsigned 64-bit hashes")
        store = self.chunk_store
        chunks = []
        missing = []
        for h in hashes:
            tokens = 0 if store is None else store.lookup(h)
            if tokens:
                chunks.append({"hash": h, "tokens": tokens})
            else:
                missing.append(h)
        tokens = sum(c["tokens"] for c in chunks)
        await self._send_kv(send, "chunk", 0, {"chunks": chunks, "missing": missing}, tokens)

    async def kv_fetch_chunks(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pull `chunk_hashes` from the chunk store of the worker at `source_url` into this
        worker's (a worker without a chunk store answers 400)."""
        req = KVChunkFetchRequest.from_json(await self._json_body(scope, receive))
        if req.model is not None:
            self._check_model(req.model)
        result = await _unless_gone(
            receive,
            self.mover.fetch_chunks(
                req.source_url, list(req.chunk_hashes), self.config.transfer_timeout_s
            ),
        )
        await send_json(send, 200, result.as_json())


async def _unless_gone(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client goes away first (its request body read already):
    then `work` is cancelled (a fetch stops pulling and stores nothing) and
    `ClientDisconnected` raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(receive())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected("the client went away")
    return task.result()


def create_app(config: EmulatorConfig | None = None, **overrides: Any) -> EmulatorApp:
    """The ASGI app of one emulated engine (`overrides` are `EmulatorConfig` fields)."""
    base = config or EmulatorConfig()
    if overrides:
        from dataclasses import replace

        base = replace(base, **overrides)
    return EmulatorApp(base)
