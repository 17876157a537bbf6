"""Property-based fuzzing of every route of the router over real HTTP, bounded for the suite
(the long run is `python -m bench.fuzz --cases 10000`, recorded in bench/RESULTS.md): bodies of
every route, valid or with fields type-mutated anywhere, and byte-level HTTP abuse, sent to a
router in front of emulated workers that are real processes (`bench.fuzz.strategies.WORKERS`:
a P/D pair of each protocol and a hybrid). Every case must get no 5xx, a 4xx in its route's
error shape, a stream that ends as it should, within a bound, with nothing logged at ERROR;
afterwards the router still serves, `/health` is ok and nothing is left held. Derandomized, so
a failure reproduces (Hypothesis prints the case).

The explicit tests below are the bugs the long run found, each pinned on its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from bench.fuzz.harness import Fuzzer, FuzzTarget, parse_responses
from bench.fuzz.strategies import ANTHROPIC, OPENAI, Case, Token, body_cases, encode, raw_cases
from loadgen.cluster import MODEL
from tests.e2e.router_cluster import outstanding
from tests.waiting import until

pytestmark = pytest.mark.slow

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.filter_too_much,
    ],
)
"""What both fuzz tests run under, besides their number of cases."""


@pytest.fixture(scope="module")
def fuzzer() -> Iterator[Fuzzer]:
    with FuzzTarget() as target:
        f = Fuzzer(target)
        yield f
        f.close()


def assert_router_still_serves(fuzzer: Fuzzer) -> None:
    """A normal request is served, `/health` is ok, and within a bound every lease is given
    back and no worker runs a request."""
    assert not fuzzer.after_problems()
    router = fuzzer.target.router
    assert router is not None
    left: list[str] = []

    async def nothing_left() -> bool:
        left[:] = fuzzer.target.call(lambda: outstanding(router)) + await fuzzer.busy_workers()
        return not left

    try:
        fuzzer.loop.run_until_complete(until(nothing_left, what="requests to give back all"))
    except AssertionError:
        raise AssertionError(f"left held after the cases: {left}") from None


def test_every_routes_bodies_get_no_5xx_and_4xx_in_the_routes_error_shape(fuzzer: Fuzzer) -> None:
    @settings(FUZZ, max_examples=160)
    @given(body_cases())
    def one(case: Case) -> None:
        outcome = fuzzer.run(case)
        assert not outcome.problems, outcome.report()

    one()
    assert_router_still_serves(fuzzer)


def test_byte_level_http_abuse_gets_no_5xx_and_no_hang(fuzzer: Fuzzer) -> None:
    @settings(FUZZ, max_examples=120)
    @given(raw_cases())
    def one(case: Case) -> None:
        outcome = fuzzer.run(case)
        assert not outcome.problems, outcome.report()

    one()
    assert_router_still_serves(fuzzer)


# --- what the long run found ----------------------------------------------------------------------


def _nested(depth: int) -> Token:
    return Token("[" * depth + '"x"' + "]" * depth)


@pytest.mark.parametrize("depth", [230, 254, 600])
@pytest.mark.parametrize(
    ("route", "path", "shape", "body"),
    [
        # each nests where the router writes the body again: a message as its cache key,
        # Anthropic's tool input as arguments, a Responses item as a chat message, a body
        # without its control-plane fields
        (
            "chat",
            "/v1/chat/completions",
            OPENAI,
            lambda d: {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi", "x": _nested(d)}],
            },
        ),
        (
            "messages",
            "/v1/messages",
            ANTHROPIC,
            lambda d: {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t", "name": "f", "input": {"a": _nested(d)}}
                        ],
                    }
                ],
            },
        ),
        (
            "responses",
            "/v1/responses",
            OPENAI,
            lambda d: {
                "model": MODEL,
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_text", "text": "hi", "x": _nested(d)}],
                    }
                ],
            },
        ),
        (
            "completions",
            "/v1/completions",
            OPENAI,
            lambda d: {"model": MODEL, "prompt": "hi", "kv_transfer_params": {}, "x": _nested(d)},
        ),
    ],
)
def test_a_body_nested_past_the_depth_limit_is_a_400_in_the_routes_shape(
    fuzzer: Fuzzer, depth: int, route: str, path: str, shape: str, body: object
) -> None:
    # each used to be a 500: the parser reads 1024 levels, orjson writes 254, and the router
    # writes these bodies again
    assert callable(body)
    outcome = fuzzer.run(Case(route, "POST", path, body=encode(body(depth)), shape=shape))
    assert outcome.statuses == [400], outcome.report()
    assert not outcome.problems, outcome.report()


@pytest.mark.parametrize("path", ["/health", "/v1/chat/completions", "/nope"])
def test_a_head_request_is_answered_without_content_and_the_connection_goes_on(
    fuzzer: Fuzzer, path: str
) -> None:
    # content after a HEAD answer's headers used to be sent, which a client takes for the
    # start of the next response on the connection
    raw = f"HEAD {path} HTTP/1.1\r\nHost: fuzz\r\n\r\n".encode()
    outcome = fuzzer.run(Case("raw", raw=raw, shape=None))
    assert not outcome.problems, outcome.report()
    assert outcome.statuses[-1] == 200  # the request after it, on the same connection
    assert len(outcome.statuses) == 2


def test_the_raw_answers_parser_keeps_a_head_answer_bodiless() -> None:
    data = (
        b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 5\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    )
    got = parse_responses(data, head_first=True)
    assert [(r.status, r.body) for r in got] == [(405, b""), (200, b"ok")]
    with pytest.raises(ValueError):
        parse_responses(
            b"HTTP/1.1 405 X\r\ncontent-length: 5\r\n\r\nabcdeHTTP/1.1 200 OK\r\n", True
        )
