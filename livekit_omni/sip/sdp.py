"""SDP offer/answer for a SIP call (RFC 3264), on aiosipua's SDP model and negotiation.

The answer takes the first codec of the caller's preference that we speak, G.711 µ-law (PCMU, payload type 0) or
A-law (PCMA, 8), both at 8 kHz, 20 ms packets; it answers telephone-event (RFC 4733) on the caller's own payload
type when offered; it mirrors every other offered stream as rejected (port 0). A re-INVITE is answered the same
way on the call's RTP port, with the codec the call has (a change of law is allowed: the egress player then plays
the other law). The caller's direction tells whether it holds the call (``sendonly`` or ``inactive``, or the old
form ``c=0.0.0.0``): we then answer ``recvonly``/``inactive`` and stop sending. A ``c=`` line with a host name
instead of an address is answered, but our RTP waits for the caller's first packet (symmetric RTP) rather than
resolve the name.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

from aiosipua.sdp import MediaDescription, SdpMessage, SdpNegotiationError, negotiate_sdp, serialize_sdp

from media.codecs import AudioEncoding
from media.rtp import PCMA_PT, PCMU_PT

#: The codecs we answer, by static payload type.
ENCODINGS: Final = {PCMU_PT: AudioEncoding.PCMU, PCMA_PT: AudioEncoding.PCMA}
_NAMES: Final = {"PCMU": PCMU_PT, "PCMA": PCMA_PT}
#: Our telephone-event payload type when the caller's offer uses a number we cannot mirror.
DEFAULT_DTMF_PT: Final = 101


class SdpRefused(ValueError):
    """The offer has nothing we can answer (no audio, no G.711): 488 Not Acceptable Here."""


@dataclass(frozen=True, slots=True)
class Negotiated:
    """What an offer/answer settled."""

    answer: SdpMessage
    encoding: AudioEncoding
    payload_type: int
    dtmf_payload_type: int | None
    #: Where the caller wants our RTP (None: nowhere yet, e.g. ``c=0.0.0.0``).
    remote: tuple[str, int] | None
    #: Whether the caller wants to hear us (False: it holds the call).
    caller_receives: bool
    #: Whether the caller sends (False: ``recvonly``/``inactive``).
    caller_sends: bool

    @property
    def answer_text(self) -> str:
        return serialize_sdp(self.answer)


def _direction(offer: SdpMessage, audio: MediaDescription) -> str:
    for d in ("sendrecv", "sendonly", "recvonly", "inactive"):
        if d in audio.attributes:
            return d
    for d in ("sendrecv", "sendonly", "recvonly", "inactive"):
        if d in offer.attributes:
            return d
    return "sendrecv"


def _usable(address: str) -> bool:
    """An IP address we may send RTP to. A host name is not used (resolving it would block the event loop; the
    caller's first packet latches its address anyway), nor the unspecified address (the old form of hold)."""
    try:
        return not ipaddress.ip_address(address).is_unspecified
    except ValueError:
        return False


def negotiate(offer: SdpMessage, *, local_ip: str, rtp_port: int, advertised_ip: str | None) -> Negotiated:
    """Answer ``offer`` for RTP on ``local_ip:rtp_port`` (``advertised_ip`` in ``c=`` and ``o=`` when set)."""
    audio = offer.audio
    if audio is None:
        raise SdpRefused("the offer has no audio stream")
    if audio.port == 0:
        raise SdpRefused("the offer's audio stream is disabled (port 0)")
    if not audio.proto.upper().startswith("RTP/AVP"):
        raise SdpRefused(
            f"the offer's audio is {audio.proto}: only plain RTP/AVP is served (no SRTP or DTLS)"
        )
    ours: list[int] = []
    dtmf_pt: int | None = None
    for codec in audio.codecs:
        name = codec.encoding_name.upper()
        rate = codec.clock_rate or 8000
        if codec.payload_type in ENCODINGS and (not name or _NAMES.get(name) == codec.payload_type):
            ours.append(codec.payload_type)
        elif name == "TELEPHONE-EVENT" and rate == 8000 and dtmf_pt is None:
            dtmf_pt = codec.payload_type
    if not ours:
        offered = [c.encoding_name or str(c.payload_type) for c in audio.codecs]
        raise SdpRefused(f"no codec in common: offered {offered}, served PCMU and PCMA at 8 kHz")
    try:
        answer, chosen = negotiate_sdp(
            offer,
            local_ip=local_ip,
            rtp_port=rtp_port,
            supported_codecs=ours,
            dtmf_payload_type=dtmf_pt if dtmf_pt is not None else 0,
            ptime=20,
            session_name="livekit-omni",
            advertised_ip=advertised_ip,
        )
    except SdpNegotiationError as e:
        raise SdpRefused(str(e)) from e
    # We packetize 20 ms whatever the offer's ptime (the pacer's frame): say so.
    for m in answer.media:
        if m.port and "ptime" in m.attributes:
            m.attributes["ptime"] = ["20"]
    direction = _direction(offer, audio)
    conn = audio.connection or offer.connection
    remote = (conn.address, audio.port) if conn is not None and _usable(conn.address) else None
    return Negotiated(
        answer=answer,
        encoding=ENCODINGS[chosen],
        payload_type=chosen,
        dtmf_payload_type=dtmf_pt,
        remote=remote,
        caller_receives=direction in ("sendrecv", "recvonly") and remote is not None,
        caller_sends=direction in ("sendrecv", "sendonly"),
    )
