"""OpenAI's call control for SIP calls: ``POST /v1/realtime/calls/{call_id}/accept``, ``/reject``, ``/refer`` and
``/hangup`` (the openai SDK's ``client.realtime.calls.accept/reject/refer/hangup``), behind the app's API-key check.

* ``accept``: the body is the call's session (``{"type": "realtime", "instructions": ..., "tools": ...}``, as a
  ``session.update``'s ``session``; ``audio.format`` is ignored: SIP negotiated the codec). 200 once the caller got
  our 200 OK; 400 for a session that does not apply; 409 for a call not waiting to be accepted; 429 or 503 when the
  engine refuses the session (the caller then gets 503 or 486).
* ``reject``: ``{"status_code": 300..699}`` (default 603 Decline) is the caller's answer.
* ``refer``: ``{"target_uri": "sip:..." | "tel:..."}``: a SIP REFER transfers the caller; 200 once the caller
  accepted it (202), 409 before the call is answered, 502 when the caller refused it, 504 without an answer.
* ``hangup``: a ringing SIP call is declined (603), an answered one gets our BYE; any other call id goes on to the
  Realtime dialect's hang-up (WebRTC calls).

404 ``call_not_found`` for a call this server does not hold. These routes come before the Realtime dialect's, so
``/hangup`` reaches SIP calls first.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from livekit_omni.realtime import wire
from livekit_omni.realtime.calls import hangup_call
from livekit_omni.realtime.config import RealtimeConfig
from livekit_omni.sessions.errors import error_response
from livekit_omni.sip.call import CallError, SipCall

#: Largest body of a call-control request (a session with tools).
MAX_BODY: Final = 1 << 20
_TARGET: Final = re.compile(r"^(sips?|tel):[^\s<>\"]{1,1000}$", re.IGNORECASE)
_session_decoder: Final = msgspec.json.Decoder(wire.SessionConfig)


class _Bad(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _call(request: Request) -> SipCall:
    sip = getattr(request.app.state, "sip", None)
    call = sip.find(request.path_params["call_id"]) if sip is not None else None
    if call is None:
        raise _Bad(404, "call_not_found", "no SIP call with that id on this server")
    return call


async def _body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise _Bad(400, "request_too_large", f"the body is limited to {MAX_BODY} bytes")
    return bytes(body)


async def _json(request: Request) -> dict[str, Any]:
    raw = await _body(request)
    if not raw.strip():
        return {}
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise _Bad(400, "invalid_json", f"the body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise _Bad(400, "invalid_value", "the body must be a JSON object")
    return data


def _handled(fn: Any) -> Any:
    async def route(request: Request) -> Response:
        try:
            return await fn(request)
        except _Bad as e:
            return error_response(e.status, e.code, e.message)
        except CallError as e:
            return error_response(e.status, e.code, e.message)

    route.__name__ = fn.__name__
    return route


@_handled
async def accept(request: Request) -> Response:
    call = _call(request)
    raw = await _body(request)
    session: wire.SessionConfig | None = None
    if raw.strip():
        try:
            session = _session_decoder.decode(raw)
        except (msgspec.DecodeError, RecursionError) as e:
            raise _Bad(400, "invalid_value", f"the body is not a Realtime session: {e}") from e
        try:
            RealtimeConfig(model="check").apply(session)  # refused here, before the call moves on
        except wire.WireError as e:
            raise _Bad(400, e.code, e.message) from e
    await call.accept(session)
    return Response(status_code=200)


@_handled
async def reject(request: Request) -> Response:
    call = _call(request)
    body = await _json(request)
    status = body.get("status_code", 603)
    if not isinstance(status, int) or isinstance(status, bool) or not 300 <= status <= 699:
        raise _Bad(400, "invalid_value", "status_code must be a SIP final status from 300 to 699")
    call.reject(status)
    return Response(status_code=200)


@_handled
async def refer(request: Request) -> Response:
    call = _call(request)
    body = await _json(request)
    target = body.get("target_uri")
    if not isinstance(target, str) or not _TARGET.match(target.strip()):
        raise _Bad(400, "invalid_value", "target_uri must be a sip:, sips: or tel: URI")
    await call.refer(target.strip())
    return Response(status_code=200)


async def hangup(request: Request) -> Response:
    sip = getattr(request.app.state, "sip", None)
    call = sip.find(request.path_params["call_id"]) if sip is not None else None
    if call is None:
        return await hangup_call(request)
    try:
        await call.hangup()
    except CallError as e:
        return error_response(e.status, e.code, e.message)
    return Response(status_code=200)


def routes() -> list[BaseRoute]:
    out: list[BaseRoute] = []
    for prefix in ("/v1/realtime/calls", "/realtime/calls"):
        out += [
            Route(prefix + "/{call_id}/accept", accept, methods=["POST"]),
            Route(prefix + "/{call_id}/reject", reject, methods=["POST"]),
            Route(prefix + "/{call_id}/refer", refer, methods=["POST"]),
            Route(prefix + "/{call_id}/hangup", hangup, methods=["POST"]),
        ]
    return out
