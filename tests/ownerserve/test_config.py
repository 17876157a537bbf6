"""Config validation: clear one-line errors naming the file and key."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from ownerserve.config import ServerSettings, load_settings
from ownerserve.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_sample_config_loads() -> None:
    s = load_settings(REPO / "configs" / "cluster.sample.yaml")
    assert {w.role for w in s.workers} == {"prefill", "decode", "hybrid"}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("server: {prot: 1}\n", "server.prot: unknown key"),
        ("workers: [{id: a, url: 'ftp://x'}]\n", "workers.0.url"),
        (
            "workers: [{id: a, url: 'http://h:1'}, {id: a, url: 'http://h:2'}]\n",
            "duplicate worker id 'a'",
        ),
        ("workers: [{id: a, url: 'http://h:99999'}]\n", "workers.0.url"),
        ("workers: [{id: 'a/b', url: 'http://h:1'}]\n", "workers.0.id"),  # the admin API's path
        ("workers: [{id: 'a b', url: 'http://h:1'}]\n", "workers.0.id"),
        ("directory: {backend: redis}\n", "needs redis_url"),
        ("server: [1, 2\n", "invalid YAML"),
        ("- 1\n", "top level must be a mapping"),
        (
            "workers: [{id: a, url: 'http://h:1', kv_transport: same_host}]\n",
            "kv_transport: store_rdma or store_tcp",
        ),
        (
            "workers: [{id: a, url: 'http://h:1', kv_transport: infiniband}]\n",
            "workers.0.kv_transport",
        ),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, fragment: str) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(p)
    msg = str(info.value)
    assert str(p) in msg and fragment in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("server: {tokenizer_cache_sessions: 0}\n", "server.tokenizer_cache_sessions"),
        ("planner: {retention_max_sessions: 0}\n", "planner.retention_max_sessions"),
        ("planner: {retention_max_tools: -1}\n", "planner.retention_max_tools"),
        ("directory: {redis_step_entries: 0}\n", "directory.redis_step_entries"),
        ("directory: {engine_map_entries: many}\n", "directory.engine_map_entries"),
        ("directory: {max_pending_writes: 0}\n", "directory.max_pending_writes"),
    ],
)
def test_a_table_or_step_bound_below_one_is_a_config_error(
    tmp_path: Path, text: str, fragment: str
) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(p)
    msg = str(info.value)
    assert str(p) in msg and fragment in msg and "\n" not in msg


def test_the_bounds_default_to_their_former_constants() -> None:
    s = load_settings(REPO / "configs" / "cluster.sample.yaml")
    assert s.server.tokenizer_cache_sessions == 8192
    assert (s.planner.retention_max_sessions, s.planner.retention_max_tools) == (65_536, 1_024)
    d = s.directory
    assert (d.redis_step_entries, d.engine_map_entries, d.max_pending_writes) == (
        256,
        32_768,
        100_000,
    )


def test_environment_overrides_file(tmp_path: Path) -> None:
    p = _write(tmp_path, "server: {port: 1234}\n")
    assert load_settings(p, env={"OWNERSERVE_SERVER__PORT": "4321"}).server.port == 4321


@pytest.mark.parametrize(
    ("keys", "fragment"),
    [
        ('["sk-ok", ""]', "server.api_keys: key 1 is empty"),
        ('["   "]', "server.api_keys: key 0 is empty"),
        ('["sk-ok", "sk-2", "sk-ok"]', "server.api_keys: key 2 repeats an earlier key"),
        ('[" sk-ok"]', "server.api_keys: key 0 begins or ends with whitespace"),
    ],
)
def test_an_empty_repeated_or_padded_api_key_is_refused(
    tmp_path: Path, keys: str, fragment: str
) -> None:
    # an empty key would let requests without one in
    p = _write(tmp_path, f"server: {{api_keys: {keys}}}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(p)
    msg = str(info.value)
    assert str(p) in msg and fragment in msg and "\n" not in msg


def test_api_keys_are_checked_however_settings_are_made() -> None:
    with pytest.raises(ValidationError):
        ServerSettings(api_keys=("sk-ok", ""))
    assert ServerSettings(api_keys=("sk-ok", "sk-2")).api_keys == ("sk-ok", "sk-2")
