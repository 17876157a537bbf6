"""Which workers the router serves with, at runtime: registering a worker with the directory
and subscribing to its KV events, adding and removing workers (admin API), and forgetting a
worker that died."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ownerserve.config import WorkerSettings
from ownerserve.directory.base import Directory, EventApplyResult
from ownerserve.errors import DirectoryUnavailableError
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.types import Tier
from router.pool import WorkerState

if TYPE_CHECKING:
    # the router's state as membership reads it (`router.state.Router` is one)
    from router.services import Members as Router

log = logging.getLogger(__name__)


async def register(router: Router, worker_id: str) -> None:
    """Tell the directory the worker's chain root and block size; subscribe to its KV
    events when it publishes them."""
    state = router.pool.get(worker_id)
    if state is None or router.directory is None:
        return
    models = state.settings.models or tuple(m.name for m in router.settings.models)
    model = router.tokenizers.get(models[0]) if models else None
    if model is not None:
        try:
            await router.directory.register_worker(worker_id, model.root, model.block_size)
            state.directory_life = await router.directory.worker_life(worker_id)
        except Exception as exc:
            # serve anyway; KV events of this worker cannot be mapped until it registers
            log.warning("worker %s: directory registration failed: %r", worker_id, exc)
    if state.settings.kv_events_endpoint:
        await _subscribe_kv_events(router, state)


async def _subscribe_kv_events(router: Router, state: WorkerState) -> None:
    """Feed the worker's KV events (`kv_events_endpoint`) into the directory, through the
    subscriber its backend makes."""
    assert router.directory is not None
    sub = state.backend.kv_event_subscriber(state.settings, LiveWorkerSink(router.directory, state))
    if sub is None:
        return
    try:
        await sub.start()
        router.subscribers.append(sub)
    except Exception:
        log.warning("worker %s: cannot subscribe to KV events at %s", state.worker_id, sub.endpoint)


class LiveWorkerSink:
    """The directory as a worker's KV event subscriber sees it: batches of a worker the pool
    holds dead are ignored. When the worker dies the directory forgets what it held, and
    batches still queued in the subscription (published just before the death) must not
    bring those blocks back; once the worker answers again its new events count.

    A batch goes to the directory with the life this router last saw the worker in
    (`WorkerState.directory_life`), which refuses it once another router replica (or this
    one, while the batch was on its way) has dropped that life. The refusal tells this
    router the life it missed: the batches after it are the next life's."""

    def __init__(self, sink: Directory, state: WorkerState) -> None:
        self._sink = sink
        self._state = state

    async def apply_events(self, worker: str, batch: EventBatch) -> EventApplyResult:
        state = self._state
        if not state.healthy:
            log.debug("worker %s is dead: ignoring its KV event batch %d", worker, batch.seq)
            return EventApplyResult()
        count_kv_blocks(state, batch)
        result = await self._sink.apply_events(worker, batch, state.directory_life)
        if result.fenced is not None:
            log.info(
                "worker %s: KV event batch %d is of a life dropped since (%s, now %d): ignored",
                worker,
                batch.seq,
                state.directory_life,
                result.fenced,
            )
            state.directory_life = result.fenced
            return result
        if batch.ts > state.events_ts:
            state.events_ts = batch.ts
        return result

    async def drop_worker(self, worker: str) -> int:
        state = self._state
        state.gpu_blocks = state.cpu_blocks = state.ssd_blocks = 0
        return await self._sink.drop_worker(worker)


def count_kv_blocks(state: WorkerState, batch: EventBatch) -> None:
    """Keep the worker's blocks per tier as `batch` changes them: `state.gpu_blocks` (what its
    HBM holds, `WorkerView.cached_tokens`), `cpu_blocks` and `ssd_blocks` (its offloading
    tiers), each stored less removed, none after AllBlocksCleared (every tier, as the directory
    takes it; a lost range of events is one, `KVEventSubscriber._lost`). Counted from the batch
    itself, not from what the directory applied: a batch another router replica applied first
    is a duplicate there, and counts here. Counts, not sets of hashes: the subscriber passes
    each batch once, and a removal of a block stored before it subscribed is floored at 0.
    Untagged events, or group 0's where the engine tags its KV cache groups."""
    gpu, cpu, ssd = state.gpu_blocks, state.cpu_blocks, state.ssd_blocks
    for event in batch.events:
        if isinstance(event, BlockStored):
            if not event.group_idx:
                n = len(event.engine_hashes)
                if event.tier == Tier.GPU:
                    gpu += n
                    state.block_tokens = event.block_size
                else:
                    if event.tier == Tier.CPU:
                        cpu += n
                    else:
                        ssd += n
                    state.offload_block_tokens = event.block_size
        elif isinstance(event, BlockRemoved):
            if not event.group_idx:
                n = len(event.engine_hashes)
                if event.tier == Tier.GPU:
                    gpu = max(0, gpu - n)
                elif event.tier == Tier.CPU:
                    cpu = max(0, cpu - n)
                else:
                    ssd = max(0, ssd - n)
        elif isinstance(event, AllBlocksCleared):
            gpu = cpu = ssd = 0
    state.gpu_blocks, state.cpu_blocks, state.ssd_blocks = gpu, cpu, ssd


async def add_worker(router: Router, worker: WorkerSettings) -> None:
    router.pool.add(worker)
    if router.started:
        await register(router, worker.id)
        state = router.pool.get(worker.id)
        if state is not None:
            await router.pool.check(state)


async def remove_worker(router: Router, worker_id: str) -> bool:
    """Take the worker out of the pool, stop its KV events and make the directory forget
    what it held; False if there is no such worker. When the directory fails to forget it,
    raises `DirectoryUnavailableError` (the worker stays out of the pool; removing it again
    retries the directory)."""
    state = router.pool.remove(worker_id)
    if state is None and worker_id not in router.undropped:
        return False
    router.working_sets.forget_worker(worker_id)
    router.committed_leases.forget_worker(worker_id)
    for sub in [s for s in router.subscribers if s.worker == worker_id]:
        router.subscribers.remove(sub)
        await close_subscriber(router, sub)
    if router.directory is not None:
        try:
            await router.directory.drop_worker(worker_id)
        except Exception as exc:
            router.undropped.add(worker_id)
            router.metrics.drop_worker_errors.inc()
            log.warning("worker %s: the directory failed to drop it", worker_id, exc_info=True)
            raise DirectoryUnavailableError(
                f"worker {worker_id!r} is out of the pool but the directory still holds its "
                f"leases ({exc!r}); remove it again to retry"
            ) from exc
    router.undropped.discard(worker_id)
    return True


async def on_worker_dead(router: Router, worker_id: str) -> None:
    """The health loop found the worker dead: forget its calibration and what it held in
    the life this router last saw it in (another replica may have dropped that life already,
    and the worker come back: its new records stay)."""
    router.calibrator.forget(worker_id)
    router.working_sets.forget_worker(worker_id)
    router.committed_leases.forget_worker(worker_id)
    if router.directory is not None:
        state = router.pool.get(worker_id)
        life = state.directory_life if state is not None else None
        await router.directory.drop_worker(worker_id, life)


async def on_worker_back(router: Router, worker_id: str) -> None:
    """The health loop found a dead worker answering again: read the life it is in now."""
    state = router.pool.get(worker_id)
    if state is not None and router.directory is not None:
        state.directory_life = await router.directory.worker_life(worker_id)


async def close_subscriber(router: Router, sub: Any) -> None:
    """Close a KV event subscription; a failure is logged and counted, not raised (the
    worker is going away either way)."""
    try:
        await sub.close()
    except Exception:
        router.metrics.subscriber_close_errors.inc()
        log.warning(
            "worker %s: closing its KV event subscription failed", sub.worker, exc_info=True
        )
