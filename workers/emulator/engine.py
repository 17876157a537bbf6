"""The emulated engine's scheduler: continuous batching over a paged KV cache, timed by a profile.

One asyncio task runs vLLM-V1-style steps. Each step takes running sequences first (one token
each for decodes, a chunk of the rest for prefills), preempting the newest running sequence when
blocks run out, then admits waiting sequences (reusing cached prefix blocks) while the token
budget (`max_batched_tokens`) and `max_num_seqs` allow. The step lasts
`decode_step_s(decodes, context) + prefill_s(...)` of the timing profile, divided by `--speed`,
slept in real time; then every sequence whose tokens are all computed samples its next token.
Full blocks are cached under their chained hashes as they are computed, and the step's cache
events are published as one KV event batch.

Prefill results for a remote decode are *held* (their blocks stay referenced) under a transfer
key until the decode side pulls them or the hold times out (`TransferHolds`; a vLLM-style hold
is a lease the decode side renews while the request waits there, as NixlConnector's heartbeats
do). On the decode side a remote-prefilled request is admitted like vLLM's async KV load: the
scheduler allocates blocks for its whole prompt first (waiting, first come first served, while
they are not free), then the pull runs with the request parked (`SeqState.LOADING`, not
preemptible), then it runs with the pulled tokens computed.

With a CPU tier (`HostPool`, vLLM's KV offloading) computed prompt blocks are also written to
CPU memory, and a waiting request whose prefix continues in CPU past what HBM caches is
admitted like an async KV load too: blocks for the CPU part are allocated (once they fit beside
the blocks that loads and prefills already admitted still need, as vLLM reserves), the request is
parked while they load at the profile's host-to-device bandwidth (`link.cpu_load_bps`, loads
queued FIFO on the one PCIe link), then it runs with only the rest to compute.

With a chunk store (`ChunkStore`, a chunk pool beside the KV pool) a request carrying a chunk layout
(`Sequence.chunks`, from `kv_transfer_params.ownerserve`) reuses, at admission, every chunk
past its prefix hit that the store holds, at whatever position it now sits: those tokens are
counted as cached and cost `rerotate_per_token_s` each (the KV copied into the request's
blocks, K re-rotated) instead of their prefill, less the first `chunk_recompute_tokens` of
each chunk, computed again (EPIC's LegoLink). Chunks computed by its prefill are then stored.

With a hybrid-attention spec (`HybridKV`: compressed and sliding-window groups, per-sequence
state) the block pool is the sealed groups' block table and the windows have a pool of their
own: a sequence holds only its last window blocks, those that fall out of the window stay
cached where the retention policy keeps their boundary, a prefix hit resumes only where every
group can be restored (or rebuilds the windows by recomputing n_win·L tokens, charged to the
step), and KV events are tagged per group. A dense model has no `HybridKV`: all of this is
skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum

from ownerserve.chunks import Chunk
from ownerserve.errors import OwnerServeError, UpstreamError
from ownerserve.events import KVEvent
from ownerserve.hashing import hash_block
from ownerserve.profiles import TimingProfile
from ownerserve.tasks import cancel_and_wait
from workers.emulator.chunk_store import ChunkStore
from workers.emulator.hetero import HybridKV, WindowRef
from workers.emulator.kv_cache import BlockPool, CachedBlock, HostPool, NewBlock
from workers.emulator.metrics import EngineMetrics
from workers.emulator.textgen import OutputText

log = logging.getLogger(__name__)

_MAX_LAG_S = 0.1
"""How far the step clock may fall behind real time before it stops catching up. Each step's
deadline follows the previous one's, so a sleep that ended early (millisecond timers) or late
(a busy box) is made up by the next: the mean step time stays the modelled one, at the cost
of some jitter, as long as the lag stays under this bound."""


class SeqState(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    LOADING = 3
    """Blocks allocated, remote KV being pulled into them (vLLM's WAITING_FOR_REMOTE_KVS)."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode request's prompt KV lies, to pull once its blocks are allocated here."""

    source_url: str
    transfer_id: str
    engine_id: str | None
    wait_s: float
    """How long the source may wait for the transfer to appear (SGLang rooms); 0 for vLLM."""
    what: str
    """How errors name the transfer (`kv_transfer_params`, `bootstrap room N`)."""
    renews_lease: bool
    """The source holds the KV under a lease this side renews while the request waits (vLLM)."""


Loader = Callable[["Sequence", RemotePrefill, list[int]], Awaitable[list[int]]]
"""Pulls the listed prompt block hashes of a sequence from its source; returns the leading
ones received (the transfer time has passed). Raises `OwnerServeError` when the pull fails."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The parts of a request's sampling settings the emulator honours."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None


class Sequence:
    """One choice of one request moving through the engine."""

    __slots__ = (
        "_tail",
        "admitted_at",
        "arrival",
        "blocks",
        "cached_tokens",
        "chunk_reused",
        "chunks",
        "chunks_pinned",
        "chunks_stored",
        "error",
        "external_tokens",
        "finish_reason",
        "finished_at",
        "first_token_at",
        "hashes",
        "hold_key",
        "hold_s",
        "host_tokens",
        "index",
        "last_token_at",
        "load_task",
        "notify",
        "notify_every",
        "num_computed",
        "num_hashed",
        "num_offloaded",
        "num_tokens",
        "on_finish",
        "out_ids",
        "params",
        "pieces",
        "prompt_ids",
        "rebuild",
        "remote",
        "remote_ready",
        "request_id",
        "resume",
        "reused",
        "state",
        "stop_reason",
        "text",
        "text_limit",
        "win",
    )

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        prompt_hashes: list[int],
        params: SamplingParams,
        text: OutputText,
        notify: asyncio.Event,
        arrival: float,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt_ids = prompt_ids
        self.hashes = list(prompt_hashes)
        self.params = params
        self.text = text
        self.notify = notify
        self.arrival = arrival
        self.state = SeqState.WAITING
        self.blocks: list[int] = []
        self.num_computed = 0
        self.num_hashed = 0
        self.out_ids: list[int] = []
        self.num_tokens = len(prompt_ids)
        self.notify_every = 1
        """Wake the consumer every this many tokens; 0: only when finished (non-streamed)."""
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text_limit: int | None = None
        self.cached_tokens = -1
        self.external_tokens = 0
        self.host_tokens = 0
        """Of `external_tokens`, those loaded from the CPU tier."""
        self.num_offloaded = 0
        """Leading prompt blocks offered to the CPU tier (vLLM's `next_stored_chunk_idx`)."""
        self.admitted_at = 0.0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.finished_at = 0.0
        self.hold_key: str | None = None
        self.hold_s = 0.0
        """How long the prefill result stays held for its decode side (unless renewed)."""
        self.remote: RemotePrefill | None = None
        """Prompt KV to pull before running; None once pulled (a preempted request then
        recomputes, as vLLM triggers one KV transfer per request)."""
        self.remote_ready = asyncio.Event()
        """Set when the remote KV is in (or the sequence finished without it)."""
        self.load_task: asyncio.Task[None] | None = None
        self.error: OwnerServeError | None = None
        self.on_finish: Callable[[Sequence], None] | None = None
        self._tail = ""
        self.chunks: tuple[Chunk, ...] = ()
        """The prompt's chunk layout (position-independent chunk reuse); () for none."""
        self.reused: list[tuple[int, int]] = []
        """Prompt spans taken from the chunk store at admission (copied, not computed)."""
        self.chunk_reused = 0
        """Tokens of `reused`."""
        self.chunks_pinned: list[int] = []
        self.chunks_stored = False
        self.win: list[WindowRef] = []
        """Window blocks held (hybrid specs): the last window of the computed prefix."""
        self.rebuild = 0
        """Tokens to recompute before the next step to rebuild the windows (hybrid specs)."""
        self.resume = ""
        """How the prefix hit's mutable state was restored
        (`ownerserve.kvstate.resume.RESUME_KINDS`)."""

    def reused_between(self, lo: int, hi: int) -> int:
        """Tokens of [lo, hi) taken from the chunk store."""
        n = 0
        for a, b in self.reused:
            if b > lo and a < hi:
                n += (b if b < hi else hi) - (a if a > lo else lo)
        return n

    @property
    def finished(self) -> bool:
        return self.state == SeqState.FINISHED

    def tokens(self, lo: int, hi: int) -> tuple[int, ...]:
        """Token ids [lo, hi) of prompt + output."""
        p = len(self.prompt_ids)
        if hi <= p:
            return tuple(self.prompt_ids[lo:hi])
        if lo >= p:
            return tuple(self.out_ids[lo - p : hi - p])
        return tuple(self.prompt_ids[lo:]) + tuple(self.out_ids[: hi - p])

    def output_text(self) -> str:
        text = "".join(self.pieces)
        return text if self.text_limit is None else text[: self.text_limit]

    def _append(self, token_id: int, piece: str) -> None:
        """Record a sampled token and decide whether the sequence is done."""
        p = self.params
        self.out_ids.append(token_id)
        self.num_tokens += 1
        if token_id == self.text.eos_id and not p.ignore_eos and len(self.out_ids) > p.min_tokens:
            self.pieces.append("")
            self.finish_reason = "stop"
            return
        if token_id in p.stop_token_ids and len(self.out_ids) > p.min_tokens:
            self.pieces.append("")
            self.finish_reason, self.stop_reason = "stop", token_id
            return
        self.pieces.append(piece)
        if p.stop and len(self.out_ids) > p.min_tokens:
            longest = max(len(s) for s in p.stop)
            self._tail = (self._tail + piece)[-(longest + len(piece)) :]
            for s in p.stop:
                if s and s in self._tail:
                    text = "".join(self.pieces)
                    at = text.find(s, max(0, len(text) - len(self._tail)))
                    self.text_limit = at + len(s) if p.include_stop_str_in_output else at
                    self.finish_reason, self.stop_reason = "stop", s
                    return
        if len(self.out_ids) >= p.max_tokens:
            self.finish_reason = "length"


@dataclass(slots=True)
class TransferHold:
    """Prefill KV kept for a remote decode: referenced blocks under a transfer key."""

    key: str
    block_ids: list[int]
    block_hashes: list[int]
    expires_at: float
    handle: asyncio.TimerHandle | None = None


class TransferHolds:
    """Prefill results waiting for their decode side, with waiters for keys not there yet.

    A hold ends when taken, or when it expires unclaimed (as vLLM's NIXL producer frees blocks
    whose lease ran out: `_reap_expired_send_leases`); `expired` counts the latter."""

    def __init__(
        self, pool: BlockPool, timeout_s: float, on_release: Callable[[], None] | None = None
    ) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._on_release = on_release
        self.expired = 0
        self._held: dict[str, TransferHold] = {}
        self._failed: dict[str, str] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key: str, block_hashes: list[int], timeout_s: float | None = None) -> None:
        """Reference the cached blocks `block_hashes` until taken or `timeout_s` passes
        (default: the transfer timeout)."""
        self.release(key)
        ids = self._pool.touch(block_hashes)
        loop = asyncio.get_running_loop()
        ttl = self._timeout_s if timeout_s is None else timeout_s
        handle = loop.call_later(ttl, self._expire, key)
        self._held[key] = TransferHold(key, ids, list(block_hashes), loop.time() + ttl, handle)
        self._wake(key)

    def renew(self, key: str, extension_s: float) -> bool:
        """Keep the hold for `key` at least `extension_s` from now (a consumer's heartbeat: vLLM
        `NixlBaseConnectorWorker._handle_heartbeat`); False if there is no such hold."""
        hold = self._held.get(key)
        if hold is None:
            return False
        loop = asyncio.get_running_loop()
        expires_at = loop.time() + extension_s
        if expires_at > hold.expires_at:
            if hold.handle is not None:
                hold.handle.cancel()
            hold.expires_at = expires_at
            hold.handle = loop.call_at(expires_at, self._expire, key)
        return True

    def _expire(self, key: str) -> None:
        if key in self._held:
            self.expired += 1
            self.release(key)

    def fail(self, key: str, reason: str) -> None:
        """The prefill for `key` will never come (aborted, failed)."""
        self._failed[key] = reason
        asyncio.get_running_loop().call_later(self._timeout_s, self._failed.pop, key, None)
        self._wake(key)

    def _wake(self, key: str) -> None:
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    def release(self, key: str) -> None:
        hold = self._held.pop(key, None)
        if hold is not None:
            if hold.handle is not None:
                hold.handle.cancel()
            self._pool.free(hold.block_ids)
            if self._on_release is not None:
                self._on_release()

    def take(self, key: str) -> TransferHold | None:
        """Remove and return the hold (its blocks stay referenced: release them when done)."""
        hold = self._held.pop(key, None)
        if hold is not None and hold.handle is not None:
            hold.handle.cancel()
        return hold

    def get(self, key: str) -> TransferHold | None:
        return self._held.get(key)

    def failure(self, key: str) -> str | None:
        return self._failed.get(key)

    async def wait(self, key: str, timeout_s: float) -> TransferHold | None:
        """The hold for `key`, waiting up to `timeout_s` for it to appear; None on timeout."""
        if key in self._held or key in self._failed or timeout_s <= 0:
            return self.take(key)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        except TimeoutError:
            waiters = self._waiters.get(key)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiters[key]
            return None
        return self.take(key)

    def release_all(self) -> None:
        for key in list(self._held):
            self.release(key)


@dataclass(slots=True)
class _Step:
    items: list[tuple[Sequence, int]]
    seconds: float


class Engine:
    """Scheduler, KV cache and clock of one emulated engine."""

    def __init__(
        self,
        profile: TimingProfile,
        pool: BlockPool,
        metrics: EngineMetrics,
        *,
        root_hash: int,
        speed: float = 1.0,
        max_num_seqs: int | None = None,
        max_batched_tokens: int | None = None,
        transfer_timeout_s: float = 30.0,
        publish: Callable[[list[KVEvent]], None] | None = None,
        host: HostPool | None = None,
        chunks: ChunkStore | None = None,
        chunk_recompute_tokens: int = 0,
        hybrid: HybridKV | None = None,
    ) -> None:
        self.profile = profile
        self.hybrid = hybrid
        """The KV cache groups of a hybrid-attention spec; None: dense attention."""
        self.chunks = chunks
        """The chunk store (chunk reuse); None: chunk layouts are ignored."""
        self.chunk_recompute_tokens = chunk_recompute_tokens
        """Leading tokens of each reused chunk computed again (EPIC's LegoLink; 0: none)."""
        self.pool = pool
        self.host = host
        """The CPU tier behind `pool`, if any."""
        self._host_link_free_at = 0.0
        """When the host-to-device link is next free (CPU-tier loads queue on it)."""
        self.metrics = metrics
        self.root_hash = root_hash
        self.block_size = pool.block_size
        self.speed = speed
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_batched_tokens = max_batched_tokens or profile.max_batched_tokens
        self.holds = TransferHolds(pool, transfer_timeout_s, on_release=self.poke)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []
        """Sequences whose remote KV is being pulled into their allocated blocks."""
        self.loaded: deque[Sequence] = deque()
        """Sequences whose remote KV is in, holding their blocks: admitted before `waiting`."""
        self.loader: Loader | None = None
        """Pulls remote prompt KV (`KVMover.load`); needed for sequences with `remote`."""
        self.on_abandon: Callable[[RemotePrefill], None] | None = None
        """Told of a remote prefill that finished here without being pulled, so the source
        frees it now (vLLM's consumer notifies the producer for a request it aborts)."""
        self.saver: Callable[[list[CachedBlock]], None] | None = None
        """Told of every block as it is computed (its sidecar's save, `sidecar_tier`)."""
        self._publish = publish
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-steps")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for seq in [*self.running, *self.waiting, *self.loading, *self.loaded]:
            self.abort(seq)
        self.holds.release_all()

    # --- requests ------------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        self.start()
        self.waiting.append(seq)
        assert self._wake is not None
        self._wake.set()

    def poke(self) -> None:
        """Blocks were freed outside a step: let waiting sequences try again."""
        if self._wake is not None and (self.waiting or self.running or self.loaded):
            self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence whose client went away; frees its blocks at once."""
        if seq.state == SeqState.FINISHED:
            return
        if seq.state == SeqState.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
            with contextlib.suppress(ValueError):
                self.loaded.remove(seq)
        elif seq.state == SeqState.LOADING:
            with contextlib.suppress(ValueError):
                self.loading.remove(seq)
            if seq.load_task is not None:
                seq.load_task.cancel()
        else:
            with contextlib.suppress(ValueError):
                self.running.remove(seq)
        seq.finish_reason = "abort"
        self._finish(seq, "abort")
        self.poke()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued sequences, those pulling remote KV included (as vLLM counts them)."""
        return len(self.waiting) + len(self.loading) + len(self.loaded)

    def awaiting_remote(self) -> list[Sequence]:
        """Sequences whose remote KV is not in yet (waiting for blocks, or being pulled)."""
        return [s for s in (*self.waiting, *self.loading) if s.remote is not None]

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block of a prefix: the profile's per-token KV, or for a hybrid
        spec every sealed group's entries for the block."""
        if self.hybrid is not None:
            return self.hybrid.block_bytes
        return self.block_size * self.profile.kv_bytes_per_token

    def state_bytes_at(self, blocks: int) -> int:
        """Bytes of a hybrid spec's windows and tail at boundary `blocks` (0 for a dense
        model): what a P/D hand-over moves beside the sealed blocks, as vLLM's NIXL transfer
        moves every KV cache group's blocks of the request."""
        hybrid = self.hybrid
        if hybrid is None or hybrid.pool is None or blocks <= 0:
            return 0
        return hybrid.spec.mutable_bytes(blocks * self.block_size)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- the step loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        clock = time.perf_counter
        assert self._wake is not None
        deadline = last = clock()
        m = self.metrics
        while True:
            step = self._schedule()
            if step is None:
                self.flush_events()
                self._wake.clear()
                await self._wake.wait()
                deadline = last = clock()
                continue
            now = clock()
            deadline = max(deadline, now - _MAX_LAG_S) + step.seconds / self.speed
            delay = deadline - now if deadline > now else 0.0
            await asyncio.sleep(delay)
            m.late_s += clock() - now - delay  # the sleep's overshoot (timers, CPU contention)
            try:
                self._complete(step)
            except Exception:  # a bug here must not silently stop every request
                log.exception("engine step failed")
                for seq, _n in step.items:
                    if seq.state == SeqState.RUNNING:
                        self.abort(seq)
            now = clock()
            m.active_s += now - last
            last = now

    def _prefix_hit_blocks(self, seq: Sequence) -> int:
        """Cached leading blocks usable by `seq`; at least one token is always recomputed."""
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = seq.hashes if len(seq.hashes) <= limit else seq.hashes[:limit]
        return self.pool.match_prefix(hashes)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_chunks(seq)
        self._release_windows(seq)
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_hashed = 0
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)
        self.metrics.preemptions += 1

    def _schedule(self) -> _Step | None:
        bs = self.block_size
        pool = self.pool
        budget = self.max_batched_tokens
        items: list[tuple[Sequence, int]] = []
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = -(-(seq.num_computed + n) // bs) - len(seq.blocks)
            while need > pool.num_free and running[-1] is not seq:
                self._preempt(running[-1])
                preempted = True
            if need > pool.num_free:
                self._preempt(seq)
                preempted = True
                continue
            if need > 0:
                got = pool.allocate(need)
                assert got is not None
                seq.blocks.extend(got)
            items.append((seq, n))
            budget -= n
            i += 1

        # vLLM admits nothing new in a step that preempted. Sequences holding blocks (remote
        # KV in) go first, as vLLM drains its kv_holding_waiting queue before the waiting one.
        loaded = self.loaded
        while loaded and budget > 0 and not preempted and len(running) < self.max_num_seqs:
            seq = loaded[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = -(-(seq.num_computed + n) // bs) - len(seq.blocks)
            if need > pool.num_free:
                break
            loaded.popleft()
            if need > 0:
                got = pool.allocate(need)
                assert got is not None
                seq.blocks.extend(got)
            self._start_running(seq, seq.num_computed)
            items.append((seq, n))
            budget -= n

        # First come, first served: the head waits until blocks for its whole sequence are
        # free (vLLM's scheduler_reserve_full_isl admission), the others wait behind it.
        waiting = self.waiting
        host = self.host
        while waiting and budget > 0 and not preempted and len(running) < self.max_num_seqs:
            seq = waiting[0]
            hit = self._prefix_hit_blocks(seq)
            use_host = host is not None and seq.remote is None
            host_limit: int | None = None
            if self.hybrid is not None and seq.remote is None:
                hit, host_limit = self._choose_resume(seq, hit)
                use_host = host_limit > 0
            hit_hashes = seq.hashes[:hit]
            computed = hit * bs
            whole = -(-seq.num_tokens // bs) - hit
            if whole > pool.free_after_touch(hit_hashes):
                break
            if host is not None and use_host:
                # vLLM's connector lookup continues where the HBM hit stops, over the same
                # limit (the last prompt token is always computed).
                limit = (seq.num_tokens - 1) // bs
                on_host = host.match_prefix(seq.hashes[hit:limit])
                if host_limit is not None:
                    on_host = min(on_host, host_limit)  # a hybrid resume's CPU part
                if on_host:
                    if on_host > pool.free_after_touch(hit_hashes) - self._inflight_reserved():
                        break
                    waiting.popleft()
                    blocks = pool.touch(hit_hashes)
                    got = pool.allocate(on_host)  # vLLM allocates only the loaded tokens
                    assert got is not None
                    seq.blocks = blocks + got
                    seq.num_computed = computed
                    seq.num_hashed = hit
                    self._start_host_load(seq, seq.hashes[hit : hit + on_host])
                    continue
            if seq.remote is not None:
                # An async KV load: allocate the whole prompt, park the request while it
                # pulls (no token budget spent). vLLM pulls even when every full block is
                # cached here (the partial last block is still remote; here it is recomputed).
                if whole > pool.free_after_touch(hit_hashes) - self._inflight_reserved():
                    break
                waiting.popleft()
                blocks = pool.touch(hit_hashes)  # before allocating, which could evict them
                got = pool.allocate(whole)
                assert got is not None
                seq.blocks = blocks + got
                seq.num_computed = computed
                seq.num_hashed = hit
                self._start_load(seq)
                continue
            waiting.popleft()
            n = min(seq.num_tokens - computed, budget)
            need = -(-(computed + n) // bs) - hit
            blocks = pool.touch(hit_hashes)
            got = pool.allocate(need)
            assert got is not None
            seq.blocks = blocks + got
            seq.num_computed = computed
            seq.num_hashed = hit
            if seq.chunks and self.chunks is not None:
                self._reuse_chunks(seq, computed)
            self._start_running(seq, computed)
            items.append((seq, n))
            budget -= n

        if not items:
            # A step that only preempted admitted nothing (as in vLLM), but vLLM's engine steps
            # again at once while requests are unfinished: do so, rather than sleep with nothing
            # left to wake the loop (sequences whose KV is in wait for the freed blocks).
            return self._schedule() if preempted else None
        return _Step(items, self._step_seconds(items))

    def _choose_resume(self, seq: Sequence, hit: int) -> tuple[int, int]:
        """A hybrid spec's resume point (`HybridKV.choose`) for a sequence whose sealed blocks
        HBM caches for `hit` blocks: the blocks to start from, and how many blocks of the CPU
        tier's continuation to load. Sets the windows' rebuild on the sequence."""
        hybrid = self.hybrid
        assert hybrid is not None
        host = self.host
        on_host = 0
        load_s = 0.0
        if host is not None:
            limit = (seq.num_tokens - 1) // self.block_size
            on_host = host.match_prefix(seq.hashes[hit:limit])
            load_s = on_host * hybrid.block_bytes / self.profile.link.cpu_load_bps
        choice = hybrid.choose(seq.hashes, hit, self.profile, on_host, load_s)
        seq.rebuild = choice.rebuild_tokens
        seq.resume = choice.how
        return choice.blocks, choice.host_blocks

    def _release_windows(self, seq: Sequence, keep_from: int | None = None) -> None:
        """Let go of the sequence's window blocks before block `keep_from` (all by default)."""
        hybrid = self.hybrid
        if hybrid is None or not seq.win:
            return
        keep = seq.num_hashed + 1 if keep_from is None else keep_from
        prompt_blocks = len(seq.prompt_ids) // self.block_size
        seq.win = hybrid.release(seq.win, keep, seq.num_hashed, prompt_blocks)

    def _inflight_reserved(self) -> int:
        """Blocks that admitted sequences not done prefilling still need for their whole
        sequence: async loads in flight or in, and running prefills (vLLM's
        `_inflight_prefill_reserved_blocks`). An async load is admitted only if its blocks fit
        beside these, since it holds them unpreemptible: without this, two loads could each hold
        part of the pool while waiting for the rest, with nothing running to free any."""
        bs = self.block_size
        total = 0
        for seq in (*self.loading, *self.loaded, *self.running):
            if seq.state == SeqState.RUNNING and seq.num_computed + 1 >= seq.num_tokens:
                continue  # decoding: its next block is had by preempting, as vLLM does
            total += max(0, -(-seq.num_tokens // bs) - len(seq.blocks))
        return total

    def _reuse_chunks(self, seq: Sequence, computed: int) -> None:
        """Take every chunk of the layout past the first `computed` tokens that the store
        holds (pinned until the sequence ends or is preempted), less the first
        `chunk_recompute_tokens` of each; the prompt's last token is always computed."""
        store = self.chunks
        assert store is not None
        k = self.chunk_recompute_tokens
        last = len(seq.prompt_ids) - 1
        spans: list[tuple[int, int]] = []
        total = 0
        for c in seq.chunks:
            lo = max(c.start + k, computed)
            hi = min(c.end, last)
            if hi <= lo or not store.lookup(c.hash):
                continue
            store.pin(c.hash)
            seq.chunks_pinned.append(c.hash)
            spans.append((lo, hi))
            total += hi - lo
        seq.reused = spans
        seq.chunk_reused = total
        if seq.cached_tokens < 0:  # counted once, as the prompt's sources are
            m = self.metrics
            m.chunk_tokens_reused += total
            m.chunks_reused += len(spans)

    def _release_chunks(self, seq: Sequence) -> None:
        store = self.chunks
        if store is not None:
            for h in seq.chunks_pinned:
                store.unpin(h)
        seq.chunks_pinned = []
        seq.reused = []
        seq.chunk_reused = 0

    def _store_chunks(self, seq: Sequence) -> None:
        """The prompt is computed: keep the KV of its chunks the store lacks (computed at
        a virtual position, attending to the system prompt and themselves only)."""
        store = self.chunks
        assert store is not None
        seq.chunks_stored = True
        m = self.metrics
        for c in seq.chunks:
            if c.hash in store:
                continue
            if store.store(c.hash, c.end - c.start):
                m.chunks_stored += 1
                m.chunk_tokens_stored += c.end - c.start

    def _start_running(self, seq: Sequence, computed: int) -> None:
        hybrid = self.hybrid
        bs = self.block_size
        if hybrid is not None and hybrid.pool is not None:
            nh = seq.num_hashed  # the resume boundary: take its windows (cached or rebuilt)
            lo = max(0, nh - hybrid.window_blocks)
            hybrid.take(seq.win, seq.hashes, seq.tokens, lo, nh, len(seq.prompt_ids) // bs)
        seq.state = SeqState.RUNNING
        if seq.cached_tokens < 0:
            self._count_prompt(seq, computed)
        self.running.append(seq)

    def _pull_limit(self, seq: Sequence) -> int:
        """Prompt blocks a pull may bring: full blocks short of the last prompt token, which
        is always computed here (it samples the first output token)."""
        return (len(seq.prompt_ids) - 1) // self.block_size

    def _start_load(self, seq: Sequence) -> None:
        seq.state = SeqState.LOADING
        self.loading.append(seq)
        missing = seq.hashes[seq.num_hashed : self._pull_limit(seq)]
        seq.load_task = asyncio.get_running_loop().create_task(
            self._load(seq, missing), name=f"kv-load-{seq.request_id}"
        )

    async def _load(self, seq: Sequence, missing: list[int]) -> None:
        """Pull `missing` into the sequence's allocated blocks, then queue it to run."""
        remote = seq.remote
        assert remote is not None and self.loader is not None
        try:
            got = await self.loader(seq, remote, missing)
        except Exception as exc:  # a malformed answer too: the request must not stay parked
            if seq.state == SeqState.LOADING:  # vLLM's kv_load_failure_policy "fail"
                self.loading.remove(seq)
                seq.remote = None
                seq.error = (
                    exc
                    if isinstance(exc, OwnerServeError)
                    else UpstreamError(f"{remote.what}: KV pull failed: {exc!r}")
                )
                self._finish(seq, "error")
                self.poke()
            return
        if seq.state != SeqState.LOADING:
            return  # aborted while pulling
        self.loading.remove(seq)
        seq.remote = None
        if got:
            self._register(seq, seq.num_hashed + len(got))
            self.flush_events()
        seq.num_computed = seq.num_hashed * self.block_size
        seq.external_tokens = len(got) * self.block_size
        if self.hybrid is not None:
            # the pull brings the windows and tail at its boundary with the sealed blocks
            # (`state_bytes_at`); a pull that brought nothing resumes at the local hit, whose
            # windows are rebuilt unless cached here
            nh = seq.num_hashed
            held = bool(got) or self.hybrid.window_held(seq.hashes, nh)
            seq.rebuild = 0 if held else min(self.hybrid.rebuild_tokens, nh * self.block_size)
            seq.resume = ("cached" if held or not seq.rebuild else "rebuilt") if nh else "cold"
        seq.state = SeqState.WAITING
        self.loaded.append(seq)
        seq.remote_ready.set()
        self.poke()

    def _start_host_load(self, seq: Sequence, hashes: list[int]) -> None:
        """Load the CPU-tier blocks `hashes` into the sequence's newly allocated blocks, the
        sequence parked meanwhile (vLLM's OffloadingConnector loads asynchronously: the request
        waits in WAITING_FOR_REMOTE_KVS while the copy runs beside the model's steps)."""
        host = self.host
        assert host is not None
        seq.state = SeqState.LOADING
        self.loading.append(seq)
        # vLLM does not store the chunks it loaded (next_stored_chunk_idx moves past them).
        seq.num_offloaded = max(seq.num_offloaded, seq.num_hashed + len(hashes))
        host.pin(hashes)
        nbytes = len(hashes) * self.block_bytes
        hybrid = self.hybrid
        if hybrid is not None:
            nbytes += self._count_hybrid_load(seq, len(hashes))
        seconds = nbytes / self.profile.link.cpu_load_bps
        now = time.perf_counter()
        end = max(now, self._host_link_free_at) + seconds / self.speed
        self._host_link_free_at = end
        m = self.metrics
        m.kv_offload_load_bytes += nbytes
        m.kv_offload_load_s += seconds
        seq.load_task = asyncio.get_running_loop().create_task(
            self._load_from_host(seq, hashes, end - now), name=f"kv-host-load-{seq.request_id}"
        )

    def _count_hybrid_load(self, seq: Sequence, blocks: int) -> int:
        """A hybrid spec's CPU load of `blocks` blocks past the sequence's HBM hit: count its
        bytes by state type, and return the bytes of the window checkpoint at its end that
        the CPU tier also holds (0 when the windows are in HBM or must be rebuilt)."""
        hybrid = self.hybrid
        assert hybrid is not None
        m = self.metrics
        bs = self.block_size
        lo = seq.num_hashed * bs
        end = seq.num_hashed + blocks
        by_type = hybrid.spec.state_bytes(lo, end * bs)
        types = [g.state_type for g in hybrid.sealed]
        extra = 0
        if hybrid.host_windows(seq.hashes, end):
            types += [g.state_type for g in hybrid.mutable]  # the windows and tail at `end`
            extra = hybrid.spec.mutable_bytes(end * bs)
        for t in dict.fromkeys(types):
            m.state_loaded_bytes[t.value] = m.state_loaded_bytes.get(t.value, 0) + by_type[t]
        return extra

    async def _load_from_host(self, seq: Sequence, hashes: list[int], delay_s: float) -> None:
        host = self.host
        assert host is not None
        try:
            await asyncio.sleep(delay_s)
        finally:
            host.unpin(hashes)
        if seq.state != SeqState.LOADING:
            return
        self.loading.remove(seq)
        self._register(seq, seq.num_hashed + len(hashes))  # cached in HBM once loaded
        self.flush_events()
        seq.num_computed = seq.num_hashed * self.block_size
        seq.external_tokens = seq.host_tokens = len(hashes) * self.block_size
        seq.state = SeqState.WAITING
        self.loaded.append(seq)
        self.poke()

    def _offload(self, seq: Sequence) -> None:
        """Offer the sequence's computed prompt blocks not offered yet to the CPU tier (vLLM's
        store jobs; `offload_prompt_only` is its default). A refused offer is made again after
        the next step, as vLLM retries chunks it could not store."""
        host = self.host
        assert host is not None
        bs = self.block_size
        upto = min(seq.num_hashed, len(seq.prompt_ids) // bs)
        lo = seq.num_offloaded
        if upto <= lo:
            return
        hashes = seq.hashes
        blocks = [
            CachedBlock(hashes[j], hashes[j - 1] if j else None, seq.tokens(j * bs, (j + 1) * bs))
            for j in range(lo, upto)
        ]
        if host.store(blocks):
            seq.num_offloaded = upto
            if self.hybrid is not None:
                self.hybrid.offload_windows(hashes, seq.tokens, lo, upto)

    def _abandon(self, seq: Sequence) -> None:
        """The sequence no longer needs its remote KV: let the source free it now."""
        remote, seq.remote = seq.remote, None
        seq.remote_ready.set()
        if remote is not None and self.on_abandon is not None:
            self.on_abandon(remote)

    def _count_prompt(self, seq: Sequence, hit_tokens: int) -> None:
        m = self.metrics
        p = len(seq.prompt_ids)
        external = min(seq.external_tokens, hit_tokens)
        host = min(seq.host_tokens, external)
        hit_tokens += seq.chunk_reused  # chunk KV reused at its new position
        seq.cached_tokens = hit_tokens
        seq.admitted_at = time.perf_counter()
        m.queue_time.observe(seq.admitted_at - seq.arrival)
        m.prefix_cache_queries += p
        m.prefix_cache_hits += hit_tokens - external
        by = m.prompt_tokens_by_source
        by["local_cache_hit"] += hit_tokens - external
        by["external_kv_transfer"] += external
        by["local_compute"] += p - hit_tokens
        cached = m.prompt_tokens_cached_by_source
        cached["device"] += hit_tokens - external
        cached["host"] += host
        cached["p2p"] += external - host  # P/D pulls (NixlConnector reports P2P)
        m.prompt_tokens += p
        if self.hybrid is not None:
            how = seq.resume or ("cached" if hit_tokens else "cold")
            m.resumes[how] = m.resumes.get(how, 0) + 1

    def _step_seconds(self, items: list[tuple[Sequence, int]]) -> float:
        prof = self.profile
        decodes = 0
        ctx = 0
        prefill = 0.0
        prefill_base = prof.prefill.base_s
        any_prefill = False
        for seq, n in items:
            if seq.rebuild:  # windows rebuilt before the step's tokens: n_win·L recomputed
                lo = seq.num_computed
                prefill += prof.prefill_s(seq.rebuild, max(0, lo - seq.rebuild)) - prefill_base
                any_prefill = True
            if n == 1 and seq.out_ids and seq.num_computed + 1 == seq.num_tokens:
                decodes += 1
                ctx += seq.num_tokens
            elif seq.chunk_reused:
                # reused chunk tokens: copied and re-rotated, and context for the rest
                lo = seq.num_computed
                u = seq.reused_between(lo, lo + n)
                if n > u:
                    prefill += prof.prefill_s(n - u, lo + u) - prefill_base
                prefill += prof.rerotate_per_token_s * u
                any_prefill = True
            else:
                prefill += prof.prefill_s(n, seq.num_computed) - prefill_base
                any_prefill = True
        total = prof.decode_step_s(decodes, ctx) + prefill
        if any_prefill:
            total += prefill_base
        m = self.metrics
        m.steps += 1
        m.busy_s += total
        return total

    def _complete(self, step: _Step) -> None:
        now = time.perf_counter()
        m = self.metrics
        bs = self.block_size
        host = self.host
        finished = False
        for seq, n in step.items:
            if seq.state != SeqState.RUNNING:
                continue  # aborted or preempted while the step ran
            was_decode = bool(seq.out_ids) and seq.num_computed + 1 == seq.num_tokens
            if seq.rebuild:
                m.window_rebuild_tokens += seq.rebuild
                seq.rebuild = 0
            lo = seq.num_computed
            seq.num_computed += n
            if was_decode:
                m.decode_tokens_computed += n
            elif seq.chunk_reused:
                m.prefill_tokens_computed += n - seq.reused_between(lo, lo + n)
            else:
                m.prefill_tokens_computed += n
            if (
                seq.chunks
                and not seq.chunks_stored
                and seq.num_computed >= len(seq.prompt_ids)
                and self.chunks is not None
            ):
                self._store_chunks(seq)
            full = seq.num_computed // bs
            if full > seq.num_hashed:
                hashed = seq.num_hashed
                self._register(seq, full)
                hybrid = self.hybrid
                if hybrid is not None and hybrid.pool is not None:
                    # let go of what left the window first: its slot may take the new block
                    self._release_windows(seq, full - hybrid.window_blocks)
                    prompt_blocks = len(seq.prompt_ids) // bs
                    hybrid.take(seq.win, seq.hashes, seq.tokens, hashed, full, prompt_blocks)
            if host is not None and seq.num_offloaded < seq.num_hashed:
                self._offload(seq)
            if seq.num_computed < seq.num_tokens:
                continue
            tid, piece = seq.text.next_token()
            seq._append(tid, piece)
            m.generation_tokens += 1
            if seq.first_token_at:
                m.itl.observe(now - seq.last_token_at)
            else:
                seq.first_token_at = now
                m.ttft.observe(now - seq.arrival)
            seq.last_token_at = now
            if seq.finish_reason is not None:
                self._finish(seq, seq.finish_reason)
                finished = True
            elif seq.notify_every and len(seq.out_ids) % seq.notify_every == 0:
                seq.notify.set()
        if finished:
            self.running = [s for s in self.running if s.state == SeqState.RUNNING]
        self.flush_events()

    def _register(self, seq: Sequence, full: int) -> None:
        bs = self.block_size
        new: list[NewBlock] = []
        hashes = seq.hashes
        for j in range(seq.num_hashed, full):
            parent = hashes[j - 1] if j else self.root_hash
            tokens = seq.tokens(j * bs, (j + 1) * bs)
            if j < len(hashes):
                h = hashes[j]
            else:
                h = hash_block(parent, tokens)
                hashes.append(h)
            new.append(NewBlock(seq.blocks[j], h, parent if j else None, tokens))
        seq.num_hashed = full
        self.pool.register(new)
        if self.saver is not None:
            self.saver([CachedBlock(b.block_hash, b.parent_hash, b.token_ids) for b in new])

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.state == SeqState.FINISHED:
            return
        was_waiting = seq.state == SeqState.WAITING
        seq.state = SeqState.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        seq.finished_at = time.perf_counter()
        if seq.hold_key is not None:
            if seq.finish_reason in ("stop", "length") and not was_waiting:
                prompt_blocks = min(len(seq.prompt_ids) // self.block_size, seq.num_hashed)
                held = self.pool.match_prefix(seq.hashes[:prompt_blocks])
                self.holds.hold(seq.hold_key, seq.hashes[:held], seq.hold_s or None)
            else:
                self.holds.fail(seq.hold_key, f"prefill ended with {seq.finish_reason}")
        if seq.blocks:
            self.pool.free(seq.blocks)
            seq.blocks = []
        if seq.chunks_pinned:
            self._release_chunks(seq)
        if seq.win:
            self._release_windows(seq)
        if self.host is not None and seq.num_offloaded:
            # vLLM's LRU policy ranks a finished request's chunks as used, its prefix last.
            self.host.touch(seq.hashes[: seq.num_offloaded])
        if seq.remote is not None:  # never pulled (aborted while waiting or pulling)
            self._abandon(seq)
        seq.remote_ready.set()
        m = self.metrics
        reason_key = seq.finish_reason if seq.finish_reason in m.request_success else "abort"
        m.request_success[reason_key] += 1
        m.e2e.observe(seq.finished_at - seq.arrival)
        if seq.on_finish is not None:
            seq.on_finish(seq)
        seq.notify.set()

    def flush_events(self) -> None:
        """Publish the cache's events since the last flush as one batch: HBM's, then the CPU
        tier's (vLLM's scheduler appends its connector's events after the block pool's)."""
        events = self.pool.drain_events()
        if self.host is not None:
            events.extend(self.host.drain_events())
        if self.hybrid is not None:
            events = self.hybrid.tag_sealed(events) + self.hybrid.drain_window_events()
        if events and self._publish is not None:
            self._publish(events)
