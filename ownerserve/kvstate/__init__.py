"""HeteroCache's KV state model: what KV state a request holds, how big each part is, which
parts are sealed shareable artifacts and which are mutable session state, and per-KV-head
artifact keys that make stored KV independent of the TP size that wrote it."""

from ownerserve.kvstate.heads import (
    HeadArtifactKey,
    head_keys,
    heads_for_rank,
    matched_chunks,
    matched_chunks_for_tp,
    store_heads_for_rank,
    store_keys_for_rank,
)
from ownerserve.kvstate.registry import (
    MODELS_DIR,
    list_specs,
    load_spec,
    spec_for_model,
    spec_from_dict,
)
from ownerserve.kvstate.spec import KVStateSpec, LayerSpec, artifact_id
from ownerserve.kvstate.types import (
    MUTABLE_TYPES,
    SEALED_TYPES,
    AttentionType,
    DType,
    StateType,
)

__all__ = [
    "MODELS_DIR",
    "MUTABLE_TYPES",
    "SEALED_TYPES",
    "AttentionType",
    "DType",
    "HeadArtifactKey",
    "KVStateSpec",
    "LayerSpec",
    "StateType",
    "artifact_id",
    "head_keys",
    "heads_for_rank",
    "list_specs",
    "load_spec",
    "matched_chunks",
    "matched_chunks_for_tp",
    "spec_for_model",
    "spec_from_dict",
    "store_heads_for_rank",
    "store_keys_for_rank",
]
