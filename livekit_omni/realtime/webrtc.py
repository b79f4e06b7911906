"""The Realtime dialect over WebRTC: ``POST /v1/realtime/calls`` (and ``/realtime/calls``).

The body is the client's SDP offer, either raw (``Content-Type: application/sdp``: browsers, agents-js) or
``multipart/form-data`` with an ``sdp`` part and a ``session`` part holding the session's JSON configuration (the
openai SDK's ``client.realtime.calls.create``, usually relayed by an app's backend). The answer is
``201 Created``, ``Content-Type: application/sdp``, the SDP answer as the body and ``Location:
/v1/realtime/calls/<call_id>``.

The call is one :class:`~livekit_omni.realtime.session.RealtimeSession`, the same as a Realtime WebSocket's, with
a different transport: its events are the same JSON events on the client's ``oai-events`` data channel (one event
per message), and both directions of audio ride the media track (Opus, or G.711 when that is all the offer has)
through the Live dialect's WebRTC media plane (:func:`media.webrtc.answer_offer`). So there is no
``input_audio_buffer.append`` and no ``response.output_audio.delta``; instead ``output_audio_buffer.started``
marks a response's first audio on the track, and ``output_audio_buffer.stopped`` (all of it played) or
``output_audio_buffer.cleared`` (cut by a barge-in or ``output_audio_buffer.clear``) follows its ``response.done``.
The engine session opens with the POST. In manual mode (``turn_detection: null``, at the start or by a later
``session.update``) the track's audio is held by the session until ``input_audio_buffer.commit`` makes it a user
item, as appended audio is over the WebSocket.

Auth: ``Authorization: Bearer`` with an API key, or with an ephemeral key from ``/v1/realtime/client_secrets``
(spent by this call; its session is the call's starting configuration). After the answer, the call can be hung up
and watched or steered from a sideband WebSocket (:mod:`livekit_omni.realtime.calls`). Errors are OpenAI's JSON error body:
400 for a bad request, 401 for a bad key, 429 when the engine has no free session slot, 503 when it is unavailable
or the server is draining.
"""

from __future__ import annotations

import logging
from typing import Final

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from livekit_omni.auth import EPHEMERAL_KEY_PREFIX as EPHEMERAL_PREFIX
from livekit_omni.auth import bearer_token, key_is_valid
from livekit_omni.realtime import wire
from livekit_omni.realtime.calls import CallTransport
from livekit_omni.realtime.client_secrets import keys_of
from livekit_omni.realtime.session import RealtimeSession
from livekit_omni.sessions import webrtc as signalling
from livekit_omni.sessions.hub import SessionHub
from livekit_omni.sessions.transport import CLOSE_TRY_AGAIN
from media.webrtc import SdpError, check_offer

log = logging.getLogger(__name__)

CALLS_PATH: Final = "/v1/realtime/calls"
_session_decoder: Final = msgspec.json.Decoder(wire.SessionConfig)

#: HTTP status of each refusal the engine can give when the call's session opens.
_OPEN_STATUS: Final = {"session_limit_reached": 429, "engine_unavailable": 503}


class _BadRequest(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _parse_offer(request: Request, body: bytes) -> tuple[str, wire.SessionConfig | None]:
    """The SDP offer and the optional session configuration of a raw or multipart body."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":

        async def replay() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        form = await Request(request.scope, replay).form(max_files=2, max_fields=8)
        try:
            sdp_part, session_part = form.get("sdp"), form.get("session")
            sdp = (await sdp_part.read()).decode() if isinstance(sdp_part, UploadFile) else sdp_part
            raw_session = (
                (await session_part.read()).decode() if isinstance(session_part, UploadFile) else session_part
            )
        finally:
            await form.close()
        if not sdp:
            raise _BadRequest("invalid_value", "the multipart body needs an 'sdp' part with the SDP offer")
        session = None
        if raw_session:
            try:
                session = _session_decoder.decode(raw_session)
            except (msgspec.DecodeError, RecursionError) as e:
                raise _BadRequest("invalid_value", f"the 'session' part is not a valid session: {e}") from e
        return sdp, session
    if ctype in ("application/sdp", "text/plain", ""):
        try:
            return body.decode(), None
        except UnicodeDecodeError as e:
            raise _BadRequest("invalid_value", "the SDP offer is not UTF-8 text") from e
    raise _BadRequest(
        "invalid_value", f"the body must be application/sdp or multipart/form-data, not {ctype or 'empty'}"
    )


async def create_call(request: Request) -> Response:
    return await signalling.answer_offer_request(request, _create)


async def _create(request: Request, hub: SessionHub) -> Response:
    signalling.refuse_if_draining(hub)
    # Auth: the app's middleware lets ephemeral keys through to here (only this route can spend one).
    token = bearer_token(request.headers)
    ephemeral = keys_of(request.app).redeem(token) if token.startswith(EPHEMERAL_PREFIX) else None
    if ephemeral is None and not key_is_valid(hub.settings, token):
        hub.metrics.rejected_sessions.labels(reason="invalid_api_key").inc()
        raise signalling.OfferRefused(401, "invalid_api_key", "missing, invalid, expired or spent API key")
    body = await signalling.read_offer(request, hub)
    try:
        sdp, session_cfg = await _parse_offer(request, body)
    except _BadRequest as e:
        raise signalling.OfferRefused(400, e.code, e.message) from e
    signalling.check_sdp_size(sdp, hub)
    try:
        check_offer(sdp)  # before an engine slot is taken: a bad offer is a 400 even on a full engine
    except SdpError as e:
        raise signalling.OfferRefused(400, "invalid_sdp", str(e)) from e

    channel = signalling.DataChannelTransport()
    session = RealtimeSession(hub, CallTransport(channel))
    try:
        for update in (ephemeral.session if ephemeral is not None else None, session_cfg):
            if update is not None:
                session.config = session.config.apply(update)
    except wire.WireError as e:
        raise signalling.OfferRefused(400, e.code, e.message) from e

    def on_stalled() -> None:
        session.spawn(session.end(code=CLOSE_TRY_AGAIN, reason="client_not_reading"))

    channel.on_stalled = on_stalled
    signalling.refuse_if_draining(hub)  # the drain began while the body was read
    try:
        await session.ensure_engine()
    except wire.WireError as e:
        await session.transport_closed()
        raise signalling.OfferRefused(_OPEN_STATUS.get(e.code, 500), e.code, e.message, type=e.type) from e

    async def on_state(state: str) -> None:
        if state in ("failed", "closed"):
            await session.transport_closed()

    peer = await signalling.answer_call(
        session, sdp, on_connection_state=on_state, on_output_frame=session.on_frame
    )
    channel.peer = peer
    session.player = peer.player
    session.attach_peer(peer)  # manual mode: the track's audio waits for input_audio_buffer.commit
    # Queued by the peer until the client's data channel opens, then sent first.
    session.start()
    signalling.watch_connect(session, peer, lambda: session.end(code=CLOSE_TRY_AGAIN, reason="not_connected"))
    log.info("realtime call %s: codec %s", session.id, peer.codec)
    return Response(
        peer.answer_sdp,
        status_code=201,
        media_type="application/sdp",
        headers={"Location": f"{CALLS_PATH}/{session.id}"},
    )
