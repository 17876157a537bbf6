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
    swa_policy_from_value,
)
from ownerserve.kvstate.spec import (
    KVStateSpec,
    LayerSpec,
    SwaCostInputs,
    SwaRestore,
    artifact_id,
    cost_based_period,
    expected_swa_restore,
    resolve_swa_policy,
    swa_period_candidates,
    swa_policy_cost,
    swa_restore_at,
)
from ownerserve.kvstate.types import (
    DEFAULT_SWA_POLICY,
    MUTABLE_TYPES,
    SEALED_TYPES,
    AttentionType,
    DType,
    StateType,
    SwaCaching,
    SwaPolicy,
)

__all__ = [
    "DEFAULT_SWA_POLICY",
    "MODELS_DIR",
    "MUTABLE_TYPES",
    "SEALED_TYPES",
    "AttentionType",
    "DType",
    "HeadArtifactKey",
    "KVStateSpec",
    "LayerSpec",
    "StateType",
    "SwaCaching",
    "SwaCostInputs",
    "SwaPolicy",
    "SwaRestore",
    "artifact_id",
    "cost_based_period",
    "expected_swa_restore",
    "head_keys",
    "heads_for_rank",
    "list_specs",
    "load_spec",
    "matched_chunks",
    "matched_chunks_for_tp",
    "resolve_swa_policy",
    "spec_for_model",
    "spec_from_dict",
    "store_heads_for_rank",
    "store_keys_for_rank",
    "swa_period_candidates",
    "swa_policy_cost",
    "swa_policy_from_value",
    "swa_restore_at",
]
