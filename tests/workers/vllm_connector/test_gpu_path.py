"""The connector's device path (`CudaPagedKV`) with plain tensors shaped like vLLM's CUDA caches:
per-head payloads saved by a TP=2 producer load bit-exactly into TP=1 and TP=4 consumers through
a real artifact store, MLA round trips, the CPU path and the device path write the same bytes,
one kernel launch per save and per load, and the stream order that lets the engine go on.

Every test runs on CUDA (skipped without a GPU); most also run on CPU tensors, where the same
class takes the kernels' reference path."""

from __future__ import annotations

import gc
import http.server
import threading
from collections.abc import Callable, Iterator
from typing import ClassVar

import pytest
import torch
import xxhash

from kernels import LayoutError
from ownerserve.kvstate.heads import heads_for_rank, store_heads_for_rank
from workers.sidecar.store import ArtifactStore
from workers.vllm_connector.client import CHECKSUM_HEADER, ArtifactRejected, SidecarClient
from workers.vllm_connector.gpu import CudaPagedKV, paged_from_vllm
from workers.vllm_connector.payload import (
    CpuAttnKV,
    calibrate_page_order,
    payload_of,
    scatter_payloads,
)
from workers.vllm_connector.plan import block_keys

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
LAYOUTS = ["flashattn", "flashinfer"]

LAYERS, BLOCKS, BS, HEADS, DIM, LATENT = 3, 10, 16, 8, 32, 72
MODEL = "m"
SRC_IDS = [7, 2, 9, 0]
DST_IDS = [1, 8, 3, 5]
HASHES = [0x1000 + i for i in range(len(SRC_IDS))]


def random_kv(device: str, heads: int = HEADS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major K and V `[layers, blocks, block_size, heads, dim]`, bf16."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, BLOCKS, BS, heads, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(LAYERS, BLOCKS, BS, heads, DIM, generator=g).to(torch.bfloat16)
    return k.to(device), v.to(device)


def vllm_layers(k: torch.Tensor, v: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """Per-layer caches as vLLM's CUDA backends allocate them (contiguous)."""
    axis = 0 if layout == "flashattn" else 1
    return [torch.stack((k[layer], v[layer]), dim=axis).contiguous() for layer in range(LAYERS)]


def cuda_flashattn_kv() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], CudaPagedKV]:
    """`random_kv` on CUDA, vLLM's flash-attention caches holding it, and `make_kv` of them:
    (k, v, layers, kv)."""
    k, v = random_kv("cuda")
    layers = vllm_layers(k, v, "flashattn")
    return k, v, layers, make_kv(layers)


def nan_layers(device: str, heads: int, layout: str) -> list[torch.Tensor]:
    shape = (2, BLOCKS, BS, heads, DIM) if layout == "flashattn" else (BLOCKS, 2, BS, heads, DIM)
    return [
        torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device) for _ in range(LAYERS)
    ]


def kv_of(layers: list[torch.Tensor], layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[layers, blocks, block_size, heads, dim]` read back out of vLLM layer caches."""
    axis = 0 if layout == "flashattn" else 1
    k = torch.stack([t.select(axis, 0) for t in layers])
    v = torch.stack([t.select(axis, 1) for t in layers])
    return k, v


def make_kv(layers: list[torch.Tensor], **kw: int) -> CudaPagedKV:
    # Small chunks and two copy threads, so a load is assembled in several pipelined chunks.
    probe = paged_from_vllm(layers, mla=layers[0].dim() == 3)
    g = probe.geometry
    unit = g.num_layers * g.kv_factor * g.block_size * g.head_dim * 2
    return CudaPagedKV(
        layers,
        mla=layers[0].dim() == 3,
        chunk_bytes=kw.get("chunk_bytes", 3 * unit),
        copy_threads=kw.get("copy_threads", 2),
        max_pinned_bytes=kw.get("max_pinned_bytes", 1 << 30),
    )


@pytest.fixture
def store() -> ArtifactStore:
    return ArtifactStore(memory_capacity_bytes=1 << 30, pin_memory=False)


def save(kv: CudaPagedKV, store: ArtifactStore, total: int, tp: int, rank: int) -> None:
    """What the save thread does: gather, then PUT every stored head's payload."""
    staged = kv.gather(SRC_IDS)
    local = heads_for_rank(total, tp, rank)
    heads = store_heads_for_rank(total, tp, rank)
    for i, chunk in enumerate(HASHES):
        for head, key in zip(heads, block_keys(MODEL, chunk, heads), strict=True):
            store.put(key, bytes(payload_of(staged, local.index(head), i)))


def load(kv: CudaPagedKV, store: ArtifactStore, heads: tuple[int, ...]) -> None:
    """What the load thread does: GET this rank's heads of every block, then scatter."""
    payloads = [[store.get(k) for k in block_keys(MODEL, c, heads)] for c in HASHES]
    scatter_payloads(payloads, kv, DST_IDS)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_tp2_saves_load_bit_exactly_into_tp1_and_tp4(
    device: str, layout: str, store: ArtifactStore
) -> None:
    k, v = random_kv(device)
    for rank in range(2):
        heads = heads_for_rank(HEADS, 2, rank)
        part = slice(heads[0], heads[-1] + 1)
        producer = make_kv(vllm_layers(k[..., part, :], v[..., part, :], layout))
        assert producer.num_kv_heads == len(heads) == 4
        save(producer, store, HEADS, 2, rank)
    assert len(store.keys()) == HEADS * len(SRC_IDS)
    for tp in (1, 4):
        for rank in range(tp):
            heads = heads_for_rank(HEADS, tp, rank)
            part = slice(heads[0], heads[-1] + 1)
            layers = nan_layers(device, len(heads), layout)
            load(make_kv(layers), store, heads)
            got_k, got_v = kv_of(layers, layout)
            assert torch.equal(got_k[:, DST_IDS], k[:, SRC_IDS, :, part])
            assert torch.equal(got_v[:, DST_IDS], v[:, SRC_IDS, :, part])
            others = [b for b in range(BLOCKS) if b not in DST_IDS]
            assert torch.isnan(got_k[:, others]).all() and torch.isnan(got_v[:, others]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_mla_latents_round_trip_as_one_head(device: str, store: ArtifactStore) -> None:
    g = torch.Generator().manual_seed(1)
    src = [
        torch.randn(BLOCKS, BS, LATENT, generator=g).to(torch.bfloat16).to(device)
        for _ in range(LAYERS)
    ]
    kv = make_kv(src)
    assert (kv.num_kv_heads, kv.kv_factor, kv.head_size) == (1, 1, LATENT)
    assert kv.payload_nbytes == LAYERS * BS * LATENT * 2
    save(kv, store, 1, 2, 0)  # TP=2: rank 0 stores the one head, rank 1 (a replica) nothing
    staged = kv.gather(SRC_IDS)
    assert bytes(payload_of(staged, 0, 1)) == src_unit(src, SRC_IDS[1])
    dst = [torch.full_like(t, float("nan")) for t in src]
    load(make_kv(dst), store, (0,))
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(b[DST_IDS], a[SRC_IDS])


def src_unit(layers: list[torch.Tensor], block: int) -> bytes:
    """An MLA payload by hand: `[layers, 1, block_size, latent]` of one block."""
    unit = torch.stack([t[block] for t in layers]).contiguous().cpu()
    return unit.view(torch.uint8).numpy().tobytes()


def vec_pages(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """vLLM CPU attention layers `[blocks, heads, block_size, 2 * dim]` written the AVX-512 way:
    per (block, head) page, K transposed `[dim, block_size]`, then V `[block_size, dim]`."""
    layers = []
    for layer in range(LAYERS):
        kt = k[layer].permute(0, 2, 3, 1).reshape(BLOCKS, HEADS, -1)  # [b, h, dim * bs]
        vt = v[layer].permute(0, 2, 1, 3).reshape(BLOCKS, HEADS, -1)  # [b, h, bs * dim]
        layers.append(torch.cat((kt, vt), dim=-1).view(BLOCKS, HEADS, BS, 2 * DIM).contiguous())
    return layers


def vec_probe(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.cat((key[:, 0].t().reshape(-1), value[:, 0].reshape(-1))).view(1, 1, BS, -1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_the_cpu_path_and_the_device_path_write_the_same_payload_bytes(
    device: str, layout: str
) -> None:
    k, v = random_kv("cpu", seed=3)
    order = calibrate_page_order(vec_probe, BS, DIM, torch.bfloat16)
    assert not order.is_token_major  # the CPU side really converts from the ISA's order
    cpu = CpuAttnKV(vec_pages(k, v), order)
    dev = make_kv(vllm_layers(k.to(device), v.to(device), layout))
    assert cpu.payload_nbytes == dev.payload_nbytes
    a, b = cpu.gather(SRC_IDS), dev.gather(SRC_IDS)
    for i in range(len(SRC_IDS)):
        for j in range(HEADS):
            assert payload_of(a, j, i) == bytes(payload_of(b, j, i))
    # and the other way: device-saved payloads load into the CPU layout exactly
    target = CpuAttnKV([torch.zeros_like(t) for t in vec_pages(k, v)], order)
    rows = [[payload_of(b, j, i) for j in range(HEADS)] for i in range(len(SRC_IDS))]
    scatter_payloads(rows, target, DST_IDS)
    assert torch.equal(target.gather(DST_IDS), cpu.gather(SRC_IDS))


@pytest.mark.parametrize("device", DEVICES)
def test_a_wrong_size_payload_is_refused_and_nothing_is_written(device: str) -> None:
    layers = nan_layers(device, 2, "flashattn")
    kv = make_kv(layers)
    good = bytes(kv.payload_nbytes)
    with pytest.raises(LayoutError):
        kv.scatter_payloads([[good, good], [good, good[:-2]]], [0, 1])
    with pytest.raises(LayoutError):
        kv.scatter_payloads([[good, good]], [0, 1])
    with pytest.raises(LayoutError):
        kv.scatter_payloads([[good, good], [good, good]], [4, 4])  # one block written twice
    with pytest.raises(LayoutError):
        kv.gather([BLOCKS])
    assert all(torch.isnan(t).all() for t in layers)


def test_the_kv_axis_is_read_off_the_shape_or_refused_when_ambiguous() -> None:
    fa = [torch.zeros(2, 5, BS, 2, DIM)]
    fi = [torch.zeros(5, 2, BS, 2, DIM)]
    assert paged_from_vllm(fa).views[1].data_ptr() - fa[0].data_ptr() == 5 * BS * 2 * DIM * 4
    assert paged_from_vllm(fi).views[1].data_ptr() - fi[0].data_ptr() == BS * 2 * DIM * 4
    with pytest.raises(LayoutError):
        paged_from_vllm([torch.zeros(2, 2, BS, 2, DIM)])
    assert paged_from_vllm([torch.zeros(2, 2, BS, 2, DIM)], kv_dim=1).geometry.num_blocks == 2


class _Sink(http.server.BaseHTTPRequestHandler):
    """PUTs are kept in `received`; GET /…/artifacts/{key} answers `served[key]` with the
    checksum of `checksummed[key]` (the same bytes unless a test corrupts one)."""

    protocol_version = "HTTP/1.1"
    received: ClassVar[list[bytes]] = []
    served: ClassVar[dict[str, bytes]] = {}
    checksummed: ClassVar[dict[str, bytes]] = {}

    def do_PUT(self) -> None:
        n = int(self.headers["content-length"])
        _Sink.received.append(self.rfile.read(n))
        self.send_response(201)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        key = self.path.rsplit("/", 1)[-1]
        data = _Sink.served.get(key)
        if data is None:
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.send_header(CHECKSUM_HEADER, xxhash.xxh3_128_hexdigest(_Sink.checksummed[key]))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def sink() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_staged_payload_view_is_sent_whole_without_a_copy(sink: str) -> None:
    k, v = random_kv("cpu")
    staged = make_kv(vllm_layers(k[..., :2, :], v[..., :2, :], "flashattn")).gather([3])
    view = payload_of(staged, 1, 0)
    assert isinstance(view, memoryview) and view.readonly
    _Sink.received.clear()
    SidecarClient(sink).put("key", view, 2)
    assert _Sink.received == [bytes(view)]


@pytest.mark.parametrize("device", DEVICES)
def test_payloads_read_straight_into_pinned_slots_load_exactly(sink: str, device: str) -> None:
    k, v = random_kv(device)
    src = make_kv(vllm_layers(k[..., :2, :], v[..., :2, :], "flashattn"))
    staged = src.gather(SRC_IDS)
    _Sink.served.clear()
    _Sink.checksummed.clear()
    for i in range(len(SRC_IDS)):
        for j in range(2):
            data = bytes(payload_of(staged, j, i))
            _Sink.served[f"k{i}-{j}"] = _Sink.checksummed[f"k{i}-{j}"] = data
    layers = nan_layers(device, 2, "flashattn")
    dst = make_kv(layers)
    staging = dst.load_staging(len(DST_IDS))
    client = SidecarClient(sink)
    for i in range(len(DST_IDS)):
        for j in range(2):
            client.get_into(f"k{i}-{j}", staging.slot(i, j))
    # a load whose last block was refused scatters the good prefix only
    dst.scatter_staged(staging, DST_IDS[:3])
    got_k, got_v = kv_of(layers, "flashattn")
    assert torch.equal(got_k[:, DST_IDS[:3]], k[:, SRC_IDS[:3], :, :2])
    assert torch.equal(got_v[:, DST_IDS[:3]], v[:, SRC_IDS[:3], :, :2])
    assert torch.isnan(got_k[:, DST_IDS[3]]).all()
    with pytest.raises(LayoutError):
        dst.scatter_staged(staging, [*DST_IDS, 6])


def test_get_into_refuses_a_missing_a_resized_or_a_corrupted_artifact(sink: str) -> None:
    _Sink.served.clear()
    _Sink.checksummed.clear()
    _Sink.served["ok"] = _Sink.checksummed["ok"] = b"x" * 64
    _Sink.served["short"] = _Sink.checksummed["short"] = b"x" * 63
    _Sink.served["bad"], _Sink.checksummed["bad"] = b"y" * 64, b"x" * 64
    client = SidecarClient(sink)
    out = memoryview(bytearray(64))
    client.get_into("ok", out)
    assert bytes(out) == b"x" * 64
    for key in ("missing", "short", "bad"):
        with pytest.raises(ArtifactRejected):
            client.get_into(key, out)
    client.get_into("ok", out)  # the connection is still usable after refusals


# ----- CUDA only: launches, stream order, pinned memory ------------------------------------


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from kernels.triton import ops

    calls: list[int] = []
    real: Callable[..., None] = ops._launch

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(ops, "_launch", counting)
    return calls


@pytest.mark.gpu
@needs_cuda
def test_a_save_and_a_load_are_one_kernel_launch_each_over_all_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    k, v, layers, kv = cuda_flashattn_kv()
    calls = _count_launches(monkeypatch)
    staged = kv.gather(SRC_IDS)
    assert len(calls) == 1
    rows = [[bytes(payload_of(staged, j, i)) for j in range(HEADS)] for i in range(len(SRC_IDS))]
    kv.scatter_payloads(rows, DST_IDS)
    assert len(calls) == 2
    after_k, after_v = kv_of(layers, "flashattn")
    assert torch.equal(after_k[:, DST_IDS], k[:, SRC_IDS])
    assert torch.equal(after_v[:, DST_IDS], v[:, SRC_IDS])


@pytest.mark.gpu
@needs_cuda
def test_a_save_sees_the_steps_writes_and_the_engine_may_reuse_the_blocks_at_once() -> None:
    _, _, layers, kv = cuda_flashattn_kv()
    fresh = torch.randn(LAYERS, 2, len(SRC_IDS), BS, HEADS, DIM, device="cuda").bfloat16()
    # The engine's stream is still busy when it writes the step's KV and calls the save...
    torch.cuda._sleep(200_000_000)
    for layer, t in enumerate(layers):
        t[:, SRC_IDS] = fresh[layer]
    staged = kv.gather(SRC_IDS)
    # ... and overwrites the blocks right after it: the save holds what the step wrote.
    for t in layers:
        t[:, SRC_IDS] = 0
    for i in range(len(SRC_IDS)):
        for j in range(HEADS):
            expect = fresh[:, :, i, :, j].contiguous().cpu().view(torch.uint8).numpy().tobytes()
            assert bytes(payload_of(staged, j, i)) == expect


@pytest.mark.gpu
@needs_cuda
def test_pinned_staging_is_bounded_and_released_with_the_last_payload_view() -> None:
    _, _, layers, kv = cuda_flashattn_kv()
    nbytes = len(SRC_IDS) * HEADS * kv.payload_nbytes
    staged = kv.gather(SRC_IDS)
    view = payload_of(staged, 0, 0)
    assert kv.pinned_bytes == nbytes
    del staged
    gc.collect()
    assert kv.pinned_bytes == nbytes  # a payload view still uses the buffer
    del view
    gc.collect()
    assert kv.pinned_bytes == 0
    # over budget: ordinary memory, the same bytes
    small = make_kv(layers, max_pinned_bytes=nbytes - 1)
    a, b = small.gather(SRC_IDS), make_kv(layers).gather(SRC_IDS)
    assert small.pinned_bytes == 0
    assert bytes(payload_of(a, 3, 2)) == bytes(payload_of(b, 3, 2))
