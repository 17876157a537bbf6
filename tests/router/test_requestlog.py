"""`router.requestlog` without servers: the request id a client's header becomes, the logfmt
line's quoting (it parses back to what was logged) and its one emission."""

from __future__ import annotations

import logging

import pytest

from router.requestlog import (
    MAX_REQUEST_ID_CHARS,
    MAX_VALUE_CHARS,
    REQUEST_LOGGER,
    RequestLog,
    logfmt_value,
    parse_logfmt,
    request_id,
)


def test_a_clients_request_id_keeps_only_safe_characters_and_is_bounded() -> None:
    assert request_id("abc-123_x.y:z") == "abc-123_x.y:z"
    assert request_id('a b"c\r\n<d>') == "abcd"
    assert request_id("x" * 10_000) == "x" * MAX_REQUEST_ID_CHARS


@pytest.mark.parametrize("given", [None, "", ' "<>\t'])
def test_without_a_usable_request_id_a_new_one_is_made(given: str | None) -> None:
    made = request_id(given)
    assert len(made) == 32 and int(made, 16) >= 0
    assert made != request_id(given)


def test_values_with_spaces_quotes_or_equals_are_quoted_and_parse_back() -> None:
    record = RequestLog("r1")
    record.model = "m"
    record.session = 'a b="c"\\ \n'
    record.failed(429, RuntimeError("x"), started=False)
    text = record.line(0.25)
    assert "\n" not in text
    assert parse_logfmt(text) == {
        "rid": "r1",
        "model": "m",
        "session": 'a b="c"\\ \n',
        "e2e_s": "0.2500",
        "status": "429",
        "outcome": "refused",
        "error": "internal_error",
    }
    assert logfmt_value("plain-value") == "plain-value"
    assert logfmt_value("") == '""'
    assert len(logfmt_value("y" * 1000)) == MAX_VALUE_CHARS


def test_a_cancelled_request_that_got_no_answer_shows_499() -> None:
    record = RequestLog("r2")
    record.cancelled(started=False)
    fields = parse_logfmt(record.line(1.0))
    assert (fields["status"], fields["outcome"]) == ("499", "cancelled")


def test_emit_writes_the_line_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    record = RequestLog("r3")
    record.answered(200, True)
    record.emit(0.1)
    record.emit(0.2)
    got = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOGGER]
    assert got == ["rid=r3 e2e_s=0.1000 status=200 outcome=ok"]


def test_with_its_logger_above_info_nothing_is_built_or_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=REQUEST_LOGGER)
    record = RequestLog("r4")
    record.emit(0.1)
    assert not [r for r in caplog.records if r.name == REQUEST_LOGGER]
