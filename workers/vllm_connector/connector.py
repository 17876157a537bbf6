"""`OwnerServeConnector`: a vLLM v1 KV connector that loads prompt blocks from the worker's
OwnerServe sidecar into vLLM's paged cache and saves newly sealed blocks to it (the flow of 3FS
KV connectors).

Load it with::

    --kv-transfer-config '{"kv_connector": "OwnerServeConnector",
        "kv_connector_module_path": "workers.vllm_connector.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"sidecar_url": "http://127.0.0.1:PORT", "model": "NAME"}}'

(the repo on the engine's PYTHONPATH; `workers.vllm_cpu.server` does this) or as one entry of
MultiConnector's `connectors` list, e.g. after NixlConnector. `kv_load_failure_policy:
"recompute"` makes vLLM recompute blocks whose artifact was refused instead of failing the
request. Extra config: `sidecar_url` (required), `model` and `salt` (hash-chain root and key
model name; default: the served model name and ""), `timeout_s` (loads and saves),
`lookup_timeout_s` and `lookup_backoff_s` (scheduler-side lookups), `load`, `save`. A request
may opt out with `kv_transfer_params: {"ownerserve": {"load": false, "save": false}}`.

Scheduler side (in vLLM's scheduler loop): `get_num_new_matched_tokens` hashes the prompt into
OwnerServe chain hashes, asks the sidecar which per-head artifacts it holds (one lookup) and
reports the whole blocks beyond vLLM's local prefix hit that it can supply, as an asynchronous
load; `update_state_after_alloc` turns that into a load plan (engine block ids + chunk hashes);
`build_connector_meta` sends this step's load plans and, for every scheduled request, the full
blocks sealed by the step that the sidecar does not hold yet (save plans).

Worker side: `start_load_kv` queues load plans to a load thread that fetches each block's
per-head artifacts (checksum-verified) and writes the good prefix into the paged cache
(`load.load_blocks`: on CUDA read straight into pinned staging, on CPU through `bytes` and the
kernels' reference path); finished loads go back through `get_finished`, refused blocks through
`get_block_ids_with_load_errors`, so vLLM recomputes them — a corrupted artifact is never loaded.
`bind_connector_metadata` starts the Mooncake Store master's round trips of the step's transfers
before the forward pass (the loads' replica lookups, the saves' reservations), so the copies do
not wait for them. `wait_for_save` gathers the step's sealed blocks out of the cache (one
synchronous staging copy, so vLLM may reuse the blocks at once) and a save thread PUTs them, off
the forward pass; `save_kv_layer` has nothing to do per layer. The KV layout and payload are
in `payload.py`.

KV cache groups (vLLM's hybrid KV cache manager, which `SupportsHMA` keeps on: full attention
beside sliding windows): every step above is per group. The worker side keeps a cache per group
(its layers; layers of different groups may share a tensor, each group's blocks being its own),
the scheduler side each request's block ids per group. Saves store, per block and group, what
vLLM still holds (a window group's blocks outside its window are vLLM's null block, skipped);
artifact keys end in the group's tag (`plan.group_tags`), so groups never share a key and an
engine without the manager (one group of every layer) never reads them as its own. The lookup
asks for every group's keys and reports a hit only up to the furthest boundary where every
group can be restored (`plan.restorable_blocks`: full attention all blocks before it, a window
the blocks covering its window before it); a load fills each group's real blocks. A model of
one group is keyed, saved and loaded exactly as a dense model always was. With several groups,
chunk reuse is off and KV goes through the sidecar, not straight through Mooncake Store.
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ownerserve.hashing import ChainHasher
from ownerserve.kvstate.heads import heads_for_rank, store_heads_for_rank
from workers.mooncake_store import StoreError
from workers.vllm_connector.chunk_side import ChunkReuse
from workers.vllm_connector.chunks import ChunkTransfer
from workers.vllm_connector.client import SidecarClient, SidecarError
from workers.vllm_connector.gpu import CudaPagedKV
from workers.vllm_connector.load import load_blocks
from workers.vllm_connector.payload import (
    CpuAttnKV,
    Gathered,
    PageOrder,
    WorkerKV,
    calibrate_page_order,
    payload_of,
)
from workers.vllm_connector.plan import (
    BlockTransfer,
    ConnectorSettings,
    KVGroup,
    Stage,
    block_keys,
    chunk_hashes,
    first_failed_index,
    group_tags,
    loadable_blocks,
    lookup_keys,
    plan_group_loads,
    plan_group_saves,
    present_mask,
    restorable_blocks,
    stage_of,
)
from workers.vllm_connector.store_path import Reserving, StagedStore, StoreKV, open_store_kv

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under the `vllm` logger so the lines land in the engine's log with its format.
logger = init_logger("vllm.ownerserve_connector")

# Save plans waiting for the save thread; beyond this the newest are dropped (a dropped save is a
# future cache miss, never a stall of the forward pass).
SAVE_QUEUE_DEPTH = 1024
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class OwnerServeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: blocks to load and blocks to save."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    chunks: list[ChunkTransfer] = field(default_factory=list)
    """Chunk loads and chunk prefill saves (`chunk_side.ChunkReuse`)."""


@dataclass(slots=True)
class _Lookup:
    """What `get_num_new_matched_tokens` found for a request."""

    local_tokens: int
    external_tokens: int
    stored_blocks: int
    hashes: list[int]


@dataclass(slots=True)
class _Tracked:
    """A running request as the save planner follows it."""

    request: Request
    hasher: ChainHasher
    block_ids: list[list[int]]
    """Per KV cache group, the request's block ids (the null block where a window let go)."""
    saved_blocks: int
    save: bool


def _request_flags(request: Request) -> tuple[bool, bool]:
    """(load, save) allowed for this request by its `kv_transfer_params.ownerserve`."""
    params = getattr(request, "kv_transfer_params", None) or {}
    ours = params.get("ownerserve") if isinstance(params, dict) else None
    if not isinstance(ours, dict):
        return True, True
    return ours.get("load", True) is not False, ours.get("save", True) is not False


def _kv_groups(kv_cache_config: KVCacheConfig) -> list[KVGroup]:
    """The engine's KV cache groups as the connector restores them. A model of one group is
    taken as it always was; with several (vLLM's hybrid KV cache manager), each must be full
    attention or a sliding window of the engine's block size, else `ValueError`."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        # a worker's group of layers of one type may carry one spec per layer
        per_layer = getattr(spec, "kv_cache_specs", None)
        specs.append(next(iter(per_layer.values())) if per_layer else spec)
    out: list[KVGroup] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, SlidingWindowSpec):
            out.append(KVGroup(int(spec.sliding_window), int(spec.extra_retained_tokens)))
        elif isinstance(spec, FullAttentionSpec) or len(specs) == 1:
            out.append(KVGroup())
        else:
            raise ValueError(
                f"OwnerServeConnector restores full-attention and sliding-window KV cache "
                f"groups; group {i} is {type(spec).__name__}"
            )
    sizes = {int(spec.block_size) for spec in specs}
    if len(sizes) > 1:
        raise ValueError(f"OwnerServeConnector: KV cache groups of block sizes {sorted(sizes)}")
    return out


def _layer_order(names: list[str]) -> list[str]:
    """Layer names in model order (the artifact's layer axis must mean the same everywhere)."""

    def index(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.search(name)
        return (int(m.group(1)) if m else 1 << 30, name)

    return sorted(names, key=index)


class _RateLimitedLog:
    """Warn at most once per `period_s` per topic (a dead sidecar must not flood the log)."""

    def __init__(self, period_s: float = 30.0) -> None:
        self.period_s = period_s
        self._last: dict[str, float] = {}

    def warning(self, topic: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(topic, -1e9) >= self.period_s:
            self._last[topic] = now
            logger.warning(msg, *args)


class OwnerServeConnector(ChunkReuse, KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by the worker's OwnerServe sidecar (see the module docstring).

    Declares `SupportsHMA`: with vLLM's hybrid KV cache manager on, each KV cache group (full
    attention, sliding windows) is saved and restored with its own layers and block ids (see
    the module docstring); a model of one group is handled as a dense model always was.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._groups = _kv_groups(kv_cache_config)
        self._group_tags = group_tags(self._groups)
        self._group_layers = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        model_config = vllm_config.model_config
        served = model_config.served_model_name
        default_model = served[0] if isinstance(served, list) and served else served
        self.settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config or {},
            default_model=str(default_model or model_config.model),
            block_size=vllm_config.cache_config.block_size,
        )
        self._mla = bool(model_config.use_mla)
        self._total_heads = 1 if self._mla else int(model_config.get_total_num_kv_heads())
        self._all_heads = list(range(self._total_heads))
        # pipeline parallelism: each stage stores its layers under its pp_rank and
        # layer range; a block is whole when every stage's heads are stored
        self._pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
        self._stages: list[Stage] | None = None
        if self._pp_size > 1:
            from vllm.distributed.utils import get_pp_indices

            n_layers = int(model_config.get_total_num_hidden_layers())
            self._stages = [
                (r, get_pp_indices(n_layers, r, self._pp_size)) for r in range(self._pp_size)
            ]
        self._stage: Stage | None = None  # this worker's (register_kv_caches)
        self._client = SidecarClient(self.settings.sidecar_url, self.settings.timeout_s)
        self._lookup_client = SidecarClient(
            self.settings.sidecar_url, self.settings.lookup_timeout_s
        )
        self._lookups_paused_until = 0.0
        self._warn = _RateLimitedLog()
        # scheduler side
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._inflight_loads: dict[str, list[BlockTransfer]] = {}
        # worker side
        self._kv: WorkerKV | None = None  # a model of one group: its cache (chunk reuse too)
        self._group_kv: list[WorkerKV] = []  # per group, its layers' cache
        self._local_heads: tuple[int, ...] = ()
        self._store_heads: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self._done_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        # one item per request: its transfers of every group
        self._load_queue: queue.Queue[list[BlockTransfer] | None] = queue.Queue()
        self._save_queue: queue.Queue[list[tuple[BlockTransfer, Gathered | StagedStore]] | None] = (
            queue.Queue(SAVE_QUEUE_DEPTH)
        )
        self._store_kv: StoreKV | None = None
        self._reserved: dict[int, Reserving] = {}
        """Save reservations made at `bind_connector_metadata`, by the id of their transfer."""
        self._threads: list[threading.Thread] = []
        self._chunk_init(
            model_config.hf_config,
            int(model_config.get_head_size()),
            # chunk reuse needs one rank holding every head and layer
            int(vllm_config.parallel_config.tensor_parallel_size) * self._pp_size,
        )
        if len(self._groups) > 1:
            self._chunk_rope = None  # chunk reuse places one group's layers: off
        logger.info(
            "OwnerServeConnector (%s): sidecar %s, model %r, block_size %d, %d KV heads, "
            "KV cache groups %s",
            role.name,
            self.settings.sidecar_url,
            self.settings.model,
            self.settings.block_size,
            self._total_heads,
            ["full" if g.window is None else f"window {g.window}" for g in self._groups],
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is just a future miss.
        return False

    # ==============================
    # Worker side
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # per KV cache group its layers in model order (one group: every layer); with the
        # hybrid manager, layers of different groups may share one tensor, each group's
        # blocks being its own
        if len(self._groups) == 1:
            group_layers = [[kv_caches[name] for name in _layer_order(list(kv_caches))]]
        else:
            group_layers = [
                [kv_caches[n] for n in _layer_order([n for n in names if n in kv_caches])]
                for names in self._group_layers
            ]
            if any(not layers for layers in group_layers):
                # (a pipeline stage without a group's layers: its keys would never be whole)
                raise ValueError(
                    "OwnerServeConnector: a KV cache group has no layer on this worker"
                )
        layers = group_layers[0]
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pp = get_pp_group()
        indices = [int(m.group(1)) for n in kv_caches if (m := _LAYER_INDEX.search(n))]
        self._stage = stage_of(indices, pp.rank_in_group, pp.world_size)
        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        if cache_dtype != "auto":
            raise NotImplementedError(f"OwnerServeConnector: kv_cache_dtype {cache_dtype}")
        group_kv: list[WorkerKV]
        if layers[0].device.type == "cuda":
            group_kv = [CudaPagedKV(g, mla=self._mla) for g in group_layers]
            how = f"CUDA {'MLA' if self._mla else 'K/V'} layer-first, pinned staging"
        elif self._mla:
            raise NotImplementedError("OwnerServeConnector: MLA on vLLM's CPU backend")
        else:
            order = self._page_order(layers[0])
            group_kv = [CpuAttnKV(g, order) for g in group_layers]
            how = "CPU attention, K page order " + (
                "token-major" if order.is_token_major else "converted from the ISA's"
            )
        kv = group_kv[0]
        self._group_kv = group_kv
        if len(group_kv) == 1:
            self._kv = kv
            self._store_kv = self._open_store(kv)
        elif self.settings.store is not None:
            logger.warning(
                "OwnerServeConnector: %d KV cache groups: KV goes through the sidecar, not "
                "straight through Mooncake Store (its path keys one group)",
                len(group_kv),
            )
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self._local_heads = heads_for_rank(self._total_heads, tp, rank)
        self._store_heads = store_heads_for_rank(self._total_heads, tp, rank)
        if kv.num_kv_heads != len(self._local_heads):
            raise ValueError(
                f"KV cache holds {kv.num_kv_heads} heads, TP rank {rank}/{tp} expects "
                f"{len(self._local_heads)}"
            )
        logger.info(
            "OwnerServeConnector: %s layers, %d-token blocks of %d-dim heads %s (stores %s), "
            "%s, %s",
            "+".join(str(g.num_layers) for g in group_kv),
            kv.block_size,
            kv.head_size,
            list(self._local_heads),
            list(self._store_heads),
            kv.dtype,
            how,
        )
        self._threads = [
            threading.Thread(target=self._load_loop, name="ownerserve-kv-load", daemon=True),
            threading.Thread(target=self._save_loop, name="ownerserve-kv-save", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _open_store(self, kv: WorkerKV) -> StoreKV | None:
        """The Mooncake Store path when configured and reachable; else the sidecar's HTTP
        calls carry the KV (a sidecar on the same store still puts it there)."""
        if self.settings.store is None:
            return None
        try:
            store_kv = open_store_kv(self.settings, kv)
        except (StoreError, ValueError, RuntimeError) as exc:
            logger.error(
                "OwnerServeConnector: Mooncake Store %s not usable, KV goes through the "
                "sidecar: %s",
                self.settings.store,
                exc,
            )
            return None
        logger.info(
            "OwnerServeConnector: KV through Mooncake Store %s (segment %s, %d bytes mounted)",
            self.settings.store,
            store_kv.client.segment,
            self.settings.store_segment_bytes,
        )
        return store_kv

    def _page_order(self, layer: torch.Tensor) -> PageOrder:
        """The CPU attention ISA's in-page element order, measured with its own cache write."""
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        if cache_dtype != "auto":
            raise NotImplementedError(f"OwnerServeConnector: kv_cache_dtype {cache_dtype}")
        _, _, bs, c = layer.shape
        head_size = c // 2
        isa = _get_attn_isa(layer.dtype, bs, head_size, cache_dtype)

        def write(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            cache = torch.zeros(1, 1, bs, c, dtype=layer.dtype)
            k_cache, v_cache = cache.view(1, 1, 2 * bs, head_size).chunk(2, dim=2)
            slots = torch.arange(bs, dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
            return cache

        logger.info("OwnerServeConnector: CPU attention ISA %s", isa)
        return calibrate_page_order(write, bs, head_size, layer.dtype)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata, and start the master's round trips of its store transfers
        now, before the forward pass: the replicas of the loads it plans are looked up
        (`StoreKV.resolve`) and the objects of the saves reserved (`StoreKV.reserve_rows`),
        so the copies in `wait_for_save` and on the load thread do not wait for them."""
        super().bind_connector_metadata(connector_metadata)
        store = self._store_kv
        if store is None or not isinstance(connector_metadata, OwnerServeConnectorMetadata):
            return
        try:
            for transfer in connector_metadata.loads:
                store.resolve(
                    [k for h in transfer.chunk_hashes for k in self._keys(h, self._local_heads)]
                )
            if store.zero_copy and self._store_heads:
                for transfer in connector_metadata.saves:
                    self._reserved[id(transfer)] = store.reserve_rows(self._save_rows(transfer))
        except Exception as exc:  # the transfers then ask for themselves
            self._warn.warning("early", "OwnerServeConnector: early round trips: %s", exc)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._bound_metadata()
        if meta is None:
            return
        self._run_chunk_loads(meta)
        by_request: dict[str, list[BlockTransfer]] = {}
        for transfer in meta.loads:
            by_request.setdefault(transfer.req_id, []).append(transfer)
        for transfers in by_request.values():
            self._load_queue.put(transfers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous between scheduler steps: a request waits in vLLM's
        # WAITING_FOR_REMOTE_KVS state until `get_finished` reports its load done.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # All layers of a block go into one artifact per head, gathered in `wait_for_save`.
        return

    def wait_for_save(self) -> None:
        meta = self._bound_metadata()
        if meta is not None and meta.chunks:
            self._run_chunk_saves(meta)
        if meta is None or not meta.saves or not self._group_kv or not self._store_heads:
            self._drop_reserved()
            return
        by_request: dict[str, list[tuple[BlockTransfer, Gathered | StagedStore]]] = {}
        for transfer in meta.saves:
            # The copy happens now, so the blocks may be reused as soon as this step ends.
            buffers: Gathered | StagedStore
            if self._store_kv is not None:
                reserving = self._reserved.pop(id(transfer), None)
                staged = self._store_kv.gather(transfer.block_ids, reserving=reserving)
                if staged is None:
                    self._warn.warning(
                        "save-staging", "OwnerServeConnector: store staging full, dropping"
                    )
                    continue
                buffers = staged
            else:
                buffers = self._group_kv[transfer.group].gather(transfer.block_ids)
            by_request.setdefault(transfer.req_id, []).append((transfer, buffers))
        for saves in by_request.values():
            try:
                self._save_queue.put_nowait(saves)
            except queue.Full:
                self._warn.warning("save-full", "OwnerServeConnector: save queue full, dropping")
                for _, buffers in saves:
                    if isinstance(buffers, StagedStore):
                        buffers.release()
        self._drop_reserved()

    def _drop_reserved(self) -> None:
        """Give back reservations `bind_connector_metadata` made that no save took."""
        if self._store_kv is None:
            return
        while self._reserved:
            _, reserving = self._reserved.popitem()
            reserving.cancel(self._store_kv.client)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done_loads = self._done_loads, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        self._load_queue.put(None)
        with contextlib.suppress(queue.Full):
            self._save_queue.put(None, timeout=1.0)
        for t in self._threads:
            t.join(timeout=5.0)
        self._client.close()
        self._lookup_client.close()
        if self._store_kv is not None:
            self._store_kv.close()
            self._store_kv.client.close()

    def _bound_metadata(self) -> OwnerServeConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, OwnerServeConnectorMetadata)
        return meta

    def _load_loop(self) -> None:
        while (transfers := self._load_queue.get()) is not None:
            failed: list[int] = []
            for transfer in transfers:  # the request's blocks of every group
                try:
                    failed.extend(self._load(transfer))
                except Exception:  # never leave a request waiting for its KV forever
                    logger.exception("OwnerServeConnector: load for %s failed", transfer.req_id)
                    failed.extend(transfer.block_ids)
            with self._lock:
                self._failed_blocks.update(failed)
                self._done_loads.add(transfers[0].req_id)

    def _load(self, transfer: BlockTransfer) -> list[int]:
        """Fetch and scatter `transfer`'s blocks (`load.load_blocks`: on CUDA straight into
        pinned staging); returns the block ids that were not loaded."""
        kv = self._group_kv[transfer.group]
        started = time.monotonic()
        rows = [
            self._keys(chunk_hash, self._local_heads, transfer.group)
            for chunk_hash in transfer.chunk_hashes
        ]
        # the whole request's artifacts in one call (a few for a very long prompt)
        if self._store_kv is not None:
            result = self._store_kv.load(rows, transfer.block_ids)
            outcome = result.load
            if result.dropped:
                try:  # the sidecar stops answering lookups with what is gone
                    self._client.report_store([], dropped=result.dropped)
                except SidecarError as exc:
                    self._warn.warning("report", "OwnerServeConnector: store report: %s", exc)
        else:
            outcome = load_blocks(self._client, kv, rows, transfer.block_ids)
        good = outcome.blocks
        logger.info(
            "OwnerServeConnector: loaded %d/%d blocks (%d bytes) of group %d for %s in %.3f s",
            good,
            len(transfer.block_ids),
            outcome.nbytes,
            transfer.group,
            transfer.req_id,
            time.monotonic() - started,
        )
        if outcome.refused is not None:
            logger.warning(
                "OwnerServeConnector: rejected artifact (%s); blocks %d.. of request %s "
                "will be recomputed",
                outcome.refused,
                transfer.first_index + good,
                transfer.req_id,
            )
        return list(transfer.block_ids[good:])

    def _keys(self, chunk_hash: int, heads: Sequence[int], group: int = 0) -> list[str]:
        """This worker's artifact keys of a block for `heads` (its pipeline stage's, if any)
        in KV cache group `group`."""
        stage = self._stage
        tag = self._group_tags[group]
        if stage is None:
            return block_keys(self.settings.model, chunk_hash, heads, group=tag)
        return block_keys(
            self.settings.model, chunk_hash, heads, pp_rank=stage[0], layers=stage[1], group=tag
        )

    def _save_loop(self) -> None:
        while (saves := self._save_queue.get()) is not None:
            # a block is whole when every rank's heads (of every pipeline stage) are stored in
            # every group that saved it this step
            groups_of: dict[int, int] = {}
            for transfer, _ in saves:
                for chunk_hash in transfer.chunk_hashes:
                    groups_of[chunk_hash] = groups_of.get(chunk_hash, 0) + 1
            per_group = self._total_heads * self._pp_size
            by_whole: dict[int, list[tuple[str, bytes | memoryview]]] = {}
            for transfer, buffers in saves:
                if isinstance(buffers, StagedStore):
                    self._save_to_store(transfer, buffers)
                    continue
                for i, chunk_hash in enumerate(transfer.chunk_hashes):
                    keys = self._keys(chunk_hash, self._store_heads, transfer.group)
                    items = by_whole.setdefault(groups_of[chunk_hash] * per_group, [])
                    for head, key in zip(self._store_heads, keys, strict=True):
                        items.append((key, payload_of(buffers, self._local_heads.index(head), i)))
            for whole, items in by_whole.items():
                try:
                    # the step's blocks of the request in one call (one per count of groups
                    # that saved a block)
                    self._client.put_many(items, whole)
                except SidecarError as exc:
                    self._warn.warning("save", "OwnerServeConnector: save failed: %s", exc)

    def _save_rows(self, transfer: BlockTransfer) -> list[list[tuple[int, str]]]:
        """(local head, key) of each block of a save, as `StoreKV.put` takes them."""
        rows = []
        for chunk_hash in transfer.chunk_hashes:
            keys = self._keys(chunk_hash, self._store_heads)
            rows.append(
                [
                    (self._local_heads.index(h), k)
                    for h, k in zip(self._store_heads, keys, strict=True)
                ]
            )
        return rows

    def _save_to_store(self, transfer: BlockTransfer, staged: StagedStore) -> None:
        """Put a save's staged blocks into Mooncake Store, then tell the sidecar (which
        indexes and publishes them as its own)."""
        assert self._store_kv is not None
        rows = self._save_rows(transfer)
        try:
            outcome = self._store_kv.put(staged, rows)
            if outcome.refused:
                self._warn.warning(
                    "save",
                    "OwnerServeConnector: Mooncake Store refused %d artifacts, first %s",
                    len(outcome.refused),
                    outcome.refused[0],
                )
            if outcome.stored:
                self._client.report_store(outcome.stored, self._total_heads * self._pp_size)
        except (StoreError, SidecarError) as exc:
            self._warn.warning("save", "OwnerServeConnector: save failed: %s", exc)
        except Exception:  # the save thread goes on: a lost save is a future miss
            logger.exception("OwnerServeConnector: save for %s failed", transfer.req_id)

    # ==============================
    # Scheduler side
    # ==============================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        allow_load, allow_save = _request_flags(request)
        prompt = request.prompt_token_ids
        if prompt is None or not (
            (self.settings.load and allow_load) or (self.settings.save and allow_save)
        ):
            return 0, False
        chunked = self._chunk_matched(request, num_computed_tokens, allow_load)
        if chunked is not None:
            return chunked
        bs = self.settings.block_size
        hashes = chunk_hashes(prompt, bs, self.settings.root(request.cache_salt))
        stored = ext = 0
        if time.monotonic() >= self._lookups_paused_until:
            try:
                masks = self._stored_masks(hashes)
            except SidecarError as exc:
                self._lookups_paused_until = time.monotonic() + self.settings.lookup_backoff_s
                self._warn.warning("lookup", "OwnerServeConnector: sidecar lookup failed: %s", exc)
            else:
                local = num_computed_tokens // bs
                # blocks restorable in every group: not saved again; of the prompt's, loaded
                stored = restorable_blocks(masks, self._groups, bs, len(hashes), local)
                if self.settings.load and allow_load:
                    end = restorable_blocks(
                        masks, self._groups, bs, loadable_blocks(len(prompt), bs), local
                    )
                    ext = max(0, end * bs - num_computed_tokens)
        self._lookups[request.request_id] = _Lookup(num_computed_tokens, ext, stored, hashes)
        return ext, ext > 0

    def _stored_masks(self, hashes: Sequence[int]) -> list[list[bool]]:
        """Per KV cache group, which of the blocks `hashes` the sidecar holds whole (every head
        of every pipeline stage), in one lookup."""
        per_group = [
            lookup_keys(self.settings.model, hashes, self._all_heads, self._stages, tag)
            for tag in self._group_tags
        ]
        present = self._lookup_client.lookup([k for keys in per_group for k in keys])
        per_block = len(self._all_heads) * self._pp_size
        masks, at = [], 0
        for keys in per_group:
            masks.append(present_mask(present[at : at + len(keys)], per_block))
            at += len(keys)
        return masks

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        lookup = self._lookups.pop(req_id, None)
        self._track(request, lookup)
        self._chunk_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens <= 0 or lookup is None:
            return
        transfers = plan_group_loads(
            req_id,
            blocks.get_block_ids(),
            lookup.hashes,
            lookup.local_tokens,
            num_external_tokens,
            self.settings.block_size,
        )
        self._pending_loads.extend(transfers)
        self._inflight_loads[req_id] = transfers

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OwnerServeConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_save(tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not tracked.block_ids:
                    tracked.block_ids = [[] for _ in new_ids]
                for ids, more in zip(tracked.block_ids, new_ids, strict=True):
                    ids.extend(more)
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._plan_save(tracked, computed, meta)
        self._chunk_meta(scheduler_output, meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = set(connector_output.invalid_block_ids or ())
        if invalid:
            self._chunk_load_failed(invalid)
            for req_id, transfers in self._inflight_loads.items():
                failed = [i for t in transfers if (i := first_failed_index(t, invalid)) is not None]
                index = min(failed, default=None)
                tracked = self._tracked.get(req_id)
                if index is not None and tracked is not None:
                    # The sidecar dropped what it refused: save the recomputed blocks again.
                    tracked.saved_blocks = min(tracked.saved_blocks, index)
        for req_id in connector_output.finished_recving or ():
            self._inflight_loads.pop(req_id, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._tracked.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._inflight_loads.pop(req_id, None)
        return False, self._chunk_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def _track(self, request: Request, lookup: _Lookup | None) -> None:
        stored = lookup.stored_blocks if lookup is not None else 0
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            tracked.saved_blocks = max(tracked.saved_blocks, stored)
            return
        _, allow_save = _request_flags(request)
        self._tracked[request.request_id] = _Tracked(
            request=request,
            hasher=ChainHasher(self.settings.block_size, self.settings.root(request.cache_salt)),
            block_ids=[],
            saved_blocks=stored,
            save=self.settings.save and allow_save,
        )

    def _plan_save(
        self, tracked: _Tracked, computed_tokens: int, meta: OwnerServeConnectorMetadata
    ) -> None:
        if not tracked.save:
            return
        bs = self.settings.block_size
        tokens = tracked.request.all_token_ids
        full = min(computed_tokens, len(tokens)) // bs
        if full <= tracked.saved_blocks:
            return
        if full > len(tracked.hasher.hashes):
            tracked.hasher.update(list(tokens[: full * bs]))
        if not tracked.block_ids:
            return
        transfers, tracked.saved_blocks = plan_group_saves(
            tracked.request.request_id,
            tracked.block_ids,
            tracked.hasher.hashes,
            tracked.saved_blocks,
            computed_tokens,
            bs,
        )
        meta.saves.extend(transfers)
