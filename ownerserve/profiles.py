"""Hardware timing profiles: how long prefill, a decode step and a KV transfer take on a worker.

One YAML file per profile in `configs/profiles/`. The same formulas drive the emulated engine's
sleeps, the planner's cost model and the cluster simulator, so they agree by construction:

    prefill_s(new, cached) = base_s + per_token_s·new + per_token_ctx_s·new·(cached + new/2)
    decode_step_s(batch, ctx) = base_s + per_seq_s·batch + per_ctx_token_s·ctx
    transfer_s(bytes, bw) = latency_s + bytes / bw
    rerotate_s(tokens) = rerotate_per_token_s·tokens   (a reused chunk's KV copied into the
                         request's blocks with K re-rotated to its new position)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ownerserve.errors import ConfigError

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
class LinkTiming:
    """Bandwidths in bytes per second."""

    intra_node_bps: float
    inter_node_bps: float
    latency_s: float
    cpu_load_bps: float
    """Host memory -> HBM (PCIe; H100 Gen5 x16 ~50 GB/s effective): CPU-tier KV loads."""
    ssd_load_bps: float

    def transfer_s(self, nbytes: float, same_node: bool) -> float:
        if nbytes <= 0:
            return 0.0
        bw = self.intra_node_bps if same_node else self.inter_node_bps
        return self.latency_s + nbytes / bw


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


def profile_from_dict(data: dict[str, Any], source: str = "<profile>") -> TimingProfile:
    try:
        return TimingProfile(
            name=str(data["name"]),
            prefill=PrefillTiming(**_section(data, "prefill", source)),
            decode=DecodeTiming(**_section(data, "decode", source)),
            link=LinkTiming(**_section(data, "link", source)),
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
