"""Chunked prompts: parsing, position-independent hashes, the 400s, the worker's layout."""

from __future__ import annotations

from typing import Any

import pytest

from ownerserve.chunks import (
    CHUNK_MARK,
    ChunkedPrompt,
    layout_params,
    locate_chunks,
    marked_texts,
    parse_layout,
    split_on_separator,
)
from ownerserve.errors import InvalidRequestError
from ownerserve.hashing import chain_root

ROOT = chain_root("m")
SEP = list(b"##")
BLANK = frozenset(b" \n\t")


def ids(text: str) -> list[int]:
    return list(text.encode())


def split(text: str, root: int = ROOT, max_len: int = 1000) -> ChunkedPrompt | None:
    return split_on_separator(ids(text), SEP, root, max_model_len=max_len, blank=BLANK)


def test_the_seed_format_splits_into_system_chunks_and_question() -> None:
    text = "sys##doc one##doc two##why?"
    cp = split(text)
    assert cp is not None
    t = ids(text)
    assert bytes(t[: cp.system_end]) == b"sys"
    assert [bytes(t[c.start : c.end]) for c in cp.chunks] == [b"doc one", b"doc two"]
    assert bytes(t[cp.question_start :]) == b"##why?"
    assert cp.chunk_tokens == len("doc one") + len("doc two")


def test_a_prompt_without_the_separator_is_not_chunked() -> None:
    assert split("plain prompt, no chunks") is None


def test_the_same_chunk_at_another_position_hashes_equal() -> None:
    a = split("sys##A doc##B doc##q1")
    b = split("sys##B doc##other##A doc##a longer question")
    assert a is not None and b is not None
    assert a.chunks[0].hash == b.chunks[2].hash  # "A doc" at positions 5 and 24
    assert a.chunks[1].hash == b.chunks[0].hash
    assert a.chunks[0].start != b.chunks[2].start
    assert len({c.hash for c in b.chunks}) == 3


def test_another_system_segment_or_model_changes_the_hash() -> None:
    a = split("sys##A doc##q")
    b = split("other sys##A doc##q")
    c = split("sys##A doc##q", root=chain_root("another-model"))
    assert a is not None and b is not None and c is not None
    assert a.chunks[0].hash != b.chunks[0].hash
    assert a.chunks[0].hash != c.chunks[0].hash
    assert a.system_hash != b.system_hash


def test_chunk_hashes_are_not_prefix_block_hashes() -> None:
    from ownerserve.hashing import hash_block

    cp = split("##A doc##q")
    assert cp is not None
    assert cp.chunks[0].hash != hash_block(ROOT, ids("A doc"))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("sys## only one separator", "unbalanced"),
        ("sys##A####q", "chunk 2 of the prompt is empty"),
        ("sys##A##  ##q", "chunk 2 of the prompt is empty"),
        ("sys##" + "x" * 50 + "##q", r"more than the model's length \(40\)"),
    ],
)
def test_malformed_chunked_prompts_are_400s(text: str, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says):
        split(text, max_len=40)


def test_too_many_chunks_is_a_400() -> None:
    with pytest.raises(InvalidRequestError, match="at most 2 chunks"):
        split_on_separator(ids("s##a##b##c##q"), SEP, ROOT, max_model_len=99, max_chunks=2)


def test_marked_chat_parts_and_messages_are_chunks_in_prompt_order() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "doc A", CHUNK_MARK: True},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "doc B", CHUNK_MARK: True},
                {"type": "text", "text": " and the question"},
            ],
        },
    ]
    texts = marked_texts(messages)
    assert texts == ["doc A", "doc B"]
    prompt = "<|system|>be brief<|end|>\n<|user|>doc A<|end|>\n<|user|>doc B and the question"
    cp = locate_chunks(ids(prompt), [ids(t) for t in texts], ROOT, max_model_len=99)
    assert [bytes(ids(prompt)[c.start : c.end]) for c in cp.chunks] == [b"doc A", b"doc B"]
    assert bytes(ids(prompt)[: cp.system_end]) == b"<|system|>be brief<|end|>\n<|user|>"
    # the same documents in the plain-text format under the same system segment hash the same
    other = locate_chunks(
        ids("<|system|>be brief<|end|>\n<|user|>doc B, then doc A"),
        [ids("doc B"), ids("doc A")],
        ROOT,
        max_model_len=99,
    )
    assert {c.hash for c in other.chunks} == {c.hash for c in cp.chunks}


def test_a_marked_chunk_that_is_empty_missing_or_badly_marked_is_a_400() -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        locate_chunks(ids("abc"), [ids("")], ROOT, max_model_len=9)
    with pytest.raises(InvalidRequestError, match="does not appear"):
        locate_chunks(ids("abc"), [ids("zz")], ROOT, max_model_len=9)
    with pytest.raises(InvalidRequestError, match="must be a boolean"):
        marked_texts([{"role": "user", "content": "x", CHUNK_MARK: "yes"}])


def test_the_layout_round_trips_and_a_bad_one_is_a_400() -> None:
    cp = split("sys##A doc##B doc##q")
    assert cp is not None
    assert parse_layout(layout_params(cp), len(ids("sys##A doc##B doc##q"))) == cp.chunks
    assert parse_layout(None, 5) == ()
    with pytest.raises(InvalidRequestError):
        parse_layout(layout_params(cp), 8)  # spans past the prompt
    with pytest.raises(InvalidRequestError):
        parse_layout({"chunks": [{"hash": "zz", "start": 0, "end": 1}]}, 8)


def test_a_chunk_prefill_is_the_system_then_the_load_span_saved_from_the_system_block_on() -> None:
    from ownerserve.chunks import chunk_prefills, load_spans

    text = "system prompt##A doc##B doc##q"
    cp = split(text)
    assert cp is not None
    toks = ids(text)
    spans = load_spans(toks, cp.system_end, cp.chunks)
    # a span is the separator leading into the chunk, then the chunk
    assert [(s.start, s.end) for s in spans] == [
        (cp.system_end, cp.chunks[0].end),
        (cp.chunks[0].end, cp.chunks[1].end),
    ]
    prefills = chunk_prefills(toks, cp, 4)
    for p, s in zip(prefills, spans, strict=True):
        assert p.prompt == tuple(toks[: cp.system_end]) + tuple(toks[s.start : s.end])
        save = p.params["chunk_save"]
        assert save == {
            "key": f"{s.key:016x}",
            "start": cp.system_end // 4 * 4,
            "end": len(p.prompt),
            "position": cp.system_end,
        }


def test_a_load_span_key_depends_on_its_content_and_lead_in_never_its_position() -> None:
    from ownerserve.chunks import load_spans

    one = split("system prompt##A doc##B doc##q")
    two = split("system prompt##B doc##A doc##q")
    assert one is not None and two is not None
    k1 = {
        s.key for s in load_spans(ids("system prompt##A doc##B doc##q"), one.system_end, one.chunks)
    }
    k2 = {
        s.key for s in load_spans(ids("system prompt##B doc##A doc##q"), two.system_end, two.chunks)
    }
    assert k1 == k2 and len(k1) == 2
    assert not k1 & {c.hash for c in one.chunks}  # the lead-in joins the key
