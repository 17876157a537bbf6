"""The start-up probe of a store transport (`workers.mooncake_store.probe`) against a real
`mooncake_master`: one sample per size, fitted into a measured price and written for the
router; without a master it falls back to the configured price and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ownerserve.kvprobe import PriceSource, load_measurements
from ownerserve.ports import free_port
from ownerserve.profiles import load_profile
from ownerserve.types import KVTransport
from workers.mooncake_store import ClientSettings, MasterAddress, MooncakeMaster, StoreClient
from workers.mooncake_store.probe import main, measure_store, run
from workers.sidecar.cli import _probe_store

KiB = 1 << 10


def test_the_probe_times_one_read_per_size_and_leaves_no_object(master: MooncakeMaster) -> None:
    holder = StoreClient.open(ClientSettings(master.address, segment_bytes=32 << 20))
    reader = StoreClient.open(ClientSettings(master.address, segment_bytes=0))
    ticks = iter(range(10_000))
    try:
        # an injected clock: each read "takes" one tick, so the samples are exact
        samples = measure_store(holder, reader, [64 * KiB, 256 * KiB], 3, lambda: next(ticks))
        assert [(s.nbytes, s.seconds) for s in samples] == [(64 * KiB, 1), (256 * KiB, 1)]
        keys = [f"ownerserve-probe-{os.getpid()}-{n}" for n in (64 * KiB, 256 * KiB)]
        assert holder.exists(keys) == [False, False]
    finally:
        reader.close()
        holder.close()


def test_a_probe_through_a_master_writes_a_measured_price(
    master: MooncakeMaster, tmp_path: Path
) -> None:
    out = tmp_path / "m.yaml"
    rc = main(
        ["--master", master.address.url, "--sizes", "64KiB,1MiB", "--repeats", "2",
         "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    got = load_measurements(out)
    assert set(got) == {KVTransport.STORE_TCP}
    assert got[KVTransport.STORE_TCP].bps > 0


def test_without_a_master_the_probe_falls_back_to_the_configured_price(tmp_path: Path) -> None:
    nowhere = MasterAddress("127.0.0.1", free_port(), free_port())
    price = run(nowhere, KVTransport.STORE_TCP, [64 * KiB, 128 * KiB], 1, "h100-llama3-8b")
    assert price.source is PriceSource.CONFIGURED
    assert price.timing == load_profile("h100-llama3-8b").link.path(KVTransport.STORE_TCP)
    assert "probe failed: StoreUnavailable" in price.detail
    out = tmp_path / "m.yaml"
    rc = main(["--master", nowhere.url, "--sizes", "64KiB,128KiB", "--out", str(out)])
    assert rc == 1 and not out.exists()


def test_the_sidecars_start_up_probe_writes_the_measured_price(
    master: MooncakeMaster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.yaml"
    _probe_store(master.address.url, out, "sidecar")
    assert "(measured: 3 samples)" in capsys.readouterr().err
    assert set(load_measurements(out)) == {KVTransport.STORE_TCP}
