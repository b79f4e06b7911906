"""Authentication on every endpoint of a real ``livekit-omni serve`` (loopback echo fixture) with an API key set,
and the file modes of what the engine shares with the media plane (its control socket, the ring segments).

One parametrised test runs every endpoint with no key, a wrong key and the right key: refused in the documented
way (docs/protocol.md, Auth: HTTP 401 with ``invalid_api_key``; on a WebSocket an ``error`` event with that code,
then close 1008) and accepted with the right key (the endpoint's own answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import websockets

from engine_bridge.ring import SHM_DIR, RingPair
from media.webrtc import enable_loopback_ice
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import ServerProcess, start_server

API_KEY = "sk-auth-test"
WRONG_KEY = "sk-not-this-one"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    enable_loopback_ice()  # the WebRTC caller of this process gathers 127.0.0.1 only
    s = start_server(
        adapter="loopback",
        env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]), "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true"},
    )
    yield s
    s.stop()


@dataclass(frozen=True)
class Outcome:
    """What one attempt got: accepted (the endpoint's own answer) or refused (status or close code, error code)."""

    accepted: bool
    #: HTTP status, or the WebSocket close code (None while it stayed open).
    status: int | None
    error_code: str | None = None


def headers_for(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def http_error_code(body: Any) -> str | None:
    return body.get("error", {}).get("code") if isinstance(body, dict) else None


async def http_get(server: ServerProcess, path: str, key: str | None) -> Outcome:
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + path, headers=headers_for(key)) as r:
            text = await r.text()
    if r.status == 401:
        return Outcome(False, 401, http_error_code(json.loads(text)))
    assert r.status == 200, (path, r.status, text)
    if path == "/metrics":
        assert "livekit_omni_sessions_total" in text
    else:
        assert json.loads(text)["object"] == "list"
    return Outcome(True, 200)


async def chat_completions(server: ServerProcess, key: str | None) -> Outcome:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/chat/completions", json=body, headers=headers_for(key)) as r:
            out = await r.json()
    if r.status == 401:
        return Outcome(False, 401, http_error_code(out))
    # Past auth, the loopback fixture has no language model: its own documented refusal is the answer.
    assert r.status == 400 and http_error_code(out) == "text_completions_unsupported", out
    return Outcome(True, r.status)


async def websocket_first_event(
    url: str, key: str | None, first: dict[str, Any] | None, subprotocols: list[str] | None = None
) -> Outcome:
    """Connect, optionally send ``first``, read the first event; a refusal must be that error, then close 1008."""
    async with websockets.connect(
        url,
        additional_headers=headers_for(key),
        subprotocols=subprotocols,  # type: ignore[arg-type]
        compression=None,
    ) as ws:
        if first is not None:
            # A refused socket may already be closed by the time this goes out (the server answers the bad key
            # as soon as it accepts); its error event is still in the receive buffer.
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(json.dumps(first))
        ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if ev["type"] == "error":
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            assert ws.close_code is not None
            return Outcome(False, ws.close_code, ev["error"]["code"])
        return (
            Outcome(True, None, None)
            if ev["type"] in ("session.started", "session.created")
            else Outcome(False, None, ev["type"])
        )


def live_ws(path: str) -> Callable[[ServerProcess, str | None], Awaitable[Outcome]]:
    async def attempt(server: ServerProcess, key: str | None) -> Outcome:
        url = server.url.replace("http://", "ws://") + path
        start = {"type": "session.start", "event_id": "s", "session": {"model": "gpt-live-1"}}
        return await websocket_first_event(url, key, start)

    return attempt


async def realtime_ws(server: ServerProcess, key: str | None) -> Outcome:
    return await websocket_first_event(
        server.url.replace("http://", "ws://") + "/v1/realtime?model=m", key, None
    )


async def realtime_ws_browser(server: ServerProcess, key: str | None) -> Outcome:
    """A browser cannot set headers on a WebSocket: its key rides in the ``openai-insecure-api-key.`` subprotocol."""
    protos = ["realtime"] + ([] if key is None else [f"openai-insecure-api-key.{key}"])
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=m"
    return await websocket_first_event(url, None, None, subprotocols=protos)


def webrtc_offer(path: str) -> Callable[[ServerProcess, str | None], Awaitable[Outcome]]:
    async def attempt(server: ServerProcess, key: str | None) -> Outcome:
        caller = WebRTCCaller(np.zeros(4800, np.int16), loop=False)
        try:
            body = {
                "session": {"model": "gpt-live-1"},
                "transport": {"type": "webrtc", "sdp": await caller.offer()},
            }
            headers = {"Content-Type": "application/json", **headers_for(key)}
            async with aiohttp.ClientSession() as http:
                async with http.post(server.url + path, data=json.dumps(body), headers=headers) as r:
                    out = await r.json()
            if r.status == 401:
                return Outcome(False, 401, http_error_code(out))
            assert r.status == 200 and "m=audio" in out["transport"]["sdp"], (r.status, out)
            # Accepted: complete the call, so the session the server opened is also closed cleanly.
            await caller.accept(out["transport"]["sdp"])
            await asyncio.wait_for(caller.opened.wait(), 10)
            return Outcome(True, 200)
        finally:
            await caller.close()

    return attempt


ENDPOINTS: dict[str, Callable[[ServerProcess, str | None], Awaitable[Outcome]]] = {
    "GET /metrics": lambda s, k: http_get(s, "/metrics", k),
    "GET /v1/models": lambda s, k: http_get(s, "/v1/models", k),
    "GET /models": lambda s, k: http_get(s, "/models", k),
    "POST /v1/chat/completions": chat_completions,
    "WS /v1/live/sessions": live_ws("/v1/live/sessions"),
    "WS /live/sessions": live_ws("/live/sessions"),
    "POST /v1/live/sessions (WebRTC offer)": webrtc_offer("/v1/live/sessions"),
    "POST /live/sessions (WebRTC offer)": webrtc_offer("/live/sessions"),
    "WS /v1/realtime": realtime_ws,
    "WS /v1/realtime (browser subprotocol key)": realtime_ws_browser,
}
#: The documented refusal: HTTP 401, or (on a WebSocket, after the upgrade) an error event then close 1008.
REFUSED_WITH = {name: 1008 if name.startswith("WS ") else 401 for name in ENDPOINTS}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_every_endpoint_needs_the_key(server: ServerProcess, endpoint: str) -> None:
    attempt = ENDPOINTS[endpoint]
    for key in (None, WRONG_KEY):
        got = await attempt(server, key)
        assert got == Outcome(False, REFUSED_WITH[endpoint], "invalid_api_key"), (endpoint, key, got)
    got = await attempt(server, API_KEY)
    assert got.accepted, (endpoint, got)


async def test_health_and_page_stay_public(server: ServerProcess) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/health", "/"):
            async with http.get(server.url + path) as r:
                assert r.status == 200, path


# --- what the engine shares with the media plane: owner-only ---------------------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_engine_socket_is_owner_only(server: ServerProcess) -> None:
    sock = Path(server.socket_path)
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert mode_of(sock) == 0o600, oct(mode_of(sock))


def test_ring_segments_are_owner_only() -> None:
    pair = RingPair.create(input_rate=16000, output_rate=24000)
    try:
        for name in pair.names:
            assert mode_of(SHM_DIR / name) == 0o600, (name, oct(mode_of(SHM_DIR / name)))
    finally:
        pair.close()
