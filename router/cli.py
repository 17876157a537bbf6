"""`ownerserve serve --config FILE [--processes N]`: run the proxy for a cluster config, in one
process or in N behind a supervisor (`router.procs`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Callable

from ownerserve.config import Settings, load_settings, settings_from_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cluster config YAML")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port")
    parser.add_argument("--policy", help="override planner.policy")
    parser.add_argument(
        "--processes",
        default="1",
        help="router processes on this host (a count, or 'auto': the usable cores); more than "
        "one: a supervisor forks them, each listens on the port with SO_REUSEPORT (the kernel "
        "spreads connections), a process that dies is restarted, SIGTERM drains them all. "
        "Needs directory.backend: redis (owners, sessions and in-flight reservations are "
        "shared there); each process's /metrics is its own",
    )
    parser.add_argument("--log-level", default="warning", help="python log level")
    parser.add_argument(
        "--request-log-level",
        default="info",
        choices=("debug", "info", "warning", "error", "critical"),
        help="level of the `ownerserve.requests` logger: at info (the default) one logfmt line "
        "per request whatever --log-level says; warning or above turns the lines off",
    )


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, env=os.environ)
    overrides = {
        "server": {"host": args.host, "port": args.port},
        "planner": {"policy": args.policy},
    }
    data = settings.model_dump(mode="json")
    for section, values in overrides.items():
        for key, value in values.items():
            if value is not None:
                data[section][key] = value
    settings = settings_from_dict(data, source=args.config)
    from router.procs import check_shareable, parse_processes

    processes = parse_processes(args.processes)
    check_shareable(settings, processes)
    logging.basicConfig(level=args.log_level.upper())
    from router.requestlog import REQUEST_LOGGER

    logging.getLogger(REQUEST_LOGGER).setLevel(args.request_log_level.upper())
    from router.server import serve

    if processes > 1:
        return _run_processes(settings, processes)
    print(
        f"ownerserve: serving the OpenAI API at http://{settings.server.host}:"
        f"{settings.server.port}/v1 ({len(settings.workers)} workers, "
        f"policy {settings.planner.policy})",
        flush=True,
    )
    import uvloop

    # `serve` handles SIGINT/SIGTERM itself: it stops accepting, lets requests in flight
    # finish and exits with status 0
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(settings))
    return 0


def _run_processes(settings: Settings, processes: int) -> int:
    """N router processes on one port behind `router.procs.Supervisor`."""
    import uvloop

    from router.procs import Supervisor, reserve_port
    from router.server import serve

    held, port = reserve_port(settings.server.host, settings.server.port)
    data = settings.model_dump(mode="json")
    data["server"]["port"] = port
    data["server"]["processes"] = processes
    settings = Settings.model_validate(data)

    def child(slot: int, ready: Callable[[], None]) -> int:
        held.close()
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(serve(settings, reuse_port=True, on_listening=ready))
        return 0

    print(
        f"ownerserve: serving the OpenAI API at http://{settings.server.host}:{port}/v1 "
        f"({len(settings.workers)} workers, policy {settings.planner.policy}, "
        f"{processes} processes)",
        flush=True,
    )
    try:
        return Supervisor(processes, child).run()
    finally:
        held.close()
