"""Block hash chains: deterministic, model-aware, prefix-stable, incremental."""

from hypothesis import given
from hypothesis import strategies as st

from ownerserve.hashing import ChainHasher, block_hash_chain, chain_root

ROOT = chain_root("m")


def test_chain_covers_only_full_blocks() -> None:
    assert len(block_hash_chain(list(range(35)), 16, ROOT)) == 2
    assert block_hash_chain(list(range(15)), 16, ROOT) == []


def test_equal_prefixes_share_hashes_and_divergence_changes_the_rest() -> None:
    a = block_hash_chain(list(range(64)), 16, ROOT)
    b = block_hash_chain([*range(32), *range(100, 132)], 16, ROOT)
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]


def test_root_depends_on_model_and_salt() -> None:
    assert chain_root("m") != chain_root("n")
    assert chain_root("m", "s") != chain_root("m")
    toks = list(range(16))
    assert block_hash_chain(toks, 16, chain_root("m")) != block_hash_chain(
        toks, 16, chain_root("n")
    )


@given(
    st.lists(st.integers(0, 300), max_size=120),
    st.lists(st.integers(0, 300), max_size=120),
    st.integers(1, 20),
)
def test_incremental_hasher_equals_full_recomputation(
    first: list[int], second: list[int], bs: int
) -> None:
    hasher = ChainHasher(bs, ROOT)
    assert hasher.update(first) == block_hash_chain(first, bs, ROOT)
    assert hasher.update(first + second) == block_hash_chain(first + second, bs, ROOT)
    assert hasher.update(second) == block_hash_chain(second, bs, ROOT)
