"""Requests for state another worker holds go to that worker (``livekit-omni serve --workers N``).

The kernel hands each new connection to whichever worker accepts it first, but a session, its resume token, a
Realtime call and an ephemeral key live in the worker that made them (their ids carry its index,
:mod:`livekit_omni.worker_ids`). A request that names one of them and lands elsewhere is relayed, whole, to the
owner over the owner's private Unix socket, and the owner answers it as if it had been sent there:

* ``POST .../realtime/calls/{call_id}/hangup``: by the call id;
* ``POST .../realtime/calls`` with ``Authorization: Bearer ek_...``: by the ephemeral key, so a key is spent in the
  one worker that minted it and stays single use across all of them (the call then lives on that worker);
* ``POST .../live/sessions`` with a ``resume_token`` (a WebRTC resume): by the token;
* a Realtime WebSocket with ``?call_id=`` (a sideband): by the call id, relayed frame by frame;
* a Live WebSocket whose first message is ``session.resume``: by the token (:func:`relay_accepted_websocket`, called
  by the Live socket after it read that message).

A relayed request carries :data:`RELAYED_HEADER` and is never relayed again. When the owner cannot be reached (it
died, so its state is gone) the local worker answers, which tells the client the id is unknown. With one worker
(the default) nothing here runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Final

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from livekit_omni import worker_ids
from livekit_omni.auth import EPHEMERAL_KEY_PREFIX
from livekit_omni.metrics import Metrics

log = logging.getLogger(__name__)

#: Set on every relayed request (the value is the relaying worker's index); such a request is served locally.
RELAYED_HEADER: Final = "x-livekit-omni-relayed"
#: Largest request body read to find a resume token (larger ones are refused by the route anyway).
MAX_PROBE_BODY_BYTES: Final = 1024 * 1024
#: What the owner is told when the client's connection dropped without a close frame (or with a code a peer may not
#: send): any code but 1000/1001 detaches a Live session for a resume, exactly as the lost connection would.
CLIENT_LOST_CLOSE_CODE: Final = 4000
#: What the client is told when the owner's connection ended without a close frame (the owner died).
OWNER_LOST_CLOSE_CODE: Final = 1012
#: Hop-by-hop headers and those the relay recomputes.
_SKIP_HEADERS: Final = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer"}
)
_WS_SKIP_HEADERS: Final = _SKIP_HEADERS | {
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-extensions",
    "sec-websocket-protocol",
}
_HANGUP: Final = re.compile(r"/realtime/calls/([^/]+)/hangup$")


class _ResumeProbe(msgspec.Struct):
    resume_token: str | None = None


class _SessionResumeProbe(msgspec.Struct):
    type: str = ""
    resume_token: str | None = None


_resume_probe: Final = msgspec.json.Decoder(_ResumeProbe)
_session_resume_probe: Final = msgspec.json.Decoder(_SessionResumeProbe)


def _header(scope: Scope, name: bytes) -> str:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v).decode("latin-1")
    return ""


def _is_relayed(scope: Scope) -> bool:
    return bool(_header(scope, RELAYED_HEADER.encode()))


def _bearer(scope: Scope) -> str:
    scheme, _, token = _header(scope, b"authorization").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _query_param(scope: Scope, name: str) -> str | None:
    from urllib.parse import parse_qs

    values = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1")).get(name)
    return values[0] if values else None


def _target(scope: Scope) -> str:
    qs = bytes(scope.get("query_string", b"")).decode("latin-1")
    path = scope.get("raw_path") or scope["path"].encode()
    return "http://worker" + bytes(path).decode("latin-1") + ("?" + qs if qs else "")


def _forward_headers(scope: Scope, skip: frozenset[str], me: int) -> list[tuple[str, str]]:
    out = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in scope.get("headers", ())
        if k.decode("latin-1").lower() not in skip
    ]
    out.append((RELAYED_HEADER, str(me)))
    return out


class Relay:
    """One HTTP client per peer worker (over its Unix socket), made on first use and closed with the app."""

    def __init__(self, identity: worker_ids.WorkerIdentity, metrics: Metrics) -> None:
        self.identity = identity
        self.metrics = metrics
        self._clients: dict[int, aiohttp.ClientSession] = {}

    def client(self, index: int) -> aiohttp.ClientSession:
        c = self._clients.get(index)
        if c is None or c.closed:
            c = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.identity.socket_path(index)),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=None),
            )
            self._clients[index] = c
        return c

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    # --- HTTP ----------------------------------------------------------------------------------------------------
    async def http(self, owner: int, scope: Scope, body: bytes, send: Send) -> bool:
        """Relay one HTTP request to ``owner`` and send its answer; False (nothing sent) if it cannot be reached."""
        headers = _forward_headers(scope, _SKIP_HEADERS, self.identity.index)
        try:
            async with self.client(owner).request(
                scope["method"], _target(scope), headers=headers, data=body, allow_redirects=False
            ) as r:
                payload = await r.read()
                out = [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in r.headers.items()
                    if k.lower() not in _SKIP_HEADERS
                ]
                status = r.status
        except (aiohttp.ClientConnectionError, OSError) as e:
            log.warning(
                "worker %d: cannot reach worker %d (%s); answering here", self.identity.index, owner, e
            )
            return False
        self.metrics.relayed_requests.labels(kind="http").inc()
        out.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": payload})
        return True

    # --- WebSocket -----------------------------------------------------------------------------------------------
    async def open_websocket(
        self, owner: int, scope: Scope, subprotocols: Iterable[str]
    ) -> aiohttp.ClientWebSocketResponse | None:
        headers = _forward_headers(scope, _WS_SKIP_HEADERS, self.identity.index)
        try:
            upstream = await self.client(owner).ws_connect(
                _target(scope), headers=headers, protocols=tuple(subprotocols), max_msg_size=0, autoping=True
            )
        except (aiohttp.ClientError, OSError) as e:
            log.warning(
                "worker %d: cannot reach worker %d (%s); answering here", self.identity.index, owner, e
            )
            return None
        self.metrics.relayed_requests.labels(kind="websocket").inc()
        return upstream


async def pipe_websocket(receive: Receive, send: Send, upstream: aiohttp.ClientWebSocketResponse) -> None:
    """Frames both ways between an accepted ASGI WebSocket and ``upstream`` until either side closes; the close
    code crosses too (a dropped client as :data:`CLIENT_LOST_CLOSE_CODE`, a dropped owner as
    :data:`OWNER_LOST_CLOSE_CODE`)."""

    async def client_to_owner() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "websocket.disconnect":
                code = int(msg.get("code") or 1006)
                await upstream.close(code=code if code in (1000, 1001) else CLIENT_LOST_CLOSE_CODE)
                return
            if msg.get("text") is not None:
                await upstream.send_str(msg["text"])
            elif msg.get("bytes") is not None:
                await upstream.send_bytes(msg["bytes"])

    async def owner_to_client() -> None:
        async for m in upstream:
            if m.type is aiohttp.WSMsgType.TEXT:
                await send({"type": "websocket.send", "text": m.data})
            elif m.type is aiohttp.WSMsgType.BINARY:
                await send({"type": "websocket.send", "bytes": m.data})
        code = upstream.close_code
        if code is None or code in (1005, 1006):
            code = OWNER_LOST_CLOSE_CODE
        reason = upstream.extra.get("close_reason", "") if hasattr(upstream, "extra") else ""
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": code, "reason": reason or ""})

    tasks = [asyncio.create_task(client_to_owner()), asyncio.create_task(owner_to_client())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if tasks[0] in done and not tasks[1].done():
            # The client left: let the owner's close reach us (bounded), then stop.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(tasks[1]), 5.0)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if not upstream.closed:
            await upstream.close()


def relay_of(app: Any) -> Relay | None:
    return getattr(app.state, "relay", None)


def resume_owner(data: str | bytes) -> int | None:
    """The worker owning the token of a Live ``session.resume`` message, when that is another worker."""
    if worker_ids.current() is None or b"session.resume" not in (
        data.encode() if isinstance(data, str) else data
    ):
        return None
    try:
        msg = _session_resume_probe.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    return worker_ids.foreign_owner(msg.resume_token) if msg.type == "session.resume" else None


async def relay_accepted_websocket(
    app: Any, scope: Scope, receive: Receive, send: Send, owner: int, first: str | bytes
) -> bool:
    """Hand an accepted Live WebSocket whose first message (``first``) is a ``session.resume`` for ``owner``'s
    session over to ``owner``. False when the owner cannot be reached (the caller then answers it itself)."""
    relay = relay_of(app)
    if relay is None or _is_relayed(scope):
        return False
    upstream = await relay.open_websocket(owner, scope, ())
    if upstream is None:
        return False
    if isinstance(first, str):
        await upstream.send_str(first)
    else:
        await upstream.send_bytes(first)
    await pipe_websocket(receive, send, upstream)
    return True


class WorkerRouter:
    """ASGI middleware (outermost) of a worker: relays requests for another worker's state to that worker."""

    def __init__(self, app: ASGIApp, relay: Relay) -> None:
        self.app = app
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _is_relayed(scope):
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket" and not _is_relayed(scope):
            await self._websocket(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        owner: int | None = None
        body_needed = False
        if scope["method"] == "POST":
            hangup = _HANGUP.search(path)
            if hangup:
                owner = worker_ids.foreign_owner(hangup.group(1))
            elif path.endswith("/realtime/calls"):
                token = _bearer(scope)
                if token.startswith(EPHEMERAL_KEY_PREFIX):
                    owner = worker_ids.foreign_owner(token[len(EPHEMERAL_KEY_PREFIX) :])
                body_needed = owner is not None
            elif path.endswith("/live/sessions"):
                body_needed = True
        if not body_needed and owner is None:
            await self.app(scope, receive, send)
            return
        body, complete = await _read_body(receive, MAX_PROBE_BODY_BYTES)
        if owner is None and complete:
            with contextlib.suppress(
                msgspec.DecodeError, UnicodeDecodeError, RecursionError, msgspec.ValidationError
            ):
                owner = worker_ids.foreign_owner(_resume_probe.decode(body).resume_token)
        if owner is not None and complete and await self.relay.http(owner, scope, body, send):
            return
        await self.app(scope, _replay(body, complete, receive), send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        call_id = _query_param(scope, "call_id") if scope["path"].endswith("/realtime") else None
        owner = worker_ids.foreign_owner(call_id)
        if owner is None:
            await self.app(scope, receive, send)
            return
        connect = await receive()  # websocket.connect
        offered = [s.strip() for s in _header(scope, b"sec-websocket-protocol").split(",") if s.strip()]
        upstream = await self.relay.open_websocket(owner, scope, offered)
        if upstream is None:
            await self.app(scope, _replay_messages([connect], receive), send)
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.protocol})
        await pipe_websocket(receive, send, upstream)


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The request body up to ``limit`` bytes, and whether that is all of it."""
    body = bytearray()
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return bytes(body), False
        body += msg.get("body", b"")
        if not msg.get("more_body", False):
            return bytes(body), True
        if len(body) > limit:
            return bytes(body), False


def _replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` first (as one message), then, if it was not all, the rest of the stream."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": not complete}
        return await receive()

    return replay


def _replay_messages(messages: list[Message], receive: Receive) -> Receive:
    queue = list(messages)

    async def replay() -> Message:
        return queue.pop(0) if queue else await receive()

    return replay


# --- /metrics of all workers ------------------------------------------------------------------------------------


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_metrics(texts: dict[int, str]) -> bytes:
    """Each worker's Prometheus text (by index) as one exposition, every sample labelled ``worker="<index>"``."""
    merged: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.samples.append(s._replace(labels={**s.labels, "worker": str(index)}))
    registry = CollectorRegistry()
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)


async def gather_metrics(app: Any, local: Callable[[], Awaitable[str]], authorization: str) -> bytes | None:
    """All workers' metrics merged (:func:`merge_metrics`), or None for a single server; a worker that does not
    answer is left out (its sessions died with it). ``authorization`` is the scraper's header, which the other
    workers check as this one did."""
    relay = relay_of(app)
    if relay is None:
        return None
    ident = relay.identity
    texts: dict[int, str] = {ident.index: await local()}

    async def fetch(index: int) -> None:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with relay.client(index).get(
                "http://worker/metrics",
                headers={RELAYED_HEADER: str(ident.index), "authorization": authorization},
                timeout=aiohttp.ClientTimeout(total=5.0),
            ) as r:
                if r.status == 200:
                    texts[index] = await r.text()

    await asyncio.gather(*(fetch(i) for i in range(ident.count) if i != ident.index))
    return merge_metrics(texts)


def is_relayed_request(scope: Scope) -> bool:
    return _is_relayed(scope)
