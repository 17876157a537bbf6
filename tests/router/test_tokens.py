"""Tokenization for routing: the chain equals hashing the whole rendered prompt, and a
session's next turn only tokenizes its new messages."""

from __future__ import annotations

from typing import Any

from ownerserve.config import ModelSettings
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.tokenizer import ByteTokenizer, ChatTemplate
from router.tokens import ModelTokenizer

MODEL = ModelSettings(name="tiny", block_size=4, salt="s")
MESSAGES = [
    {"role": "system", "content": "You are a coding agent with tools."},
    {"role": "user", "content": "List the files please."},
]


def _reference_chain(messages, tools=None):
    text = ChatTemplate().render(messages, tools=tools)
    ids = ByteTokenizer().encode(text)
    return ids, block_hash_chain(ids, MODEL.block_size, chain_root("tiny", "s"))


def test_chain_matches_hashing_the_rendered_prompt():
    mt = ModelTokenizer(MODEL)
    tools = [{"type": "function", "function": {"name": "ls"}}]
    tok = mt.tokenize_chat("s1", MESSAGES, tools)
    ids, chain = _reference_chain(MESSAGES, tools)
    assert list(tok.token_ids) == ids
    assert list(tok.chain) == chain
    assert tok.previous_chain_len == 0


def test_next_turn_tokenizes_only_new_messages():
    mt = ModelTokenizer(MODEL)
    mt.tokenize_chat("s1", MESSAGES)
    misses = mt.message_cache_misses
    turn2 = [*MESSAGES, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "a b"}]
    tok = mt.tokenize_chat("s1", turn2)
    assert mt.message_cache_misses - misses == 2
    assert list(tok.chain) == _reference_chain(turn2)[1]
    assert tok.extends_previous and tok.common_blocks > 0


def test_a_diverging_branch_is_not_an_extension():
    mt = ModelTokenizer(MODEL)
    long_turn = [*MESSAGES, {"role": "assistant", "content": "branch A " * 8}]
    mt.tokenize_chat("s1", long_turn)
    other = [*MESSAGES, {"role": "assistant", "content": "branch B " * 8}]
    tok = mt.tokenize_chat("s1", other)
    assert not tok.extends_previous
    assert 0 < tok.common_blocks < tok.previous_chain_len


def test_completion_prompts_as_text_and_token_ids():
    mt = ModelTokenizer(MODEL)
    text = "def handler(request):\n    return route(request)\n"
    a = mt.tokenize_prompt("c1", text)
    b = mt.tokenize_prompt("c1", text + "# more\n")
    assert list(b.token_ids[: len(a.token_ids)]) == list(a.token_ids)
    assert b.extends_previous
    ids = mt.tokenize_prompt(None, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(ids.chain) == 2 and ids.prompt_tokens == 9


def test_fast_block_hashes_equal_the_core_chain():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ownerserve.hashing import block_hash_chain
    from router.tokens import hash_blocks

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(st.integers(0, 2**32 - 1), max_size=200),
        st.integers(1, 17),
        st.integers(0, 40),
    )
    def check(tokens, bs, start):
        root = chain_root("m", "")
        start = min(start, len(tokens)) // bs * bs
        parent = root
        if start:
            parent = block_hash_chain(tokens[:start], bs, root)[-1]
        expected = block_hash_chain(tokens[start:], bs, root, start_parent=parent)
        assert hash_blocks(tokens, bs, parent, start) == expected

    check()


def test_tools_or_an_edited_early_message_rehash_from_there():
    mt = ModelTokenizer(MODEL)
    a = mt.tokenize_chat("s1", MESSAGES)
    edited = [MESSAGES[0], {"role": "user", "content": "List the files, quickly."}]
    b = mt.tokenize_chat("s1", edited)
    assert list(b.chain) == _reference_chain(edited)[1]
    assert b.common_blocks < len(a.chain)
    tools = [{"type": "function", "function": {"name": "grep"}}]
    c = mt.tokenize_chat("s1", edited, tools)
    assert list(c.chain) == _reference_chain(edited, tools)[1]
    same = mt.tokenize_chat("s1", edited, tools)
    assert same.chain == c.chain and same.common_blocks == len(c.chain)


def test_byte_token_arrays_equal_the_tokenizers_ids():
    from router.tokens import array_encoder

    text = "héllo wörld ✓ \x00\xff" * 20
    assert list(array_encoder(ByteTokenizer())(text)) == ByteTokenizer().encode(text)


def _agent_turns(session: int, turns: int) -> list[list[dict[str, str]]]:
    """A session's prompts turn by turn: a shared system prompt, then its own messages."""
    messages = [{"role": "system", "content": "You are a coding agent with tools. " * 20}]
    out = []
    for t in range(turns):
        messages = [
            *messages,
            {"role": "user", "content": f"session {session} turn {t}: " + "tool output " * 60},
        ]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"reply {session}.{t}"}]
    return out


def test_caches_stay_under_their_byte_bound_over_many_sessions():
    """Thousands of distinct sessions: the caches' accounted bytes never pass `max_bytes`,
    the oldest sessions and messages go, and what is accounted is what the caches hold (the
    Python heap they keep, traced, within a factor of it)."""
    import gc
    import tracemalloc

    cap = 1024 * 1024
    mt = ModelTokenizer(MODEL, max_bytes=cap)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for s in range(250):
            for messages in _agent_turns(s, 3):
                mt.tokenize_chat(f"s{s}", messages)
            stats = mt.cache_stats()
            assert stats["sessions_bytes"] + stats["messages_bytes"] <= cap
        gc.collect()
        held = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    stats = mt.cache_stats()
    assert stats["sessions_evicted"] > 0 and stats["messages_evicted"] > 0
    accounted = stats["sessions_bytes"] + stats["messages_bytes"]
    assert cap // 2 < accounted <= cap
    assert accounted / 2 < held < accounted * 2
    # the newest session is cached: its next turn reuses its blocks
    tok = mt.tokenize_chat("s249", _agent_turns(249, 4)[-1])
    assert tok.previous_chain_len > 0 and tok.common_blocks == tok.previous_chain_len


def test_an_edited_tool_output_or_call_id_is_a_changed_history():
    mt = ModelTokenizer(MODEL)
    call: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls"}}],
    }
    turn: list[dict[str, Any]] = [
        *MESSAGES,
        call,
        {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"},
    ]
    mt.tokenize_chat("s1", turn)
    for edit in (
        {"role": "tool", "tool_call_id": "c1", "content": "a.py c.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "a.py b.py"},
        {"role": "tool", "content": "a.py b.py", "tool_call_id": "c1", "name": "ls"},
    ):
        edited = [*turn[:-1], edit, {"role": "user", "content": "go on"}]
        tok = mt.tokenize_chat("s1", edited)
        assert list(tok.chain) == _reference_chain(edited)[1]
        assert list(tok.token_ids) == _reference_chain(edited)[0]
