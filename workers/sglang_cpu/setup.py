"""Install SGLang 0.5.23 for CPU into a cached venv outside the repo and build the tiny local model.

`python -m workers.sglang_cpu.setup` prints the venv and model paths as JSON. Both are built once
under `${OWNERSERVE_CACHE:-~/.cache/ownerserve}/sglang-cpu-0.5.23/`, guarded by a file lock, and
marked ready only after every step succeeded and the server's modules import.

What it takes, and why (each the smallest step found to work):
- The `sglang` wheel is installed with `--no-deps`: its requirements pin a CUDA torch (2.14.1)
  and CUDA-only kernel packages (`sglang-kernel`, flashinfer, cutlass, DeepEP, ...), none of
  which has a CPU build. Its other requirements are installed as listed, on the local CPU torch
  2.13.0 (`_SKIPPED_REQUIREMENTS` names what is left out; a text model on the torch-native
  attention backend reaches none of it).
- `SGLANG_USE_CPU_ENGINE=1` (set by `workers.sglang_cpu.server`): without it SGLang does not take
  its CPU paths. Those import `sgl_kernel` unconditionally, and `torchvision` is imported at
  start-up by a multimodal helper; the stand-ins in `workers/sglang_cpu/standins` (on the
  server's PYTHONPATH) answer those imports. Neither is installed into the venv, and no SGLang
  file is edited.
- P/D also takes Mooncake's non-CUDA Transfer Engine (`PD_REQUIREMENTS`) and, in the P/D
  servers' processes only, `workers/sglang_cpu/cpu_pd/sitecustomize.py` (see there and
  `workers.sglang_cpu.server`).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from workers.engine_process import engine_env
from workers.engine_venv import (
    TORCH_PIN,
    build_once,
    cache_root,
    download_wheel,
    print_install,
    run,
    venv_with_wheel,
)
from workers.vllm_cpu.setup import build_model

SGLANG_VERSION = "0.5.23"
_SKIPPED_REQUIREMENTS = (
    # the torch family: the CPU wheel is installed first; these pins would pull CUDA builds
    *("torch", "torchaudio", "torchvision", "torchcodec", "torch-memory-saver"),
    # CUDA-only kernels and runtimes (no CPU build exists; each pulls CUDA packages)
    *("sglang-kernel", "flashinfer-python", "flash-attn-4", "humming-kernels"),
    *("nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels", "cuda-python"),
    *("sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "tilelang", "kernels", "nvidia-ml-py"),
    # vision / video / model-zoo extras a text model never imports (timm needs torchvision)
    *("timm", "av", "decord2", "deepseek-recipe"),
    # a profiler binary, not needed to serve
    "py-spy",
)
PD_REQUIREMENTS = ("mooncake-transfer-engine-non-cuda>=0.3.13",)
"""Mooncake's Transfer Engine for P/D (`--disaggregation-transfer-backend mooncake_tcp`): the
non-CUDA build, which needs no CUDA runtime or driver library (the PyPI default links both)."""
STANDINS = Path(__file__).with_name("standins")
"""Modules put on the server's PYTHONPATH in place of CUDA-only packages (see the docstring)."""
_TAG = "sglang-cpu setup"
_IMPORT_CHECK = (
    "import sglang, sglang.launch_server, sglang.srt.entrypoints.http_server, torch, zmq, msgspec,"
    " mooncake.engine;"
    " print('sglang', sglang.__version__, torch.__version__)"
)


@dataclass(frozen=True, slots=True)
class SglangCpuInstall:
    """Where the ready SGLang venv and tiny model live."""

    root: Path
    venv: Path
    model: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def default_cache_root(env: dict[str, str] | None = None) -> Path:
    """`$OWNERSERVE_CACHE/sglang-cpu-<version>`, defaulting to `~/.cache/ownerserve`."""
    return cache_root(f"sglang-cpu-{SGLANG_VERSION}", env)


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an SGLang CPU process needs: CPU engine on, the stand-ins on the path,
    offline hub, and none of the caller's interpreter settings."""
    env = engine_env(base)
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=str(STANDINS),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def _install_spec() -> str:
    """Changes whenever what the venv should contain changes, so a stale marker is not trusted."""
    parts = [SGLANG_VERSION, TORCH_PIN, *_SKIPPED_REQUIREMENTS, *PD_REQUIREMENTS, "v1"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def install_venv(root: Path) -> Path:
    """Create `root/venv` with SGLang and its CPU-usable dependencies; idempotent."""
    venv = root / "venv"

    def build() -> None:
        wheel = download_wheel(_TAG, root / "dl", "sglang", SGLANG_VERSION)
        pip, constraints = venv_with_wheel(
            _TAG, root, venv, wheel, _SKIPPED_REQUIREMENTS, "requirements-cpu.txt"
        )
        run(_TAG, [*pip, *PD_REQUIREMENTS, "-c", str(constraints)])
        run(_TAG, [str(venv / "bin" / "python"), "-c", _IMPORT_CHECK], env=server_env())

    return build_once(_TAG, venv, _install_spec(), build)


def ensure(root: Path | None = None) -> SglangCpuInstall:
    """The ready install, building whatever is missing."""
    root = default_cache_root() if root is None else root
    venv = install_venv(root)
    # the tiny Llama the vLLM tests serve, built with this venv's python: the same tokenizer,
    # chat template and weights, so both engines see the same ids
    return SglangCpuInstall(root=root, venv=venv, model=build_model(root, venv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=None, help="cache dir (default: see above)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    inst = ensure(args.root)
    print_install({"venv": inst.venv, "python": inst.python, "model": inst.model}, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
