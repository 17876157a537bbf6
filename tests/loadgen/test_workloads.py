"""Workload generators: deterministic per seed, the agent-workload shapes, exact lengths."""

from __future__ import annotations

import statistics
from itertools import pairwise
from pathlib import Path

import pytest

from loadgen import workloads as W
from loadgen.sim.workload import trace_sessions
from loadgen.text import TextFactory, ascii_text, template_overhead
from loadgen.trace import export_trace, load_trace, prefix_sharing, workload_prompts, write_trace
from ownerserve.tokenizer import ChatTemplate


@pytest.mark.parametrize("name", sorted(W.GENERATORS))
def test_same_seed_gives_identical_workload_and_other_seed_differs(name: str) -> None:
    a = W.generate(name, seed=7, scale=0.5)
    b = W.generate(name, seed=7, scale=0.5)
    c = W.generate(name, seed=8, scale=0.5)
    assert a == b
    assert a != c
    assert a.n_requests > 0


def test_text_has_exact_byte_length_and_is_stable_per_key() -> None:
    tf = TextFactory(seed=3)
    for n in (1, 15, 16, 511, 512, 4000):
        text = tf.make("k", n)
        assert len(text.encode()) == n
        assert text.isascii()
    assert tf.make("k", 100) == tf.make("k", 100)
    assert tf.make("k", 100) != tf.make("j", 100)
    assert tf.make("k", 300).startswith(tf.make("k", 100))  # prefixes are stable
    assert ascii_text(3, "k", 0) == ""


def test_template_overhead_matches_the_rendered_prompt() -> None:
    over = template_overhead()
    rendered = ChatTemplate().render([{"role": "user", "content": "abc"}])
    assert len(rendered) == over.total + 3
    assert rendered.startswith("<|user|>") and over.head == len("<|user|>")


def test_agentic_sessions_share_repo_context_within_a_group_and_append_tool_outputs() -> None:
    w = W.agentic(W.AgenticParams(sessions=12, repo_groups=2, turns=(3, 5)), seed=1)
    by_group: dict[str, set[str]] = {}
    for s in w.sessions:
        first = s.steps[0].new_messages
        assert [m.role for m in first] == ["system", "user", "user"]
        by_group.setdefault(s.group, set()).add(first[1].content)
        assert all(st.new_messages[0].role == "tool" for st in s.steps[1:])
        assert all(st.gap_s > 0 for st in s.steps[1:])
        assert all(len(st.reply) == st.max_tokens for st in s.steps)
    assert len(by_group) == 2
    assert all(len(contents) == 1 for contents in by_group.values())
    systems = {s.steps[0].new_messages[0].content for s in w.sessions}
    assert len(systems) == 1
    starts = [s.start_s for s in w.sessions]
    assert starts == sorted(starts) and starts[0] == 0.0


@pytest.mark.parametrize("name", ["agentic", "forked", "agentic-long"])
def test_tool_results_answer_the_previous_replys_tool_call(name: str) -> None:
    # OpenAI-shaped: strict servers (sglang-router) reject a tool message without its call id
    w = W.generate(name, seed=1, scale=0.3)
    for s in w.sessions:
        for prev, step in zip(s.steps, s.steps[1:], strict=False):
            (tool,) = step.new_messages
            reply = prev.reply_message()
            assert tool.role == "tool" and reply is not None
            assert reply["tool_calls"][0]["id"] == tool.tool_call_id
            assert tool.as_dict()["tool_call_id"] == tool.tool_call_id
        assert s.steps[-1].reply_tool_call is None


def test_agentic_tool_outputs_and_outputs_vary_between_short_and_long() -> None:
    p = W.AgenticParams(sessions=40, long_tool_prob=0.3, long_output_prob=0.3)
    w = W.agentic(p, seed=2)
    tools = [len(st.new_messages[0].content) for s in w.sessions for st in s.steps[1:]]
    outs = [st.max_tokens for s in w.sessions for st in s.steps]
    assert min(tools) < p.tool_tokens[1] and max(tools) >= p.long_tool_tokens[0]
    assert min(outs) <= p.short_output[1] and max(outs) >= p.long_output[0]


def test_forked_branches_share_one_prefix_start_together_then_diverge() -> None:
    w = W.forked(W.ForkedParams(groups=3, branches=4), seed=5)
    assert len(w.sessions) == 12
    groups: dict[str, list[W.Session]] = {}
    for s in w.sessions:
        groups.setdefault(s.group, []).append(s)
    for branches in groups.values():
        assert len(branches) == 4
        assert len({b.start_s for b in branches}) == 1
        assert len({b.steps[0].new_messages[1].content for b in branches}) == 1
        assert len({b.steps[0].new_messages[2].content for b in branches}) == 4


def test_docqa_reuses_long_documents_across_users() -> None:
    w = W.docqa(W.DocQAParams(sessions=10, documents=2, doc_tokens=(5000, 6000)), seed=4)
    docs = {s.steps[0].new_messages[1].content for s in w.sessions}
    assert len(docs) == 2
    assert all(len(d) > 5000 for d in docs)
    assert all(len(s.steps) >= 3 for s in w.sessions)


def test_resume_sessions_idle_long_once_then_continue() -> None:
    w = W.resume(W.ResumeParams(sessions=5), seed=9)
    for s in w.sessions:
        labels = [st.label for st in s.steps]
        assert labels.count("resume") == 1
        k = labels.index("resume")
        assert 0 < k < len(s.steps)
        assert s.steps[k].gap_s == W.AgenticParams().resume_idle_s


def test_time_scale_multiplies_starts_and_gaps() -> None:
    w = W.generate("agentic", seed=1, scale=0.3)
    h = w.scaled(0.1)
    assert [s.start_s * 0.1 for s in w.sessions] == pytest.approx([s.start_s for s in h.sessions])
    assert sum(s.idle_s for s in h.sessions) == pytest.approx(
        0.1 * sum(s.idle_s for s in w.sessions)
    )


def test_export_gives_mooncake_rows_whose_sharing_reflects_the_sessions() -> None:
    w = W.generate("mixed", seed=3, scale=0.3)
    rows = export_trace(w)
    prompts = workload_prompts(w)
    assert len(rows) == w.n_requests == len(prompts)
    for row, (t, _s, _k, prompt) in zip(rows, prompts, strict=True):
        assert row.input_length == len(prompt)
        assert len(row.hash_ids) == -(-row.input_length // 512)
        assert row.timestamp_ms == round(t * 1000)
    ts = [r.timestamp_ms for r in rows]
    assert ts == sorted(ts)
    # multi-turn sessions over shared contexts: most prompt blocks were seen before
    assert prefix_sharing(rows) > 0.5
    assert export_trace(w) == rows


# -- agentic-long: long coding-agent sessions with subagents ---------------------------------

LONG = W.AgenticLongParams()
END = ChatTemplate.GENERATION_PROMPT


@pytest.fixture(scope="module")
def long_w() -> W.Workload:
    return W.generate("agentic-long", seed=11)


@pytest.fixture(scope="module")
def long_prompts(long_w: W.Workload) -> dict[str, list[str]]:
    """Every session's rendered prompts, step by step (one token per character)."""
    out: dict[str, list[str]] = {s.session_id: [] for s in long_w.sessions}
    for _t, session, k, prompt in sorted(
        workload_prompts(long_w), key=lambda x: (x[1].session_id, x[2])
    ):
        assert len(out[session.session_id]) == k
        out[session.session_id].append(prompt)
    return out


def _mains(w: W.Workload) -> list[W.Session]:
    return [s for s in w.sessions if s.kind == "agentic-long"]


def _render(msgs: tuple[W.Msg, ...]) -> str:
    return "".join(ChatTemplate().render_message(m.as_dict()) for m in msgs)


def test_agentic_long_groups_share_one_8_to_16k_prefix(long_w: W.Workload) -> None:
    prefixes: dict[str, set[str]] = {}
    for s in _mains(long_w):
        system, repo, task = s.steps[0].new_messages
        assert (system.role, repo.role, task.role) == ("system", "user", "user")
        prefixes.setdefault(s.group, set()).add(_render((system, repo)))
    assert len(prefixes) == LONG.repo_groups
    for texts in prefixes.values():
        (text,) = texts
        assert LONG.prefix_tokens[0] <= len(text) <= LONG.prefix_tokens[1]
    assert len({s.steps[0].new_messages[0] for s in long_w.sessions}) == 1  # one system prompt


def test_agentic_long_sessions_run_20_to_60_turns_to_60_to_120k_tokens(
    long_w: W.Workload, long_prompts: dict[str, list[str]]
) -> None:
    mains = _mains(long_w)
    assert len(mains) == LONG.sessions
    assert all(LONG.turns[0] <= len(s.steps) <= LONG.turns[1] for s in mains)
    assert len({len(s.steps) for s in mains}) > 10
    finals = [len(long_prompts[s.session_id][-1]) for s in mains]
    assert all(LONG.context_tokens[0] <= n <= LONG.context_tokens[1] for n in finals)
    assert max(finals) - min(finals) > 30_000
    assert all(len(p[-1]) <= LONG.context_tokens[1] for p in long_prompts.values())


def test_agentic_long_turn_sizes_outputs_and_gaps_follow_their_distributions(
    long_w: W.Workload, long_prompts: dict[str, list[str]]
) -> None:
    growth = [len(b) - len(a) for p in long_prompts.values() for a, b in pairwise(p)]
    assert 1_000 <= statistics.median(growth) <= 2_000
    assert sum(g > 10_000 for g in growth) >= 3  # the long tool outputs
    outs = [st.max_tokens for s in long_w.sessions for st in s.steps]
    assert 270 <= statistics.median(outs) <= 330
    assert all(len(st.reply) == st.max_tokens for s in long_w.sessions for st in s.steps)
    gaps = [st.gap_s for s in long_w.sessions for st in s.steps[1:]]
    p50, p99 = statistics.quantiles(gaps, n=100)[49], statistics.quantiles(gaps, n=100)[98]
    assert 1.6 <= p50 <= 2.5
    assert 60.0 <= p99 <= 600.0
    assert max(gaps) <= LONG.gap_max_s
    assert all(s.steps[0].gap_s == 0.0 for s in long_w.sessions)


def test_agentic_long_turns_mostly_reuse_90_percent_of_their_prefix(
    long_w: W.Workload, long_prompts: dict[str, list[str]]
) -> None:
    """A turn resends the previous prompt and its reply: that prefix is at least 90% of the
    prompt in >= 90% of the turns (the traces: 96% at ~195K-token contexts)."""
    shares = []
    for s in long_w.sessions:
        prompts = long_prompts[s.session_id]
        for k in range(1, len(s.steps)):
            reply = s.steps[k - 1].reply_message()
            assert reply is not None
            prefix = prompts[k - 1].removesuffix(END) + ChatTemplate().render_message(reply)
            assert prompts[k].startswith(prefix)
            shares.append(len(prefix) / len(prompts[k]))
    assert sum(x >= 0.9 for x in shares) / len(shares) >= 0.9


def test_agentic_long_subagents_fork_from_their_parents_prefix(
    long_w: W.Workload, long_prompts: dict[str, list[str]]
) -> None:
    by_id = {s.session_id: s for s in long_w.sessions}
    subs = [s for s in long_w.sessions if s.kind == "subagent"]
    parents = {s.session_id.rsplit("-sub", 1)[0] for s in subs}
    assert 0.10 <= len(parents) / LONG.sessions <= 0.20
    for sub in subs:
        parent = by_id[sub.session_id.rsplit("-sub", 1)[0]]
        assert sub.group == parent.group and sub.steps[0].label == "subagent"
        assert LONG.subagent_turns[0] <= len(sub.steps) <= LONG.subagent_turns[1]
        # it starts with the parent's prompt at some turn j, sent at that turn's planned time
        first = long_prompts[sub.session_id][0]
        j = max(
            k
            for k, p in enumerate(long_prompts[parent.session_id])
            if first.startswith(p.removesuffix(END))
        )
        assert 0 < j < len(parent.steps) - 1
        assert sub.spawned_at == (parent.session_id, j)  # replayed: when the parent sends j
        assert sub.start_s == pytest.approx(
            parent.start_s + sum(st.gap_s for st in parent.steps[: j + 1])
        )
        assert sub.steps[0].new_messages[-1].content.startswith("Subagent task: ")


def test_agentic_long_scale_shrinks_tokens_not_sessions_or_turns(long_w: W.Workload) -> None:
    w = W.generate("agentic-long", seed=11, scale=0.1)
    for small, full in zip(w.sessions, long_w.sessions, strict=True):
        assert (small.session_id, small.start_s) == (full.session_id, full.start_s)
        assert [st.gap_s for st in small.steps] == [st.gap_s for st in full.steps]
    mains = _mains(w)
    assert len(mains) == LONG.sessions
    assert all(LONG.turns[0] <= len(s.steps) <= LONG.turns[1] for s in mains)
    for s in mains:
        assert 800 <= len(_render(s.steps[0].new_messages[:2])) <= 1_600
    last = {s.session_id: p for _t, s, _k, p in workload_prompts(w)}
    assert all(len(p) <= 12_000 for p in last.values())
    assert statistics.median(st.max_tokens for s in w.sessions for st in s.steps) <= 40


def test_agentic_long_exports_a_trace_that_round_trips(tmp_path: Path) -> None:
    w = W.generate("agentic-long", seed=5, scale=0.1)
    rows = export_trace(w)
    path = tmp_path / "long.jsonl"
    write_trace(rows, path)
    assert load_trace(path) == rows
    assert len(rows) == w.n_requests
    assert {r.session_id for r in rows} == {s.session_id for s in w.sessions}
    per_session = [len(s.turns) for s in trace_sessions(path)]
    assert sorted(per_session) == sorted(len(s.steps) for s in w.sessions)
    assert prefix_sharing(rows) > 0.8
