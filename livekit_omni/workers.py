"""``livekit-omni serve --workers N``: N facade/media processes on one port, sharing one engine.

One asyncio process holds only so many WebRTC sessions in real time (``benchmarks/media_plane.py``), far fewer
than an engine on a GPU can serve. So the media plane runs in N worker processes:

* **The parent** (this module's :func:`serve_workers`) reserves the port once, keeps the engine (an
  :class:`~livekit_omni.supervisor.EngineSupervisor` that spawns it and restarts it when it dies; with
  ``--engine ADDRESS`` it spawns nothing), starts the workers, restarts a worker that dies, forwards SIGTERM (drain)
  and SIGINT to all of them, and prints the URL once. It serves no request and holds no session.
* **Each worker** (``python -m livekit_omni.workers``) runs the whole app on a listening socket of its own bound to
  that port with ``SO_REUSEPORT`` (the kernel hashes each new connection to one of them) and on a private Unix
  socket, with its own control connection to
  the engine (attached, never spawned). It owns its sessions: peer connections, Live and Realtime sessions, resume
  tokens, call ids, ephemeral keys, all tagged with its index (:mod:`livekit_omni.worker_ids`); a request for
  another worker's state is relayed there (:mod:`livekit_omni.routing`).

Admission stays global: the engine counts every connection's sessions against ``max_sessions``, so a full engine
refuses a worker's open and the worker answers with the usual ``session_limit_reached``. See docs/deployment.md,
"Workers".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Final

import aiohttp

from livekit_omni import worker_ids
from livekit_omni.settings import Settings
from livekit_omni.supervisor import EngineSupervisor

log = logging.getLogger(__name__)

#: The resolved settings (JSON) a worker runs with; its engine address is the parent's engine.
SETTINGS_ENV: Final = "LIVEKIT_OMNI_WORKER_SETTINGS"
#: How long the parent waits before restarting a worker that died (it doubles while workers keep dying).
RESTART_BACKOFF_S: Final = 0.5
MAX_RESTART_BACKOFF_S: Final = 10.0
#: A worker that lived this long before dying is restarted after the shortest backoff again.
STABLE_AFTER_S: Final = 30.0


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.backoff = RESTART_BACKOFF_S
        self.restart_at: float | None = None


class Parent:
    """The parent of ``serve --workers N``: one engine, one listening socket, N worker processes."""

    def __init__(self, settings: Settings, count: int, listener: socket.socket, socket_dir: str) -> None:
        self.settings = settings
        self.count = count
        self.listener = listener
        self.socket_dir = socket_dir
        self.workers = [_Worker(i) for i in range(count)]
        self.engine: EngineSupervisor | None = None
        self.stopping = False
        self._stop_signal: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.listener.getsockname()[1]}"

    def _worker_env(self, engine_address: str) -> dict[str, str]:
        port = self.listener.getsockname()[1]
        worker_settings = self.settings.model_copy(update={"engine_address": engine_address, "port": port})
        env = dict(os.environ)
        env[SETTINGS_ENV] = worker_settings.model_dump_json()
        env.setdefault("HF_HUB_OFFLINE", "1")
        return env

    def _spawn(self, w: _Worker, env: dict[str, str]) -> None:
        cmd = [
            sys.executable,
            "-m",
            "livekit_omni.workers",
            "--index",
            str(w.index),
            "--count",
            str(self.count),
            "--socket-dir",
            self.socket_dir,
            "--parent-pid",
            str(os.getpid()),
        ]
        # Its own session: a terminal's Ctrl-C reaches the parent only, which forwards one SIGINT to each worker
        # (two would make uvicorn skip its graceful shutdown).
        w.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        w.started_at = time.monotonic()
        w.restart_at = None
        log.info("worker %d: pid %d", w.index, w.proc.pid)

    def _signal_workers(self, sig: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    def on_signal(self, sig: int) -> None:
        if not self.stopping:
            log.warning("%s: stopping %d workers", signal.Signals(sig).name, self.count)
        self.stopping = True
        self._stop_signal = sig
        self._signal_workers(sig)  # a second SIGTERM cuts the workers' drain short, as on one process

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        if self.settings.engine_address is None:
            self.engine = EngineSupervisor(self.settings)
            await self.engine.start()
            engine_address = str(self.engine.address)
        else:
            engine_address = self.settings.engine_address
        env = self._worker_env(engine_address)
        for w in self.workers:
            self._spawn(w, env)
        print(
            f"livekit-omni serving at {self.url}  ({self.count} workers; frontend {self.url}/ , "
            f"health {self.url}/health)",
            flush=True,
        )
        ready = asyncio.create_task(self._announce_ready())
        try:
            await self._supervise(env)
        finally:
            ready.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ready
            if self.engine is not None:
                await self.engine.stop()
        return 0

    async def _supervise(self, env: dict[str, str]) -> None:
        while True:
            now = time.monotonic()
            alive = 0
            for w in self.workers:
                proc = w.proc
                if proc is not None and proc.poll() is None:
                    alive += 1
                    continue
                if self.stopping:
                    continue
                if proc is not None:
                    # Died on its own: its sessions are gone (the engine closed them with its connection); the
                    # others keep theirs. A new worker takes its index, so its socket and id tags stay valid.
                    lived = now - w.started_at
                    w.backoff = (
                        RESTART_BACKOFF_S
                        if lived > STABLE_AFTER_S
                        else min(w.backoff * 2, MAX_RESTART_BACKOFF_S)
                    )
                    w.restarts += 1
                    w.restart_at = now + w.backoff
                    log.error(
                        "worker %d (pid %d) exited with %s after %.0f s; restarting it (#%d) in %.1f s",
                        w.index,
                        proc.pid,
                        proc.returncode,
                        lived,
                        w.restarts,
                        w.backoff,
                    )
                    w.proc = None
                if w.restart_at is not None and now >= w.restart_at:
                    self._spawn(w, env)
                    alive += 1
            if self.stopping and alive == 0:
                return
            await asyncio.sleep(0.1)

    async def _announce_ready(self) -> None:
        """Print the ready line once the engine and every worker answer /health with 200."""
        if self.engine is not None:
            await self.engine.wait_ready(timeout=None)
        pending = set(range(self.count))
        while pending:
            for i in list(pending):
                if await _worker_healthy(os.path.join(self.socket_dir, f"worker-{i}.sock")):
                    pending.discard(i)
            if pending:
                await asyncio.sleep(0.2)
        print(f"livekit-omni engine ready: {self.url}  ({self.count} workers)", flush=True)


async def _worker_healthy(path: str) -> bool:
    if not os.path.exists(path):
        return False
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as http,
            http.get("http://worker/health", timeout=aiohttp.ClientTimeout(total=5.0)) as r,
        ):
            return r.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` with ``SO_REUSEPORT``, not listening yet."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def serve_workers(settings: Settings, count: int) -> int:
    """Run ``livekit-omni serve`` as a parent of ``count`` workers; returns the exit status."""
    # Why SO_REUSEPORT rather than one listening socket shared by all: on a shared socket every idle worker is woken
    # for each connection and the same one tends to win the accept (measured: all sessions on one worker), while
    # the kernel spreads connections over a reuseport group by their address hash. The parent's socket never
    # listens (so it gets no connections); it keeps the port (an ephemeral one for port 0) while workers restart.
    listener = reuseport_socket(settings.host, settings.port)
    socket_dir = tempfile.mkdtemp(prefix="lko-workers-")
    try:
        return asyncio.run(Parent(settings, count, listener, socket_dir).run())
    finally:
        listener.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def _bind_private(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead predecessor's socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    return sock


def worker_main(argv: list[str] | None = None) -> int:
    """One worker: the app on its ``SO_REUSEPORT`` socket of the server's port and on its private Unix socket."""
    ap = argparse.ArgumentParser(prog="livekit_omni.workers", description="a worker of livekit-omni serve")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--socket-dir", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)
    raw = os.environ.get(SETTINGS_ENV)
    if not raw:
        print(
            f"livekit_omni.workers: {SETTINGS_ENV} is not set (started by livekit-omni serve)",
            file=sys.stderr,
        )
        return 2
    settings = Settings.model_validate_json(raw)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [worker {args.index}] %(name)s: %(message)s",
    )
    identity = worker_ids.WorkerIdentity(args.index, args.count, args.socket_dir)
    worker_ids.set_current(identity)  # before the app exists: every id it issues carries the tag

    from livekit_omni.app import create_app
    from livekit_omni.server import run_server

    public = reuseport_socket(settings.host, settings.port)
    private = _bind_private(identity.socket_path(args.index))
    return run_server(
        create_app(settings), settings, sockets=[public, private], announce=False, parent_pid=args.parent_pid
    )


if __name__ == "__main__":
    sys.exit(worker_main())
