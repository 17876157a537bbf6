"""Hardware timing profiles: how long prefill, a decode step and a KV transfer take on a worker.

One YAML file per profile in `configs/profiles/`. The same formulas drive the emulated engine's
sleeps, the planner's cost model and the cluster simulator, so they agree by construction:

    prefill_s(new, cached) = base_s + per_token_s·new + per_token_ctx_s·new·(cached + new/2)
    decode_step_s(batch, ctx) = base_s + per_seq_s·batch + per_ctx_token_s·ctx
    transfer_s(bytes, path) = latency_s(path) + bytes / bps(path)
    path = kv_transport_into(same_node, dst same_host, dst transport)   (KVTransport)
    rerotate_s(tokens) = rerotate_per_token_s·tokens   (a reused chunk's KV copied into the
                         request's blocks with K re-rotated to its new position)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from ownerserve.errors import ConfigError
from ownerserve.types import KVTransport

PROFILES_DIR = Path(__file__).resolve().parent.parent / "configs" / "profiles"


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    base_s: float
    per_token_s: float
    per_token_ctx_s: float

    def seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """Time to compute `new_tokens` on top of `cached_tokens` of reused prefix."""
        if new_tokens <= 0:
            return 0.0
        ctx = cached_tokens + new_tokens / 2.0
        return self.base_s + self.per_token_s * new_tokens + self.per_token_ctx_s * new_tokens * ctx


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    base_s: float
    per_seq_s: float
    per_ctx_token_s: float

    def step_seconds(self, batch: int, total_context: int) -> float:
        """One decode step for `batch` sequences holding `total_context` tokens in all."""
        if batch <= 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_ctx_token_s * total_context


@dataclass(frozen=True, slots=True)
class TransportTiming:
    """One data path's price: `seconds(bytes) = latency_s + bytes / bps` (0 for nothing)."""

    bps: float
    latency_s: float

    def seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bps


@dataclass(frozen=True, slots=True)
class LinkTiming:
    """Bandwidths in bytes per second. `intra_node_bps`, `inter_node_bps` and `latency_s` are
    the defaults of the KV transports a profile does not name in `kv_transports:`: same_host
    = (intra_node_bps, latency_s), store_rdma and store_tcp = (inter_node_bps, latency_s)."""

    intra_node_bps: float
    inter_node_bps: float
    latency_s: float
    cpu_load_bps: float
    """Host memory -> HBM (PCIe; H100 Gen5 x16 ~50 GB/s effective): CPU-tier KV loads."""
    ssd_load_bps: float
    same_host: TransportTiming | None = None
    store_tcp: TransportTiming | None = None
    store_rdma: TransportTiming | None = None

    def path(self, transport: KVTransport) -> TransportTiming:
        """The price of a KV transport: the profile's `kv_transports:` entry, else its default
        from the link fields (class docstring)."""
        if transport is KVTransport.SAME_HOST:
            named, bps = self.same_host, self.intra_node_bps
        elif transport is KVTransport.STORE_TCP:
            named, bps = self.store_tcp, self.inter_node_bps
        else:
            named, bps = self.store_rdma, self.inter_node_bps
        return named if named is not None else TransportTiming(bps, self.latency_s)

    def with_path(self, transport: KVTransport, timing: TransportTiming) -> LinkTiming:
        """This link with `transport` priced at `timing`."""
        if transport is KVTransport.SAME_HOST:
            return replace(self, same_host=timing)
        if transport is KVTransport.STORE_TCP:
            return replace(self, store_tcp=timing)
        return replace(self, store_rdma=timing)

    def transfer_s(self, nbytes: float, transport: KVTransport) -> float:
        """latency_s(path) + bytes / bps(path); 0 for nothing."""
        return self.path(transport).seconds(nbytes)


def kv_transport_into(same_node: bool, same_host: bool, transport: KVTransport) -> KVTransport:
    """The data path KV takes into a worker from a peer (or a tier) on `same_node` or not: the
    same-host path when both sit on one node and the worker takes KV through host memory
    (`same_host`), else the store transport its KV client speaks (`transport`, store_tcp or
    store_rdma). Priced by the destination's view, so every source on a node costs the same."""
    if same_node and same_host:
        return KVTransport.SAME_HOST
    return transport


@dataclass(frozen=True, slots=True)
class TimingProfile:
    name: str
    prefill: PrefillTiming
    decode: DecodeTiming
    link: LinkTiming
    kv_bytes_per_token: int
    hbm_kv_bytes: int
    max_num_seqs: int
    max_batched_tokens: int
    rerotate_per_token_s: float = 0.0
    """Seconds per token to copy a cached chunk's KV into a request's blocks and re-rotate
    its K to the new position (chunk reuse, `ownerserve/chunks.py`); 0: free."""

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        return self.prefill.seconds(new_tokens, cached_tokens)

    def decode_step_s(self, batch: int, total_context: int) -> float:
        return self.decode.step_seconds(batch, total_context)


def _section(data: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    val = data.get(key)
    if not isinstance(val, dict):
        raise ConfigError(f"{source}: {key}: missing or not a mapping")
    return val


def _transports(data: dict[str, Any], source: str) -> dict[KVTransport, TransportTiming]:
    """The `kv_transports:` section: {same_host|store_tcp|store_rdma: {bps, latency_s}}."""
    val = data.get("kv_transports")
    if val is None:
        return {}
    if not isinstance(val, dict):
        raise ConfigError(f"{source}: kv_transports: not a mapping")
    out: dict[KVTransport, TransportTiming] = {}
    known = {t.value for t in KVTransport}
    for name, entry in val.items():
        if name not in known:
            raise ConfigError(
                f"{source}: kv_transports: unknown transport {name!r} (one of {sorted(known)})"
            )
        if not isinstance(entry, dict) or set(entry) != {"bps", "latency_s"}:
            raise ConfigError(f"{source}: kv_transports.{name}: needs exactly bps and latency_s")
        try:
            bps, lat = float(entry["bps"]), float(entry["latency_s"])
        except (TypeError, ValueError):
            raise ConfigError(
                f"{source}: kv_transports.{name}: bps, latency_s must be numbers"
            ) from None
        if not bps > 0 or not lat >= 0:
            raise ConfigError(f"{source}: kv_transports.{name}: bps must be > 0, latency_s >= 0")
        out[KVTransport(name)] = TransportTiming(bps, lat)
    return out


def profile_from_dict(data: dict[str, Any], source: str = "<profile>") -> TimingProfile:
    transports = _transports(data, source)
    try:
        link = _section(data, "link", source)
        return TimingProfile(
            name=str(data["name"]),
            prefill=PrefillTiming(**_section(data, "prefill", source)),
            decode=DecodeTiming(**_section(data, "decode", source)),
            link=LinkTiming(
                **link,
                same_host=transports.get(KVTransport.SAME_HOST),
                store_tcp=transports.get(KVTransport.STORE_TCP),
                store_rdma=transports.get(KVTransport.STORE_RDMA),
            ),
            kv_bytes_per_token=int(data["kv_bytes_per_token"]),
            hbm_kv_bytes=int(float(data["hbm_kv_bytes"])),
            max_num_seqs=int(data.get("max_num_seqs", 256)),
            max_batched_tokens=int(data.get("max_batched_tokens", 8192)),
            rerotate_per_token_s=float(data.get("rerotate_per_token_s", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: invalid profile: {exc}") from None


def load_profile(name_or_path: str) -> TimingProfile:
    """A profile by name (a file in `configs/profiles/`) or by path to a YAML file."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILES_DIR / f"{name_or_path}.yaml"
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read profile: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: profile must be a mapping")
    return profile_from_dict(data, str(p))
