"""Mooncake Store as the home of KV artifacts: the master's lifecycle (`master`) and a typed,
checksumming client (`client`). Imports `mooncake.store` only when a client is opened."""

from workers.mooncake_store.client import (
    CHECKSUM_BYTES,
    CORRUPTED,
    MISSING,
    ClientSettings,
    RegisteredBuffer,
    StoreClient,
    StoreError,
    StoreFull,
    StoreUnavailable,
    checksum,
)
from workers.mooncake_store.master import (
    MasterAddress,
    MasterUnavailable,
    MooncakeMaster,
    find_master_binary,
)

__all__ = [
    "CHECKSUM_BYTES",
    "CORRUPTED",
    "MISSING",
    "ClientSettings",
    "MasterAddress",
    "MasterUnavailable",
    "MooncakeMaster",
    "RegisteredBuffer",
    "StoreClient",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "checksum",
    "find_master_binary",
]
