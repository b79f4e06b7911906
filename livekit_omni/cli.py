"""``livekit-omni serve`` and ``livekit-omni engine``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from engine_bridge.adapters.registry import adapter_names
from livekit_omni.settings import Settings

log = logging.getLogger("livekit_omni")


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _serve(args: argparse.Namespace) -> int:
    settings = Settings.load(args.config, host=args.host, port=args.port, engine_address=args.engine)
    if args.adapter:
        settings.engine.adapter = args.adapter
    _configure_logging(settings.log_level)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.workers < 1:
        print("livekit-omni serve: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.workers > 1:
        if settings.sip.enabled:
            print(
                "livekit-omni serve: SIP takes one process per node (--workers 1); more calls than one node holds go "
                "through a SIP proxy in front of several nodes (docs/deployment.md, SIP)",
                file=sys.stderr,
            )
            return 2
        from livekit_omni.workers import serve_workers

        return serve_workers(settings, args.workers)

    from livekit_omni.app import create_app
    from livekit_omni.server import run_server

    return run_server(create_app(settings), settings)


def _engine(args: argparse.Namespace) -> int:
    from engine_bridge.engine import run_engine

    settings = Settings.load(args.config)
    if args.address:
        settings.engine.address = args.address
    if args.adapter:
        settings.engine.adapter = args.adapter
    _configure_logging(settings.log_level)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"livekit-omni engine on {settings.engine.address}", flush=True)
    asyncio.run(run_engine(settings.engine))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="livekit-omni", description="Full-duplex voice sessions for LiveKit, browsers and phones"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve", help="run the HTTP/WebSocket server (and spawn an engine unless --engine is given)"
    )
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.add_argument(
        "--engine",
        default=None,
        metavar="ADDRESS",
        help="attach to a running engine (unix:/path or tcp:HOST:PORT)",
    )
    s.add_argument("--config", default=None, metavar="FILE", help="TOML settings file")
    s.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="facade/media processes sharing one engine and one port (docs/deployment.md, Workers)",
    )
    s.add_argument(
        "--adapter",
        choices=adapter_names(),
        default=None,
        help="engine model adapter (loopback: test fixture)",
    )
    s.set_defaults(func=_serve)
    e = sub.add_parser("engine", help="run the engine process alone")
    e.add_argument("--config", default=None, metavar="FILE")
    e.add_argument("--address", default=None, help="listen address (unix:/path or tcp:HOST:PORT)")
    e.add_argument("--adapter", choices=adapter_names(), default=None)
    e.set_defaults(func=_engine)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
