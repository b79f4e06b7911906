"""A SIP caller for benchmarks and tests: aiosipua's UAC (the same library the server uses, on the other side of the
dialog) over UDP, and an RTP socket that sends G.711 µ-law at real time and hears what comes back.

* :meth:`SipCaller.call` sends the INVITE (PCMU and telephone-event offered), waits for the 200 OK and ACKs it;
* the caller's microphone sends one 20 ms packet per tick of a :class:`CallerClock` shared by every caller of the
  process (one timer for a hundred calls, not a hundred timers): queued clips (:meth:`SipCaller.say`), silence
  otherwise, as a phone does;
* every received packet is decoded and handed to ``on_audio(arrival time, pcm at 8 kHz)``, and counted
  (:attr:`SipCaller.received`, the largest gap between two packets);
* :meth:`SipCaller.hangup` sends the BYE (or the server's BYE ends the call: :attr:`SipCaller.ended`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from aiosipua.dialog import DialogState
from aiosipua.incoming_call import IncomingCall
from aiosipua.message import SipRequest
from aiosipua.sdp import build_sdp, parse_sdp
from aiosipua.uac import SipUAC
from aiosipua.uas import SipUAS

from livekit_omni.sip.transport import OmniUdpTransport
from media.codecs import ulaw_decode, ulaw_encode

RATE: Final = 8000
FRAME: Final = 160
_SILENCE: Final = bytes([0xFF]) * FRAME


class CallerClock:
    """One 20 ms clock for every caller of the process (absolute deadlines, like the server's pacer)."""

    def __init__(self) -> None:
        self.callers: set[SipCaller] = set()
        self._task: asyncio.Task[None] | None = None
        self.late = 0
        self.ticks = 0

    def add(self, caller: SipCaller) -> None:
        self.callers.add(caller)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    def discard(self, caller: SipCaller) -> None:
        self.callers.discard(caller)

    async def _run(self) -> None:
        t0 = time.monotonic()
        k = 0
        while self.callers:
            k += 1
            delay = t0 + k * 0.02 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.01:
                self.late += 1
            self.ticks += 1
            now = time.monotonic()
            for c in list(self.callers):
                c._tick(now)


_CLOCK: CallerClock | None = None


def clock() -> CallerClock:
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = CallerClock()
    return _CLOCK


@dataclass
class _Clip:
    pcm: npt.NDArray[np.int16]
    mark_frame: int
    sent: asyncio.Future[float]


class _Rtp(asyncio.DatagramProtocol):
    def __init__(self, caller: SipCaller) -> None:
        self.caller = caller

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.caller._received(data)


class SipCaller:
    """One call to ``server`` (host, port) for ``uri``. See the module docstring."""

    def __init__(
        self,
        server: tuple[str, int],
        uri: str = "sip:omni@127.0.0.1",
        *,
        on_audio: Callable[[float, npt.NDArray[np.int16]], None] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.server = server
        self.uri = uri
        self.host = host
        self.on_audio = on_audio
        self.received = 0
        self.max_gap_s = 0.0
        self.sent = 0
        self.first_rx = 0.0
        self.last_rx = 0.0
        self.ended = asyncio.Event()
        self._queue: list[_Clip] = []
        self._pos = 0
        self._seq = random.getrandbits(16)
        self._ts = random.getrandbits(32)
        self._ssrc = random.getrandbits(32)
        self._rtp: asyncio.DatagramTransport | None = None
        self._remote: tuple[str, int] | None = None
        self._sip: OmniUdpTransport | None = None
        self._uac: SipUAC | None = None
        self._uas: SipUAS | None = None
        self._call: Any = None

    async def call(self, timeout: float = 30.0) -> None:
        """INVITE, wait for the 200 OK (raises RuntimeError with the status when refused), start the microphone."""
        loop = asyncio.get_running_loop()
        rtp, _ = await loop.create_datagram_endpoint(lambda: _Rtp(self), local_addr=(self.host, 0))
        self._rtp = rtp
        rtp_port = rtp.get_extra_info("sockname")[1]
        # The server's own hardened transport (aiosipua's asserts a transport class no event loop's matches).
        self._sip = OmniUdpTransport(local_addr=(self.host, 0))
        self._uac = SipUAC(self._sip)
        self._uas = SipUAS(self._sip, uac=self._uac)
        self._uas.on_bye = self._on_bye
        await self._uas.start()
        assert self._sip._udp_transport is not None
        sip_port = self._sip._udp_transport.get_extra_info("sockname")[1]
        self._sip.local_addr = (self.host, sip_port)  # what Via and Contact advertise
        offer = build_sdp(self.host, rtp_port, 0, "PCMU", dtmf_payload_type=101)
        self._call = self._uac.send_invite(
            f"sip:caller@{self.host}:{sip_port}",
            self.uri,
            self.server,
            offer,
            user_agent="testkit-sip-caller",
        )
        await self._call.wait_answered(timeout)
        answer = self._call.sdp_answer or parse_sdp(self._call.invite.text)
        addr = answer.rtp_address if answer is not None else None
        if addr is None:
            raise RuntimeError("the 200 OK has no SDP answer with an RTP address")
        self._remote = (addr[0], addr[1])
        clock().add(self)

    def _on_bye(self, call: IncomingCall, request: SipRequest) -> None:
        self.ended.set()
        clock().discard(self)

    def say(self, pcm: npt.NDArray[np.int16], mark_sample: int) -> asyncio.Future[float]:
        """Queue ``pcm`` (8 kHz); the future resolves to the time the packet holding ``mark_sample`` was sent."""
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._queue.append(_Clip(pcm, mark_sample // FRAME, fut))
        return fut

    def _tick(self, now: float) -> None:
        rtp, remote = self._rtp, self._remote
        if rtp is None or remote is None or rtp.is_closing():
            return
        payload = _SILENCE
        if self._queue:
            clip = self._queue[0]
            chunk = clip.pcm[self._pos * FRAME : (self._pos + 1) * FRAME]
            if chunk.shape[0] < FRAME:
                chunk = np.pad(chunk, (0, FRAME - chunk.shape[0]))
            payload = ulaw_encode(chunk.astype(np.int16)).tobytes()
            if self._pos == clip.mark_frame and not clip.sent.done():
                clip.sent.set_result(now)
            self._pos += 1
            if self._pos * FRAME >= clip.pcm.shape[0]:
                self._queue.pop(0)
                self._pos = 0
        header = struct.pack("!BBHII", 0x80, 0, self._seq, self._ts, self._ssrc)
        self._seq = (self._seq + 1) & 0xFFFF
        self._ts = (self._ts + FRAME) & 0xFFFFFFFF
        rtp.sendto(header + payload, remote)
        self.sent += 1

    def _received(self, data: bytes) -> None:
        now = time.monotonic()
        if len(data) < 12 or data[1] & 0x7F != 0:
            return
        if self.received:
            self.max_gap_s = max(self.max_gap_s, now - self.last_rx)
        else:
            self.first_rx = now
        self.received += 1
        self.last_rx = now
        if self.on_audio is not None:
            self.on_audio(now, ulaw_decode(data[12:]))

    def reset_counts(self) -> None:
        """Start a new measuring window for :attr:`received` and :attr:`max_gap_s`."""
        self.received = 0
        self.max_gap_s = 0.0

    async def hangup(self) -> None:
        """Send the BYE (when the call is up) and close the sockets."""
        clock().discard(self)
        if (
            self._call is not None
            and self._uac is not None
            and self._call.dialog.state is DialogState.CONFIRMED
        ):
            with contextlib.suppress(Exception):
                self._call.hangup(self._uac)
            await asyncio.sleep(0.05)
        if self._rtp is not None:
            self._rtp.close()
        if self._uas is not None:
            with contextlib.suppress(Exception):
                await self._uas.stop()
