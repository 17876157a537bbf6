"""What one emulated engine is: its role, model, timing profile, cache size and ports.

`EmulatorConfig` is built from the command line (`add_arguments` / `config_from_args`, shared by
`python -m workers.emulator` and `ownerserve worker emulate`) or directly by tests.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ownerserve.errors import ConfigError
from ownerserve.kvstate import KVStateSpec, SwaPolicy, load_spec, spec_for_model
from ownerserve.kvstate.groups import is_hybrid, kv_cache_groups, sealed_block_bytes
from ownerserve.kvstate.registry import swa_policy_from_value
from ownerserve.kvstate.retention import Retention
from ownerserve.profiles import TimingProfile, load_profile
from ownerserve.types import Role
from workers.emulator.hetero import HybridKV

DEFAULT_MODEL = "ownerserve-tiny"


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """Settings of one emulated engine; `None` sizes come from the timing profile."""

    role: Role = Role.HYBRID
    model: str = DEFAULT_MODEL
    profile: str = "fast-test"
    speed: float = 1.0
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None
    worker_id: str | None = None
    node: str = "node0"
    tokenizer: str = "byte"
    chat_template: str | None = None
    salt: str = ""
    block_size: int = 16
    num_blocks: int | None = None
    cpu_kv_blocks: int = 0
    """Blocks of the CPU tier behind HBM (vLLM's KV offloading, `--kv-offloading-size` in
    blocks); 0: no CPU tier."""
    chunk_store_tokens: int | None = None
    """Tokens of chunk KV the chunk store keeps (chunk reuse, a pool beside the KV pool); None:
    15/70 of the KV pool's tokens (a 15% chunk pool beside a 70% main pool); 0: no
    chunk store (chunk layouts are ignored)."""
    chunk_recompute_tokens: int = 0
    """Leading tokens of each reused chunk computed again (EPIC's LegoLink); 0: none."""
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None
    max_model_len: int = 131072
    stream_interval: int = 1
    """Stream a chunk every this many tokens (vLLM's --stream-interval)."""
    output_len: int = 128
    """Tokens the emulated model writes before its end-of-sequence token (unless `max_tokens`)."""
    bootstrap_port: int | None = None
    kv_events_port: int | None = None
    kv_events_host: str = "127.0.0.1"
    kv_events_topic: str = ""
    kv_events_replay_port: int | None = None
    transfer_timeout_s: float = 30.0
    """How long an SGLang-style decode side waits for its prefill's room, and how long a
    prefill side holds a room's blocks for a decode that has not pulled them yet."""
    kv_lease_s: float = 30.0
    """How long a prefill side holds a vLLM-style (`kv_transfer_params`) result for a decode
    that has not pulled it: vLLM NixlConnector's `kv_lease_duration` (kv_connector_extra_config,
    default 30 s). A decode side where the request waits renews it every `kv_lease_s / 6` by
    `2/3 * kv_lease_s` (its heartbeat), so the KV is freed this long after the decode side let go
    of it or died."""
    max_body_bytes: int = 32 * 1024 * 1024
    kv_spec: str | None = None
    """The served model's KV state spec (a name in `configs/models/` or a YAML path); None:
    the spec whose name or alias is `model`, if any. A hybrid-attention spec (more than one
    full-attention group) gets HeteroCache's groups; a dense one, or none, the plain pool."""
    retention_interval: int | None = None
    """Which boundaries keep their sliding-window state (vLLM's prefix-cache retention
    interval): None every block boundary, 0 only each request's last prompt boundary, N every
    N tokens (and the last prompt boundary)."""
    window_num_blocks: int | None = None
    """Blocks of the sliding-window pool (hybrid specs); None: as many as the KV pool's."""
    swa_policy: str | None = None
    """Which boundaries the CPU tier keeps window checkpoints for (hybrid specs): `full`,
    `zero` or `periodic:N`; None: the spec's `swa_policy:` (default periodic 4096)."""
    sidecar_url: str | None = None
    """Its own KV sidecar (workers/sidecar): every computed block is saved there and a
    request's blocks past its HBM hit that the sidecar holds are loaded from it
    (`sidecar_tier`); None: none, its KV lives in HBM (and the CPU tier) only."""
    tool_call_every: int = 0
    """Tool-calling mode: when a chat request offers tools (tool_choice auto), every this
    many user turns is answered with a tool call, arguments drawn from its schema (0: off)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ConfigError(
                f"--role must be prefill, decode or hybrid, got {self.role!r}"
            ) from None
        if self.speed <= 0:
            raise ConfigError(f"--speed must be positive, got {self.speed}")
        if self.block_size <= 0:
            raise ConfigError(f"--block-size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"--num-blocks must be positive, got {self.num_blocks}")
        if self.cpu_kv_blocks < 0:
            raise ConfigError(f"--cpu-num-blocks must be >= 0, got {self.cpu_kv_blocks}")
        if self.chunk_store_tokens is not None and self.chunk_store_tokens < 0:
            raise ConfigError(f"--chunk-store-tokens must be >= 0, got {self.chunk_store_tokens}")
        if self.chunk_recompute_tokens < 0:
            raise ConfigError(
                f"--chunk-recompute-tokens must be >= 0, got {self.chunk_recompute_tokens}"
            )
        if self.stream_interval <= 0:
            raise ConfigError(f"--stream-interval must be positive, got {self.stream_interval}")
        if self.transfer_timeout_s <= 0:
            raise ConfigError("--transfer-timeout-s must be positive")
        if self.kv_lease_s <= 0:
            raise ConfigError("--kv-lease-duration must be positive")
        if self.retention_interval is not None and self.retention_interval < 0:
            raise ConfigError(
                f"--prefix-cache-retention-interval must be >= 0, got {self.retention_interval}"
            )
        if self.swa_policy is not None:
            self.offload_policy()  # a bad value is a ConfigError now, not at start-up
        if self.window_num_blocks is not None and self.window_num_blocks <= 0:
            raise ConfigError(f"--window-num-blocks must be positive, got {self.window_num_blocks}")
        if self.tool_call_every < 0:
            raise ConfigError(f"--tool-call-every must be >= 0, got {self.tool_call_every}")

    @property
    def name(self) -> str:
        """The worker's id: `--worker-id`, else `<role>-<port>`."""
        return self.worker_id or f"{self.role.value}-{self.port}"

    @property
    def public_host(self) -> str:
        """The host other workers use to reach this one (KV pulls)."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host

    def timing(self) -> TimingProfile:
        return load_profile(self.profile)

    def kv_state_spec(self) -> KVStateSpec | None:
        """The served model's spec if it is hybrid (`kv_spec`, else found by `model`); None
        for a dense model or one without a spec (the plain pool, timed by the profile)."""
        if self.kv_spec is not None:
            spec = load_spec(self.kv_spec)
        else:
            found = spec_for_model(self.model)
            if found is None:
                return None
            spec = found
        if not is_hybrid(kv_cache_groups(spec)):
            return None  # dense: the plain pool, whatever the block size
        try:
            kv_cache_groups(spec, self.block_size)
        except ValueError as exc:
            raise ConfigError(f"--block-size {self.block_size}: {exc}") from None
        return spec

    def capacity_blocks(self, profile: TimingProfile, spec: KVStateSpec | None = None) -> int:
        """KV capacity in blocks: `--num-blocks`, else HBM for KV / bytes per block (for a
        hybrid spec, the bytes of a block in every sealed group)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if spec is not None:
            per_block = sealed_block_bytes(kv_cache_groups(spec, self.block_size))
        else:
            per_block = profile.kv_bytes_per_token * self.block_size
        return max(1, int(profile.hbm_kv_bytes // per_block))

    def offload_policy(self) -> SwaPolicy | None:
        """`swa_policy` as a `SwaPolicy` (None: the spec's)."""
        value = self.swa_policy
        if value is None:
            return None
        text = value.strip().lower()
        if text.startswith("periodic:"):
            try:
                return swa_policy_from_value({"periodic": int(text.split(":", 1)[1])})
            except ValueError:
                pass
        elif text in ("full", "zero"):
            return swa_policy_from_value(text)
        raise ConfigError(f"--swa-policy must be full, zero or periodic:N, got {value!r}")

    def hybrid_kv(self, spec: KVStateSpec | None, capacity_blocks: int) -> HybridKV | None:
        """HeteroCache's groups for a hybrid spec (None for a dense model)."""
        if spec is None:
            return None
        return HybridKV(
            spec,
            self.block_size,
            Retention(self.retention_interval),
            self.window_num_blocks or capacity_blocks,
            offload=self.offload_policy(),
            host_window_blocks=self.cpu_kv_blocks,
        )

    def chunk_capacity_tokens(self, profile: TimingProfile) -> int:
        """The chunk store's size in tokens: `--chunk-store-tokens`, else 15/70 of the pool's."""
        if self.chunk_store_tokens is not None:
            return self.chunk_store_tokens
        return self.capacity_blocks(profile) * self.block_size * 15 // 70


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The emulated engine's command-line options."""
    d = EmulatorConfig()
    parser.add_argument("--role", choices=[r.value for r in Role], default=d.role.value)
    parser.add_argument("--port", type=int, default=d.port, help="HTTP port (OpenAI API)")
    parser.add_argument("--host", default=d.host, help="bind address")
    parser.add_argument(
        "--advertise-host", default=None, help="host peers use to pull KV (default: --host)"
    )
    parser.add_argument("--profile", default=d.profile, help="timing profile name or YAML path")
    parser.add_argument(
        "--speed", type=float, default=d.speed, help="emulated time runs this many times faster"
    )
    parser.add_argument("--model", default=d.model, help="served model name")
    parser.add_argument("--worker-id", default=None, help="id in metrics and KV events")
    parser.add_argument("--node", default=d.node, help="node name (same node: faster KV links)")
    parser.add_argument("--tokenizer", default=d.tokenizer, help="'byte' or a tokenizer.json path")
    parser.add_argument("--chat-template", default=None, help="Jinja chat template file")
    parser.add_argument("--salt", default=d.salt, help="block-hash chain salt")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV capacity in blocks")
    parser.add_argument(
        "--cpu-num-blocks",
        type=int,
        default=d.cpu_kv_blocks,
        help="CPU KV tier behind HBM, in blocks (vLLM's KV offloading); 0: none",
    )
    parser.add_argument(
        "--chunk-store-tokens",
        type=int,
        default=None,
        help="chunk KV kept by content hash for position-independent reuse, in tokens "
        "(default: 15/70 of the KV pool's tokens; 0: no chunk store)",
    )
    parser.add_argument(
        "--chunk-recompute-tokens",
        type=int,
        default=d.chunk_recompute_tokens,
        help="leading tokens of each reused chunk computed again (EPIC's LegoLink; 0: none)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument(
        "--stream-interval", type=int, default=d.stream_interval, help="tokens per stream chunk"
    )
    parser.add_argument(
        "--output-len", type=int, default=d.output_len, help="natural output length in tokens"
    )
    parser.add_argument("--bootstrap-port", type=int, default=None, help="SGLang PD bootstrap")
    parser.add_argument("--kv-events-port", type=int, default=None, help="ZMQ PUB port")
    parser.add_argument("--kv-events-host", default=d.kv_events_host)
    parser.add_argument("--kv-events-topic", default=d.kv_events_topic)
    parser.add_argument("--kv-events-replay-port", type=int, default=None, help="ZMQ ROUTER port")
    parser.add_argument("--transfer-timeout-s", type=float, default=d.transfer_timeout_s)
    parser.add_argument(
        "--kv-lease-duration",
        type=float,
        default=d.kv_lease_s,
        help="seconds a prefill holds unpulled KV unless its decode renews the lease "
        "(vLLM NixlConnector's kv_lease_duration)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    parser.add_argument(
        "--kv-spec",
        default=None,
        help="the model's KV state spec (configs/models/ name or YAML path; default: the spec "
        "named by --model or one of its aliases; a hybrid one gets HeteroCache's groups)",
    )
    parser.add_argument(
        "--prefix-cache-retention-interval",
        type=_retention,
        default=None,
        help="hybrid specs: boundaries that keep sliding-window state: unset every block, "
        "0 only each request's last prompt boundary, N every N tokens (vLLM's retention "
        "interval)",
    )
    parser.add_argument(
        "--swa-policy",
        default=None,
        help="hybrid specs with a CPU tier: boundaries whose window checkpoints it keeps: "
        "full, zero or periodic:N (default: the spec's swa_policy)",
    )
    parser.add_argument(
        "--window-num-blocks",
        type=int,
        default=None,
        help="hybrid specs: blocks of the sliding-window pool (default: --num-blocks's)",
    )
    parser.add_argument(
        "--sidecar-url",
        default=None,
        help="its own KV sidecar's URL (ownerserve worker sidecar): computed blocks are saved "
        "there, and blocks past a request's HBM hit that it holds are loaded from it",
    )
    parser.add_argument(
        "--tool-call-every",
        type=int,
        default=d.tool_call_every,
        help="with tools offered, answer every k-th user turn with a tool call (0: never)",
    )


def _retention(value: str) -> int | None:
    try:
        return Retention.parse(value).interval
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        role=Role(args.role),
        model=args.model,
        profile=args.profile,
        speed=args.speed,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        worker_id=args.worker_id,
        node=args.node,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        salt=args.salt,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        cpu_kv_blocks=args.cpu_num_blocks,
        chunk_store_tokens=args.chunk_store_tokens,
        chunk_recompute_tokens=args.chunk_recompute_tokens,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        output_len=args.output_len,
        stream_interval=args.stream_interval,
        bootstrap_port=args.bootstrap_port,
        kv_events_port=args.kv_events_port,
        kv_events_host=args.kv_events_host,
        kv_events_topic=args.kv_events_topic,
        kv_events_replay_port=args.kv_events_replay_port,
        transfer_timeout_s=args.transfer_timeout_s,
        kv_lease_s=args.kv_lease_duration,
        max_body_bytes=args.max_body_bytes,
        tool_call_every=args.tool_call_every,
        sidecar_url=args.sidecar_url,
        kv_spec=args.kv_spec,
        retention_interval=args.prefix_cache_retention_interval,
        window_num_blocks=args.window_num_blocks,
        swa_policy=args.swa_policy,
    )
