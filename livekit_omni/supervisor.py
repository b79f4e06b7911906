"""Keeps an engine attached to the serving process: spawns it (or attaches to one), restarts it when it dies.

When the engine dies, :class:`engine_bridge.client.EngineClient` fails every open session (each gets an
``engine_lost`` error and a close); the supervisor removes the dead engine's orphaned segments, starts a new engine
and reconnects, so new sessions work again. /health reports the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from typing import Any

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient, EngineSession
from engine_bridge.control import Address, EngineLostError
from engine_bridge.protocol import EngineState
from engine_bridge.ring import remove_orphan_segments
from livekit_omni.settings import Settings

log = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    def __init__(self, state: EngineState, detail: str = "") -> None:
        super().__init__(f"the engine is {state}{': ' + detail if detail else ''}")
        self.state = state


class EngineSupervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.attached = settings.engine_address is not None
        self.address = Address.parse(settings.engine_address or settings.engine.address)
        self.state = EngineState.STARTING
        self.detail = ""
        self.client: EngineClient | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.engine_info: dict[str, Any] = {}
        self.engine_info_at = 0.0  # time.monotonic() of the ping engine_info came from
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._ready = asyncio.Event()

    # --- public ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-supervisor")

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    def ready_client(self) -> EngineClient:
        """The attached engine's client; :class:`EngineUnavailableError` unless the engine is up and ready."""
        client = self.client
        if client is None or client.lost or self.state is not EngineState.READY:
            raise EngineUnavailableError(self.state, self.detail)
        return client

    async def open_session(self, config: p.SessionConfig, **kw: Any) -> EngineSession:
        return await self.ready_client().open_session(config, **kw)

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.state is EngineState.READY else str(self.state),
            "engine": {
                "state": str(self.state),
                "detail": self.detail,
                "address": str(self.address),
                "attached": self.attached,
                "pid": self.process.pid if self.process else self.engine_info.get("engine_pid"),
                "restarts": self.restarts,
                **{k: v for k, v in self.engine_info.items() if k not in ("state",)},
                # A busy engine may miss the ping of this request: then the figures above are this old.
                "info_age_s": round(time.monotonic() - self.engine_info_at, 3)
                if self.engine_info_at
                else None,
            },
        }

    async def refresh(self) -> None:
        """Update engine_info from a ping (session counts etc.)."""
        client = self.client
        if client is None or client.lost:
            return
        with contextlib.suppress(Exception):
            self._set_info(await client.ping(timeout=2.0))

    def _set_info(self, info: p.EngineHealth) -> None:
        self.engine_info = info.flat()
        self.engine_info_at = time.monotonic()

    async def stop(self) -> None:
        self._stopping = True
        self.state = EngineState.STOPPED
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.client is not None:
            await self.client.close()
        await self._terminate_process()

    # --- the loop ---------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 0.5
        while not self._stopping:
            try:
                await self._bring_up()
                backoff = 0.5
                assert self.client is not None
                await self.client.wait_lost()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.error("engine start failed: %s", e)
                self.detail = str(e)
            if self._stopping:
                return
            self._ready.clear()
            self.state = EngineState.RESTARTING
            self.restarts += 1
            log.warning("engine lost (restart #%d); starting a new one", self.restarts)
            await self._terminate_process()
            # The dead engine attached to our rings; our own sessions were closed (and unlinked) by the client.
            # Anything else of ours left behind by dead processes goes now.
            await asyncio.to_thread(remove_orphan_segments)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _bring_up(self) -> None:
        self.state = EngineState.STARTING
        if not self.attached:
            await self._spawn()
        self.client = await self._connect(timeout=60.0)
        self.state = EngineState.LOADING
        # Wait for the engine to load its models; /health says "loading" meanwhile.
        t0 = time.monotonic()
        while True:
            info = await self.client.ping(timeout=5.0)
            self._set_info(info)
            if info.state is EngineState.READY:
                break
            if info.state is EngineState.FAILED:
                self.state = EngineState.FAILED
                self.detail = info.error or "model loading failed"
                raise RuntimeError(self.detail)
            if self.process is not None and self.process.poll() is not None:
                raise EngineLostError(f"engine exited with code {self.process.returncode} while loading")
            await asyncio.sleep(0.25)
        self.state = EngineState.READY
        self.detail = ""
        self._ready.set()
        log.info("engine ready at %s (%.1f s)", self.address, time.monotonic() - t0)

    async def _spawn(self) -> None:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = [
            sys.executable,
            "-m",
            "engine_bridge.engine",
            "--settings-json",
            self.settings.engine.model_dump_json(),
            "--log-level",
            self.settings.log_level,
        ]
        self.process = subprocess.Popen(cmd, env=env)  # noqa: ASYNC220 - Popen returns at once
        log.info("spawned engine pid %d", self.process.pid)

    async def _connect(self, timeout: float) -> EngineClient:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise EngineLostError(f"engine exited with code {self.process.returncode}")
            try:
                return await EngineClient.connect(self.address, timeout=2.0, client_name="livekit-omni serve")
            except (EngineLostError, OSError) as e:
                last = e
                await asyncio.sleep(0.1)
        raise EngineLostError(f"engine did not come up within {timeout:.0f} s: {last}")

    async def _terminate_process(self) -> None:
        proc = self.process
        if proc is None:
            return
        self.process = None
        if proc.poll() is None:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
