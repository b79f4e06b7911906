"""aiosipua's user agent server with the checks a server facing trunks needs before a request reaches its handlers.

:class:`OmniUAS` is aiosipua's :class:`~aiosipua.uas.SipUAS` (dialogs, CANCEL matching, 2xx retransmission until the
ACK, session timers, REFER) plus:

* a body that claims to be SDP must parse, or the request is answered 400 (aiosipua would raise inside its
  handler and leave the caller without an answer);
* an INVITE whose Request-URI or headers are not usable (no From tag, a CSeq method that is not INVITE) is
  answered 400;
* session timers (RFC 4028) only for a caller that asks for them or supports them;
* a rejected INVITE whose ACK never comes is forgotten after Timer H (aiosipua keeps it until the ACK);
* a CANCEL that comes after our 200 OK is answered 200 and changes nothing (RFC 3261 §9.2: the INVITE's
  transaction is over; aiosipua would stop the 200's retransmission and drop the call);
* :meth:`forget` drops a call we ended (aiosipua's ``hangup`` sends the BYE but keeps the call);
* :meth:`send_request` sends a request of ours in a dialog (BYE, REFER) as a client transaction: retransmitted
  over UDP (Timer E: T1 doubling up to T2) until a final response, given up after 64×T1; the response is matched
  by the top Via's branch and the CSeq method (aiosipua, with no UAC, drops responses).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from aiosipua.dialog import DialogState
from aiosipua.incoming_call import IncomingCall
from aiosipua.message import SipRequest, SipResponse
from aiosipua.sdp import parse_sdp
from aiosipua.transaction import T1, T2, TIMER_H
from aiosipua.uas import SipUAS
from aiosipua.uas_requests import handle_cancel

log = logging.getLogger(__name__)

#: Methods with a body that may be an SDP offer or answer.
_SDP_METHODS: Final = frozenset({"INVITE", "ACK", "UPDATE", "PRACK"})


class OmniUAS(SipUAS):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handlers["CANCEL"] = self._handle_cancel
        #: Our client transactions waiting for their final response, by (branch, method).
        self._client: dict[tuple[str, str], asyncio.Future[SipResponse]] = {}

    # --- requests of ours ------------------------------------------------------------------------------------
    def send_request(self, request: SipRequest, addr: tuple[str, int]) -> asyncio.Future[SipResponse]:
        """Send ``request`` (built by the dialog) to ``addr``; the future gets its final response, or
        TimeoutError after 64×T1. Raises what the transport raises (a TCP connection that is gone)."""
        vias = request.via
        key = (vias[0].branch or "", request.method.upper())
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[SipResponse] = loop.create_future()
        self.transport.send(request, addr)
        self._client[key] = fut
        task = loop.create_task(self._retransmit(request, addr, fut))
        fut.add_done_callback(lambda _f: (task.cancel(), self._client.pop(key, None)))
        return fut

    async def _retransmit(
        self, request: SipRequest, addr: tuple[str, int], fut: asyncio.Future[SipResponse]
    ) -> None:
        interval, elapsed = T1, 0.0
        while elapsed < TIMER_H and not fut.done():
            await asyncio.sleep(interval)
            elapsed += interval
            if fut.done():
                return
            if not self.transport.reliable:
                try:
                    self.transport.send(request, addr)
                except (OSError, RuntimeError):
                    break
                interval = min(interval * 2, T2)
        if not fut.done():
            fut.set_exception(TimeoutError(f"no final response to {request.method} within {TIMER_H:g} s"))

    def _on_message(self, msg: SipRequest | SipResponse, addr: tuple[str, int]) -> None:
        if isinstance(msg, SipResponse):
            cseq = msg.cseq
            vias = msg.via
            if cseq is not None and vias:
                fut = self._client.get((vias[0].branch or "", cseq.method.upper()))
                if fut is not None and not fut.done() and msg.status_code >= 200:
                    fut.set_result(msg)
            return
        super()._on_message(msg, addr)

    def _handle_cancel(self, request: SipRequest, addr: tuple[str, int]) -> None:
        vias = request.via
        branch = vias[0].branch if vias else None
        txn = self.transactions.get_server(branch, "INVITE") if branch else None
        call = (
            self._calls.get(txn.request.call_id or "")
            if txn is not None and txn.request is not None
            else None
        )
        if call is not None and call._answered:
            resp = call.dialog.create_response(request, 200, "OK")
            self.transport.send_reply(resp)
            return
        handle_cancel(self, request, addr)

    def _handle_request(self, request: SipRequest, addr: tuple[str, int]) -> None:
        method = request.method.upper()
        try:
            # The headers every handler reads, parsed once here: a value that does not parse is the request's
            # fault (400), not ours (aiosipua would raise inside the handler).
            cseq, _ = request.cseq, request.via
            from_addr, to_addr = request.from_addr, request.to_addr
            _ = request.contact
            if cseq is not None and (cseq.seq < 0 or cseq.seq >= 2**31):
                raise ValueError(f"CSeq number {cseq.seq} out of range")
        except Exception as e:
            if method != "ACK" and request.headers.get("via"):
                self._send_error(request, 400, "Bad Request")
            log.info("sip: %s from %s has a header that does not parse: %s", method, addr, e)
            return
        if method in _SDP_METHODS and request.body and request.content_type == "application/sdp":
            try:
                sdp = parse_sdp(request.text)
                if sdp.audio is None and method == "INVITE":
                    raise ValueError("no audio section")
            except Exception as e:
                if method != "ACK":
                    self._send_error(request, 400, "Bad SDP")
                log.info("sip: %s from %s has a bad SDP body: %s", method, addr, e)
                return
        if method == "INVITE":
            if (
                to_addr is None
                or cseq is None
                or cseq.method.upper() != "INVITE"
                or from_addr is None
                or not from_addr.tag
            ):
                self._send_error(request, 400, "Bad Request")
                return
        super()._handle_request(request, addr)
        if method == "INVITE" and self.session_expires is not None:
            call = self._calls.get(request.call_id or "")
            if (
                call is not None
                and call.invite is request
                and call.dialog.state is DialogState.EARLY
                and not _offers_timer(request)
            ):
                # A caller that neither asks for session timers nor supports them never refreshes: no timer then
                # (aiosipua would arm one and end a long call at its interval).
                call.session_interval = None

    def reject(
        self, call: IncomingCall, status: int, reason: str = "", *, headers: dict[str, str] | None = None
    ) -> None:
        """Answer the INVITE ``status`` (with ``headers``, e.g. Retry-After), and forget the call after Timer H
        if its ACK never comes."""
        if call._answered or call.dialog.state is DialogState.TERMINATED:
            return
        call._send_response(status, reason or _reason(status), extra_headers=headers)
        call.dialog.terminate()
        asyncio.get_running_loop().call_later(TIMER_H, self._drop, call)

    def _drop(self, call: IncomingCall) -> None:
        """Forget a refused call unless its Call-ID has a newer call (a retry after a 401 reuses it)."""
        if self._calls.get(call.call_id) is call:
            del self._calls[call.call_id]

    def forget(self, call: IncomingCall) -> None:
        """Stop the call's timers and drop it (after our BYE, or once the caller's BYE or CANCEL ended it)."""
        call._stop_retransmissions()
        if self._calls.get(call.call_id) is call:
            del self._calls[call.call_id]
        self._remove_invite_transaction(call.invite)


def _offers_timer(request: SipRequest) -> bool:
    if request.get_header("session-expires"):
        return True
    tokens = request.headers.get("supported") + request.headers.get("require")
    return any(t.strip().lower() == "timer" for t in tokens)


def _reason(status: int) -> str:
    return {
        400: "Bad Request",
        401: "Unauthorized",
        403: "Forbidden",
        486: "Busy Here",
        487: "Request Terminated",
        488: "Not Acceptable Here",
        500: "Server Internal Error",
        503: "Service Unavailable",
    }.get(status, "Error")
