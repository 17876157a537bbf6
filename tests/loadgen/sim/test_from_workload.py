"""Load-generator workloads as simulator sessions: the blocks are the engine's blocks."""

from __future__ import annotations

from dataclasses import fields

import httpx

from loadgen.client import RunOptions, run_workload
from loadgen.sim.from_workload import Rendering, step_prompts, workload_sessions
from loadgen.workloads import AgenticParams, Workload, agentic, docqa
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.tokenizer import ByteTokenizer, ChatTemplate
from workers.emulator.config import EmulatorConfig
from workers.emulator.server import EmulatorServer

SMALL = AgenticParams(
    sessions=3,
    rate_per_s=50.0,
    repo_groups=2,
    system_tokens=100,
    repo_tokens=(200, 400),
    turns=(2, 4),
    tool_tokens=(20, 120),
    long_tool_tokens=(200, 300),
    short_output=(3, 9),
    long_output=(10, 20),
)


def _small(seed: int = 0) -> Workload:
    return agentic(SMALL, seed=seed).scaled(0.01)


def test_rendering_defaults_are_the_emulators() -> None:
    emu = EmulatorConfig()
    for f in fields(Rendering):
        assert getattr(Rendering(), f.name) == getattr(emu, f.name), f.name


def test_chains_are_ownerserve_hashes_of_the_rendered_prompt() -> None:
    w = _small()
    sims = workload_sessions(w)
    root = chain_root("ownerserve-tiny")
    prompts = step_prompts(w)
    assert [s.session_id for s in sims] == list(range(len(w.sessions)))
    for sim, session, msgs in zip(sims, w.sessions, prompts, strict=True):
        assert sim.start_s == session.start_s and sim.fork_of is None
        assert len(sim.turns) == len(session.steps)
        for k, (turn, step, messages) in enumerate(
            zip(sim.turns, session.steps, msgs, strict=True)
        ):
            ids = ByteTokenizer().encode(ChatTemplate().render(messages))
            assert turn.chain == tuple(block_hash_chain(ids, 16, root))
            assert turn.input_tokens == len(ids) and len(turn.chain) == len(ids) // 16
            assert turn.output_tokens == step.max_tokens
            assert turn.gap_s == (step.gap_s if k else 0.0)


def test_each_turn_extends_the_previous_chain() -> None:
    for w in (_small(1), docqa(seed=2)):
        for sim in workload_sessions(w):
            for prev, turn in zip(sim.turns, sim.turns[1:], strict=False):
                assert turn.chain[: len(prev.chain)] == prev.chain
                assert len(turn.chain) > len(prev.chain)


def test_sessions_of_one_group_share_their_prefix_blocks() -> None:
    w = _small()
    sims = workload_sessions(w)
    by_group: dict[str, list[tuple[int, ...]]] = {}
    for session, sim in zip(w.sessions, sims, strict=True):
        by_group.setdefault(session.group, []).append(sim.turns[0].chain)
    # the system prompt (100 tokens) is common to all: its first full blocks are shared
    firsts = [chains[0] for chains in by_group.values()]
    assert all(c[:5] == firsts[0][:5] for c in firsts)
    for chains in by_group.values():
        if len(chains) > 1:  # same repository: shared beyond the system prompt
            assert chains[0][:20] == chains[1][:20]


def test_other_block_size_and_model_change_the_chain() -> None:
    w = _small()
    base = workload_sessions(w)[0].turns[0]
    other = workload_sessions(w, Rendering(block_size=32))[0].turns[0]
    renamed = workload_sessions(w, Rendering(model="m2"))[0].turns[0]
    assert len(other.chain) == base.input_tokens // 32
    assert renamed.chain[0] != base.chain[0]


async def test_emulated_engine_holds_exactly_the_simulated_blocks() -> None:
    """Replay the workload against a real emulated engine: its usage and its prefix cache
    agree with the simulator's turns token for token and block for block."""
    w = _small(3)
    sims = workload_sessions(w)
    server = EmulatorServer(EmulatorConfig(port=0, profile="fast-test"))
    await server.start()
    try:
        result = await run_workload(w, RunOptions(target=server.url, progress=False))
        async with httpx.AsyncClient(timeout=10.0) as client:
            held = set((await client.get(server.url + "/kv_blocks")).json()["block_hashes"])
    finally:
        await server.stop()
    assert all(r.ok for r in result.requests)
    index = {s.session_id: i for i, s in enumerate(w.sessions)}
    for rec in result.requests:
        turn = sims[index[rec.session_id]].turns[rec.step]
        assert rec.prompt_tokens == turn.input_tokens
        assert rec.completion_tokens == turn.output_tokens
    for sim in sims:
        for turn in sim.turns:
            assert set(turn.chain) <= held
