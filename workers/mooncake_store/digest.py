"""The digests stored after every payload in Mooncake Store, and the one rule every reader
verifies them by (`verify`), whichever writer made them.

**Two kinds, told apart by the digest's last byte.**
- `XXH3`: the XXH3-128 digest of the payload (`checksum`), what CPU writers store (the sidecar's
  store tier, the connector's CPU path, `StoreClient.put_from` / `put_split`).
- `KEYED_MAC`: what the connector's GPU path computes on the device in one launch (the GPU has
  no XXH3): two multilinear sums over the payload's little-endian 64-bit words, each word times
  its own odd pseudo-random multiplier, wrapping mod 2^64 (the multilinear family of Lemire and
  Kaser, "Strongly universal string hashing is fast", 2014), plus two lanes of the XXH3-128 of
  the object's key and payload length. Since each multiplier is odd, any change of a single word
  changes lane 0. Keying by the object's name makes a replica that holds another key's object (a
  stale replica after a forced remove and the memory's reuse: measured to return the other
  object's bytes with that object's valid digest) fail it. The top byte of lane 1 is the kind's
  tag (`MAC_TAG`, never 0, so a reserved object still all zeros never verifies): 120 bits.

An XXH3 digest ends in `MAC_TAG` one time in 256: `verify` then tries the keyed MAC first and
XXH3 after it, so every object verifies by the kind it was written with. `mac_digests` is the
numpy implementation (CPU readers); `workers.vllm_connector.gpu_digest` computes the same
digest with Triton on the device, and the tests check they agree.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import xxhash

DIGEST_BYTES = 16
"""Bytes of every digest (either kind)."""
MAC_TAG = 0x6B
"""The last byte of every `KEYED_MAC` digest."""

# splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA
# 2014): the multiplier of word i in lane j is mix(SEEDS[j] + GAMMA * (i + 1)) | 1
GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)
LANE1_MASK = (1 << 56) - 1
"""Lane 1 keeps its low 56 bits; the top byte is `MAC_TAG`."""


def checksum(data: Any) -> bytes:
    """The `XXH3` digest: the XXH3-128 digest of a bytes-like payload."""
    return xxhash.xxh3_128_digest(data)


def is_mac(digest: Any) -> bool:
    """Whether `digest` is tagged as a `KEYED_MAC` (an XXH3 digest is too, 1 in 256)."""
    return len(digest) == DIGEST_BYTES and digest[DIGEST_BYTES - 1] == MAC_TAG


@functools.lru_cache(maxsize=8)
def mac_multipliers(words: int) -> np.ndarray:
    """The `[2, words]` uint64 multipliers of a payload of `words` 64-bit words (read-only)."""
    i = np.arange(1, words + 1, dtype=np.uint64)
    out = np.empty((2, words), dtype=np.uint64)
    for lane, seed in enumerate(SEEDS):
        z = np.uint64(seed) + i * np.uint64(GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
        out[lane] = (z ^ (z >> np.uint64(31))) | np.uint64(1)
    out.flags.writeable = False
    return out


def key_lanes(keys: list[str], nbytes: int) -> np.ndarray:
    """`[len(keys), 2]` uint64: the XXH3-128 of each key's name and the payload length, the
    terms that bind a `KEYED_MAC` digest to its object."""
    tail = nbytes.to_bytes(8, "little")
    joined = b"".join(xxhash.xxh3_128_digest(k.encode() + tail) for k in keys)
    return np.frombuffer(joined, dtype="<u8").reshape(len(keys), 2).astype(np.uint64)


def finish(sums: np.ndarray) -> np.ndarray:
    """`[n, 2]` uint64 lane sums (key terms included) -> `[n, 16]` uint8 digests, tagged."""
    lanes = np.array(sums, dtype=np.uint64).reshape(-1, 2)
    lanes[:, 1] = (lanes[:, 1] & np.uint64(LANE1_MASK)) | np.uint64(MAC_TAG << 56)
    return lanes.astype("<u8").view(np.uint8).reshape(-1, DIGEST_BYTES)


def mac_digests(keys: list[str], payloads: list[Any]) -> list[bytes]:
    """The `KEYED_MAC` digest of each (key, payload), on the CPU (a payload of a length not a
    multiple of 8 is hashed as if padded with zero bytes; its length is in the key terms)."""
    out: list[bytes] = []
    for key, payload in zip(keys, payloads, strict=True):
        data = np.frombuffer(payload, dtype=np.uint8)
        n = data.size
        if n % 8:
            data = np.concatenate([data, np.zeros(8 - n % 8, dtype=np.uint8)])
        words = data.view("<u8").astype(np.uint64, copy=False)
        sums = mac_multipliers(words.size) @ words if words.size else np.zeros(2, np.uint64)
        sums = sums + key_lanes([key], n)[0]
        out.append(finish(sums).tobytes())
    return out


def verify(key: str, payload: Any, digest: Any) -> bool:
    """Whether `payload` is the object `key` that `digest` was made for, by either kind; the one
    rule every reader of the store applies."""
    if len(digest) != DIGEST_BYTES:
        return False
    digest = bytes(digest)
    if is_mac(digest) and mac_digests([key], [payload])[0] == digest:
        return True
    return checksum(payload) == digest
