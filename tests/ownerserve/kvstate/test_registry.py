"""The attention spec registry: loading `configs/models/*.yaml` and rejecting bad files."""

from pathlib import Path

import pytest

from ownerserve.config import ModelSettings, settings_from_dict
from ownerserve.errors import ConfigError
from ownerserve.kvstate import AttentionType, list_specs, load_spec, spec_for_model

SHIPPED = {"llama3-8b", "deepseek-v3", "deepseek-v3.2", "qwen3-8b-swa", "deepseek-v4"}


def test_every_shipped_spec_loads_and_names_itself_after_its_file() -> None:
    assert set(list_specs()) >= SHIPPED
    for name in list_specs():
        spec = load_spec(name)
        assert spec.name == name
        assert spec.bytes_per_token() > 0
        assert load_spec(name) is spec  # cached: one frozen value per file


def test_a_model_without_kv_spec_takes_the_spec_of_its_name_and_none_when_unknown() -> None:
    assert ModelSettings(name="deepseek-v4-like").kv_spec == "deepseek-v4"
    assert ModelSettings(name="ownerserve-tiny").kv_spec == "llama3-8b"
    assert ModelSettings(name="m").kv_spec is None
    assert ModelSettings(name="m", kv_spec="qwen3-8b-swa").kv_spec == "qwen3-8b-swa"


def test_a_kv_spec_that_does_not_load_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="kv_spec 'no-such-spec'"):
        settings_from_dict({"models": [{"name": "m", "kv_spec": "no-such-spec"}]})


def test_specs_are_found_by_served_model_name() -> None:
    assert spec_for_model("meta-llama/Llama-3.1-8B-Instruct").name == "llama3-8b"  # type: ignore[union-attr]
    assert spec_for_model("DEEPSEEK-AI/DeepSeek-V4-Pro").name == "deepseek-v4"  # type: ignore[union-attr]
    assert spec_for_model("deepseek-v3.2").name == "deepseek-v3.2"  # type: ignore[union-attr]
    assert spec_for_model("no-such-model") is None


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "m.yaml"
    p.write_text(text)
    return p


GOOD = """
name: tiny
num_layers: 4
block_tokens: 8
kinds:
  full: {attention: dense, kv_heads: 2, head_dim: 64, dtype: fp16}
  win: {attention: swa, kv_heads: 2, head_dim: 64, window: 32}
pattern: [win, full]
overrides: {0: full}
"""


def test_pattern_and_overrides_lay_out_the_layers(tmp_path: Path) -> None:
    spec = load_spec(str(_write(tmp_path, GOOD)))
    kinds = [layer.attention for layer in spec.layers]
    assert kinds == [
        AttentionType.DENSE,
        AttentionType.DENSE,
        AttentionType.SWA,
        AttentionType.DENSE,
    ]
    assert spec.bytes_per_token() == 3 * 2 * 2 * 64 * 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("pattern: [win, full]", "pattern: [win, nope]"), "pattern: unknown kind 'nope'"),
        (("dtype: fp16", "dtype: fp2"), "kinds.full"),
        (("window: 32", "window: 32, colour: red"), "unknown keys ['colour']"),
        (("block_tokens: 8", "block_tokens: eight"), "block_tokens"),
        (("num_layers: 4", "num_layers: 0"), "num_layers"),
        (("overrides: {0: full}", "overrides: {9: full}"), "overrides: layer 9"),
        (("head_dim: 64, dtype", "head_dim: 64.5, dtype"), "head_dim must be an integer"),
        (("kv_heads: 2, head_dim: 64, window", "kv_heads: 4, head_dim: 64, window"), "kv_heads"),
        (("name: tiny", "nme: tiny"), "unknown keys ['nme']"),
    ],
)
def test_bad_spec_files_name_the_file_and_the_key(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    assert change[0] in GOOD
    p = _write(tmp_path, GOOD.replace(*change))
    with pytest.raises(ConfigError) as info:
        load_spec(str(p))
    assert str(p) in str(info.value)
    assert message in str(info.value)


def test_missing_and_malformed_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read spec"):
        load_spec("no-such-spec")
    with pytest.raises(ConfigError, match="mapping"):
        load_spec(str(_write(tmp_path, "- just\n- a list\n")))
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_spec(str(_write(tmp_path, "name: [unclosed\n")))
