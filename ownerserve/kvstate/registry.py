"""The attention spec registry: `KVStateSpec`s loaded from `configs/models/*.yaml`.

A spec file names its layer kinds once and lays them out with a cycled `pattern` (plus
optional per-layer `overrides`)::

    name: deepseek-v4
    aliases: [deepseek-ai/DeepSeek-V4-Pro]
    num_layers: 61
    block_tokens: 128          # a cache block covers lcm(m, m') original tokens
    kinds:
      hca: {attention: hca, kv_heads: 1, head_dim: 512, compress_ratio: 128, window: 128, ...}
      csa: {attention: csa, kv_heads: 1, head_dim: 512, compress_ratio: 4, index_head_dim: 128, ...}
    pattern: [hca, csa]        # layer i has kind pattern[i % len(pattern)]
    overrides: {0: hca}        # optional: layer index -> kind
    swa_policy: {periodic: 4096}   # optional: full | zero | cost | {periodic: p} (the default)

Loaded specs are cached per file and modification time: frozen values, safe to share.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from ownerserve.errors import ConfigError
from ownerserve.kvstate.spec import KVStateSpec, LayerSpec
from ownerserve.kvstate.types import DEFAULT_SWA_POLICY, AttentionType, DType, SwaPolicy
from ownerserve.yamlfile import load_yaml

MODELS_DIR = Path(__file__).resolve().parent.parent.parent / "configs" / "models"

_LAYER_KEYS = frozenset(LayerSpec.__dataclass_fields__) - {"kind"}
_SPEC_KEYS = frozenset(
    {"name", "aliases", "revision", "description", "num_layers", "block_tokens", "kinds"}
    | {"pattern", "overrides", "swa_policy"}
)


def _layer_from_dict(kind: str, data: Any, source: str) -> LayerSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: kinds.{kind}: must be a mapping")
    unknown = set(data) - _LAYER_KEYS
    if unknown:
        raise ConfigError(f"{source}: kinds.{kind}: unknown keys {sorted(unknown)}")
    args: dict[str, Any] = {}
    try:
        for key, val in data.items():
            if key == "attention":
                args[key] = AttentionType(str(val))
            elif key.endswith("dtype"):
                args[key] = DType(str(val))
            elif key == "compress_overlap":
                if not isinstance(val, bool):
                    raise ValueError("compress_overlap must be true or false")
                args[key] = val
            else:
                if isinstance(val, bool) or not isinstance(val, int):
                    raise ValueError(f"{key} must be an integer, got {val!r}")
                args[key] = val
        if "attention" not in args:
            raise ValueError("missing 'attention'")
        return LayerSpec(kind=kind, **args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: kinds.{kind}: {exc}") from None


def swa_policy_from_value(value: Any, source: str = "<spec>") -> SwaPolicy:
    """A `swa_policy:` value: ``full``, ``zero``, ``cost`` (p* chosen for the deployment's
    profile) or ``{periodic: p}``; None is the default, periodic(4096)."""
    if value is None:
        return DEFAULT_SWA_POLICY
    if value == "full":
        return SwaPolicy.full()
    if value == "zero":
        return SwaPolicy.zero()
    if value == "cost":
        return SwaPolicy.cost_based()
    if isinstance(value, dict) and set(value) == {"periodic"}:
        p = value["periodic"]
        if not isinstance(p, bool) and isinstance(p, int) and p > 0:
            return SwaPolicy.periodic(p)
    raise ConfigError(
        f"{source}: swa_policy: must be full, zero, cost or {{periodic: <tokens > 0>}}, "
        f"got {value!r}"
    )


def spec_from_dict(data: dict[str, Any], source: str = "<spec>") -> KVStateSpec:
    """Build a spec from the YAML mapping; every error names `source` and the key."""
    unknown = set(data) - _SPEC_KEYS
    if unknown:
        raise ConfigError(f"{source}: unknown keys {sorted(unknown)}")
    for key in ("name", "num_layers", "block_tokens", "kinds", "pattern"):
        if key not in data:
            raise ConfigError(f"{source}: {key}: missing")
    kinds_raw = data["kinds"]
    if not isinstance(kinds_raw, dict) or not kinds_raw:
        raise ConfigError(f"{source}: kinds: must be a non-empty mapping")
    kinds = {str(k): _layer_from_dict(str(k), v, source) for k, v in kinds_raw.items()}
    num_layers = data["num_layers"]
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ConfigError(f"{source}: num_layers: must be a positive integer")
    pattern = data["pattern"]
    if not isinstance(pattern, list) or not pattern:
        raise ConfigError(f"{source}: pattern: must be a non-empty list of kind names")
    for k in pattern:
        if k not in kinds:
            raise ConfigError(f"{source}: pattern: unknown kind {k!r}")
    layers = [kinds[pattern[i % len(pattern)]] for i in range(num_layers)]
    overrides = data.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{source}: overrides: must be a mapping of layer index to kind")
    for idx, k in overrides.items():
        if not isinstance(idx, int) or not 0 <= idx < num_layers:
            raise ConfigError(f"{source}: overrides: layer {idx!r} out of range")
        if k not in kinds:
            raise ConfigError(f"{source}: overrides.{idx}: unknown kind {k!r}")
        layers[idx] = kinds[k]
    aliases = data.get("aliases") or []
    if not isinstance(aliases, list):
        raise ConfigError(f"{source}: aliases: must be a list")
    block_tokens = data["block_tokens"]
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int):
        raise ConfigError(f"{source}: block_tokens: must be an integer")
    try:
        return KVStateSpec(
            name=str(data["name"]),
            layers=tuple(layers),
            block_tokens=block_tokens,
            aliases=tuple(str(a) for a in aliases),
            revision=str(data.get("revision", "")),
            description=str(data.get("description", "")).strip(),
            swa_policy=swa_policy_from_value(data.get("swa_policy"), source),
        )
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


@lru_cache(maxsize=64)
def _load_path(path: str, mtime_ns: int) -> KVStateSpec:
    p = Path(path)
    data = load_yaml(p, "spec")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: spec must be a mapping")
    return spec_from_dict(data, str(p))


def load_spec(name_or_path: str) -> KVStateSpec:
    """A spec by name (a file in `configs/models/`) or by path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix not in (".yaml", ".yml"):
        p = MODELS_DIR / f"{name_or_path}.yaml"
    p = p.resolve()
    try:
        mtime_ns = p.stat().st_mtime_ns
    except OSError:
        mtime_ns = -1  # let the read report the error
    return _load_path(str(p), mtime_ns)


def list_specs() -> list[str]:
    """Names of the specs shipped in `configs/models/`."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def spec_for_model(model: str) -> KVStateSpec | None:
    """The shipped spec whose name or one of whose aliases is `model` (case-insensitive)."""
    want = model.lower()
    for name in list_specs():
        spec = load_spec(name)
        if want == spec.name.lower() or want in (a.lower() for a in spec.aliases):
            return spec
    return None
