"""The SIP endpoint of ``livekit-omni serve``: aiosipua user agent servers on UDP and TCP, one :class:`SipCall` per
INVITE. Started and stopped with the app (``sip.enabled``; docs/sip.md).

Requests go through the hardened transports (:mod:`livekit_omni.sip.transport`: retransmissions answered from the
transaction's last response, TCP responses on their connection, unparseable input dropped) and aiosipua's dialog
handling (:class:`~livekit_omni.sip.uas.OmniUAS`); what is left for us is the calls. OPTIONS (a trunk's or a
proxy's keep-alive probe) is answered 200 with our Allow list while the server admits calls, and 503 with
Retry-After while it drains, so a proxy's dispatcher takes a draining node out of rotation.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from functools import partial
from typing import Any, Final

import msgspec
from aiosipua.incoming_call import IncomingCall
from aiosipua.message import SipRequest, SipResponse
from aiosipua.utils import generate_tag

from livekit_omni.realtime import wire
from livekit_omni.realtime.config import RealtimeConfig
from livekit_omni.sessions.hub import SessionHub
from livekit_omni.settings import Settings
from livekit_omni.sip.auth import DigestAuthenticator, source_filter
from livekit_omni.sip.call import SipCall
from livekit_omni.sip.transport import OmniTcpTransport, OmniUdpTransport
from livekit_omni.sip.uas import OmniUAS
from livekit_omni.sip.webhook import Webhook

log = logging.getLogger(__name__)

#: The methods we answer (the Allow header).
ALLOW: Final = "INVITE, ACK, BYE, CANCEL, OPTIONS, UPDATE"
#: Calls in progress are bounded by the engine's admission; this bounds the calls not answered yet (ringing, waiting
#: for the app's decision, opening their engine session), what a flood of INVITEs can hold on this side.
MAX_PENDING_CALLS: Final = 256


class SipError(RuntimeError):
    """The SIP endpoint cannot start (bad settings, the port is taken)."""


def default_route_address() -> str:
    """The local address of the interface of the default route (no packet is sent), or 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, only looked up
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


class SipServer:
    """Every SIP transport of the server and its calls."""

    def __init__(self, hub: SessionHub, settings: Settings) -> None:
        sip = settings.sip
        self.hub = hub
        self.settings = settings
        host = sip.host or settings.host
        self.host = host
        self.public_address = sip.public_address or (default_route_address() if _wildcard(host) else host)
        #: Where the calls' RTP sockets bind.
        self.rtp_host = host
        self.advertised_addr = (self.public_address, sip.port)
        self.session_defaults: wire.SessionConfig | None = None
        if sip.session:
            try:
                self.session_defaults = msgspec.convert(sip.session, wire.SessionConfig)
                RealtimeConfig(model=settings.model_name).apply(
                    self.session_defaults
                )  # refused now, not per call
            except msgspec.ValidationError as e:
                raise SipError(f"sip.session is not a Realtime session configuration: {e}") from e
            except wire.WireError as e:
                raise SipError(f"sip.session: {e.message}") from e
        self.allowed = source_filter(sip.allowed_sources)
        self.auth = (
            DigestAuthenticator(
                {c.username: c.password for c in sip.credentials},
                realm=sip.realm,
                algorithm=sip.digest_algorithm,
            )
            if sip.credentials
            else None
        )
        self.webhook: Webhook | None = None
        if sip.webhook_url:
            if not sip.webhook_secret:
                raise SipError("sip.webhook_url needs sip.webhook_secret (the webhook is signed)")
            try:
                self.webhook = Webhook(sip.webhook_url, sip.webhook_secret)
            except ValueError as e:
                raise SipError(f"sip.webhook_secret: {e}") from e
        self.uas: list[OmniUAS] = []
        #: Calls by SIP Call-ID (being answered or in progress).
        self.calls: dict[str, SipCall] = {}
        self.refusals: dict[str, int] = {}

    # --- life ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        sip = self.settings.sip
        if not log.isEnabledFor(logging.DEBUG):
            # aiosipua logs a warning for every malformed request it meets; ours counts them and logs one in a
            # hundred (livekit_omni/sip/transport.py), so a scanner cannot fill the log.
            logging.getLogger("aiosipua").setLevel(logging.ERROR)
        for name in dict.fromkeys(sip.transports):
            transport: OmniUdpTransport | OmniTcpTransport = (
                OmniUdpTransport(local_addr=(self.host, sip.port))
                if name == "udp"
                else OmniTcpTransport(local_addr=(self.host, sip.port))
            )
            transport.hardening.allowed = self.allowed
            uas = OmniUAS(
                transport,
                user_agent=sip.user_agent,
                advertised_addr=self.advertised_addr,
                session_expires=sip.session_expires_s or None,
                min_se=sip.min_se_s,
            )
            if self.uas:
                # One table of dialogs and INVITE transactions for every transport: a caller may send its BYE or
                # CANCEL over UDP for a call it set up over TCP (our Contact names no transport, so UDP is its
                # default for in-dialog requests, RFC 3263).
                uas._calls = self.uas[0]._calls
                uas.transactions = self.uas[0].transactions
            uas.on_invite = partial(self._on_invite, uas)
            uas.on_reinvite = self._on_reinvite
            uas.on_bye = self._on_bye
            uas.on_cancel = self._on_cancel
            uas.on_options = partial(self._on_options, uas)
            uas.on_ack_timeout = self._on_ack_timeout
            uas.on_session_expired = self._on_session_expired
            uas.on_transfer_progress = self._on_transfer_progress
            try:
                await uas.start()
            except OSError as e:
                await self.stop()
                raise SipError(f"cannot listen for SIP on {name} {self.host}:{sip.port}: {e}") from e
            self.uas.append(uas)
        log.info(
            "sip: listening on %s %s:%d, advertising %s; RTP on %d-%d",
            "+".join(sip.transports),
            self.host,
            sip.port,
            self.public_address,
            sip.rtp_port_min,
            sip.rtp_port_max,
        )

    async def stop(self) -> None:
        """Stop listening. Open calls are ended by the hub's shutdown (each gets its BYE) before this runs; calls
        still ringing are refused 503 with Retry-After (the caller tries again, elsewhere)."""
        for call in list(self.calls.values()):
            if not call.answered:
                call.uas.reject(call.incoming, 503, headers=self.retry_after())
        for uas in self.uas:
            try:
                await uas.stop()
            except Exception:
                log.exception("sip: stopping a transport failed")
        self.uas.clear()
        if self.webhook is not None:
            await self.webhook.close()

    def find(self, call_id: str) -> SipCall | None:
        """The call with this API call id (being answered or in progress)."""
        for call in self.calls.values():
            if call.id == call_id:
                return call
        return None

    # --- admission answers -------------------------------------------------------------------------------------
    def retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.sip.retry_after_s)}

    def refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        self.hub.metrics.rejected_sessions.labels(reason=f"sip_{reason}").inc()

    def forget(self, call: SipCall) -> None:
        if self.calls.get(call.sip_call_id) is call:
            del self.calls[call.sip_call_id]

    # --- aiosipua's callbacks ----------------------------------------------------------------------------------
    def _on_invite(self, uas: OmniUAS, incoming: IncomingCall) -> None:
        if incoming.call_id in self.calls:
            return  # a second INVITE of a call being answered (a new branch): the first one's answer stands
        if self.auth is not None:
            ok, stale = self.auth.check(incoming.invite)
            if not ok:
                self.refused("unauthorized")
                uas.reject(incoming, 401, headers={"WWW-Authenticate": self.auth.challenge(stale=stale)})
                return
        if sum(1 for c in self.calls.values() if not c.answered) >= MAX_PENDING_CALLS:
            self.refused("overload")
            uas.reject(incoming, 503, headers=self.retry_after())
            return
        call = SipCall(self, uas, incoming)
        self.calls[incoming.call_id] = call
        _spawn(call.answer(), f"sip-answer-{call.id}")

    def _on_reinvite(self, incoming: IncomingCall) -> None:
        call = self.calls.get(incoming.call_id)
        if call is not None:
            call.on_reinvite()

    def _on_bye(self, incoming: IncomingCall, request: SipRequest) -> None:
        call = self.calls.get(incoming.call_id)
        if call is not None:
            call.on_bye()

    def _on_cancel(self, request: SipRequest, addr: tuple[str, int]) -> None:
        call = self.calls.get(request.call_id or "")
        if call is not None:
            call.on_cancel()

    def _on_ack_timeout(self, incoming: IncomingCall) -> None:
        call = self.calls.get(incoming.call_id)
        if call is not None:
            call.on_ack_timeout()

    def _on_session_expired(self, incoming: IncomingCall) -> None:
        call = self.calls.get(incoming.call_id)
        if call is not None:
            call.on_session_expired()

    def _on_transfer_progress(self, sip_call_id: str, status: int, reason: str) -> None:
        call = self.calls.get(sip_call_id)
        if call is not None:
            call.on_transfer_progress(status, reason)

    def _on_options(self, uas: OmniUAS, request: SipRequest, addr: tuple[str, int]) -> None:
        admitting = self.hub.admitting
        resp = SipResponse(
            status_code=200 if admitting else 503, reason_phrase="OK" if admitting else "Draining"
        )
        for v in request.headers.get("via"):
            resp.headers.append("Via", v)
        for name in ("From", "Call-ID", "CSeq"):
            value = request.headers.get_first(name)
            if value:
                resp.headers.set_single(name, value)
        to = request.headers.get_first("to") or ""
        resp.headers.set_single("To", to if ";tag=" in to else f"{to};tag={generate_tag()}")
        resp.headers.set_single("Allow", ALLOW)
        resp.headers.set_single("Accept", "application/sdp")
        resp.headers.set_single("User-Agent", self.settings.sip.user_agent)
        if not admitting:
            resp.headers.set_single("Retry-After", str(self.settings.sip.retry_after_s))
        uas.transport.send_reply(resp)

    def stats(self) -> dict[str, Any]:
        return {
            "calls": len(self.calls),
            "webhook": (
                {"delivered": self.webhook.delivered, "failed": self.webhook.failed} if self.webhook else None
            ),
            "refusals": dict(self.refusals),
            "transports": {
                type(u.transport).__name__: {
                    "malformed": u.transport.hardening.malformed,
                    "retransmissions": u.transport.hardening.retransmissions,
                    "forbidden": u.transport.hardening.forbidden,
                }
                for u in self.uas
                if isinstance(u.transport, OmniUdpTransport | OmniTcpTransport)
            },
        }


_tasks: set[asyncio.Task[Any]] = set()


def _spawn(coro: Any, name: str) -> None:
    task = asyncio.ensure_future(coro)
    task.set_name(name)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
