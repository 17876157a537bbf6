"""Round-number profile, config and builders for the planner tests (hand-computable costs)."""

from __future__ import annotations

from ownerserve.profiles import DecodeTiming, LinkTiming, PrefillTiming, TimingProfile
from ownerserve.types import Role, Tier
from planner.cost import CostConfig, CostModel
from planner.types import ClusterView, RequestView, WorkerView

UNIT = TimingProfile(
    name="unit",
    prefill=PrefillTiming(base_s=0.01, per_token_s=1e-4, per_token_ctx_s=1e-8),
    decode=DecodeTiming(base_s=0.005, per_seq_s=1e-4, per_ctx_token_s=1e-8),
    link=LinkTiming(
        intra_node_bps=1e11,
        inter_node_bps=1e10,
        latency_s=1e-3,
        cpu_load_bps=1e9,
        ssd_load_bps=1e8,
    ),
    kv_bytes_per_token=1000,
    hbm_kv_bytes=1_000_000_000,  # 1e6 tokens
    max_num_seqs=100,
    max_batched_tokens=8192,
)

UNIT_CONFIG = CostConfig(
    lam=1e-9,
    mu=1.0,
    profile="unit",
    decode_horizon_tokens=10,
    pd_handshake_s=0.002,
    migration_margin_s=0.05,
    migration_margin_rel=0.1,
    xi=0.0,  # the worked example (planner/README.md) prices a duplicate by λ alone
)


def unit_model(config: CostConfig = UNIT_CONFIG) -> CostModel:
    return CostModel(config, {"unit": UNIT})


def worker(
    wid: str,
    role: Role,
    node: str = "node0",
    *,
    gpu: int = 0,
    cpu: int = 0,
    ssd: int = 0,
    **kw: object,
) -> WorkerView:
    cached = {t: b for t, b in ((Tier.GPU, gpu), (Tier.CPU, cpu), (Tier.SSD, ssd)) if b}
    return WorkerView(
        worker_id=wid,
        role=role,
        node=node,
        profile="unit",
        cached_blocks=cached,
        **kw,  # type: ignore[arg-type]
    )


def cluster(*workers: WorkerView) -> ClusterView:
    return ClusterView(workers=workers)


def request(prompt_tokens: int, **kw: object) -> RequestView:
    """Block size 100, K = 1000 bytes per token, 10 decode steps counted."""
    return RequestView(
        model="m",
        prompt_tokens=prompt_tokens,
        block_size=100,
        chain_blocks=prompt_tokens // 100,
        max_tokens=10,
        kv_bytes_per_token=1000,
        **kw,  # type: ignore[arg-type]
    )


def with_p0(*workers: WorkerView) -> ClusterView:
    """`workers` and an idle P worker, p0, on node0."""
    return cluster(worker("p0", Role.PREFILL, "node0"), *workers)


def owned_turn(prompt_tokens: int, previous_prompt_tokens: int, owner_blocks: int) -> RequestView:
    """A turn of session "s", whose decode owner d0 also owns the first `owner_blocks` blocks
    of its prompt."""
    return request(
        prompt_tokens, session_id="s", session_owner="d0", owner="d0", owner_blocks=owner_blocks,
        previous_prompt_tokens=previous_prompt_tokens,
    )  # fmt: skip


# The worked example of planner/README.md: a session turn of 400 new tokens on a 1600-token
# prefix owned by its decode owner d0 (2 running, 1 waiting), an idle P worker on d0's node and
# a decode worker d1 on another node with one running decode of a large context.
def example() -> tuple[RequestView, ClusterView]:
    req = owned_turn(2000, previous_prompt_tokens=1600, owner_blocks=16)
    cl = with_p0(
        worker("d0", Role.DECODE, "node0", gpu=16, running=2, waiting=1, kv_usage=0.1),
        worker("d1", Role.DECODE, "node1", running=1, kv_usage=0.5),
    )
    return req, cl
