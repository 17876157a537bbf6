"""The emulated engine: a vLLM-compatible worker whose forward pass is a timing model.

It serves the OpenAI API and both P/D protocols (vLLM's `kv_transfer_params`, SGLang's
bootstrap rooms), keeps a real paged prefix cache with LRU eviction, publishes vLLM-format KV
events over ZMQ and sleeps (real time / `--speed`) as long as the timing profile says a GPU
would take. Start one with `python -m workers.emulator` or `ownerserve worker emulate`.
"""

from workers.emulator.app import EmulatorApp, create_app
from workers.emulator.config import EmulatorConfig
from workers.emulator.server import EmulatorServer

__all__ = ["EmulatorApp", "EmulatorConfig", "EmulatorServer", "create_app"]
