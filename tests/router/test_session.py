"""Session identity: explicit keys in priority order, else derived from the stable prefix."""

from __future__ import annotations

from router.session import SessionSource, identify_session

SYSTEM = {"role": "system", "content": "You are a coding agent."}
FIRST = {"role": "user", "content": "Fix the failing test."}


def test_generic_header_wins_over_framework_headers_and_user_field():
    headers = {"x-session-id": "a", "x-claude-code-session-id": "b", "session_id": "c"}
    key = identify_session(headers, {"user": "u"}, "m", [FIRST])
    assert (key.session_id, key.source) == ("a", SessionSource.HEADER)


def test_agent_framework_headers_are_recognised():
    for header in ("x-claude-code-session-id", "session-id", "session_id", "x-opencode-session"):
        key = identify_session({header: "s-1"}, {}, "m", [FIRST])
        assert key.session_id == "s-1" and key.explicit


def test_openai_user_field_then_claude_metadata():
    assert identify_session({}, {"user": "alice"}, "m", [FIRST]).source is SessionSource.USER
    legacy = {"metadata": {"user_id": "user_abc_account_1_session_5f0e"}}
    assert identify_session({}, legacy, "m", [FIRST]).session_id == "5f0e"
    new = {"metadata": {"user_id": '{"device_id":"d","session_id":"9a1b"}'}}
    assert identify_session({}, new, "m", [FIRST]).session_id == "9a1b"


def test_oversized_or_blank_header_is_ignored():
    key = identify_session({"x-session-id": " " * 3, "session-id": "x" * 1000}, {}, "m", [FIRST])
    assert key.source is SessionSource.DERIVED


def test_derived_session_is_stable_across_turns_of_one_conversation():
    turn1 = [SYSTEM, FIRST]
    turn2 = [*turn1, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "out"}]
    k1 = identify_session({}, {}, "m", turn1)
    k2 = identify_session({}, {}, "m", turn2)
    assert k1.source is SessionSource.DERIVED and not k1.explicit
    assert k1.session_id == k2.session_id


def test_derived_session_differs_by_first_turn_and_by_model():
    other = [SYSTEM, {"role": "user", "content": "Write docs."}]
    base = identify_session({}, {}, "m", [SYSTEM, FIRST]).session_id
    assert identify_session({}, {}, "m", other).session_id != base
    assert identify_session({}, {}, "m2", [SYSTEM, FIRST]).session_id != base


def test_completion_prompt_session_derives_from_its_chain():
    key = identify_session({}, {}, "m", None, chain=(11, 22, 33))
    assert key.source is SessionSource.DERIVED
    assert identify_session({}, {}, "m", None).source is SessionSource.NONE


def test_derived_session_cache_gives_the_same_ids():
    from router.session import DerivedSessionCache

    cache = DerivedSessionCache(capacity=2)
    for messages in ([SYSTEM, FIRST], [FIRST], [{"role": "user", "content": [{"type": "text"}]}]):
        assert cache.session_id("m", messages) == identify_session({}, {}, "m", messages).session_id
        assert cache.session_id("m", messages) == identify_session({}, {}, "m", messages).session_id


def test_a_claude_code_subagent_is_its_own_session_in_its_parents_program():
    main = identify_session({"x-claude-code-session-id": "s"}, {}, "m", [FIRST])
    assert (main.session_id, main.parent) == ("s", None)
    sub = {"x-claude-code-session-id": "s", "x-claude-code-agent-id": "a1"}
    key = identify_session(sub, {}, "m", [FIRST])
    assert (key.session_id, key.parent, key.source) == ("s/a1", "s", SessionSource.HEADER)
    nested = {**sub, "x-claude-code-agent-id": "a2", "x-claude-code-parent-agent-id": "a1"}
    assert identify_session(nested, {}, "m", [FIRST]).parent == "s/a1"


def test_a_parent_session_header_names_the_spawning_session():
    key = identify_session({"x-session-id": "c", "x-parent-session-id": "p"}, {}, "m", [FIRST])
    assert (key.session_id, key.parent) == ("c", "p")
    same = identify_session({"x-session-id": "c", "x-parent-session-id": "c"}, {}, "m", [FIRST])
    assert same.parent is None  # a session is not its own parent
    assert identify_session({"x-session-id": "c"}, {}, "m", [FIRST]).parent is None


def test_the_derived_session_cache_holds_digests_not_the_prefixes() -> None:
    """Many distinct conversations with long system prompts: the cache holds at most
    `capacity` entries, and none keeps its prompt alive (the heap it retains is ~0.2 KB an
    entry, not the 64 KB prompts)."""
    import gc
    import tracemalloc

    from router.session import DerivedSessionCache

    cache = DerivedSessionCache(capacity=64)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(500):
            messages = [
                {"role": "system", "content": f"agent {i} " + "x" * 65_536},
                {"role": "user", "content": f"task {i}"},
            ]
            sid = cache.session_id("m", messages)
            assert cache.session_id("m", messages) == sid  # the same prefix, the same id
            del messages
            assert len(cache) <= 64
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert retained < 64 * 1_024
