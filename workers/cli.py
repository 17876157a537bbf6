"""`ownerserve worker ...`: worker-side processes. Subcommands: `emulate` (an emulated engine).

ownerserve worker emulate --role decode --port 8102 --profile h100-llama3-8b --speed 10
"""

from __future__ import annotations

import argparse
import sys

from workers.emulator.config import add_arguments as add_emulator_arguments
from workers.emulator.config import config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="worker_command", metavar="WORKER_COMMAND")
    emulate = sub.add_parser(
        "emulate",
        help="run an emulated vLLM/SGLang engine (timing model, prefix cache, KV events)",
        description="Run an emulated vLLM/SGLang engine: OpenAI API, P/D protocols, KV events.",
    )
    add_emulator_arguments(emulate)


def run(args: argparse.Namespace) -> int:
    if args.worker_command == "emulate":
        from workers.emulator.server import run_forever

        config = config_from_args(args)
        config.timing()  # a bad profile fails here, with exit code 2 from the CLI
        try:
            return run_forever(config)
        except OSError as exc:
            print(f"ownerserve worker emulate: error: {exc}", file=sys.stderr)
            return 1
    print("usage: ownerserve worker {emulate} ...  (see ownerserve worker --help)", file=sys.stderr)
    return 2
