"""Config validation: clear one-line errors naming the file and key."""

from pathlib import Path

import pytest

from ownerserve.config import load_settings
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
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, fragment: str) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(p)
    msg = str(info.value)
    assert str(p) in msg and fragment in msg and "\n" not in msg


def test_environment_overrides_file(tmp_path: Path) -> None:
    p = _write(tmp_path, "server: {port: 1234}\n")
    assert load_settings(p, env={"OWNERSERVE_SERVER__PORT": "4321"}).server.port == 4321
