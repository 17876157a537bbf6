"""The `ownerserve` command line: one entry point that wires the packages together.

Each subcommand lives in the package it drives and exposes `add_arguments(parser)` and
`run(args) -> int`; only the chosen subcommand's module is imported, so `ownerserve --help`
and `ownerserve version` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ownerserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class _Command:
    name: str
    module: str
    help: str


COMMANDS: tuple[_Command, ...] = (
    _Command("serve", "router.cli", "run the OpenAI-compatible proxy from a cluster config file"),
    _Command(
        "status",
        "ownerserve.cli.status",
        "show a running router's workers, admission and recent plans (its admin API)",
    ),
    _Command(
        "demo",
        "ownerserve.cli.demo",
        "run agent sessions on a local emulated xPyD cluster, beside two peer routers",
    ),
    _Command("worker", "workers.cli", "run a worker-side process (emulated engine, sidecar)"),
    _Command("loadgen", "loadgen.cli", "drive an OpenAI endpoint with agentic traffic"),
    _Command("bench", "loadgen.bench_cli", "run the project's benchmarks side by side"),
    _Command("sim", "loadgen.sim.cli", "simulate routing policies on a large cluster"),
    _Command("version", "ownerserve.cli.version", "print the version"),
)


def _available(cmd: _Command) -> bool:
    return importlib.util.find_spec(cmd.module.rsplit(".", 1)[0]) is not None and (
        importlib.util.find_spec(cmd.module) is not None
    )


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ownerserve",
        description="OwnerServe: an ownership-aware PD-hybrid router for agentic LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        if not _available(cmd):
            continue
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.name == selected:
            importlib.import_module(cmd.module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(selected)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(next(c.module for c in COMMANDS if c.name == args.command))
    try:
        return int(module.run(args))
    except ConfigError as exc:
        print(f"ownerserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
