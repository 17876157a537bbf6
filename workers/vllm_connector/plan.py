"""The connector's pure decisions: which artifact keys hold a block, how many prompt tokens the
sidecar can supply, and which engine blocks a load fills or a save reads. No I/O, no vLLM.

A block's identity is the OwnerServe chain hash of its tokens (`ownerserve.hashing`, the same
chain the router computes from the same token ids, block size and root), so a block saved by one
worker is found by every other worker and by the router's directory. Its KV is stored as one
artifact per KV head: key `HeadArtifactKey(model, head, chunk_hash)` with all layers of
that head in the one artifact (`layer` left unset); MLA models have one head (head 0). The
store path's grouped layout (`object_groups`, `group_key`) keys one object per group of blocks
holding every head instead.

**KV cache groups.** With vLLM's hybrid KV cache manager a model's layers fall into several KV
cache groups (full attention; sliding windows), each with its own block ids for the same token
positions. A model of one group keys its blocks as above; with several, each group's artifacts
hold its own layers and their keys end in the group's tag (`KVGroup.tag`), so that no group's
block is ever read as another's. A sliding-window group lets the blocks before its window go
(vLLM puts its null block, `NULL_BLOCK_ID`, in their place): saves store what it still holds,
and a prefix is restorable up to a boundary only where every group holds what vLLM needs to
resume there (`KVGroup.first_needed`, `restorable_blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.kvstate.heads import HeadArtifactKey
from workers.mooncake_store.master import MasterAddress


class ConnectorConfigError(ValueError):
    """`kv_connector_extra_config` does not describe a usable connector."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector reads from `kv_connector_extra_config` (plus the engine's block size).

    `model` and `salt` fix the hash chain's root (`chain_root(model, salt)`) and the artifact
    keys' model name: they must equal the router's model settings (`name`, `salt`) for the
    router's directory and the sidecars to agree on block identities.
    """

    sidecar_url: str
    model: str
    block_size: int
    salt: str = ""
    timeout_s: float = 10.0
    # The scheduler loop waits for lookups: keep them short, and skip them for a while after a
    # failure (`lookup_backoff_s`) rather than stall every new request on a dead sidecar.
    lookup_timeout_s: float = 1.0
    lookup_backoff_s: float = 5.0
    load: bool = True
    save: bool = True
    store: str | None = None
    """`mooncake://HOST:PORT?metadata_port=P`: save and load through that Mooncake Store
    directly (`store_path.py`), the same store the sidecar runs on (`--store`)."""
    store_segment_bytes: int = 0
    """Memory the connector's store client mounts (0: none; objects go to the segments of others,
    e.g. the sidecar's). With a segment, saves land in it and loads from it are local copies."""
    store_staging_bytes: int = 512 << 20
    """Registered host staging per direction (pinned on CUDA)."""
    store_digest_threads: int = 4
    """Threads that hash a batch's payloads (checksums computed on save, verified on load)."""
    store_replica_cache_s: float = 5.0
    """Objects read again within this time skip the master's lookup (a hot prefix's blocks);
    0: off (`ClientSettings.replica_cache_s`)."""

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, object], *, default_model: str, block_size: int
    ) -> ConnectorSettings:
        url = extra.get("sidecar_url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConnectorConfigError(
                "kv_connector_extra_config.sidecar_url must be the local sidecar's http:// URL"
            )
        model = extra.get("model", default_model)
        salt = extra.get("salt", "")
        timeout = extra.get("timeout_s", 10.0)
        lookup_timeout = extra.get("lookup_timeout_s", 1.0)
        backoff = extra.get("lookup_backoff_s", 5.0)
        if not isinstance(model, str) or not model:
            raise ConnectorConfigError("kv_connector_extra_config.model must be a non-empty str")
        if not isinstance(salt, str):
            raise ConnectorConfigError("kv_connector_extra_config.salt must be a str")
        seconds: dict[str, float] = {}
        for name, value in (
            ("timeout_s", timeout),
            ("lookup_timeout_s", lookup_timeout),
            ("lookup_backoff_s", backoff),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConnectorConfigError(f"kv_connector_extra_config.{name} must be > 0")
            seconds[name] = float(value)
        if block_size <= 0:
            raise ConnectorConfigError("block_size must be positive")
        flags = {}
        for name in ("load", "save"):
            value = extra.get(name, True)
            if not isinstance(value, bool):
                raise ConnectorConfigError(f"kv_connector_extra_config.{name} must be a bool")
            flags[name] = value
        store = extra.get("store")
        if store is not None:
            if not isinstance(store, str):
                raise ConnectorConfigError("kv_connector_extra_config.store must be a str")
            try:
                MasterAddress.parse(store)
            except ValueError as exc:
                raise ConnectorConfigError(f"kv_connector_extra_config.store: {exc}") from None
        sizes: dict[str, int] = {}
        for name, default, least in (
            ("store_segment_bytes", 0, 0),
            ("store_staging_bytes", 512 << 20, 1),
            ("store_digest_threads", 4, 1),
        ):
            value = extra.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConnectorConfigError(
                    f"kv_connector_extra_config.{name} must be an integer >= {least}"
                )
            sizes[name] = value
        cache_s = extra.get("store_replica_cache_s", 5.0)
        if isinstance(cache_s, bool) or not isinstance(cache_s, int | float) or cache_s < 0:
            raise ConnectorConfigError(
                "kv_connector_extra_config.store_replica_cache_s must be a number >= 0"
            )
        return cls(
            sidecar_url=url.rstrip("/"),
            model=model,
            block_size=block_size,
            salt=salt,
            timeout_s=seconds["timeout_s"],
            lookup_timeout_s=seconds["lookup_timeout_s"],
            lookup_backoff_s=seconds["lookup_backoff_s"],
            load=flags["load"],
            save=flags["save"],
            store=store,
            store_replica_cache_s=float(cache_s),
            **sizes,
        )

    def root(self, cache_salt: str | None = None) -> int:
        """Parent hash of a chain's first block; a request's vLLM `cache_salt` (tenant
        isolation) joins the configured salt, so salted requests never share artifacts with
        unsalted ones."""
        salt = self.salt if not cache_salt else f"{self.salt}\x00{cache_salt}"
        return chain_root(self.model, salt)


def chunk_hashes(token_ids: Sequence[int], block_size: int, root: int) -> list[int]:
    """Chain hashes of every full block of `token_ids` (a trailing partial block has none)."""
    return block_hash_chain(token_ids, block_size, root)


NULL_BLOCK_ID = 0
"""vLLM's null block (`BlockPool.null_block`, the pool's block 0, never handed to a request as
its own): what a sliding-window group's block list holds where the window let a block go. It
holds no KV of the request: never saved, never loaded into."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One of the engine's KV cache groups as the connector restores it: full attention
    (`window` None: every block before a boundary) or a sliding window of `window` tokens that
    also keeps `retained` trailing tokens below it (vLLM's `SlidingWindowSpec`)."""

    window: int | None = None
    retained: int = 0

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError("a sliding window holds at least one token")
        if self.retained < 0:
            raise ValueError("retained tokens must be >= 0")

    def first_needed(self, boundary_blocks: int, block_size: int) -> int:
        """The first block this group must hold for vLLM to resume a request after
        `boundary_blocks` blocks: 0 for full attention; for a window, the block holding the
        first token the next token attends to (vLLM's `get_num_skipped_tokens`), whole blocks
        before it being the null block."""
        if self.window is None:
            return 0
        skipped = max(0, boundary_blocks * block_size - self.window + 1 - self.retained)
        return min(skipped // block_size, boundary_blocks)

    def tag(self, index: int) -> str:
        """Key suffix of group `index`'s artifacts (when the engine has several groups): its
        index in the engine's KV cache config and its kind, e.g. `kvgroup:0:window64`."""
        kind = "full" if self.window is None else f"window{self.window}"
        return f"kvgroup:{index}:{kind}"


def group_tags(groups: Sequence[KVGroup]) -> list[str | None]:
    """Each group's key suffix: none for a model of one group (its keys are those of a dense
    model), else `KVGroup.tag`."""
    if len(groups) == 1:
        return [None]
    return [g.tag(i) for i, g in enumerate(groups)]


def block_keys(
    model: str,
    chunk_hash: int,
    heads: Sequence[int],
    *,
    pp_rank: int = 0,
    layers: tuple[int, int] | None = None,
    group: str | None = None,
) -> list[str]:
    """Artifact keys of one block: one per KV head, all layers in each (a pipeline stage's:
    its `pp_rank` and model layer range `[a, b)`; unset for PP=1); `group`: the KV cache
    group's tag (`group_tags`), whose layers the artifacts then hold."""
    suffix = "" if group is None else f"@{group}"
    return [
        HeadArtifactKey(model, h, chunk_hash, pp_rank=pp_rank, layers=layers).to_string() + suffix
        for h in heads
    ]


Stage = tuple[int, tuple[int, int]]
"""A pipeline stage as keys name it: (pp_rank, model layers [a, b) it holds)."""


def stage_keys(
    model: str,
    chunk_hash: int,
    heads: Sequence[int],
    stages: Sequence[Stage] | None = None,
    group: str | None = None,
) -> list[str]:
    """Artifact keys of one block over every pipeline stage: each stage's heads' keys, stage
    after stage (a block is whole when every stage's heads are stored); PP=1
    (`stages` None or empty): `block_keys`."""
    if not stages:
        return block_keys(model, chunk_hash, heads, group=group)
    return [
        k
        for pp_rank, layers in stages
        for k in block_keys(model, chunk_hash, heads, pp_rank=pp_rank, layers=layers, group=group)
    ]


def lookup_keys(
    model: str,
    hashes: Sequence[int],
    heads: Sequence[int],
    stages: Sequence[Stage] | None = None,
    group: str | None = None,
) -> list[str]:
    """Keys of `hashes` block after block, `len(heads)` keys per block and stage (one lookup
    request), of KV cache group `group` (its tag; None: a model of one group)."""
    return [k for c in hashes for k in stage_keys(model, c, heads, stages, group)]


def stage_of(layer_indices: Sequence[int], pp_rank: int, pp_size: int) -> Stage | None:
    """This rank's stage from the model layer indices it registered (None for PP=1: keys stay
    those of a whole model). Raises `ValueError` when they are not one contiguous range."""
    if pp_size <= 1:
        return None
    lo, hi = min(layer_indices), max(layer_indices) + 1
    if sorted(layer_indices) != list(range(lo, hi)):
        raise ValueError(f"pipeline stage {pp_rank}: layers {sorted(layer_indices)} not contiguous")
    return pp_rank, (lo, hi)


def present_blocks(present: Sequence[bool], heads_per_block: int) -> int:
    """Leading blocks whose every head is present, from `lookup_keys`' answer."""
    if heads_per_block <= 0:
        raise ValueError("heads_per_block must be positive")
    n = len(present) // heads_per_block
    for i in range(n):
        if not all(present[i * heads_per_block : (i + 1) * heads_per_block]):
            return i
    return n


def present_mask(present: Sequence[bool], heads_per_block: int) -> list[bool]:
    """Per block of `lookup_keys`' answer: whether every head (and stage) of it is present."""
    if heads_per_block <= 0:
        raise ValueError("heads_per_block must be positive")
    n = len(present) // heads_per_block
    return [all(present[i * heads_per_block : (i + 1) * heads_per_block]) for i in range(n)]


def restorable_blocks(
    masks: Sequence[Sequence[bool]],
    groups: Sequence[KVGroup],
    block_size: int,
    limit: int,
    local_blocks: int = 0,
) -> int:
    """The furthest boundary `n <= limit` (in blocks) where every group can be restored from
    what is stored (`masks[g][i]`: group g's block i is): a full-attention group needs every
    block before n, a window group the blocks from its `first_needed(n)` on (those before
    `local_blocks`, vLLM's own prefix hit, it holds itself). 0 when there is none. For one
    full-attention group this is `present_blocks` capped at `limit`."""
    if len(masks) != len(groups) or not groups:
        raise ValueError(f"{len(masks)} presence masks for {len(groups)} groups")
    limit = min(limit, *(len(m) for m in masks))
    runs: list[list[int]] = []  # per window group: present blocks in a row ending at each block
    for mask, g in zip(masks, groups, strict=True):
        if g.window is None:
            lead = next((i for i, p in enumerate(mask[:limit]) if not p), limit)
            limit = min(limit, lead)
            runs.append([])
            continue
        run, at = [], 0
        for p in mask[:limit]:
            at = at + 1 if p else 0
            run.append(at)
        runs.append(run)
    for n in range(limit, 0, -1):
        if all(
            g.window is None
            or (start := max(g.first_needed(n, block_size), local_blocks)) >= n
            or runs[k][n - 1] >= n - start
            for k, g in enumerate(groups)
        ):
            return n
    return 0


def loadable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks the connector may supply: vLLM must compute at least the prompt's
    last token itself (its logits start the answer), so a prompt that ends on a block boundary
    leaves its last block to compute."""
    return max(0, num_prompt_tokens - 1) // block_size


def external_tokens(
    stored_blocks: int, num_prompt_tokens: int, local_computed_tokens: int, block_size: int
) -> int:
    """Prompt tokens to load beyond vLLM's own (block-aligned) prefix-cache hit."""
    supply = min(stored_blocks, loadable_blocks(num_prompt_tokens, block_size)) * block_size
    return max(0, supply - local_computed_tokens)


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Engine blocks of one request to fill from (load) or copy into (save) the sidecar: block
    `block_ids[i]` holds the block whose chain hash is `chunk_hashes[i]`; `first_index` is its
    position in the request's block list."""

    req_id: str
    first_index: int
    block_ids: tuple[int, ...]
    chunk_hashes: tuple[int, ...]
    group: int = 0
    """The KV cache group whose blocks these are (its index in the engine's config)."""

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.chunk_hashes):
            raise ValueError("block_ids and chunk_hashes differ in length")


def plan_load(
    req_id: str,
    request_block_ids: Sequence[int],
    hashes: Sequence[int],
    local_computed_tokens: int,
    num_external_tokens: int,
    block_size: int,
) -> BlockTransfer:
    """The blocks vLLM allocated for `num_external_tokens` tokens after its local hit."""
    if local_computed_tokens % block_size or num_external_tokens % block_size:
        raise ValueError("loads start and end on block boundaries")
    first = local_computed_tokens // block_size
    end = first + num_external_tokens // block_size
    if end > len(request_block_ids) or end > len(hashes):
        raise ValueError(
            f"load of blocks [{first}, {end}) exceeds the request's "
            f"{len(request_block_ids)} blocks / {len(hashes)} hashes"
        )
    return BlockTransfer(
        req_id, first, tuple(request_block_ids[first:end]), tuple(hashes[first:end])
    )


def plan_save(
    req_id: str,
    request_block_ids: Sequence[int],
    hashes: Sequence[int],
    saved_blocks: int,
    computed_tokens: int,
    block_size: int,
) -> BlockTransfer | None:
    """Blocks sealed by the end of this step that are not saved yet: every full block below
    `computed_tokens` (tokens whose KV exists after the step) from index `saved_blocks` on, as far
    as the request has both block ids and hashes for. None when there is nothing new."""
    end = min(computed_tokens // block_size, len(request_block_ids), len(hashes))
    if end <= saved_blocks:
        return None
    return BlockTransfer(
        req_id,
        saved_blocks,
        tuple(request_block_ids[saved_blocks:end]),
        tuple(hashes[saved_blocks:end]),
    )


def live_runs(transfer: BlockTransfer) -> list[BlockTransfer]:
    """`transfer` without the null block (`NULL_BLOCK_ID`, where a window let a block go): its
    runs of real blocks, each a transfer of its own (one, `transfer` itself, when it has no
    null block; vLLM's window groups only ever null a leading run)."""
    if NULL_BLOCK_ID not in transfer.block_ids:
        return [transfer]
    out: list[BlockTransfer] = []
    start = None
    for i, b in enumerate((*transfer.block_ids, NULL_BLOCK_ID)):
        if b != NULL_BLOCK_ID and start is None:
            start = i
        elif b == NULL_BLOCK_ID and start is not None:
            out.append(
                BlockTransfer(
                    transfer.req_id,
                    transfer.first_index + start,
                    transfer.block_ids[start:i],
                    transfer.chunk_hashes[start:i],
                    transfer.group,
                )
            )
            start = None
    return out


def plan_group_loads(
    req_id: str,
    group_block_ids: Sequence[Sequence[int]],
    hashes: Sequence[int],
    local_computed_tokens: int,
    num_external_tokens: int,
    block_size: int,
) -> list[BlockTransfer]:
    """`plan_load` for every KV cache group (`group_block_ids[g]`: the request's block ids in
    group g), without the null blocks: every real block vLLM allocated for the external tokens
    is filled, those a window let go are not. One transfer, `plan_load`'s, for one group of
    full attention."""
    return [
        run
        for g, ids in enumerate(group_block_ids)
        for run in live_runs(
            replace(
                plan_load(req_id, ids, hashes, local_computed_tokens, num_external_tokens,
                          block_size),
                group=g,
            )
        )
    ]  # fmt: skip


def plan_group_saves(
    req_id: str,
    group_block_ids: Sequence[Sequence[int]],
    hashes: Sequence[int],
    saved_blocks: int,
    computed_tokens: int,
    block_size: int,
) -> tuple[list[BlockTransfer], int]:
    """`plan_save` for every KV cache group, over the blocks every group has ids for, without
    the null blocks (a window group saves what it still holds); and the request's saved-blocks
    count after them. One transfer, `plan_save`'s, for one group of full attention."""
    if not group_block_ids:
        return [], saved_blocks
    common = min(len(ids) for ids in group_block_ids)
    out: list[BlockTransfer] = []
    end = saved_blocks
    for g, ids in enumerate(group_block_ids):
        transfer = plan_save(req_id, ids[:common], hashes, saved_blocks, computed_tokens,
                             block_size)  # fmt: skip
        if transfer is None:
            continue
        end = transfer.first_index + len(transfer.block_ids)
        out.extend(live_runs(replace(transfer, group=g)))
    return out, end


def first_failed_index(transfer: BlockTransfer, invalid_block_ids: set[int]) -> int | None:
    """Position in the request's block list of the first block of `transfer` that failed to
    load, or None when none did."""
    for i, b in enumerate(transfer.block_ids):
        if b in invalid_block_ids:
            return transfer.first_index + i
    return None


BLOCKS_PER_OBJECT = 8
"""Blocks per store object in the grouped layout (`object_groups`): the size the device
measurement chose (`bench/kernels/connector_store.py`, `bench/history/mooncake_store.md`)."""


@dataclass(frozen=True, slots=True)
class ObjectGroup:
    """One store object of the grouped layout: `count` consecutive blocks of a save or load,
    from its block `first` on, every KV head of each (`[count, heads, payload]`, block after
    block, then one digest for the whole object)."""

    key: str
    first: int
    count: int


def group_key(
    model: str,
    last_hash: int,
    count: int,
    heads: int,
    *,
    pp_rank: int = 0,
    layers: tuple[int, int] | None = None,
) -> str:
    """The key of the object holding the `count` blocks that end with the block of chain hash
    `last_hash`, `heads` KV heads each: the chain hash names every block before it, so the key
    names the object's bytes (a partial group has another key than the full one)."""
    if count < 1 or heads < 1:
        raise ValueError("a group holds at least one block of at least one head")
    s = f"{model}@blocks:{count}@heads:{heads}@pp_rank:{pp_rank}@{last_hash:016x}"
    if layers is not None:
        s += f"@layers:{layers[0]}-{layers[1]}"
    return s


def object_groups(
    model: str,
    first_index: int,
    chunk_hashes: Sequence[int],
    heads: int,
    blocks_per_object: int = BLOCKS_PER_OBJECT,
    *,
    pp_rank: int = 0,
    layers: tuple[int, int] | None = None,
) -> list[ObjectGroup]:
    """The grouped layout's objects of consecutive blocks `chunk_hashes` (the first at position
    `first_index` of the request's block list): cut at the request's multiples of
    `blocks_per_object`, so a save and a later load of the same blocks cut alike (a save that
    starts or ends inside a group writes that part as an object of its own)."""
    if blocks_per_object < 1:
        raise ValueError("blocks_per_object must be >= 1")
    if first_index < 0:
        raise ValueError("first_index must be >= 0")
    out: list[ObjectGroup] = []
    i, n = 0, len(chunk_hashes)
    while i < n:
        end = min(n, (first_index + i) // blocks_per_object * blocks_per_object
                  + blocks_per_object - first_index)  # fmt: skip
        count = end - i
        key = group_key(model, chunk_hashes[end - 1], count, heads, pp_rank=pp_rank, layers=layers)
        out.append(ObjectGroup(key, i, count))
        i = end
    return out


def head_range(heads: Sequence[int]) -> tuple[int, int]:
    """`[a, b)` of a rank's global KV heads (what it takes out of a grouped object's blocks);
    `ValueError` when they are not one ascending contiguous run."""
    if not heads or list(heads) != list(range(heads[0], heads[0] + len(heads))):
        raise ValueError(f"heads {list(heads)} are not one contiguous ascending run")
    return heads[0], heads[0] + len(heads)
