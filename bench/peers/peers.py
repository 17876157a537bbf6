"""Install the peer routers of `loadgen.peers` into their cached venvs ahead of a benchmark.

python -m bench.peers.peers            # install both, print their binaries
python -m bench.peers.peers --check    # only report what is installed
"""

from __future__ import annotations

import argparse
import sys

from loadgen.peers import PEERS, PeerUnavailableError, installed, peer_binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("names", nargs="*", default=list(PEERS), help="peers (default: all)")
    parser.add_argument("--check", action="store_true", help="report only, install nothing")
    args = parser.parse_args(argv)
    status = 0
    for name in args.names:
        try:
            path = installed(name) if args.check else peer_binary(name)
        except (PeerUnavailableError, KeyError) as exc:
            print(f"{name}: unavailable: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{name}: {path if path else 'not installed'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
