"""`ownerserve serve --config FILE`: run the proxy for a cluster config."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

from ownerserve.config import load_settings, settings_from_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cluster config YAML")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port")
    parser.add_argument("--policy", help="override planner.policy")
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
    logging.basicConfig(level=args.log_level.upper())
    from router.requestlog import REQUEST_LOGGER

    logging.getLogger(REQUEST_LOGGER).setLevel(args.request_log_level.upper())
    from router.server import serve

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
