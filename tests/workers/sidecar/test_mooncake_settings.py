"""What the Mooncake transport module promises without the engine: it always imports, says why
it cannot run, reads its settings from the environment and refuses unusable ones."""

from __future__ import annotations

import pytest

from workers.sidecar import mooncake_transport as mt
from workers.sidecar.store import ArtifactStore
from workers.sidecar.transport import TransferError


def test_availability_is_stated() -> None:
    assert isinstance(mt.AVAILABLE, bool)
    assert (mt.UNAVAILABLE_REASON == "") is mt.AVAILABLE


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OWNERSERVE_MOONCAKE_PROTOCOL", "rdma")
    monkeypatch.setenv("OWNERSERVE_MOONCAKE_DEVICE", "mlx5_0")
    monkeypatch.setenv("OWNERSERVE_MOONCAKE_HOST", "10.0.0.7")
    monkeypatch.setenv("OWNERSERVE_MOONCAKE_STAGING_BYTES", str(64 << 20))
    monkeypatch.setenv("OWNERSERVE_MOONCAKE_REGION_BYTES", str(8 << 20))
    monkeypatch.setenv("OWNERSERVE_MOONCAKE_PIN_CACHE_BYTES", "0")
    s = mt.MooncakeSettings.from_env()
    assert (s.protocol, s.device_name, s.local_hostname) == ("rdma", "mlx5_0", "10.0.0.7")
    assert (s.staging_bytes, s.region_bytes, s.metadata) == (64 << 20, 8 << 20, "P2PHANDSHAKE")
    assert s.pin_cache_bytes == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"staging_bytes": 1 << 20, "region_bytes": 1 << 20},  # fewer than two regions
        {"region_bytes": 0},
        {"batch_bytes": 0},
        {"pin_cache_bytes": -1},
    ],
)
def test_unusable_settings_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        mt.MooncakeSettings(**kwargs)  # type: ignore[arg-type]


async def test_fetch_without_the_engine_is_a_transfer_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where `mooncake.engine` does not import, a fetch fails typed, naming the reason (forced
    here: on machines with Mooncake installed it cannot be produced for real)."""
    monkeypatch.setattr(mt, "AVAILABLE", False)
    monkeypatch.setattr(mt, "UNAVAILABLE_REASON", "no libibverbs")
    with pytest.raises(TransferError, match="no libibverbs"):
        await mt.fetch(ArtifactStore(memory_capacity_bytes=10), "127.0.0.1", 1, ["k"])
