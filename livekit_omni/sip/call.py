"""One SIP call: its dialog (aiosipua's :class:`~aiosipua.incoming_call.IncomingCall`), its RTP
(:class:`media.rtp.RtpPeer`) and its Realtime session, which is the call as the rest of the server knows it.

A call is one more way into the session core (docs/architecture.md, The serving side): a
:class:`~livekit_omni.realtime.session.RealtimeSession` over a :class:`SipCallTransport`, opened through the hub's
admission like any other, its audio on the media plane like a WebRTC call's (``carries_audio = False``: the RTP
peer's pacer pulls the egress player and hands each frame to ``session.on_frame``). Its events go to whoever
steers the call (the sidebands attached with ``?call_id=``), none when nobody does.

The life of a call:

1. **INVITE** (aiosipua has answered 100 Trying): a draining server answers 503; an offer with nothing we speak
   488; otherwise 180 Ringing, then the engine session opens (``session_limit_reached``: ``sip.limit_status``,
   486 or 503 with Retry-After; the engine unavailable: 503 with Retry-After; any other refusal 500), the RTP
   socket is bound, and the 200 OK carries the SDP answer. aiosipua retransmits it until the ACK;
2. **in the call**: a re-INVITE is answered on the same RTP port (hold: the caller's ``sendonly``/``inactive`` stops
   our sending, resume starts it again; a new address moves the RTP; a change of law plays the other law);
   RTP silence of ``sip.rtp_timeout_s`` while the caller should be sending ends the call;
3. **the end**, whoever ends it: the caller's BYE (200 OK, then the session ends at once: its engine session
   closes), a CANCEL before the answer (aiosipua answers 200 and 487; the session, if it opened, ends), no ACK for
   the 200 within 64×T1, or the session ending on our side (hang-up through the API, lifetime, engine lost,
   shutdown), which sends the BYE. The session's end closes the transport, which ends the SIP side once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from aiosipua.dialog import DialogState
from aiosipua.incoming_call import IncomingCall
from aiosipua.message import SipResponse

from engine_bridge import protocol as p
from engine_bridge.control import EngineRequestError
from livekit_omni.realtime import wire
from livekit_omni.realtime.session import RealtimeSession
from livekit_omni.sessions.errors import WireError
from livekit_omni.sessions.state import SessionState
from livekit_omni.sessions.transport import CLOSE_NORMAL
from livekit_omni.sip.sdp import Negotiated, SdpRefused, negotiate
from livekit_omni.sip.uas import OmniUAS
from media.codecs import G711_RATE
from media.rtp import RtpPeer, open_rtp_peer

if TYPE_CHECKING:
    from livekit_omni.sessions.hub import SessionHub
    from livekit_omni.sessions.websocket import WebSocketTransport
    from livekit_omni.settings import Settings
    from livekit_omni.sip.webhook import Webhook

log = logging.getLogger(__name__)

#: DTMF keys kept per call (the latest).
DTMF_HISTORY: Final = 64


class CallError(Exception):
    """A call-control request the call cannot carry out: the HTTP status and OpenAI's error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True, slots=True)
class Accept:
    """The app accepts the call with this session configuration (None: the default session)."""

    session: wire.SessionConfig | None


@dataclass(frozen=True, slots=True)
class Reject:
    """The app refuses the call with this SIP status."""

    status: int


Decision = Accept | Reject


class CallHost(Protocol):
    """What a call needs of the endpoint that made it (:class:`~livekit_omni.sip.server.SipServer`)."""

    hub: SessionHub
    settings: Settings
    #: Where RTP sockets bind; what SDP and Contact advertise; the SIP address (host, port) we advertise.
    rtp_host: str
    public_address: str
    advertised_addr: tuple[str, int]
    #: ``sip.session`` decoded: what a call's session is configured with when no webhook decides.
    session_defaults: wire.SessionConfig | None
    #: The app's webhook (None: every call is accepted with the default session).
    webhook: Webhook | None

    def retry_after(self) -> dict[str, str]: ...

    def refused(self, reason: str) -> None: ...

    def forget(self, call: SipCall) -> None: ...


def _api_error(e: WireError) -> CallError:
    """The accept request's answer when the engine refused the call's session: 429 at the session limit, 503 when
    the engine is unavailable, 400 for tools the engine cannot run (the app's configuration), else 500."""
    if e.code == "session_limit_reached":
        return CallError(429, e.code, e.message)
    if e.code == "engine_unavailable":
        return CallError(503, e.code, e.message)
    cause = e.__cause__
    if isinstance(cause, EngineRequestError) and cause.code == p.ErrorCode.INVALID_TOOLS:
        return CallError(400, "invalid_tools", cause.message)
    return CallError(500, e.code, e.message)


class SipCallTransport:
    """A SIP call's events: to each attached sideband (none: nowhere). Closing it ends the SIP side of the call."""

    kind = "sip"
    carries_audio = False

    def __init__(self, call: SipCall) -> None:
        self.call = call
        self.sidebands: set[WebSocketTransport] = set()
        self.closed = False

    def send(self, data: bytes) -> None:
        for sb in list(self.sidebands):
            if sb.closed:
                self.sidebands.discard(sb)
            else:
                sb.send(data)

    async def put(self, data: bytes) -> None:
        self.send(data)

    async def close(self, code: int, reason: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        for sb in list(self.sidebands):
            await sb.close(code, reason)
        self.sidebands.clear()
        await self.call.end_sip(reason)


class SipCall:
    """See the module docstring. Made by :class:`~livekit_omni.sip.server.SipServer` for each new INVITE."""

    def __init__(self, server: CallHost, uas: OmniUAS, incoming: IncomingCall) -> None:
        self.server = server
        self.uas = uas
        self.incoming = incoming
        self.session = RealtimeSession(server.hub, SipCallTransport(self))
        #: The call id of the API (``/v1/realtime/calls/{call_id}/...``, ``?call_id=``): the session's id.
        self.id = self.session.id
        self.sip_call_id = incoming.call_id
        self.rtp: RtpPeer | None = None
        self.negotiated: Negotiated | None = None
        self.cancelled = False
        self.ended = False
        self.created_at = time.monotonic()
        self.dtmf: collections.deque[str] = collections.deque(maxlen=DTMF_HISTORY)
        #: With a webhook: the app's decision (None: the caller cancelled while it was awaited), and how answering
        #: went after an accept (the accept request waits for it).
        self._decision: asyncio.Future[Decision | None] | None = None
        self._outcome: asyncio.Future[None] | None = None

    @property
    def answered(self) -> bool:
        return self.incoming._answered

    def __repr__(self) -> str:
        return f"SipCall({self.id}, {self.sip_call_id!r})"

    # --- INVITE ------------------------------------------------------------------------------------------------
    async def answer(self) -> None:
        """Take the INVITE through to 200 OK, or refuse it. Never raises."""
        try:
            await self._answer()
        except Exception:
            log.exception("sip call %s: answering failed", self.id)
            self.uas.reject(self.incoming, 500)
            self._settle(CallError(500, "internal_error", "answering the call failed"))
            if self.session.state is SessionState.NEW:
                await self._drop()
            else:
                await self.session.end(code=CLOSE_NORMAL, reason="internal_error", notify=False)
        finally:
            self._settle(CallError(409, "call_not_found", "the call ended before it was answered"))

    def _settle(self, error: CallError | None) -> None:
        fut = self._outcome
        if fut is not None and not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    async def _answer(self) -> None:
        server, inc, session = self.server, self.incoming, self.session
        sip = server.settings.sip
        if not server.hub.admitting:
            server.refused("draining")
            self.uas.reject(inc, 503, headers=server.retry_after())
            await self._drop()
            return
        offer = inc.sdp_offer
        if offer is None:
            server.refused("no_offer")
            self.uas.reject(inc, 488, "Not Acceptable Here (an offer in the INVITE is required)")
            await self._drop()
            return
        try:
            plan = negotiate(offer, local_ip=server.rtp_host, rtp_port=0, advertised_ip=server.public_address)
        except SdpRefused as e:
            log.info("sip call %s from %s: %s", self.id, inc.caller, e)
            server.refused("codec")
            self.uas.reject(inc, 488)
            await self._drop()
            return
        inc.ringing()
        config = server.session_defaults
        if server.webhook is not None:
            decision = await self._await_decision(server.webhook)
            if decision is None:
                return
            config = decision.session
        if config is not None:
            session.config = session.config.apply(config)
        try:
            await session.ensure_engine()
        except WireError as e:
            status: int = sip.limit_status if e.code == "session_limit_reached" else 503
            if e.code not in ("session_limit_reached", "engine_unavailable"):
                status = 500
            log.info("sip call %s: refused %d (%s: %s)", self.id, status, e.code, e.message)
            self.uas.reject(inc, status, headers=server.retry_after() if status == 503 else None)
            self._settle(_api_error(e))
            await session.transport_closed()
            return
        if self.cancelled or session.state is not SessionState.ACTIVE:
            await session.end(code=CLOSE_NORMAL, reason="cancelled", notify=False)
            return
        bridge = session.bridge
        assert bridge is not None
        player = bridge.output_at(G711_RATE)
        try:
            rtp = await open_rtp_peer(
                server.rtp_host,
                (sip.rtp_port_min, sip.rtp_port_max),
                bridge.writer,
                player,
                encoding=plan.encoding,
                payload_type=plan.payload_type,
                dtmf_payload_type=plan.dtmf_payload_type,
                remote=plan.remote,
                jitter_prefetch=sip.jitter_prefetch,
                on_output_frame=session.on_frame,
                on_dtmf=self._on_dtmf,
            )
        except OSError as e:
            log.error("sip call %s: %s", self.id, e)
            self.uas.reject(inc, 503, headers=server.retry_after())
            self._settle(CallError(503, "no_rtp_port", str(e)))
            await session.end(code=CLOSE_NORMAL, reason="no_rtp_port", notify=False)
            return
        self.rtp = rtp
        session.player = player
        session.attach_peer(rtp)  # manual turn-taking (turn_detection null): the audio waits for a commit
        if self.cancelled or session.state is not SessionState.ACTIVE:
            await session.end(code=CLOSE_NORMAL, reason="cancelled", notify=False)
            return
        neg = negotiate(
            offer, local_ip=server.rtp_host, rtp_port=rtp.local_port, advertised_ip=server.public_address
        )
        self.negotiated = neg
        rtp.sending = neg.caller_receives
        inc.accept(neg.answer)
        rtp.start()
        session.start()
        self._settle(None)
        if sip.rtp_timeout_s > 0:
            session.spawn(self._watch_rtp(sip.rtp_timeout_s))
        log.info(
            "sip call %s (%s) from %s: answered, %s/8000 RTP on %d",
            self.id,
            self.sip_call_id,
            inc.caller,
            neg.encoding.value.upper(),
            rtp.local_port,
        )

    async def _await_decision(self, webhook: Webhook) -> Accept | None:
        """Announce the call to the app and wait for its accept or reject (``sip.accept_timeout_s``). None: the
        call was refused or cancelled meanwhile (answered already)."""
        server, inc = self.server, self.incoming
        loop = asyncio.get_running_loop()
        self._decision = loop.create_future()
        if not await webhook.incoming(self.id, inc.invite):
            server.refused("webhook_failed")
            self.uas.reject(inc, 503, headers=server.retry_after())
            await self._drop()
            return None
        try:
            decision = await asyncio.wait_for(
                asyncio.shield(self._decision), server.settings.sip.accept_timeout_s
            )
        except TimeoutError:
            log.info("sip call %s: the app neither accepted nor rejected it in time", self.id)
            server.refused("not_accepted")
            self.uas.reject(inc, 480, "Temporarily Unavailable (not accepted in time)")
            await self._drop()
            return None
        if decision is None or self.cancelled:
            await self._drop()
            return None
        if isinstance(decision, Reject):
            log.info("sip call %s: rejected by the app (%d)", self.id, decision.status)
            server.refused("rejected")
            self.uas.reject(inc, decision.status)
            await self._drop()
            return None
        return decision

    @property
    def awaiting_decision(self) -> bool:
        return self._decision is not None and not self._decision.done()

    async def accept(self, session: wire.SessionConfig | None) -> None:
        """``POST .../accept``: answer the call with ``session``; returns once the 200 OK went out. Raises
        :class:`CallError` when the call is not waiting for a decision or answering it failed."""
        if not self.awaiting_decision:
            raise CallError(
                409, "call_not_pending", "the call is not waiting to be accepted (answered or ended)"
            )
        assert self._decision is not None
        self._outcome = asyncio.get_running_loop().create_future()
        self._decision.set_result(Accept(session))
        await self._outcome

    def reject(self, status: int) -> None:
        """``POST .../reject``: refuse the call with ``status``."""
        if not self.awaiting_decision:
            raise CallError(
                409, "call_not_pending", "the call is not waiting to be accepted (answered or ended)"
            )
        assert self._decision is not None
        self._decision.set_result(Reject(status))

    async def hangup(self) -> None:
        """``POST .../hangup``: a ringing call is declined (603), an answered one gets our BYE."""
        if self.awaiting_decision:
            self.reject(603)
            return
        if self.session.state is SessionState.ACTIVE:
            await self.session.end(code=CLOSE_NORMAL, reason="hangup")
            return
        raise CallError(404, "call_not_found", "the call has ended")

    async def refer(self, target: str) -> None:
        """``POST .../refer``: transfer the caller to ``target`` (a SIP REFER in the call's dialog, RFC 3515).
        Returns once the caller accepted the REFER (2xx); the caller then calls the target and reports how it
        went in NOTIFYs, and a successful transfer ends this call."""
        inc = self.incoming
        if not self.answered or self.ended or inc.dialog.state is not DialogState.CONFIRMED:
            raise CallError(409, "call_not_answered", "only an answered call can be transferred")
        host, port = self.server.advertised_addr
        req = inc.dialog.create_request(
            "REFER",
            via_host=host,
            via_port=port,
            via_transport="TCP" if self.uas.transport.reliable else "UDP",
        )
        req.headers.set_single("Refer-To", f"<{target}>")
        req.headers.set_single("Referred-By", f"<{inc.dialog.local_uri}>")
        req.headers.set_single("Contact", f"<sip:{host}:{port}>")
        req.headers.set_single("Content-Length", "0")
        try:
            response = await self.uas.send_request(req, inc.source_addr)
        except TimeoutError as e:
            raise CallError(504, "refer_timeout", "the caller did not answer the REFER") from e
        except (OSError, RuntimeError) as e:
            raise CallError(502, "refer_failed", f"cannot send the REFER: {e}") from e
        if response.status_code >= 300:
            raise CallError(
                502,
                "refer_refused",
                f"the caller refused the transfer: {response.status_code} {response.reason_phrase}",
            )
        log.info("sip call %s: transferring the caller to %s", self.id, target)

    def on_transfer_progress(self, status: int, reason: str) -> None:
        """A NOTIFY of the transfer (RFC 3515): a 2xx means the caller reached the target, so our leg ends."""
        log.info("sip call %s: transfer %d %s", self.id, status, reason)
        if 200 <= status < 300 and self.session.state is SessionState.ACTIVE:
            self.session.spawn(self.session.end(code=CLOSE_NORMAL, reason="transferred"))

    # --- in the call -------------------------------------------------------------------------------------------
    def on_reinvite(self) -> None:
        """A re-INVITE (aiosipua checked its dialog and CSeq): answer it on the same RTP port."""
        inc, rtp = self.incoming, self.rtp
        offer = inc.sdp_offer if inc.invite.body else None
        if rtp is None or self.ended:
            self.uas.reject(inc, 500)
            return
        if offer is None:
            # No offer (RFC 3261 §14.2: ours goes in the 200, the answer in the ACK): offer what we have.
            neg = self.negotiated
            inc.accept(neg.answer if neg is not None else None)
            return
        try:
            neg = negotiate(
                offer,
                local_ip=self.server.rtp_host,
                rtp_port=rtp.local_port,
                advertised_ip=self.server.public_address,
            )
        except SdpRefused as e:
            log.info("sip call %s: re-INVITE refused: %s", self.id, e)
            inc._send_response(488, "Not Acceptable Here")
            return
        old = self.negotiated
        self.negotiated = neg
        if old is None or neg.encoding is not old.encoding or neg.payload_type != rtp.payload_type:
            rtp.switch_codec(neg.encoding, neg.payload_type)
        rtp.dtmf_payload_type = neg.dtmf_payload_type
        rtp.set_remote(neg.remote)
        held = not neg.caller_receives
        if held != (not rtp.sending):
            log.info("sip call %s: %s", self.id, "on hold" if held else "resumed")
        rtp.sending = neg.caller_receives
        inc.accept(neg.answer)

    def _on_dtmf(self, key: str, timestamp: int) -> None:
        """A key press (RFC 4733): to whoever steers the call, as the Realtime dialect's event."""
        self.dtmf.append(key)
        log.info("sip call %s: DTMF %s", self.id, key)
        if self.session.state is SessionState.ACTIVE:
            self.session.emit(wire.DtmfEventReceived(event=key, received_at=int(time.time())))

    async def _watch_rtp(self, timeout_s: float) -> None:
        while self.session.state is SessionState.ACTIVE:
            await asyncio.sleep(1.0)
            rtp, neg = self.rtp, self.negotiated
            if rtp is None or neg is None or not neg.caller_sends:
                continue
            if rtp.idle_s > timeout_s:
                log.info("sip call %s: no RTP for %.0f s; hanging up", self.id, rtp.idle_s)
                await self.session.end(code=CLOSE_NORMAL, reason="rtp_timeout")
                return

    # --- the end -----------------------------------------------------------------------------------------------
    def on_bye(self) -> None:
        """The caller hung up (aiosipua answered 200 OK): the session ends now."""
        log.info("sip call %s: the caller hung up", self.id)
        self.session.spawn(self.session.end(code=CLOSE_NORMAL, reason="caller_hangup"))

    def on_cancel(self) -> None:
        """CANCEL before our 200 (aiosipua answered 200 and 487): the answering task sees it at its next step."""
        log.info("sip call %s: cancelled by the caller", self.id)
        self.cancelled = True
        if self._decision is not None and not self._decision.done():
            self._decision.set_result(None)
        if self.session.state is SessionState.ACTIVE:
            self.session.spawn(self.session.end(code=CLOSE_NORMAL, reason="cancelled", notify=False))

    def on_session_expired(self) -> None:
        """No session refresh came in time (RFC 4028): aiosipua sent the BYE; the session ends."""
        log.info("sip call %s: the session timer expired", self.id)
        self.session.spawn(self.session.end(code=CLOSE_NORMAL, reason="session_expired", notify=False))

    def on_ack_timeout(self) -> None:
        log.info("sip call %s: our 200 OK was never acknowledged; ending the call", self.id)
        self.session.spawn(self.session.end(code=CLOSE_NORMAL, reason="no_ack", notify=False))

    async def end_sip(self, reason: str) -> None:
        """The session ended (its transport closed): the SIP side ends once. An answered call the caller did not
        end gets our BYE; one not yet answered is refused."""
        if self.ended:
            return
        self.ended = True
        rtp = self.rtp
        if rtp is not None:
            await rtp.close()
            st, pacer = rtp.stats, rtp.pacer
            log.info(
                "sip call %s ended (%s): rtp in %d frames (%d concealed, %d gaps, %d foreign, %d malformed), "
                "out %d packets; pacer %d ticks, %d late, %d skipped",
                self.id,
                reason or "caller gone",
                st.frames_in,
                st.concealed,
                st.gaps,
                st.foreign,
                st.malformed,
                st.packets_out,
                pacer.ticks,
                pacer.late,
                pacer.skipped,
            )
        inc = self.incoming
        if inc.dialog.state is DialogState.CONFIRMED:
            self._send_bye()
        elif inc.dialog.state is DialogState.EARLY and not self.cancelled:
            self.uas.reject(inc, 503 if reason in ("server_shutdown", "draining") else 480)
        if inc.dialog.state is DialogState.TERMINATED and self.answered:
            self.uas.forget(inc)
        self.server.forget(self)

    def _send_bye(self) -> None:
        inc = self.incoming
        host, port = self.server.advertised_addr
        bye = inc.dialog.create_request(
            "BYE", via_host=host, via_port=port, via_transport="TCP" if self.uas.transport.reliable else "UDP"
        )
        inc.dialog.terminate()
        try:
            fut = self.uas.send_request(bye, inc.source_addr)
        except (OSError, RuntimeError) as e:  # a TCP caller whose connection is gone
            log.info("sip call %s: cannot send BYE: %s", self.id, e)
            return
        fut.add_done_callback(self._bye_done)

    def _bye_done(self, fut: asyncio.Future[SipResponse]) -> None:
        if fut.cancelled():
            return
        e = fut.exception()
        if e is not None:
            log.info("sip call %s: our BYE got no answer: %s", self.id, e)

    async def _drop(self) -> None:
        """A call refused before its engine session opened: nothing to close but our bookkeeping."""
        self.ended = True
        self.server.forget(self)
        if self.session.state is SessionState.NEW:
            self.session.advance(SessionState.CLOSED)

    def stats(self) -> dict[str, object]:
        return {
            "call_id": self.id,
            "sip_call_id": self.sip_call_id,
            "codec": self.negotiated.encoding.value if self.negotiated else None,
            "rtp": self.rtp.stats.as_dict() if self.rtp else {},
            "dtmf": "".join(self.dtmf),
        }
