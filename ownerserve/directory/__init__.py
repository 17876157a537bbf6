"""The ownership directory: who owns which KV artifact, in which tier, and each session's
decode owner. One `Directory` protocol, an in-process and a Redis backend."""

from ownerserve.directory.base import (
    Artifact,
    Directory,
    DirectoryHealth,
    EventApplyResult,
    Holding,
    HoldKind,
    Lease,
    Match,
)

__all__ = [
    "Artifact",
    "Directory",
    "DirectoryHealth",
    "EventApplyResult",
    "HoldKind",
    "Holding",
    "Lease",
    "Match",
]
