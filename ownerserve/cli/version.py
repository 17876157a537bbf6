"""`ownerserve version`: print the installed version."""

from __future__ import annotations

import argparse

import ownerserve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    del args
    print(f"ownerserve {ownerserve.__version__}")
    return 0
