"""The connector's pure decisions: settings, block -> artifact keys, how many prompt tokens the
sidecar can supply, and which engine blocks a load fills and a save reads (also per KV cache
group of a hybrid model: full attention beside sliding windows)."""

from __future__ import annotations

import pytest

from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.kvstate import HeadArtifactKey
from workers.vllm_connector.plan import (
    NULL_BLOCK_ID,
    BlockTransfer,
    ConnectorConfigError,
    ConnectorSettings,
    KVGroup,
    block_keys,
    chunk_hashes,
    external_tokens,
    first_failed_index,
    group_tags,
    live_runs,
    loadable_blocks,
    lookup_keys,
    plan_group_loads,
    plan_group_saves,
    plan_load,
    plan_save,
    present_blocks,
    present_mask,
    restorable_blocks,
    stage_keys,
    stage_of,
)

BS = 32


def settings(**extra: object) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config(
        {"sidecar_url": "http://127.0.0.1:9/", **extra}, default_model="tiny-llama", block_size=BS
    )


def test_settings_default_to_the_served_model_and_strip_the_url() -> None:
    s = settings()
    assert (s.sidecar_url, s.model, s.salt, s.block_size) == (
        "http://127.0.0.1:9",
        "tiny-llama",
        "",
        BS,
    )
    assert s.load and s.save
    assert settings(model="m", salt="x", load=False).model == "m"


@pytest.mark.parametrize(
    "extra",
    [
        {"sidecar_url": None},
        {"sidecar_url": "127.0.0.1:9"},
        {"model": ""},
        {"salt": 3},
        {"timeout_s": 0},
        {"lookup_timeout_s": True},
        {"lookup_backoff_s": -1},
        {"load": "yes"},
    ],
)
def test_bad_extra_config_is_a_config_error(extra: dict[str, object]) -> None:
    with pytest.raises(ConnectorConfigError):
        settings(**extra)


def test_the_chain_root_is_the_routers_and_a_cache_salt_isolates() -> None:
    s = settings(salt="s1")
    assert s.root() == chain_root("tiny-llama", "s1")
    assert s.root("tenant") not in (s.root(), settings(salt="s1").root("other"))
    tokens = list(range(100))
    assert chunk_hashes(tokens, BS, s.root()) == block_hash_chain(
        tokens, BS, chain_root("tiny-llama", "s1")
    )
    assert len(chunk_hashes(tokens, BS, s.root())) == 3  # the partial 4th block has no hash


def test_block_keys_are_per_head_artifact_keys_of_the_chunk() -> None:
    keys = block_keys("tiny-llama", 0xABC, [0, 1, 2, 3])
    assert keys == [HeadArtifactKey("tiny-llama", h, 0xABC).to_string() for h in range(4)]
    assert keys[2].endswith("@head:2@pp_rank:0@0000000000000abc")
    assert lookup_keys("m", [1, 2], [0, 1]) == block_keys("m", 1, [0, 1]) + block_keys(
        "m", 2, [0, 1]
    )


def test_a_pipeline_stage_keys_its_layer_range_and_pp1_keys_are_unchanged() -> None:
    whole = block_keys("m", 0xABC, [0, 1])
    assert block_keys("m", 0xABC, [0, 1], pp_rank=0, layers=None) == whole
    stage = block_keys("m", 0xABC, [0, 1], pp_rank=1, layers=(16, 32))
    assert stage[1] == "m@pcp0@dcp0@head:1@pp_rank:1@0000000000000abc@layers:16-32"
    # two stages of one rank index split differently never share a key
    assert block_keys("m", 0xABC, [0], pp_rank=1, layers=(11, 22)) != block_keys(
        "m", 0xABC, [0], pp_rank=1, layers=(10, 21)
    )
    with pytest.raises(ValueError):
        block_keys("m", 0xABC, [0], layers=(4, 4))


def test_a_block_counts_only_when_every_head_is_present_and_the_prefix_ends_at_a_gap() -> None:
    assert present_blocks([True] * 8, 4) == 2
    assert present_blocks([True, True, True, False, True, True, True, True], 4) == 0
    assert present_blocks([True] * 4 + [False] + [True] * 7, 4) == 1
    assert present_blocks([], 4) == 0
    with pytest.raises(ValueError):
        present_blocks([True], 0)


def test_the_last_prompt_token_is_always_left_to_the_engine() -> None:
    assert loadable_blocks(64, BS) == 1  # block-aligned prompt: its last block is computed
    assert loadable_blocks(65, BS) == 2
    assert loadable_blocks(0, BS) == 0
    # 5 stored blocks, 100-token prompt (3 full blocks), 1 block already cached locally.
    assert external_tokens(5, 100, 32, BS) == 64
    assert external_tokens(1, 100, 32, BS) == 0  # nothing beyond the local hit
    assert external_tokens(2, 100, 0, BS) == 64
    assert external_tokens(0, 100, 0, BS) == 0


def test_a_load_fills_the_blocks_after_the_local_hit() -> None:
    ids = [7, 3, 9, 4, 5]
    hashes = [11, 12, 13, 14]
    t = plan_load("r", ids, hashes, local_computed_tokens=32, num_external_tokens=64, block_size=BS)
    assert t == BlockTransfer("r", 1, (3, 9), (12, 13))
    with pytest.raises(ValueError):
        plan_load("r", ids, hashes, 16, 64, BS)  # not block aligned
    with pytest.raises(ValueError):
        plan_load("r", ids, hashes, 64, 96, BS)  # beyond the hashes


def test_a_save_takes_blocks_sealed_by_the_step_once() -> None:
    ids = [7, 3, 9, 4]
    hashes = [11, 12, 13]
    # 70 tokens computed after the step: blocks 0 and 1 are sealed.
    t = plan_save("r", ids, hashes, saved_blocks=0, computed_tokens=70, block_size=BS)
    assert t == BlockTransfer("r", 0, (7, 3), (11, 12))
    assert plan_save("r", ids, hashes, 2, 70, BS) is None
    # Sealed blocks beyond the known hashes wait for them.
    assert plan_save("r", ids, hashes, 2, 200, BS) == BlockTransfer("r", 2, (9,), (13,))
    # Blocks the sidecar already holds (the cursor) are skipped.
    assert plan_save("r", ids, hashes, 1, 96, BS) == BlockTransfer("r", 1, (3, 9), (12, 13))


def test_the_first_failed_block_of_a_load_is_found_by_engine_block_id() -> None:
    t = BlockTransfer("r", 2, (30, 31, 32), (1, 2, 3))
    assert first_failed_index(t, {32, 31}) == 3
    assert first_failed_index(t, {99}) is None


def test_a_transfer_needs_one_hash_per_block() -> None:
    with pytest.raises(ValueError):
        BlockTransfer("r", 0, (1, 2), (3,))


def test_pipeline_stages_key_their_layers_and_a_block_needs_every_stage() -> None:
    stages = [(0, (0, 3)), (1, (3, 6))]
    keys = stage_keys("m", 0xAB, [0, 1], stages)
    assert keys == [
        HeadArtifactKey("m", 0, 0xAB, pp_rank=0, layers=(0, 3)).to_string(),
        HeadArtifactKey("m", 1, 0xAB, pp_rank=0, layers=(0, 3)).to_string(),
        HeadArtifactKey("m", 0, 0xAB, pp_rank=1, layers=(3, 6)).to_string(),
        HeadArtifactKey("m", 1, 0xAB, pp_rank=1, layers=(3, 6)).to_string(),
    ]
    # PP=1 keys are the whole model's, as before
    assert stage_keys("m", 0xAB, [0, 1]) == block_keys("m", 0xAB, [0, 1])
    assert stage_keys("m", 0xAB, [0, 1], []) == block_keys("m", 0xAB, [0, 1])
    # a lookup asks for heads x stages keys a block; the second stage missing one head of the
    # second block ends the stored prefix there
    looked = lookup_keys("m", [1, 2], [0, 1], stages)
    assert len(looked) == 8
    present = [True] * 7 + [False]
    assert present_blocks(present, 2 * len(stages)) == 1
    # a stage's own keys differ from another split's: stages split differently never mix
    assert set(stage_keys("m", 1, [0], [(0, (0, 2)), (1, (2, 6))])).isdisjoint(
        stage_keys("m", 1, [0], stages)
    )


def test_a_workers_stage_comes_from_the_layers_it_registered() -> None:
    assert stage_of([0, 1, 2], 0, 1) is None  # PP=1
    assert stage_of([5, 3, 4], 1, 2) == (1, (3, 6))
    with pytest.raises(ValueError, match="not contiguous"):
        stage_of([3, 5], 1, 2)


FULL = KVGroup()
WINDOW = KVGroup(window=64)  # 64 tokens of 32-token blocks: two blocks before a boundary


def test_one_group_keys_as_a_dense_model_and_groups_never_share_a_key() -> None:
    assert group_tags([FULL]) == [None]
    assert group_tags([WINDOW]) == [None]
    tags = group_tags([WINDOW, WINDOW, FULL])
    assert tags == ["kvgroup:0:window64", "kvgroup:1:window64", "kvgroup:2:full"]
    dense = block_keys("m", 0xAB, [0, 1])
    assert block_keys("m", 0xAB, [0, 1], group=None) == dense
    per_group = [block_keys("m", 0xAB, [0, 1], group=t) for t in tags]
    assert per_group[2][1] == dense[1] + "@kvgroup:2:full"
    keys = [k for ks in per_group for k in ks] + dense
    assert len(set(keys)) == len(keys)
    # a pipeline stage's layers and the group both name the key; the sidecar still indexes it
    from workers.sidecar.index import chunk_of

    staged = block_keys("m", 0xAB, [0], pp_rank=1, layers=(3, 6), group=tags[0])[0]
    assert staged.endswith("@layers:3-6@kvgroup:0:window64")
    chunk = chunk_of(staged)
    assert chunk is not None and chunk.chunk_hash == 0xAB
    assert lookup_keys("m", [1, 2], [0], None, tags[1]) == block_keys(
        "m", 1, [0], group=tags[1]
    ) + block_keys("m", 2, [0], group=tags[1])


def test_a_window_group_needs_the_blocks_covering_its_window_before_a_boundary() -> None:
    # vLLM's get_num_skipped_tokens: at 5 blocks (160 tokens) the next token attends to
    # tokens 97..160, so blocks 3 and 4 are needed and 0..2 are the null block
    assert FULL.first_needed(5, BS) == 0
    assert WINDOW.first_needed(5, BS) == 3
    assert WINDOW.first_needed(2, BS) == 0
    assert WINDOW.first_needed(1, BS) == 0
    assert KVGroup(window=65).first_needed(5, BS) == 3
    assert KVGroup(window=66).first_needed(5, BS) == 2
    assert KVGroup(window=64, retained=2).first_needed(5, BS) == 2
    assert KVGroup(window=32).first_needed(5, BS) == 4
    with pytest.raises(ValueError):
        KVGroup(window=0)


def test_a_prefix_is_restorable_only_where_every_group_can_resume() -> None:
    full = [True] * 8
    # the window group was saved around boundary 5 only (blocks 3 and 4) and at the end (6, 7)
    window = [False, False, False, True, True, False, True, True]
    assert restorable_blocks([full], [FULL], BS, limit=8) == 8
    assert restorable_blocks([full, window], [FULL, WINDOW], BS, limit=8) == 8
    assert restorable_blocks([full, window], [FULL, WINDOW], BS, limit=7) == 5
    assert restorable_blocks([full, window], [FULL, WINDOW], BS, limit=4) == 0
    # the full-attention group needs every block before the boundary
    holes = [True] * 6 + [False, True]
    assert restorable_blocks([holes, window], [FULL, WINDOW], BS, limit=8) == 5
    # a window group's blocks vLLM holds itself (its local hit) need not be stored
    assert restorable_blocks([full, window], [WINDOW, WINDOW], BS, limit=7) == 5
    only_last = [False] * 7 + [True]
    assert restorable_blocks([full, only_last], [FULL, WINDOW], BS, limit=8) == 0
    assert restorable_blocks([full, only_last], [FULL, WINDOW], BS, limit=8, local_blocks=7) == 8
    # one full-attention group: the leading stored blocks, as `present_blocks` counts them
    for mask in ([True, True, False, True], [True] * 4, [False] * 4):
        got = restorable_blocks([mask], [FULL], BS, limit=3)
        assert got == min(3, present_blocks(mask, 1))
    with pytest.raises(ValueError):
        restorable_blocks([full], [FULL, WINDOW], BS, limit=8)


def test_presence_is_per_block_of_every_head() -> None:
    assert present_mask([True, True, True, False, False, True], 2) == [True, False, False]
    with pytest.raises(ValueError):
        present_mask([True], 0)


def test_loads_and_saves_of_each_group_skip_the_null_block() -> None:
    n = NULL_BLOCK_ID
    full_ids, window_ids = [7, 3, 9, 4, 5, 6], [n, n, n, 8, 10, 11]
    hashes = [21, 22, 23, 24, 25]
    loads = plan_group_loads("r", [window_ids, full_ids], hashes, 32, 128, BS)
    assert loads == [
        BlockTransfer("r", 3, (8, 10), (24, 25), group=0),
        BlockTransfer("r", 1, (3, 9, 4, 5), (22, 23, 24, 25), group=1),
    ]
    # one full-attention group: `plan_load`'s transfer
    assert plan_group_loads("r", [full_ids], hashes, 32, 128, BS) == [
        plan_load("r", full_ids, hashes, 32, 128, BS)
    ]
    saves, saved = plan_group_saves("r", [window_ids, full_ids], hashes, 0, 170, BS)
    assert saved == 5
    assert saves == [
        BlockTransfer("r", 3, (8, 10), (24, 25), group=0),
        BlockTransfer("r", 0, (7, 3, 9, 4, 5), tuple(hashes), group=1),
    ]
    assert plan_group_saves("r", [window_ids, full_ids], hashes, 5, 170, BS) == ([], 5)
    # a group wholly outside its window this step saves nothing; the others still do
    saves, saved = plan_group_saves("r", [[n, n, n], [7, 3, 9]], hashes, 0, 96, BS)
    assert saves == [BlockTransfer("r", 0, (7, 3, 9), (21, 22, 23), group=1)]
    assert saved == 3
    assert plan_group_saves("r", [full_ids], hashes, 1, 96, BS) == (
        [plan_save("r", full_ids, hashes, 1, 96, BS)],
        3,
    )


def test_a_transfer_s_runs_of_real_blocks() -> None:
    n = NULL_BLOCK_ID
    t = BlockTransfer("r", 2, (5, 6), (1, 2), group=1)
    assert live_runs(t) == [t]
    t = BlockTransfer("r", 2, (n, 5, n, 6, 7), (1, 2, 3, 4, 5), group=1)
    assert live_runs(t) == [
        BlockTransfer("r", 3, (5,), (2,), group=1),
        BlockTransfer("r", 5, (6, 7), (4, 5), group=1),
    ]
    assert live_runs(BlockTransfer("r", 0, (n,), (1,))) == []
