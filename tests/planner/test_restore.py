"""The restore planner: load vs recompute per state type, under each SWA caching policy."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ownerserve.kvstate import SEALED_TYPES, StateType, load_spec
from ownerserve.profiles import TimingProfile, load_profile
from ownerserve.types import KVTransport, Tier
from planner.restore import (
    Decision,
    RestoreAction,
    SwaPolicy,
    load_bandwidth,
    plan_restore,
)

H100 = load_profile("h100-llama3-8b")
LLAMA = load_spec("llama3-8b")
V4 = load_spec("deepseek-v4")
QWEN = load_spec("qwen3-8b-swa")


def _slow(bps: float = 1e7, latency_s: float = 2e-4) -> TimingProfile:
    """The H100 profile behind a slow link: every path to SSD or another node at `bps`."""
    link = replace(H100.link, ssd_load_bps=bps, inter_node_bps=bps, latency_s=latency_s)
    return replace(H100, link=link)


def test_a_gpu_resident_prefix_loads() -> None:
    n = 32768
    plan = plan_restore(LLAMA, n, Tier.GPU, H100, path=KVTransport.SAME_HOST)
    choice = plan.choice(StateType.DENSE_KV)
    assert choice.decision is Decision.LOAD
    assert choice.load_bytes == n * 131072 and choice.recompute_tokens == 0
    # NVLink-class peer copy: latency + 4 GiB / 400 GB/s
    assert plan.restore_s == pytest.approx(2e-4 + n * 131072 / 4e11)
    assert plan.restore_s < plan.recompute_all_s / 100
    assert plan.actions() == (RestoreAction.LOAD_COMPRESSED_KV,)
    local = plan_restore(LLAMA, n, Tier.GPU, H100, local=True, queue_s=1.0)
    assert local.choice(StateType.DENSE_KV).decision is Decision.LOAD
    assert local.restore_s == 0.0 and local.queue_s == 0.0  # nothing to move, nothing to run
    assert local.hbm_bytes == 0


def test_an_ssd_prefix_behind_a_slow_link_is_recomputed_when_that_is_cheaper() -> None:
    n = 2048
    slow = _slow(1e7)
    plan = plan_restore(LLAMA, n, Tier.SSD, slow, path=KVTransport.STORE_RDMA)
    assert plan.choice(StateType.DENSE_KV).decision is Decision.RECOMPUTE
    assert plan.loaded_bytes == 0 and plan.recomputed_tokens == n
    assert plan.restore_s == pytest.approx(H100.prefill_s(n, 0))
    assert plan.load_all_s > 10 * plan.recompute_all_s  # 268 MB at 10 MB/s
    # the same prefix on a local NVMe loads: 268 MB / 6 GB/s beats 2048 tokens of prefill
    fast = plan_restore(LLAMA, n, Tier.SSD, H100, path=KVTransport.SAME_HOST, overlap=False)
    assert fast.choice(StateType.DENSE_KV).decision is Decision.LOAD
    assert fast.restore_s == pytest.approx(2e-4 + n * 131072 / 6e9)


def test_without_overlap_the_cheaper_pure_plan_wins() -> None:
    cases = [(Tier.SSD, _slow(), KVTransport.STORE_RDMA), (Tier.CPU, H100, KVTransport.SAME_HOST)]
    for tier, profile, path in cases:
        plan = plan_restore(LLAMA, 32768, tier, profile, path=path, overlap=False)
        assert plan.restore_s == min(plan.load_all_s, plan.recompute_all_s)
        assert plan.choice(StateType.DENSE_KV).decision in (Decision.LOAD, Decision.RECOMPUTE)


def test_a_mix_recomputes_the_front_while_the_rest_loads() -> None:
    plan = plan_restore(LLAMA, 32768, Tier.SSD, H100)
    choice = plan.choice(StateType.DENSE_KV)
    assert choice.decision is Decision.MIX
    assert plan.restore_s < 0.95 * min(plan.load_all_s, plan.recompute_all_s)
    front, load = plan.steps[0], plan.steps[1]
    assert front.action is RestoreAction.RECOMPUTE_PREFIX and front.start == 0
    assert load.action is RestoreAction.LOAD_COMPRESSED_KV and load.start == front.end
    assert front.end % LLAMA.block_tokens == 0
    # the split balances the two streams to within one block of compute
    assert abs(front.seconds - load.seconds) <= H100.prefill_s(LLAMA.block_tokens, front.end)
    assert choice.load_bytes + choice.recompute_tokens * 131072 == 32768 * 131072


@pytest.mark.parametrize("spec", [V4, LLAMA, QWEN], ids=lambda s: s.name)
@pytest.mark.parametrize(
    ("tier", "profile", "local"),
    [(Tier.GPU, H100, True), (Tier.CPU, H100, False), (Tier.SSD, _slow(), False)],
)
@pytest.mark.parametrize("extra", [1, 100, 127])
def test_the_incomplete_compression_block_is_always_recomputed(
    spec, tier: Tier, profile: TimingProfile, local: bool, extra: int
) -> None:
    n = 128 * 40 + extra
    tail = n % spec.block_tokens
    plan = plan_restore(spec, n, tier, profile, local=local)
    assert plan.sealed_tokens == n - tail and plan.tail_tokens == tail
    if StateType.TAIL_STATE in spec.state_types:
        assert plan.choice(StateType.TAIL_STATE).decision is Decision.RECOMPUTE
        assert plan.choice(StateType.TAIL_STATE).recompute_tokens == tail
    tail_steps = [s for s in plan.steps if s.action is RestoreAction.RECOMPUTE_TAIL]
    assert [(s.start, s.end) for s in tail_steps] == [(n - tail, n)]
    assert tail_steps[0].seconds > 0
    assert all(s.end <= plan.sealed_tokens for s in plan.steps if "load" in s.action.value)
    assert plan.recomputed_tokens >= tail
    assert plan.restore_s >= profile.prefill_s(tail, n - tail)


def test_zero_swa_caching_recomputes_exactly_n_win_times_l_tokens() -> None:
    n = 128 * 1000
    plan = plan_restore(V4, n, Tier.SSD, H100, swa_policy=SwaPolicy.zero())
    swa = plan.choice(StateType.WINDOW_SWA)
    assert swa.decision is Decision.RECOMPUTE
    assert swa.recompute_tokens == 128 * 61 == 7808
    steps = {s.action: s for s in plan.steps}
    assert RestoreAction.LOAD_SWA_CHECKPOINT not in steps
    assert (steps[RestoreAction.RECOMPUTE_SWA].start, steps[RestoreAction.RECOMPUTE_SWA].end) == (
        n - 7808,
        n,
    )
    assert steps[RestoreAction.LOAD_COMPRESSED_KV].end == n - 7808
    # a wide-window hybrid pays for its windows: 4096 x 27 layers
    qwen = plan_restore(QWEN, 200_000, Tier.SSD, H100, swa_policy=SwaPolicy.zero())
    assert qwen.choice(StateType.WINDOW_SWA).recompute_tokens == 4096 * 27


def test_full_swa_caching_loads_the_windows_and_recomputes_only_the_tail() -> None:
    n = 128 * 1000 + 5
    plan = plan_restore(V4, n, Tier.SSD, H100, swa_policy=SwaPolicy.full())
    swa = plan.choice(StateType.WINDOW_SWA)
    assert swa.decision is Decision.LOAD
    assert swa.load_bytes == V4.swa_bytes(n - 5) == 61 * 128 * 576
    assert swa.recompute_tokens == 0
    assert plan.recomputed_tokens == 5
    for kind in SEALED_TYPES & set(V4.state_types):
        assert plan.choice(kind).decision is Decision.LOAD


def test_periodic_checkpoints_load_the_last_one_and_recompute_since() -> None:
    n = 128 * 1000  # the checkpoint before it is at 31 x 4096 = 126976
    plan = plan_restore(V4, n, Tier.SSD, H100, swa_policy=SwaPolicy.periodic(4096))
    swa = plan.choice(StateType.WINDOW_SWA)
    assert swa.decision is Decision.LOAD and swa.recompute_tokens == n - 126976
    # a checkpoint older than n_win·L tokens is not worth loading: recompute instead
    stale = plan_restore(V4, n, Tier.SSD, H100, swa_policy=SwaPolicy.periodic(100_000))
    assert stale.choice(StateType.WINDOW_SWA).decision is Decision.RECOMPUTE
    assert stale.choice(StateType.WINDOW_SWA).recompute_tokens == 7808


def test_a_gpu_copy_keeps_its_windows_whatever_the_disk_policy() -> None:
    plan = plan_restore(V4, 128 * 100, Tier.GPU, H100, swa_policy=SwaPolicy.zero())
    assert plan.choice(StateType.WINDOW_SWA).decision is Decision.LOAD


def test_a_long_queue_favours_loading_over_recompute() -> None:
    slowish = _slow(2e8)
    idle = plan_restore(LLAMA, 2048, Tier.SSD, slowish, path=KVTransport.STORE_RDMA, overlap=False)
    busy = plan_restore(
        LLAMA, 2048, Tier.SSD, slowish, path=KVTransport.STORE_RDMA, overlap=False, queue_s=2.0
    )
    assert idle.choice(StateType.DENSE_KV).decision is Decision.RECOMPUTE
    assert busy.choice(StateType.DENSE_KV).decision is Decision.LOAD
    assert busy.queue_s == 0.0  # a pure load waits for no GPU slot
    assert idle.restore_s == pytest.approx(H100.prefill_s(2048, 0))


def test_objective_adds_lambda_times_hbm_bytes() -> None:
    plan = plan_restore(V4, 10_000, Tier.CPU, H100, lam=1e-11)
    assert plan.hbm_bytes == V4.total_bytes(10_000)
    assert plan.objective == pytest.approx(plan.restore_s + 1e-11 * plan.hbm_bytes)


def test_prefetch_hides_loads_behind_a_tool_call() -> None:
    plain = plan_restore(LLAMA, 32768, Tier.SSD, H100, overlap=False)
    ahead = plan_restore(LLAMA, 32768, Tier.SSD, H100, overlap=False, prefetch_window_s=0.5)
    assert RestoreAction.PREFETCH_ARTIFACT in ahead.actions()
    assert ahead.restore_s == pytest.approx(max(0.0, plain.restore_s - 0.5))


def test_an_hbm_deficit_asks_to_drop_low_utility_artifacts() -> None:
    plan = plan_restore(LLAMA, 1000, Tier.CPU, H100, hbm_free_bytes=10**6)
    drop = [s for s in plan.steps if s.action is RestoreAction.DROP_LOW_UTILITY_ARTIFACT]
    assert len(drop) == 1 and drop[0].nbytes == 1000 * 131072 - 10**6
    roomy = plan_restore(LLAMA, 1000, Tier.CPU, H100, hbm_free_bytes=10**12)
    assert RestoreAction.DROP_LOW_UTILITY_ARTIFACT not in roomy.actions()


def test_nothing_cached_costs_nothing_and_bad_input_is_rejected() -> None:
    plan = plan_restore(V4, 0, Tier.SSD, H100)
    assert plan.restore_s == 0.0 and plan.steps == () and plan.hbm_bytes == V4.total_bytes(0)
    with pytest.raises(ValueError):
        plan_restore(V4, -1, Tier.SSD, H100)
    with pytest.raises(ValueError):
        plan_restore(V4, 10, Tier.SSD, H100, queue_s=-1.0)
    with pytest.raises(ValueError):
        SwaPolicy.periodic(0)


def test_tier_names_are_accepted_as_strings() -> None:
    assert plan_restore(LLAMA, 4096, "cpu", H100).tier is Tier.CPU  # type: ignore[arg-type]


def test_load_bandwidth_takes_the_slowest_link_on_the_path() -> None:
    link = H100.link
    assert load_bandwidth(link, Tier.GPU, path=KVTransport.SAME_HOST) == link.intra_node_bps
    assert load_bandwidth(link, Tier.GPU, path=KVTransport.STORE_RDMA) == link.inter_node_bps
    assert load_bandwidth(link, Tier.CPU, path=KVTransport.STORE_RDMA) == link.inter_node_bps
    assert load_bandwidth(link, Tier.SSD, path=KVTransport.SAME_HOST) == link.ssd_load_bps


@settings(max_examples=60, deadline=None)
@given(
    spec=st.sampled_from([LLAMA, V4, QWEN, load_spec("deepseek-v3")]),
    n=st.integers(0, 300_000),
    tier=st.sampled_from(list(Tier)),
    path=st.sampled_from(list(KVTransport)),
    queue_s=st.floats(0, 5),
    policy=st.sampled_from([SwaPolicy.full(), SwaPolicy.zero(), SwaPolicy.periodic(2048)]),
    bps=st.sampled_from([1e7, 1e9, 1e11]),
    base=st.sampled_from(["h100-llama3-8b", "fast-test"]),
)
def test_the_plan_is_never_worse_than_loading_all_or_recomputing_all(
    spec, n, tier, path, queue_s, policy, bps, base
) -> None:
    link = replace(load_profile(base).link, ssd_load_bps=bps, inter_node_bps=bps)
    profile = replace(load_profile(base), link=link)
    plan = plan_restore(spec, n, tier, profile, path=path, queue_s=queue_s, swa_policy=policy)
    assert 0.0 <= plan.restore_s <= min(plan.load_all_s, plan.recompute_all_s) + 1e-9
    assert plan.restore_s <= plan.load_s + plan.queue_s + plan.recompute_s + 1e-9
    assert plan.recomputed_tokens >= plan.tail_tokens
    assert all(s.start <= s.end for s in plan.steps)


@pytest.mark.parametrize("spec", [LLAMA, V4, QWEN], ids=lambda s: s.name)
@pytest.mark.parametrize("n", [3_000, 40_000])
@pytest.mark.parametrize(("bps", "queue_s"), [(6e9, 0.0), (1e9, 0.3), (5e10, 0.0)])
def test_the_solved_mix_split_is_the_best_block_boundary(spec, n, bps, queue_s) -> None:
    # white-box: compares the private solver with an exhaustive scan of every block boundary
    from planner.restore import _Planner

    p = _Planner(
        spec,
        n,
        Tier.SSD,
        _slow(bps),
        path=KVTransport.SAME_HOST,
        local=False,
        queue_s=queue_s,
        policy=SwaPolicy.periodic(1024),
        overlap=True,
        prefetch_s=0.0,
    )
    mix = p.best_mix()
    assert mix is not None
    scan = min(
        o.restore_s
        for k in range(1, p.sealed // spec.block_tokens)
        for o in p.options_at(k * spec.block_tokens)
    )
    assert mix.restore_s == pytest.approx(scan, rel=1e-9)


def test_a_partly_resident_prefix_loads_only_what_hbm_lacks() -> None:
    n, a = 32768, 16384
    plan = plan_restore(LLAMA, n, Tier.CPU, H100, resident_tokens=a)
    assert plan.loaded_bytes == (n - a) * 131072
    assert plan.restore_s == pytest.approx(2e-4 + (n - a) * 131072 / 5e10)  # no mix
    assert plan.recompute_all_s == pytest.approx(H100.prefill_s(n - a, a))
    assert plan.hbm_bytes == (n - a) * 131072
    # V4 under zero SWA caching: the windows at S = 12800 need the last 7808 tokens, and the
    # resident 6400 already cover everything before them: nothing is worth loading
    v4 = plan_restore(V4, 12850, Tier.SSD, H100, resident_tokens=6400, swa_policy=SwaPolicy.zero())
    assert v4.loaded_bytes == 0 and v4.recomputed_tokens == 12850 - 6400
    assert v4.restore_s == pytest.approx(H100.prefill_s(6450, 6400))
    # resident tokens count only up to a sealed boundary (6450 -> 6400)
    assert plan_restore(V4, 12850, Tier.SSD, H100, resident_tokens=6450).recompute_all_s == (
        pytest.approx(H100.prefill_s(6450, 6400))
    )


def test_the_spec_s_own_swa_policy_is_the_default() -> None:
    n = 128 * 1000 + 100
    full_spec = replace(V4, swa_policy=SwaPolicy.full())
    assert plan_restore(full_spec, n, Tier.SSD, H100).restore_s == pytest.approx(
        plan_restore(V4, n, Tier.SSD, H100, swa_policy=SwaPolicy.full()).restore_s
    )
    # cost-based, unresolved: p* for this profile and tier, a session of n tokens
    cost = plan_restore(replace(V4, swa_policy=SwaPolicy.cost_based()), n, Tier.SSD, H100)
    assert (
        cost.restore_s <= plan_restore(V4, n, Tier.SSD, H100, swa_policy=SwaPolicy.zero()).restore_s
    )
