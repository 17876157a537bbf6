"""OwnerServe core: the shared vocabulary (blocks, artifacts, sessions, events), the ownership
directory and configuration. Imports nothing from router/, planner/ or workers/."""

from ownerserve.hashing import ChainHasher, block_hash_chain, chain_root
from ownerserve.types import BackendKind, Role, Tier

__version__ = "0.1.0"

__all__ = [
    "BackendKind",
    "ChainHasher",
    "Role",
    "Tier",
    "__version__",
    "block_hash_chain",
    "chain_root",
]
