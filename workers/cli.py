"""`ownerserve worker ...`: worker-side processes. Subcommands: `emulate` (an emulated engine)
and `sidecar` (a worker's KV artifact store and transfer server, `workers.sidecar.server`).

ownerserve worker emulate --role decode --port 8102 --profile h100-llama3-8b --speed 10
ownerserve worker sidecar --worker-id w0 --port 8200 --store-dir /tmp/w0-kv
"""

from __future__ import annotations

import argparse
import sys

from workers.emulator.config import add_arguments as add_emulator_arguments
from workers.emulator.config import config_from_args
from workers.sidecar.cli import add_arguments as add_sidecar_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="worker_command", metavar="WORKER_COMMAND")
    emulate = sub.add_parser(
        "emulate",
        help="run an emulated vLLM/SGLang engine (timing model, prefix cache, KV events)",
        description="Run an emulated vLLM/SGLang engine: OpenAI API, P/D protocols, KV events.",
    )
    add_emulator_arguments(emulate)
    emulate.add_argument(
        "--lifeline-fd",
        type=int,
        default=None,
        help="read end of a pipe its launcher holds open: exit (as on SIGTERM) when it closes",
    )
    sidecar = sub.add_parser(
        "sidecar",
        help="run a worker's KV sidecar (artifact store, HTTP KV API, transfer server)",
        description=(
            "Run a worker's KV sidecar: a checksummed artifact store (memory tier over files in "
            "--store-dir) behind an HTTP API the vLLM connector and the router use, a transfer "
            "server peers pull artifacts from, and replicas published to the directory."
        ),
    )
    add_sidecar_arguments(sidecar)


def run(args: argparse.Namespace) -> int:
    if args.worker_command == "emulate":
        from workers.emulator.server import run_forever

        config = config_from_args(args)
        config.timing()  # a bad profile fails here, with exit code 2 from the CLI
        try:
            return run_forever(config, args.lifeline_fd)
        except OSError as exc:
            print(f"ownerserve worker emulate: error: {exc}", file=sys.stderr)
            return 1
    if args.worker_command == "sidecar":
        from workers.sidecar.cli import run as run_sidecar

        return run_sidecar(args)
    print(
        "usage: ownerserve worker {emulate,sidecar} ...  (see ownerserve worker --help)",
        file=sys.stderr,
    )
    return 2
