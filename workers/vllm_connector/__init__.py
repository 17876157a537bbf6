"""OwnerServe's vLLM KV connector: loads prompt blocks from the worker's sidecar into vLLM's paged
cache and saves newly sealed blocks to it, keyed per KV head by OwnerServe chain hashes.

`connector.OwnerServeConnector` imports vLLM (load it by `kv_connector_module_path`); the pure
parts below import only the core, torch and `kernels`, so they are tested without vLLM.
"""

from workers.vllm_connector.plan import (
    BlockTransfer,
    ConnectorConfigError,
    ConnectorSettings,
    block_keys,
    chunk_hashes,
    external_tokens,
    loadable_blocks,
    lookup_keys,
    plan_load,
    plan_save,
    present_blocks,
)

__all__ = [
    "BlockTransfer",
    "ConnectorConfigError",
    "ConnectorSettings",
    "block_keys",
    "chunk_hashes",
    "external_tokens",
    "loadable_blocks",
    "lookup_keys",
    "plan_load",
    "plan_save",
    "present_blocks",
]
