"""`python -m workers.emulator --role prefill|decode|hybrid --port N --profile NAME ...`."""

from __future__ import annotations

import argparse
import sys

from ownerserve.errors import ConfigError
from workers.emulator.config import add_arguments, config_from_args
from workers.emulator.server import run_forever


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.emulator",
        description="An emulated vLLM/SGLang engine: OpenAI API, P/D protocols, KV events.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        config.timing()
        return run_forever(config)
    except ConfigError as exc:
        print(f"emulator: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"emulator: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
