"""aiosipua's SIP transports (UDP datagrams, TCP streams), hardened for a server that faces trunks and the internet.

aiosipua parses, routes responses by Via and keeps dialogs; what these subclasses add, all in ``_dispatch`` (the
one place every received message passes) and ``send_reply`` (every response leaves through it):

* **retransmissions** (RFC 3261 §17.2): aiosipua's transaction layer matches responses and CANCELs but does not
  absorb a request that arrives again (a UDP client retransmits until it hears an answer). Every response we send
  is kept per server transaction (top Via branch, CSeq number and method) for ``TRANSACTION_LINGER_S`` (Timer J's
  64×T1); a request of a transaction already answered is answered again with the latest response and goes no
  further, and one still being worked on is dropped (its answer is on the way). ACK is never answered;
* **Record-Route** (RFC 3261 §12.1.1): a proxy in front of us (Kamailio's dispatcher) records its route in the
  INVITE, and the caller learns it from our 1xx/2xx, which must copy it; aiosipua's responses do not, so the INVITE's
  Record-Route headers are kept with its transaction and added to those responses here;
* **TCP responses** go back on the connection the request came in on (RFC 3261 §18.2.2): the received port is
  written into the request's top Via as ``rport``, which is what aiosipua's Via routing then follows;
* **who may call** (``allowed``): a request from a source outside it is answered 403 and goes no further;
* **quiet failures**: a datagram that does not parse is dropped and counted, with one log line per
  ``LOG_EVERY`` (no stack trace: a scanner must not fill the log); a handler that raises is logged and the request
  is answered 500 when it can be.

Everything is bounded: the response cache holds at most ``MAX_TRANSACTIONS`` entries (oldest out first), messages
are capped by aiosipua (256 headers, TCP: 64 KiB of headers, 1 MiB of body) and by the datagram size.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from aiosipua.headers import parse_via, stringify_via
from aiosipua.message import SipMessage, SipRequest, SipResponse
from aiosipua.transport import SipTransport, TcpSipTransport, UdpSipTransport

log = logging.getLogger(__name__)

#: How long a server transaction's last response is kept for retransmitted requests (64 × T1).
TRANSACTION_LINGER_S: Final = 32.0
#: Server transactions remembered at most (a flood of new requests pushes the oldest out).
MAX_TRANSACTIONS: Final = 8192
#: One log line per this many unparseable messages.
LOG_EVERY: Final = 100

TxKey = tuple[str, int, str]
SourceCheck = Callable[[str], bool]


def transaction_key(msg: SipMessage) -> TxKey | None:
    """(top Via branch, CSeq number, CSeq method): one server transaction's requests and responses."""
    vias = msg.headers.get("via")
    cseq = msg.headers.get_first("cseq")
    if not vias or not cseq:
        return None
    branch = ""
    for part in vias[0].split(";")[1:]:
        name, _, value = part.strip().partition("=")
        if name.lower() == "branch":
            branch = value.strip()
            break
    num, _, method = cseq.strip().partition(" ")
    if not branch or not num.isdigit() or not method.strip():
        return None
    return branch, int(num), method.strip().upper()


class ResponseCache:
    """The latest response of each recent server transaction (bounded, expiring)."""

    def __init__(self, linger_s: float = TRANSACTION_LINGER_S, limit: int = MAX_TRANSACTIONS) -> None:
        self.linger_s = linger_s
        self.limit = limit
        self._entries: collections.OrderedDict[TxKey, tuple[float, SipResponse | None]] = (
            collections.OrderedDict()
        )
        #: The Record-Route headers of the INVITEs among them.
        self._routes: dict[TxKey, list[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _prune(self, now: float) -> None:
        entries = self._entries
        while entries:
            _key, (at, _) = next(iter(entries.items()))
            if now - at <= self.linger_s and len(entries) <= self.limit:
                break
            old, _ = entries.popitem(last=False)
            self._routes.pop(old, None)

    def begin(self, key: TxKey, record_route: list[str] | None = None) -> tuple[bool, SipResponse | None]:
        """A request of ``key`` arrived: (seen before, the response to send again if any). A new one is recorded
        (with its Record-Route headers)."""
        now = time.monotonic()
        self._prune(now)
        hit = self._entries.get(key)
        if hit is not None:
            return True, hit[1]
        self._entries[key] = (now, None)
        if record_route:
            self._routes[key] = record_route
        return False, None

    def record_route(self, key: TxKey) -> list[str]:
        return self._routes.get(key, [])

    def answered(self, key: TxKey, response: SipResponse) -> None:
        if key in self._entries:
            self._entries[key] = (time.monotonic(), response)
            self._entries.move_to_end(key)


@dataclass
class _Hardening:
    """What both transports share (a mixin's state)."""

    responses: ResponseCache = field(default_factory=ResponseCache)
    #: Which source addresses may send requests (None: all).
    allowed: SourceCheck | None = None
    malformed: int = 0
    retransmissions: int = 0
    forbidden: int = 0


class _HardenedMixin:
    """``_dispatch`` and ``send_reply`` of both transports (see the module docstring)."""

    hardening: _Hardening
    on_message: Callable[[SipRequest | SipResponse, tuple[str, int]], None] | None

    #: Each transport's own (declared here for the mixin's use; both transports define it).
    send: Callable[[SipRequest | SipResponse, tuple[str, int]], None]

    def _stamp(self, request: SipRequest, addr: tuple[str, int]) -> None:
        """Record where the request came from in its top Via (RFC 3261 §18.2.1, RFC 3581)."""
        vias = request.headers.get("via")
        via = parse_via(vias[0])
        rport_asked = "rport" in via.params and not via.params["rport"]
        if via.host != addr[0] or rport_asked or self._always_rport:
            via.params["received"] = addr[0]
        if rport_asked or self._always_rport:
            via.params["rport"] = str(addr[1])
        request.headers.remove("Via")
        request.headers.append("Via", stringify_via(via))
        for v in vias[1:]:
            request.headers.append("Via", v)

    #: TCP: the response goes back on the request's connection, named by its port.
    _always_rport = False

    def _dispatch(self, data: bytes, addr: tuple[str, int]) -> None:
        h = self.hardening
        try:
            msg = SipMessage.parse(data)
            if isinstance(msg, SipRequest):
                if not msg.headers.get("via"):
                    raise ValueError("no Via")
                self._stamp(msg, addr)
        except Exception as e:  # aiosipua raises ValueError for what it checks, IndexError & co. for the rest
            h.malformed += 1
            if h.malformed % LOG_EVERY == 1:
                log.warning("sip: unparseable message from %s (%s; %d so far)", addr, e, h.malformed)
            return
        if isinstance(msg, SipRequest):
            if h.allowed is not None and not h.allowed(addr[0]):
                h.forbidden += 1
                if msg.method.upper() != "ACK":
                    self._answer(msg, 403, "Forbidden")
                return
            if msg.method.upper() != "ACK":
                key = transaction_key(msg)
                if key is not None:
                    seen, response = h.responses.begin(key, msg.headers.get("record-route"))
                    if seen:
                        h.retransmissions += 1
                        if response is not None:
                            self._send_reply(response)
                        return
        handler = self.on_message
        if handler is None:
            return
        try:
            handler(msg, addr)
        except Exception:
            log.exception("sip: handling %s from %s failed", _describe(msg), addr)
            if isinstance(msg, SipRequest) and msg.method.upper() != "ACK":
                self._answer(msg, 500, "Server Internal Error")

    def _answer(self, request: SipRequest, status: int, reason: str) -> None:
        """A stateless answer to a request (no dialog): Via, From, To, Call-ID and CSeq copied."""
        resp = SipResponse(status_code=status, reason_phrase=reason)
        for v in request.headers.get("via"):
            resp.headers.append("Via", v)
        for name in ("From", "To", "Call-ID", "CSeq"):
            value = request.headers.get_first(name)
            if value:
                resp.headers.set_single(name, value)
        self._send_reply(resp)

    def _send_reply(self, response: SipResponse) -> None:
        try:
            SipTransport.send_reply(self, response)  # type: ignore[arg-type]  # Via routing, then self.send
        except (OSError, RuntimeError, ValueError) as e:
            log.info("sip: cannot send %d %s: %s", response.status_code, response.reason_phrase, e)

    def send_reply(self, response: SipResponse) -> None:
        key = transaction_key(response)
        if key is not None:
            if (
                key[2] == "INVITE"
                and 100 < response.status_code < 300
                and not response.headers.get("record-route")
            ):
                for route in self.hardening.responses.record_route(key):
                    response.headers.append("Record-Route", route)
            self.hardening.responses.answered(key, response)
        self._send_reply(response)


class _UdpProtocol(asyncio.DatagramProtocol):
    """aiosipua's UDP protocol asserts asyncio's own transport class, which uvloop's (uvicorn's loop) is not."""

    def __init__(self, owner: OmniUdpTransport) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: tuple[str, int] | Any) -> None:
        self.owner._dispatch(data, (str(addr[0]), int(addr[1])))

    def error_received(self, exc: Exception) -> None:
        log.debug("sip udp: %s", exc)


@dataclass
class OmniUdpTransport(_HardenedMixin, UdpSipTransport):
    hardening: _Hardening = field(default_factory=_Hardening)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _UdpProtocol(self), local_addr=self.local_addr
        )
        self._udp_transport = transport

    def send(self, message: SipRequest | SipResponse, addr: tuple[str, int]) -> None:
        UdpSipTransport.send(self, message, addr)


@dataclass
class OmniTcpTransport(_HardenedMixin, TcpSipTransport):
    hardening: _Hardening = field(default_factory=_Hardening)
    _always_rport = True

    def send(self, message: SipRequest | SipResponse, addr: tuple[str, int]) -> None:
        TcpSipTransport.send(self, message, addr)


def _describe(msg: SipMessage) -> str:
    if isinstance(msg, SipRequest):
        return msg.method
    if isinstance(msg, SipResponse):
        return f"{msg.status_code} response"
    return "message"
