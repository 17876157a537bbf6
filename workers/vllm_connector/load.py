"""What the connector's load thread does for one request: fetch its blocks' per-head artifacts
from the sidecar, checksum-verified, and write the good prefix (the blocks before the first
refused artifact) into the paged cache. No vLLM import: the tests and the benchmark drive it with
plain tensors and a real sidecar.

A `CudaPagedKV` cache reads the batch answers straight into its pinned load staging
(`SidecarClient.get_many_into`, each payload verified there) and writes the prefix with one
`scatter_staged`: no host copy of the payloads. Other caches (vLLM's CPU backend, `CpuAttnKV`)
take the payloads as `bytes` (`get_many`) and `scatter_payloads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.vllm_connector.client import ArtifactRejected, SidecarClient, SidecarError
from workers.vllm_connector.gpu import CudaPagedKV
from workers.vllm_connector.payload import WorkerKV, scatter_payloads


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What a load wrote: its first `blocks` blocks (`nbytes` of payloads), and why the next one
    was refused (None when every block was loaded)."""

    blocks: int
    nbytes: int
    refused: str | None


def load_blocks(
    client: SidecarClient,
    kv: WorkerKV,
    rows: Sequence[Sequence[str]],
    block_ids: Sequence[int],
) -> LoadOutcome:
    """Fetch `rows[i]` (block `block_ids[i]`'s artifact keys, one per local head in cache order)
    in as few batch calls as the bounds allow and write the blocks before the first refused
    artifact (missing, of the wrong size or failing its checksum) into `kv`; a call that fails
    as a whole refuses every block."""
    if len(rows) != len(block_ids):
        raise ValueError(f"{len(rows)} key rows for {len(block_ids)} blocks")
    if not rows:
        return LoadOutcome(0, 0, None)
    if isinstance(kv, CudaPagedKV):
        return _load_staged(client, kv, rows, block_ids)
    return _load_bytes(client, kv, rows, block_ids)


def _good_prefix(results: Sequence[object], heads: int) -> tuple[int, str | None]:
    """(blocks before the first refused artifact, why it was refused) of per-artifact results in
    block order, `heads` per block."""
    for i, got in enumerate(results):
        if isinstance(got, ArtifactRejected):
            return i // heads, str(got)
    return len(results) // heads, None


def _load_staged(
    client: SidecarClient, kv: CudaPagedKV, rows: Sequence[Sequence[str]], block_ids: Sequence[int]
) -> LoadOutcome:
    heads = kv.num_kv_heads
    staging = kv.load_staging(len(rows))
    keys: list[str] = []
    slots: list[memoryview] = []
    for i, row in enumerate(rows):
        if len(row) != heads:
            raise ValueError(f"block {i}: {len(row)} keys for {heads} heads")
        keys.extend(row)
        slots.extend(staging.slot(i, j) for j in range(heads))
    try:
        good, refused = _good_prefix(client.get_many_into(keys, slots), heads)
    except SidecarError as exc:
        good, refused = 0, str(exc)
    if good:
        kv.scatter_staged(staging, block_ids[:good])
    return LoadOutcome(good, good * heads * kv.payload_nbytes, refused)


def _load_bytes(
    client: SidecarClient, kv: WorkerKV, rows: Sequence[Sequence[str]], block_ids: Sequence[int]
) -> LoadOutcome:
    size = kv.payload_nbytes
    keys = [key for row in rows for key in row]
    try:
        got = client.get_many(keys, [size] * len(keys))
    except SidecarError as exc:
        return LoadOutcome(0, 0, str(exc))
    payloads: list[list[bytes]] = []
    refused: str | None = None
    at = 0
    for row in rows:
        datas: list[bytes] = []
        for key in row:
            data = got[at]
            at += 1
            if isinstance(data, ArtifactRejected):
                refused = str(data)
            elif len(data) != size:
                refused = f"{key}: {len(data)} bytes, expected {size}"
            if refused is not None:
                break
            assert isinstance(data, bytes)
            datas.append(data)
        if refused is not None:
            break
        payloads.append(datas)
    good = len(payloads)
    if good:
        scatter_payloads(payloads, kv, block_ids[:good])
    return LoadOutcome(good, sum(len(p) for row in payloads for p in row), refused)
