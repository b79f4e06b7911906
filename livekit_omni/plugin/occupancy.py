"""Engine occupancy for a LiveKit worker's ``load_fnc``: active sessions ÷ the engine's session limit.

LiveKit's default load is the worker's CPU, which says nothing about a worker whose sessions run on an engine:
the worker process idles while the engine is full. This reports what admission is bounded by instead, and it is
the same number for every worker sharing the engine, so they all turn FULL together when it is.

* co-located (``engine_address``): the engine's Ping (``active_sessions``, ``max_sessions``, ``state``) over one
  persistent control connection, kept on a private event-loop thread because LiveKit calls ``load_fnc`` from an
  executor thread, every 0.5 s;
* remote (``base_url``): ``GET /health`` of the ``livekit-omni serve`` (its ``engine`` section carries the same).

An engine that cannot be reached, or is not ready (still loading, restarting), reports full load (1.0): a worker
that cannot serve a call must not be offered one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import threading
import urllib.error
import urllib.request
import weakref
from typing import TYPE_CHECKING, Any, Final

from livekit_omni.plugin.log import logger
from livekit_omni.plugin.options import ENV_API_KEY, ENV_BASE_URL, ENV_ENGINE_ADDRESS

if TYPE_CHECKING:
    from engine_bridge.client import EngineClient
    from livekit_omni.plugin.model import OmniDuplexModel

#: The load reported when the engine cannot take a session (unreachable, loading, failed).
FULL: Final = 1.0


def occupancy_of(info: dict[str, Any]) -> float:
    """Load in [0, 1] from engine health info (a Ping result, or /health's ``engine`` section)."""
    if info.get("state") != "ready":
        return FULL
    try:
        active = int(info["active_sessions"])
        limit = int(info["max_sessions"])
    except (KeyError, TypeError, ValueError):
        return FULL
    if limit <= 0:
        return FULL
    return min(FULL, max(0.0, active / limit))


class EngineOccupancy:
    """A load function: ``AgentServer(load_fnc=EngineOccupancy(...))``. Thread-safe; never raises."""

    def __init__(
        self,
        *,
        engine_address: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 1.0,
    ) -> None:
        if engine_address is None and base_url is None:
            engine_address = os.environ.get(ENV_ENGINE_ADDRESS) or None
            base_url = os.environ.get(ENV_BASE_URL) or None
        if bool(engine_address) == bool(base_url):
            raise ValueError(
                f"EngineOccupancy needs exactly one of engine_address or base_url (or {ENV_ENGINE_ADDRESS} / "
                f"{ENV_BASE_URL})"
            )
        self.engine_address = engine_address
        self.base_url = base_url
        self.api_key = api_key if api_key is not None else os.environ.get(ENV_API_KEY) or None
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: EngineClient | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @classmethod
    def for_model(cls, model: OmniDuplexModel, *, timeout_s: float = 1.0) -> EngineOccupancy:
        """The occupancy of the engine a model's sessions run on."""
        o = model.options
        return cls(
            engine_address=o.engine_address, base_url=o.base_url, api_key=o.api_key, timeout_s=timeout_s
        )

    def __call__(self) -> float:
        return self.load()

    def load(self) -> float:
        """Blocking (bounded by ``timeout_s``): meant for LiveKit's executor thread."""
        try:
            info = self._remote_info() if self.base_url else self._colocated_info()
        except Exception as e:
            logger.warning("engine occupancy unavailable (%s); reporting full load", e)
            return FULL
        return occupancy_of(info)

    async def aload(self) -> float:
        return await asyncio.to_thread(self.load)

    def close(self) -> None:
        """Close the control connection and stop its thread. Idempotent."""
        with self._lock:
            loop, thread, client = self._loop, self._thread, self._client
            self._loop = self._thread = self._client = None
        if loop is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        if client is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(client.close(), loop).result(self.timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(self.timeout_s)
            if not thread.is_alive():
                loop.close()

    # --- remote -------------------------------------------------------------------------------------------------
    def _remote_info(self) -> dict[str, Any]:
        from livekit_omni.plugin.remote import health_url

        assert self.base_url is not None
        req = urllib.request.Request(health_url(self.base_url))
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            # 503 while the engine loads or restarts: its body still says why, and the load is full.
            body = json.loads(e.read() or b"{}")
        engine: dict[str, Any] = body.get("engine") or {}
        return engine

    # --- co-located ---------------------------------------------------------------------------------------------
    def _colocated_info(self) -> dict[str, Any]:
        loop = self._ensure_loop()
        fut = asyncio.run_coroutine_threadsafe(self._ping(), loop)
        try:
            return fut.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"engine ping timed out after {self.timeout_s} s") from None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="omni-occupancy", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
                # A probe dropped without close() still stops its thread.
                self._finalizer = weakref.finalize(self, loop.call_soon_threadsafe, loop.stop)
            return self._loop

    async def _ping(self) -> dict[str, Any]:
        from engine_bridge.client import EngineClient

        if self._client is None or self._client.lost:
            assert self.engine_address is not None
            self._client = await EngineClient.connect(
                self.engine_address, timeout=self.timeout_s, client_name="livekit-omni occupancy"
            )
        return (await self._client.ping(timeout=self.timeout_s)).flat()
