"""The backend registry and what each backend answers at each moment: P/D bodies and their
order, where a worker's KV API is, and how the router subscribes to its KV events."""

from __future__ import annotations

from typing import Any

import pytest

from ownerserve.config import WorkerSettings
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.errors import UpstreamError
from ownerserve.types import BackendKind
from router.backends import BACKENDS, PDHandoff, WorkerAddress, backend_for
from router.backends.vllm import REMOTE_DECODE_PARAMS

BODY: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def address(**kw: Any) -> WorkerAddress:
    return WorkerAddress("p0", "http://10.0.0.5:8000", **kw)


def test_every_backend_kind_has_a_backend_of_that_kind() -> None:
    assert set(BACKENDS) == set(BackendKind)
    for kind in BackendKind:
        assert backend_for(kind).kind is kind


@pytest.mark.parametrize("kind", [BackendKind.VLLM, BackendKind.EMULATOR])
def test_vllm_protocol_builds_the_decode_body_from_the_prefills_answer(kind: BackendKind) -> None:
    backend = backend_for(kind)
    assert backend.pd_handoff is PDHandoff.AFTER_PREFILL
    p_body = backend.prefill_body(BODY, address())
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"] == REMOTE_DECODE_PARAMS
    params = {"remote_engine_id": "e", "remote_block_ids": [[3]]}
    d_body = backend.decode_body(BODY, p_body, {"kv_transfer_params": params})
    assert d_body == dict(BODY, kv_transfer_params=params)
    answers: list[Any] = [{"choices": []}, None, [1]]  # no params, no answer, not an object
    for answer in answers:
        with pytest.raises(UpstreamError):
            backend.decode_body(BODY, p_body, answer)


def test_sglang_sends_both_sides_the_same_new_bootstrap_room() -> None:
    backend = backend_for(BackendKind.SGLANG)
    assert backend.pd_handoff is PDHandoff.RENDEZVOUS
    prefill = address(bootstrap_port=8998)
    p_body = backend.prefill_body(BODY, prefill)
    d_body = backend.decode_body(BODY, p_body, None)
    assert p_body["stream"] is False and "stream_options" not in p_body
    assert d_body["stream"] is True and d_body["stream_options"] == BODY["stream_options"]
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        assert p_body[name] == d_body[name]
    assert (d_body["bootstrap_host"], d_body["bootstrap_port"]) == ("10.0.0.5", 8998)
    assert 0 <= d_body["bootstrap_room"] < 2**63
    assert backend.prefill_body(BODY, prefill)["bootstrap_room"] != p_body["bootstrap_room"]
    assert "bootstrap_room" not in BODY  # the client's body is left alone


def test_sglang_prefill_without_a_bootstrap_port_is_refused() -> None:
    with pytest.raises(ValueError, match="bootstrap_port"):
        backend_for(BackendKind.SGLANG).prefill_body(BODY, address())


def test_the_kv_api_is_the_sidecar_and_for_the_emulator_else_the_engine() -> None:
    bare = {kind: backend_for(kind).kv_api_url(address()) for kind in BackendKind}
    assert bare == {
        BackendKind.VLLM: None,
        BackendKind.SGLANG: None,
        BackendKind.EMULATOR: "http://10.0.0.5:8000",
    }
    for kind in BackendKind:
        with_sidecar = address(sidecar_url="http://10.0.0.5:8200")
        assert backend_for(kind).kv_api_url(with_sidecar) == "http://10.0.0.5:8200"


@pytest.mark.parametrize(
    ("kind", "endpoint", "binds"),
    [
        # vLLM connects to a host:port endpoint (the subscriber binds) and binds the others
        (BackendKind.VLLM, "tcp://127.0.0.1:5557", True),
        (BackendKind.VLLM, "tcp://*:5557", False),
        (BackendKind.VLLM, "ipc:///tmp/kv", False),
        # the emulated engine (and SGLang) bind their own endpoint
        (BackendKind.EMULATOR, "tcp://127.0.0.1:5557", False),
        (BackendKind.SGLANG, "tcp://127.0.0.1:5557", False),
    ],
)
def test_kv_event_subscriber_binds_only_where_the_publisher_connects(
    kind: BackendKind, endpoint: str, binds: bool
) -> None:
    settings = WorkerSettings(
        id="w0",
        url="http://127.0.0.1:8000",
        kind=kind,
        kv_events_endpoint=endpoint,
        kv_events_replay_endpoint="tcp://127.0.0.1:5558",
    )
    sub = backend_for(kind).kv_event_subscriber(settings, InMemoryDirectory())
    assert sub is not None
    assert (sub.worker, sub.endpoint, sub.bind) == ("w0", endpoint, binds)
    assert sub.replay_endpoint == "tcp://127.0.0.1:5558"


@pytest.mark.parametrize("kind", list(BackendKind))
def test_a_worker_without_a_kv_events_endpoint_gets_no_subscriber(kind: BackendKind) -> None:
    settings = WorkerSettings(id="w0", url="http://127.0.0.1:8000", kind=kind)
    assert backend_for(kind).kv_event_subscriber(settings, InMemoryDirectory()) is None
