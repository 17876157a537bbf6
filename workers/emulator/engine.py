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
key until the decode side pulls them or the hold times out (`TransferHolds`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from ownerserve.events import KVEvent
from ownerserve.hashing import hash_block
from ownerserve.profiles import TimingProfile
from ownerserve.tasks import cancel_and_wait
from workers.emulator.kv_cache import BlockPool, NewBlock
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
        "external_tokens",
        "finish_reason",
        "finished_at",
        "first_token_at",
        "hashes",
        "hold_key",
        "index",
        "last_token_at",
        "notify",
        "notify_every",
        "num_computed",
        "num_hashed",
        "num_tokens",
        "on_finish",
        "out_ids",
        "params",
        "pieces",
        "pinned",
        "prompt_ids",
        "request_id",
        "state",
        "stop_reason",
        "text",
        "text_limit",
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
        self.pinned: list[int] = []
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
        self.admitted_at = 0.0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.finished_at = 0.0
        self.hold_key: str | None = None
        self.on_finish: Callable[[Sequence], None] | None = None
        self._tail = ""

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
    handle: asyncio.TimerHandle | None = None


class TransferHolds:
    """Prefill results waiting for their decode side, with waiters for keys not there yet."""

    def __init__(
        self, pool: BlockPool, timeout_s: float, on_release: Callable[[], None] | None = None
    ) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._on_release = on_release
        self._held: dict[str, TransferHold] = {}
        self._failed: dict[str, str] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key: str, block_hashes: list[int]) -> None:
        """Reference the cached blocks `block_hashes` until taken or timed out."""
        self.release(key)
        ids = self._pool.touch(block_hashes)
        loop = asyncio.get_running_loop()
        handle = loop.call_later(self._timeout_s, self.release, key)
        self._held[key] = TransferHold(key, ids, list(block_hashes), handle)
        self._wake(key)

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
    ) -> None:
        self.profile = profile
        self.pool = pool
        self.metrics = metrics
        self.root_hash = root_hash
        self.block_size = pool.block_size
        self.speed = speed
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_batched_tokens = max_batched_tokens or profile.max_batched_tokens
        self.holds = TransferHolds(pool, transfer_timeout_s, on_release=self.poke)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
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
        for seq in [*self.running, *self.waiting]:
            self._finish(seq, "abort")
        self.running.clear()
        self.waiting.clear()
        self.holds.release_all()

    # --- requests ------------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        self.start()
        self.waiting.append(seq)
        assert self._wake is not None
        self._wake.set()

    def poke(self) -> None:
        """Blocks were freed outside a step: let waiting sequences try again."""
        if self._wake is not None and (self.waiting or self.running):
            self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence whose client went away; frees its blocks at once."""
        if seq.state == SeqState.FINISHED:
            return
        if seq.state == SeqState.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
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
        return len(self.waiting)

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

        waiting = self.waiting
        skip = 0
        while (
            len(waiting) > skip
            and budget > 0
            and not preempted
            and len(running) < self.max_num_seqs
        ):
            seq = waiting[skip]
            hit = self._prefix_hit_blocks(seq)
            hit_hashes = seq.hashes[:hit]
            computed = hit * bs
            n = min(seq.num_tokens - computed, budget)
            need = -(-(computed + n) // bs) - hit
            if need > pool.free_after_touch(hit_hashes):
                if running or items:
                    break
                # Nothing runs, so nothing will free blocks: blocks pinned by later waiting
                # sequences (pulled KV) are all there is. Let the next one try (FIFO otherwise).
                skip += 1
                continue
            del waiting[skip]
            blocks = pool.touch(hit_hashes)
            got = pool.allocate(need)
            assert got is not None
            seq.blocks = blocks + got
            if seq.pinned:
                pool.free(seq.pinned)
                seq.pinned = []
            seq.num_computed = computed
            seq.num_hashed = hit
            seq.state = SeqState.RUNNING
            if seq.cached_tokens < 0:
                self._count_prompt(seq, computed)
            running.append(seq)
            items.append((seq, n))
            budget -= n

        if not items:
            return None
        return _Step(items, self._step_seconds(items))

    def _count_prompt(self, seq: Sequence, hit_tokens: int) -> None:
        m = self.metrics
        p = len(seq.prompt_ids)
        external = min(seq.external_tokens, hit_tokens)
        seq.cached_tokens = hit_tokens
        seq.admitted_at = time.perf_counter()
        m.queue_time.observe(seq.admitted_at - seq.arrival)
        m.prefix_cache_queries += p
        m.prefix_cache_hits += hit_tokens - external
        by = m.prompt_tokens_by_source
        by["local_cache_hit"] += hit_tokens - external
        by["external_kv_transfer"] += external
        by["local_compute"] += p - hit_tokens
        m.prompt_tokens += p

    def _step_seconds(self, items: list[tuple[Sequence, int]]) -> float:
        prof = self.profile
        decodes = 0
        ctx = 0
        prefill = 0.0
        prefill_base = prof.prefill.base_s
        any_prefill = False
        for seq, n in items:
            if n == 1 and seq.out_ids and seq.num_computed + 1 == seq.num_tokens:
                decodes += 1
                ctx += seq.num_tokens
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
        finished = False
        for seq, n in step.items:
            if seq.state != SeqState.RUNNING:
                continue  # aborted or preempted while the step ran
            was_decode = bool(seq.out_ids) and seq.num_computed + 1 == seq.num_tokens
            seq.num_computed += n
            if was_decode:
                m.decode_tokens_computed += n
            else:
                m.prefill_tokens_computed += n
            full = seq.num_computed // bs
            if full > seq.num_hashed:
                self._register(seq, full)
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
                self.holds.hold(seq.hold_key, seq.hashes[:held])
            else:
                self.holds.fail(seq.hold_key, f"prefill ended with {seq.finish_reason}")
        if seq.blocks:
            self.pool.free(seq.blocks)
            seq.blocks = []
        if seq.pinned:
            self.pool.free(seq.pinned)
            seq.pinned = []
        m = self.metrics
        reason_key = seq.finish_reason if seq.finish_reason in m.request_success else "abort"
        m.request_success[reason_key] += 1
        m.e2e.observe(seq.finished_at - seq.arrival)
        if seq.on_finish is not None:
            seq.on_finish(seq)
        seq.notify.set()

    def flush_events(self) -> None:
        events = self.pool.drain_events()
        if events and self._publish is not None:
            self._publish(events)
