"""Workload generators: deterministic per seed, the shapes the mission asks for, exact lengths."""

from __future__ import annotations

import pytest

from loadgen import workloads as W
from loadgen.text import TextFactory, ascii_text, template_overhead
from loadgen.trace import export_trace, prefix_sharing, workload_prompts
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


@pytest.mark.parametrize("name", ["agentic", "forked"])
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
