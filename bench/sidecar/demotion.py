"""How long the sidecar's SSD tier holds its event loop: a put that demotes artifacts to SSD,
and a load of an artifact from SSD, with the store's writes done on the caller's thread
(`write_behind=False`, as before 2026-11-25) and behind, by the store's own thread
(`write_behind=True`, what the sidecar runs), side by side in one run.

For each artifact size, a store whose memory tier holds two artifacts takes `--puts` puts in a
row: from the third on, each demotes the lowest-utility resident to SSD. "put holds" is how long
each put kept its caller (the event loop: the store is only used from it); "all written" is from
the first put until every file is written (`flush()`): into the page cache on the loop, synced to
disk (`fdatasync`) before its rename behind. Then every SSD artifact is loaded once: with
write-behind as the sidecar serves a `GET` (`ssd_reader` in a thread, then `get_verified` on
the loop; "load holds" counts only the loop's part), without it in one `get`. The two modes
alternate per size (`--rounds` each), medians of the rounds' values; files go to a fresh
directory under `--dir` (default: the system's temporary directory), removed after.

    .venv/bin/python -m bench.sidecar.demotion [--sizes 1M,16M,64M] [--puts 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workers.sidecar.store import ArtifactStore, Tier

MiB = 1 << 20


def one_round(size: int, puts: int, write_behind: bool, root: Path) -> dict[str, float]:
    """One store, `puts` puts of `size` bytes, then one load of each SSD artifact: seconds."""
    ssd = Path(tempfile.mkdtemp(prefix="ssd-", dir=root))
    store = ArtifactStore(
        memory_capacity_bytes=2 * size,
        ssd_dir=ssd,
        ssd_capacity_bytes=puts * size,
        pin_memory=False,
        write_behind=write_behind,
    )
    blobs = [os.urandom(size) for _ in range(puts)]
    pool = ThreadPoolExecutor(1)
    try:
        t0 = time.perf_counter()
        put_s = []
        for i, blob in enumerate(blobs):
            t1 = time.perf_counter()
            store.put(f"k{i}", blob)
            put_s.append(time.perf_counter() - t1)
        store.flush()
        written_s = time.perf_counter() - t0
        stored = store.keys()  # a list: the store is not a mapping
        on_ssd = [k for k in stored if store.meta(k).tier is Tier.SSD]
        load_s = []
        for key in on_ssd:
            reader = store.ssd_reader(key, verify=True) if write_behind else None
            loaded = pool.submit(reader).result() if reader is not None else None
            t1 = time.perf_counter()
            store.get_verified(key, loaded=loaded)
            load_s.append(time.perf_counter() - t1)
        return {
            "put_p50": statistics.median(put_s),
            "put_max": max(put_s),
            "written": written_s,
            "load_p50": statistics.median(load_s),
            "load_max": max(load_s),
            "demoted": float(store.stats().demoted),
        }
    finally:
        pool.shutdown()
        store.close()
        shutil.rmtree(ssd, ignore_errors=True)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size >> 10} KiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="1M,16M,64M", help="artifact sizes, comma-separated")
    p.add_argument("--puts", type=int, default=12, help="puts per round (>= 3: two stay in memory)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode and size")
    p.add_argument("--dir", type=Path, default=None, help="where the SSD tier's files go")
    a = p.parse_args()
    if a.puts < 3:
        p.error("--puts must be at least 3")
    root = Path(tempfile.mkdtemp(prefix="ownerserve-demotion-", dir=a.dir))
    print(
        "| artifact | SSD writes | put holds p50 ms | put holds max ms | all written ms "
        "| load holds p50 ms | load holds max ms | demoted |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    try:
        for size in map(_size, a.sizes.split(",")):
            runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for _ in range(a.rounds):
                for mode in (False, True):
                    runs[mode].append(one_round(size, a.puts, mode, root))
            for mode in (False, True):
                m = {k: statistics.median(r[k] for r in runs[mode]) for k in runs[mode][0]}
                print(
                    f"| {_label(size)} | {'behind' if mode else 'on the loop'} "
                    f"| {m['put_p50'] * 1e3:.2f} | {m['put_max'] * 1e3:.2f} "
                    f"| {m['written'] * 1e3:.1f} | {m['load_p50'] * 1e3:.2f} "
                    f"| {m['load_max'] * 1e3:.2f} | {m['demoted']:.0f} |",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
