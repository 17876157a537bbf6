"""The KV artifact store: checksums on every load from both tiers, utility-ranked demotion and
dropping, typed errors."""

from __future__ import annotations

import dataclasses
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from workers.sidecar.store import (
    ArtifactCorrupted,
    ArtifactMeta,
    ArtifactMissing,
    ArtifactStore,
    ArtifactTooLarge,
    Tier,
    artifact_utility,
    checksum,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def corrupt_file_of(ssd_dir: Path, name_prefix: str) -> None:
    """Flip the last payload byte of the one SSD file whose name starts with `name_prefix`."""
    (f,) = [p for p in ssd_dir.iterdir() if p.name.startswith(name_prefix)]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))


def test_put_get_roundtrip_memory() -> None:
    s = ArtifactStore(memory_capacity_bytes=1024)
    s.put("k", b"abc")
    assert s.has("k") and s.get("k") == b"abc"
    assert s.meta("k").reuse_count == 1
    with pytest.raises(ArtifactMissing):
        s.get("nope")


def test_peer_payload_with_wrong_checksum_is_refused() -> None:
    s = ArtifactStore(memory_capacity_bytes=1024)
    with pytest.raises(ArtifactCorrupted):
        s.put("k", b"abc", expected_checksum=checksum(b"abd"))
    assert not s.has("k")
    s.put("k", b"abc", expected_checksum=checksum(b"abc"))
    assert s.get("k") == b"abc"


def test_corrupted_memory_artifact_is_never_returned() -> None:
    s = ArtifactStore(memory_capacity_bytes=1024, pin_memory=False)
    s.put("k", b"abcdef")
    s._mem["k"] = b"abcdeX"  # simulate a bit flip in memory (not reachable through the API)
    with pytest.raises(ArtifactCorrupted):
        s.get("k")
    assert not s.has("k") and s.stats().corrupted == 1


def test_demotion_to_ssd_and_corruption_on_disk(tmp_path: Path) -> None:
    clock = Clock()
    s = ArtifactStore(
        memory_capacity_bytes=100, ssd_dir=tmp_path, ssd_capacity_bytes=1000, clock=clock
    )
    s.put("hot", b"h" * 60)
    s.get("hot")
    s.get("hot")  # reused twice: higher utility
    clock.t = 1.0
    s.put("cold", b"c" * 60)  # memory full: the lowest-utility resident ("hot"? no) is demoted
    assert s.meta("cold").tier is Tier.MEMORY
    assert s.meta("hot").tier is Tier.SSD  # only other resident; demoted, not lost
    assert s.get("hot") == b"h" * 60
    s.put("cold2", b"d" * 60)
    assert s.meta("cold").tier is Tier.SSD
    # corrupt the file of "cold" on disk: the load fails typed and the artifact is dropped
    corrupt_file_of(tmp_path, "cold.")
    with pytest.raises(ArtifactCorrupted):
        s.get("cold")
    assert not s.has("cold")
    # truncated file: also typed
    (g,) = [p for p in tmp_path.iterdir() if p.name.startswith("hot.")]
    g.write_bytes(b"OSKV2\n")
    with pytest.raises(ArtifactCorrupted):
        s.get("hot")


def test_ssd_full_drops_lowest_utility(tmp_path: Path) -> None:
    clock = Clock()
    s = ArtifactStore(
        memory_capacity_bytes=10, ssd_dir=tmp_path, ssd_capacity_bytes=200, clock=clock
    )
    s.put("a", b"a" * 100, recompute_s=1.0, load_s=0.0)  # valuable
    s.put("b", b"b" * 100, recompute_s=0.001, load_s=0.0)  # cheap to recompute
    assert s.meta("a").tier is Tier.SSD
    s.put("c", b"c" * 100, recompute_s=1.0, load_s=0.0)
    assert s.has("a") and s.has("c") and not s.has("b")
    assert s.stats().dropped == 1 and s.stats().ssd_bytes == 200
    assert len(list(tmp_path.glob("*.kv"))) == 2


def test_too_large_and_replace() -> None:
    s = ArtifactStore(memory_capacity_bytes=10)
    with pytest.raises(ArtifactTooLarge):
        s.put("k", b"x" * 11)
    s.put("k", b"x" * 10)
    s.put("k", b"y" * 5)
    assert s.get("k") == b"y" * 5 and s.stats().memory_bytes == 5
    assert s.delete("k") and not s.delete("k")


def test_ssd_tier_is_recovered_by_a_new_store(tmp_path: Path) -> None:
    clock = Clock()
    old = ArtifactStore(
        memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1000, clock=clock
    )
    old.put("m@pcp0@dcp0@head:0@pp_rank:0@00000000000000aa", b"x" * 100, recompute_s=2.0)
    clock.t = 1.0
    old.put("key/with spaces", b"y" * 200, load_s=0.5)
    clock.t = 2.0
    old.put("gone", b"z" * 50)
    (tmp_path / "gone.half-written.tmp").write_bytes(b"OSKV2\n")  # a write cut short
    (tmp_path / "foreign.kv").write_bytes(b"not an artifact")
    (gone,) = tmp_path.glob("gone.*.kv")
    gone.write_bytes(gone.read_bytes()[:8])  # truncated inside its header

    new = ArtifactStore(
        memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1000, clock=clock
    )
    recovered = new.recover_ssd()
    assert sorted(recovered) == ["key/with spaces", "m@pcp0@dcp0@head:0@pp_rank:0@00000000000000aa"]
    assert new.get("key/with spaces") == b"y" * 200
    meta = new.meta("m@pcp0@dcp0@head:0@pp_rank:0@00000000000000aa")
    assert (meta.size_bytes, meta.recompute_s, meta.tier) == (100, 2.0, Tier.SSD)
    assert new.meta("key/with spaces").load_s == 0.5
    assert new.stats().ssd_bytes == 300 and not new.has("gone")
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".kv", ".kv"]  # the rest deleted
    # a recovered payload that was corrupted on disk is still refused on load
    corrupt_file_of(tmp_path, "key_with_spaces.")
    with pytest.raises(ArtifactCorrupted):
        new.get("key/with spaces")


def test_recovery_keeps_the_newest_files_that_fit(tmp_path: Path) -> None:
    old = ArtifactStore(memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1000)
    for i, name in enumerate(["old", "mid", "new"]):
        old.put(name, bytes([i]) * 100)
        (f,) = tmp_path.glob(f"{name}.*.kv")
        os.utime(f, (1000.0 + i, 1000.0 + i))
    new = ArtifactStore(memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=250)
    assert new.recover_ssd() == ["new", "mid"]
    assert new.stats().dropped == 1 and len(list(tmp_path.glob("*.kv"))) == 2


def test_artifact_metadata_keeps_its_dataclass_contract_with_the_fast_constructor() -> None:
    """ArtifactMeta's `__init__` is generated (`ownerserve.records.fast_init`): positional and
    keyword arguments, defaults, immutability, equality, hashing and `replace` behave as the
    dataclass's own would."""
    a = ArtifactMeta("k", 10, b"d", 0.5, 0.25)
    b = ArtifactMeta(key="k", size_bytes=10, checksum=b"d", recompute_s=0.5, load_s=0.25)
    assert a == b and hash(a) == hash(b)
    assert (a.reuse_count, a.last_access_s, a.tier) == (0, 0.0, Tier.MEMORY)
    c = dataclasses.replace(a, tier=Tier.SSD, reuse_count=3)
    assert (c.key, c.size_bytes, c.tier, c.reuse_count) == ("k", 10, Tier.SSD, 3) and c != a
    assert ArtifactMeta("k", 10, b"d", 0.5, 0.25, 1, 2.0, Tier.SSD).last_access_s == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.size_bytes = 11  # type: ignore[misc]
    with pytest.raises(TypeError):
        ArtifactMeta("k", 10)  # type: ignore[call-arg]
    assert repr(a).startswith("ArtifactMeta(key='k', size_bytes=10")


# --- write-behind SSD tier ------------------------------------------------------------------


def hold_writer(s: ArtifactStore) -> threading.Event:
    """Keep the store's SSD writer thread busy until the returned event is set (its jobs run
    in order: every write asked for after this waits)."""
    go = threading.Event()
    s._submit(go.wait)
    return go


def files_of(ssd_dir: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in ssd_dir.glob("*.kv"))


def test_write_behind_demotion_returns_before_the_file_and_serves_from_memory_meanwhile(
    tmp_path: Path,
) -> None:
    s = ArtifactStore(
        memory_capacity_bytes=100, ssd_dir=tmp_path, ssd_capacity_bytes=1000, write_behind=True
    )
    s.put("a", b"a" * 60)
    go = hold_writer(s)
    s.put("b", b"b" * 60)  # demotes "a": its write waits behind the held writer
    assert s.meta("a").tier is Tier.SSD and files_of(tmp_path) == []
    assert s.stats().ssd_pending_bytes == 60 and s.stats().ssd_bytes == 60
    assert s.get("a") == b"a" * 60  # from the bytes on their way to the file
    assert s.ssd_reader("a", verify=True) is None  # nothing to read from disk yet
    go.set()
    s.flush()
    assert files_of(tmp_path) == ["a"] and s.stats().ssd_pending_bytes == 0
    reader = s.ssd_reader("a", verify=True)
    assert reader is not None
    loaded = reader()
    assert loaded == (b"a" * 60, checksum(b"a" * 60))
    assert s.get_verified("a", loaded=loaded) == (b"a" * 60, checksum(b"a" * 60))
    s.close()


def test_write_behind_keeps_the_order_of_writes_and_deletions(tmp_path: Path) -> None:
    s = ArtifactStore(
        memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1000, write_behind=True
    )
    go = hold_writer(s)
    s.put("k", b"1" * 50)  # straight to SSD: queued
    assert s.delete("k")  # its deletion queued after the write
    s.put("k", b"2" * 40)  # a new value, queued after both
    s.put("gone", b"g" * 30)
    assert s.delete("gone")
    assert s.get("k") == b"2" * 40  # the newest value, while all of it waits
    go.set()
    s.close()
    assert files_of(tmp_path) == ["k"]
    new = ArtifactStore(memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1000)
    assert new.recover_ssd() == ["k"] and new.get("k") == b"2" * 40


def test_the_same_bytes_written_again_stay_served_until_their_second_write_lands(
    tmp_path: Path,
) -> None:
    """A key written, deleted and written again with the very same bytes object: the first
    write landing must not end the second one's pending state (its file is deleted next)."""
    s = ArtifactStore(
        memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1000, write_behind=True
    )
    data = b"s" * 64
    go = hold_writer(s)
    s.put("k", data)
    s.delete("k")
    mid = hold_writer(s)  # the writer stops again after the first write and the deletion
    s.put("k", data)  # bytes(data) is data itself
    go.set()
    while len(s._jobs) > 2:  # the first write and the deletion have run
        s._jobs[0].result()
        s._jobs.popleft()
    assert s.get("k") == data and files_of(tmp_path) == []  # still the second write's bytes
    mid.set()
    s.close()
    assert s.get("k") == data and files_of(tmp_path) == ["k"]


def test_write_behind_waits_for_the_oldest_writes_beyond_its_pending_bound(
    tmp_path: Path,
) -> None:
    s = ArtifactStore(
        memory_capacity_bytes=0,
        ssd_dir=tmp_path,
        ssd_capacity_bytes=1000,
        write_behind=True,
        max_pending_bytes=100,
    )
    go = hold_writer(s)
    s.put("a", b"a" * 80)  # within the bound: returns at once
    assert not go.is_set() and s.stats().ssd_pending_bytes == 80
    threading.Timer(0.2, go.set).start()
    s.put("b", b"b" * 80)  # 160 pending: waits until the writer got through the oldest jobs
    assert go.is_set() and s.stats().ssd_pending_bytes <= 100
    s.close()
    assert files_of(tmp_path) == ["a", "b"]


def test_a_failed_write_behind_is_counted_and_its_artifact_never_served(tmp_path: Path) -> None:
    s = ArtifactStore(
        memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1000, write_behind=True
    )
    s._path("k").mkdir()  # a directory where the file goes: the rename fails for real
    s.put("k", b"k" * 50)
    s.flush()
    assert s.stats().ssd_write_errors == 1 and s.stats().ssd_pending_bytes == 0
    assert list(tmp_path.glob("*.tmp")) == []  # the half-done write is cleaned up
    with pytest.raises(ArtifactCorrupted):
        s.get("k")
    assert not s.has("k") and s.stats().ssd_bytes == 0
    s.close()


def test_bytes_loaded_elsewhere_that_no_longer_match_are_read_again(tmp_path: Path) -> None:
    s = ArtifactStore(memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1000)
    s.put("k", b"old" * 10)
    reader = s.ssd_reader("k", verify=True)
    assert reader is not None and s.ssd_reader("missing", verify=True) is None
    stale = reader()
    s.put("k", b"new" * 10)  # replaced while the stale bytes were read in a thread
    assert s.get_verified("k", loaded=stale)[0] == b"new" * 10
    assert s.read_for_transfer("k", loaded=(b"short", None))[0] == b"new" * 10
    assert s.stats().corrupted == 0


def test_write_behind_under_random_traffic_never_serves_wrong_or_corrupted_bytes(
    tmp_path: Path,
) -> None:
    """Puts (some of the very same bytes again), gets (some through `ssd_reader` in another
    thread, as the sidecar serves), deletes and evictions in a seeded random order against a
    small memory tier while the writer thread works: every get returns the latest bytes put,
    nothing is ever found corrupted, and after `close` a new store recovers what the SSD tier
    holds, whole."""
    rng = random.Random(7)
    s = ArtifactStore(
        memory_capacity_bytes=3 * 4096,
        ssd_dir=tmp_path,
        ssd_capacity_bytes=1 << 20,
        write_behind=True,
        max_pending_bytes=6 * 4096,
    )
    blobs = [rng.randbytes(rng.randrange(1, 4096)) for _ in range(12)]
    model: dict[str, bytes] = {}
    keys = [f"k{i}" for i in range(10)]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3000):
            key, op = rng.choice(keys), rng.random()
            if op < 0.4:
                model[key] = rng.choice(blobs)
                s.put(key, model[key])
            elif op < 0.55:
                assert s.delete(key) == (model.pop(key, None) is not None)
            elif op < 0.8:
                reader = s.ssd_reader(key, verify=True)
                loaded = None if reader is None else pool.submit(reader).result()
                if key in model:
                    assert s.get_verified(key, loaded=loaded)[0] == model[key]
                else:
                    with pytest.raises(ArtifactMissing):
                        s.get_verified(key, loaded=loaded)
            else:
                reader = s.ssd_reader(key, verify=False)
                later = None if reader is None else pool.submit(reader)
                other = rng.choice(keys)  # traffic while the file is read (maybe its key)
                model[other] = rng.choice(blobs)
                s.put(other, model[other])
                if later is not None:
                    assert s.read_for_transfer(key, loaded=later.result())[0] == model[key]
            # what memory could not keep was demoted or dropped (the SSD tier is large enough)
            assert {k for k in keys if s.has(k)} == set(model)
    assert s.stats().corrupted == 0 and s.stats().ssd_write_errors == 0
    s.close()
    on_ssd = {k for k in keys if s.has(k) and s.meta(k).tier is Tier.SSD}
    new = ArtifactStore(memory_capacity_bytes=0, ssd_dir=tmp_path, ssd_capacity_bytes=1 << 20)
    assert set(new.recover_ssd()) == on_ssd
    assert all(new.get(k) == model[k] for k in on_ssd)


def _meta(**kw: float) -> ArtifactMeta:
    base: dict[str, float] = dict(
        size_bytes=10**9, reuse_count=3, last_access_s=100.0, recompute_s=2.0, load_s=0.5
    )
    base.update(kw)
    return ArtifactMeta(
        key="k",
        checksum=b"",
        size_bytes=int(base["size_bytes"]),
        reuse_count=int(base["reuse_count"]),
        last_access_s=base["last_access_s"],
        recompute_s=base["recompute_s"],
        load_s=base["load_s"],
    )


def test_artifact_utility_rewards_reuse_recency_savings_and_small_size() -> None:
    now = 200.0
    u = artifact_utility(_meta(), now)
    assert u == pytest.approx(4 * 2 ** (-100 / 600) * 1.5 / 1e9)
    assert artifact_utility(_meta(reuse_count=10), now) > u
    assert artifact_utility(_meta(last_access_s=0.0), now) < u
    assert artifact_utility(_meta(size_bytes=2 * 10**9), now) < u
    assert artifact_utility(_meta(recompute_s=0.1), now) == 0.0  # cheaper to recompute
