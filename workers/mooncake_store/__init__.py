"""Mooncake Store as the home of KV artifacts: the master's lifecycle (`master`) and a typed,
checksumming client (`client`) and the digests it verifies (`digest`: XXH3-128 from CPU writers, a
keyed MAC from the connector's GPU path). Imports `mooncake.store` only when a client is opened."""

from workers.mooncake_store.client import (
    CHECKSUM_BYTES,
    CORRUPTED,
    EXISTS,
    MISSING,
    ClientSettings,
    RegisteredBuffer,
    Replica,
    StoreClient,
    StoreError,
    StoreFull,
    StoreUnavailable,
    checksum,
)
from workers.mooncake_store.digest import verify
from workers.mooncake_store.master import (
    MasterAddress,
    MasterUnavailable,
    MooncakeMaster,
    find_master_binary,
)

__all__ = [
    "CHECKSUM_BYTES",
    "CORRUPTED",
    "EXISTS",
    "MISSING",
    "ClientSettings",
    "MasterAddress",
    "MasterUnavailable",
    "MooncakeMaster",
    "RegisteredBuffer",
    "Replica",
    "StoreClient",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "checksum",
    "find_master_binary",
    "verify",
]
