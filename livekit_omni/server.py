"""Run the app under uvicorn with the serving process's signal handling: SIGTERM drains (livekit_omni.drain).

Shared by ``livekit-omni serve`` (one process) and each worker of ``serve --workers N`` (livekit_omni.workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from livekit_omni.app import drain_app
from livekit_omni.settings import Settings


def uvicorn_config(app: Starlette, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
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


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains first (livekit_omni.drain) and then exits 0.

    uvicorn would stop listening at once and re-raise the SIGTERM after its shutdown (exit status -15);
    SIGINT keeps uvicorn's behaviour (open sessions get ``server_shutdown`` and 1012 right away)."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.app = app
        self.drain_task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM:
            if self.drain_task is not None:
                self.app.state.drain.cut_short()
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
            self.app.state.drain.cut_short()  # a second SIGTERM: close the open sessions now

    async def _drain(self) -> None:
        try:
            await drain_app(self.app)
        finally:
            self.should_exit = True


def run_server(
    app: Starlette,
    settings: Settings,
    *,
    sockets: list[socket.socket] | None = None,
    announce: bool = True,
    parent_pid: int | None = None,
) -> int:
    """Serve ``app`` until a signal ends it; returns the exit status (0). ``sockets``: listen on these (already
    bound) instead of ``settings.host``/``port``. ``announce``: print the URL lines (one process does, not each
    worker). ``parent_pid``: stop when that process is gone (a worker whose parent was killed)."""
    server = DrainingServer(uvicorn_config(app, settings), app)

    async def watch_parent(pid: int) -> None:
        while True:
            await asyncio.sleep(1.0)
            if os.getppid() != pid:  # re-parented: the serving parent is gone
                server.handle_exit(signal.SIGINT, None)
                return

    async def run() -> None:
        server.loop = asyncio.get_running_loop()
        serve_task = asyncio.create_task(server.serve(sockets=sockets))
        watcher = asyncio.create_task(watch_parent(parent_pid)) if parent_pid is not None else None
        try:
            while not server.started:
                if serve_task.done():
                    await serve_task
                    return
                await asyncio.sleep(0.05)
            if announce:
                port = server.servers[0].sockets[0].getsockname()[1] if server.servers else settings.port
                url = f"http://{settings.host}:{port}"
                print(f"livekit-omni serving at {url}  (frontend {url}/ , health {url}/health)", flush=True)
                try:
                    await app.state.supervisor.wait_ready(timeout=None)
                    print(f"livekit-omni engine ready: {url}", flush=True)
                except asyncio.CancelledError:
                    pass
            await serve_task
        finally:
            if watcher is not None:
                watcher.cancel()

    # uvicorn re-raises the SIGINT/SIGTERM it handled once it has shut down cleanly; that is a normal exit.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0
