"""The ownership directory: who owns which KV artifact, in which tier, and each session's
decode owner. One `Directory` protocol, an in-process and a Redis backend (see README.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ownerserve.directory.base import (
    Artifact,
    ArtifactInfo,
    Directory,
    DirectoryHealth,
    EventApplyResult,
    Holding,
    HoldKind,
    Lease,
    Match,
)
from ownerserve.directory.memory import InMemoryDirectory

if TYPE_CHECKING:
    from ownerserve.config import DirectorySettings


def open_directory(
    settings: DirectorySettings, *, resilient: bool = True, cluster: bool | None = None
) -> Directory:
    """The directory `settings` ask for: in-process, or Redis (one server, or a Cluster when
    `cluster` is true or the URL has `?cluster=1`) wrapped in `ResilientDirectory` so the
    router keeps serving from a local view while Redis is unreachable."""
    if settings.backend == "memory":
        return InMemoryDirectory()
    from ownerserve.directory.redis import RedisDirectory
    from ownerserve.directory.resilient import ResilientDirectory

    assert settings.redis_url is not None  # DirectorySettings validates this
    primary = RedisDirectory.from_url(
        settings.redis_url,
        settings.key_prefix,
        cluster=cluster,
        step_entries=settings.redis_step_entries,
        engine_map_limit=settings.engine_map_entries,
    )
    if not resilient:
        return primary
    return ResilientDirectory(
        primary,
        max_pending=settings.max_pending_writes,
        mirror_cached_blocks=settings.mirror_cached_blocks,
    )


__all__ = [
    "Artifact",
    "ArtifactInfo",
    "Directory",
    "DirectoryHealth",
    "EventApplyResult",
    "HoldKind",
    "Holding",
    "InMemoryDirectory",
    "Lease",
    "Match",
    "open_directory",
]
