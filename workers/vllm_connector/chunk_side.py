"""`ChunkReuse`: the chunk-reuse half of `OwnerServeConnector` (`chunks.py` says what it does),
grouped like the connector: scheduler-side hooks (`_chunk_matched`, `_chunk_after_alloc`,
`_chunk_meta`, `_chunk_finished`) and worker-side ones (`_run_chunk_loads`,
`_run_chunk_saves`). Chunk loads are synchronous (done in `start_load_kv`, before the forward
pass): a refused artifact puts the blocks from its first token on into the load errors, so
vLLM recomputes them, and the request's answer says so in `kv_transfer_params.ownerserve.
chunk_fallback`."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from kernels import LayoutError
from kernels.rope import RopeSpec
from ownerserve.chunks import chunk_artifact_key
from workers.vllm_connector.chunks import (
    ChunkArtifact,
    ChunkSaveSpec,
    ChunkTransfer,
    blocks_for,
    decode_artifact,
    encode_artifact,
    layout_of,
    place,
    plan_pieces,
    save_spec_of,
    tokens_of,
)
from workers.vllm_connector.client import SidecarClient, SidecarError
from workers.vllm_connector.payload import CpuAttnKV, WorkerKV
from workers.vllm_connector.plan import ConnectorSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class ChunkReuse:
    """Mixed into `OwnerServeConnector`; uses its settings, clients, cache and locks."""

    settings: ConnectorSettings
    _client: SidecarClient
    _lookup_client: SidecarClient
    _kv: WorkerKV | None
    _lock: threading.Lock
    _failed_blocks: set[int]
    _total_heads: int
    _tracked: dict[str, Any]

    def _chunk_init(self, hf_config: Any, head_size: int, tp_size: int) -> None:
        from workers.vllm_connector.chunks import rope_of

        self._chunk_rope: RopeSpec | None = rope_of(hf_config, head_size) if tp_size == 1 else None
        self._chunk_loads: dict[str, ChunkTransfer] = {}
        self._chunk_save_specs: dict[str, ChunkSaveSpec] = {}
        self._chunk_pending: list[ChunkTransfer] = []
        self._chunk_refused: dict[str, str] = {}
        self._chunk_inflight: dict[str, list[int]] = {}

    # ==============================
    # Scheduler side
    # ==============================

    def _chunk_matched(
        self, request: Request, num_computed_tokens: int, allow_load: bool
    ) -> tuple[int, bool] | None:
        """`get_num_new_matched_tokens` for a chunked request (None: not one, go on as usual):
        the leading stored chunks past the local hit, loaded synchronously."""
        params = getattr(request, "kv_transfer_params", None)
        prompt = request.prompt_token_ids
        if prompt is None:
            return None
        spec = save_spec_of(params)
        if spec is not None and spec.end <= len(prompt):
            self._chunk_save_specs[request.request_id] = spec
        layout = layout_of(params, prompt)
        if layout is None:
            return None
        if self._chunk_rope is None or not (self.settings.load and allow_load):
            return 0, False
        system_end, spans = layout
        keys = [chunk_artifact_key(self.settings.model, s.key) for s in spans]
        try:
            present = self._lookup_client.lookup(keys)
        except SidecarError:
            present = [False] * len(keys)
        end, pieces = plan_pieces(
            self.settings.model,
            system_end,
            spans,
            present,
            num_computed_tokens,
            len(prompt),
            self.settings.block_size,
        )
        if not pieces:
            if end <= num_computed_tokens and spans[-1].end > num_computed_tokens:
                # nothing loadable past the local hit: computed here, not isolated
                self._chunk_refused[request.request_id] = (
                    "missing" if not all(present) else "no_system_hit"
                )
            return 0, False
        if not all(present[: len(spans)]):
            self._chunk_refused[request.request_id] = "missing"
        self._chunk_loads[request.request_id] = ChunkTransfer(
            request.request_id, [], num_computed_tokens, pieces
        )
        return end - num_computed_tokens, False

    def _chunk_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        transfer = self._chunk_loads.pop(request.request_id, None)
        if transfer is None or num_external_tokens <= 0:
            return
        end = transfer.first_token + num_external_tokens
        first, ids = blocks_for(
            blocks.get_block_ids()[0], transfer.first_token, end, self.settings.block_size
        )
        transfer.block_ids, transfer.first_token = ids, first
        self._chunk_pending.append(transfer)
        self._chunk_inflight[request.request_id] = ids

    def _chunk_meta(self, scheduler_output: SchedulerOutput, meta: Any) -> None:
        """This step's chunk loads, and the saves of chunk prefills whose prompt it completes."""
        meta.chunks.extend(self._chunk_pending)
        self._chunk_pending = []
        if not self._chunk_save_specs:
            return
        scheduled = scheduler_output.num_scheduled_tokens
        computed: dict[str, int] = {
            new.req_id: new.num_computed_tokens + scheduled.get(new.req_id, 0)
            for new in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
        for req_id, spec in list(self._chunk_save_specs.items()):
            tracked = self._tracked.get(req_id)
            if tracked is None or computed.get(req_id, 0) < spec.end:
                continue
            del self._chunk_save_specs[req_id]
            # chunk reuse runs on a model of one KV cache group: its block ids are group 0's
            first, ids = blocks_for(
                tracked.block_ids[0] if tracked.block_ids else [],
                spec.start,
                spec.end,
                self.settings.block_size,
            )
            key = chunk_artifact_key(self.settings.model, spec.key)
            meta.chunks.append(ChunkTransfer(req_id, ids, first, save=spec, save_key=key))

    def _chunk_finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request; the `kv_transfer_params` its answer carries, if any: never on a
        P/D hand-over's request, whose params are the NIXL connector's (MultiConnector takes
        one connector's params only)."""
        req_id = request.request_id
        self._chunk_loads.pop(req_id, None)
        self._chunk_save_specs.pop(req_id, None)
        self._chunk_inflight.pop(req_id, None)
        why = self._chunk_refused.pop(req_id, None)
        params = getattr(request, "kv_transfer_params", None) or {}
        pd = isinstance(params, dict) and (
            params.get("do_remote_decode") or params.get("do_remote_prefill")
        )
        return {"ownerserve": {"chunk_fallback": why}} if why and not pd else None

    def _chunk_load_failed(self, invalid: set[int]) -> None:
        """Blocks vLLM recomputes because a chunk artifact was refused: say so in the answer."""
        for req_id, ids in self._chunk_inflight.items():
            if invalid.intersection(ids):
                self._chunk_refused[req_id] = "refused"

    # ==============================
    # Worker side
    # ==============================

    def _run_chunk_loads(self, meta: Any) -> None:
        for transfer in meta.chunks:
            if transfer.save is None:
                failed = self._chunk_load(transfer)
                if failed:
                    with self._lock:
                        self._failed_blocks.update(failed)

    def _chunk_load(self, transfer: ChunkTransfer) -> list[int]:
        """Fill the transfer's tokens (its artifacts in one batch GET); returns the block ids
        to recompute (from the first token of a refused artifact on)."""
        kv = self._kv
        if not isinstance(kv, CpuAttnKV) or self._chunk_rope is None:
            return list(transfer.block_ids)
        keys = list(dict.fromkeys(p.key for p in transfer.pieces))
        try:
            # every artifact of the request in one batch call, each checksum-verified
            fetched = dict(zip(keys, self._client.get_many(keys), strict=True))
        except SidecarError:
            return list(transfer.block_ids)
        blocks = kv.gather(transfer.block_ids)
        arts: dict[str, ChunkArtifact] = {}
        bs = kv.block_size
        bad_from: int | None = None
        for piece in transfer.pieces:
            try:
                if piece.key not in arts:
                    data = fetched[piece.key]
                    if isinstance(data, SidecarError):
                        raise data
                    arts[piece.key] = decode_artifact(
                        data, kv.num_kv_heads, kv.num_layers, kv.head_size, kv.dtype
                    )
                place(blocks, transfer.first_token, piece, arts[piece.key], self._chunk_rope)
            except (SidecarError, LayoutError):
                bad_from = piece.dst
                break
        good = len(transfer.block_ids)
        if bad_from is not None:
            good = (bad_from - transfer.first_token) // bs
        if good:
            kv.scatter(blocks[:, :good].contiguous(), transfer.block_ids[:good])
        return list(transfer.block_ids[good:])

    def _run_chunk_saves(self, meta: Any) -> None:
        kv = self._kv
        if not isinstance(kv, CpuAttnKV):
            return
        for transfer in meta.chunks:
            spec = transfer.save
            if spec is None:
                continue
            blocks = kv.gather(transfer.block_ids)
            data = encode_artifact(
                tokens_of(blocks, transfer.first_token, spec.start, spec.end),
                spec.start,
                spec.position,
            )
            # a lost chunk save is a future miss: the router prefills it again
            with contextlib.suppress(SidecarError):
                self._client.put(transfer.save_key, data)
