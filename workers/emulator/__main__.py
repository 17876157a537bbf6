"""`python -m workers.emulator --role prefill|decode|hybrid --port N --profile NAME ...`: the
same as `ownerserve worker emulate ...` (flags, exit codes, error lines)."""

from __future__ import annotations

import sys

from ownerserve.cli import main as ownerserve_main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return ownerserve_main(["worker", "emulate", *args])


if __name__ == "__main__":
    sys.exit(main())
