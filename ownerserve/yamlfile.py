"""Reading a YAML file the project is configured with (settings, KV specs, KV measurements):
every failure a `ConfigError` that names the file, what it was read as, and the line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ownerserve.errors import ConfigError


def load_yaml(path: Path, what: str) -> Any:
    """The data in `path` (None for an empty file), read as `what` (e.g. "spec"): `ConfigError`
    "<path>: cannot read <what>: ..." or "<path>: line N: invalid YAML in <what>: ..."."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(f"{path}:{where} invalid YAML in {what}: {problem}") from None
