"""``livekit-omni serve`` and ``livekit-omni engine``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from types import FrameType

from engine_bridge.adapters.registry import adapter_names
from livekit_omni.settings import Settings

log = logging.getLogger("livekit_omni")


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from livekit_omni.app import create_app

    settings = Settings.load(args.config, host=args.host, port=args.port, engine_address=args.engine)
    if args.adapter:
        settings.engine.adapter = args.adapter
    _configure_logging(settings.log_level)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    app = create_app(settings)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # Twice the facade's limit: a message over the limit gets a `message_too_large` error event from the facade
        # instead of a bare protocol close (1009) from uvicorn.
        ws_max_size=2 * settings.limits.max_message_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        lifespan="on",
    )
    from livekit_omni.app import drain_app

    class DrainingServer(uvicorn.Server):
        """uvicorn, except that SIGTERM drains first (livekit_omni.drain) and then exits 0.

        uvicorn would stop listening at once and re-raise the SIGTERM after its shutdown (exit status -15);
        SIGINT keeps uvicorn's behaviour (open sessions get ``server_shutdown`` and 1012 right away)."""

        drain_task: asyncio.Task[None] | None = None
        loop: asyncio.AbstractEventLoop | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if sig != signal.SIGTERM:
                if self.drain_task is not None:
                    app.state.drain.cut_short()
                super().handle_exit(sig, frame)
                return
            loop = self.loop
            if loop is None or not self.started or self.should_exit:
                self.should_exit = True  # not serving yet (or already stopping): stop without a drain
                return
            # A signal handler runs between bytecodes of the loop's thread: hand the work to the loop.
            loop.call_soon_threadsafe(self._sigterm)

        def _sigterm(self) -> None:
            if self.drain_task is None:
                self.drain_task = asyncio.create_task(self._drain(), name="drain")
            else:
                app.state.drain.cut_short()  # a second SIGTERM: close the open sessions now

        async def _drain(self) -> None:
            try:
                await drain_app(app)
            finally:
                self.should_exit = True

    server = DrainingServer(config)

    async def run() -> None:
        server.loop = asyncio.get_running_loop()
        serve_task = asyncio.create_task(server.serve())
        while not server.started:
            if serve_task.done():
                await serve_task
                return
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else settings.port
        url = f"http://{settings.host}:{port}"
        print(f"livekit-omni serving at {url}  (frontend {url}/ , health {url}/health)", flush=True)
        try:
            await app.state.supervisor.wait_ready(timeout=None)
            print(f"livekit-omni engine ready: {url}", flush=True)
        except asyncio.CancelledError:
            pass
        await serve_task

    # uvicorn re-raises the SIGINT/SIGTERM it handled once it has shut down cleanly; that is a normal exit.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


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
