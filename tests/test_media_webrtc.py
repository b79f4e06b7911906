"""media.webrtc: SDP hygiene, the receive jitter buffer, and a real call on 127.0.0.1 through an engine process.

The call: an aiortc caller (testkit.webrtc_caller.WebRTCCaller) sends Piper speech to answer_offer(), which writes it into
an engine session running the loopback echo fixture; the echo comes back on the outgoing track. The data channel
carries JSON both ways.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import soxr
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtp import RtpPacket

from engine_bridge import protocol as p
from media.codecs import OpusEncoder
from media.webrtc import (
    AudioJitterBuffer,
    SdpError,
    answer_offer,
    disable_loopback_ice,
    enable_loopback_ice,
    loopback_ice_enabled,
    sanitize_offer_sdp,
)
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import EngineProcess, connect_engine, spawn_engine
from tests.speech_fixtures import synthesize_speech

LOOPBACK_DELAY_MS = 100

OFFER_CANDIDATES = "\r\n".join(
    [
        "v=0",
        "m=audio 9 UDP/TLS/RTP/SAVPF 111",
        "a=candidate:1 1 udp 2122260223 127.0.0.1 50000 typ host generation 0",
        "a=candidate:2 1 udp 2122194687 192.168.1.5 50001 typ host generation 0",
        "a=candidate:3 1 tcp 1518280447 127.0.0.1 9 typ host tcptype active generation 0",
        "a=candidate:4 1 udp 2122129151 4f1c7d0a-1234-4abc-9def-0123456789ab.local 50002 typ host",
        "a=candidate:5 1 udp 2122063615 ::1 50003 typ host generation 0",
        "a=end-of-candidates",
        "",
    ]
)


def test_sanitize_offer_strips_mdns_always_and_non_loopback_when_asked() -> None:
    kept = sanitize_offer_sdp(OFFER_CANDIDATES, loopback_only=False)
    assert ".local" not in kept and "192.168.1.5" in kept and "::1" in kept
    loop = sanitize_offer_sdp(OFFER_CANDIDATES, loopback_only=True)
    cands = [line for line in loop.split("\r\n") if line.startswith("a=candidate")]
    assert cands == ["a=candidate:1 1 udp 2122260223 127.0.0.1 50000 typ host generation 0"]
    assert "a=end-of-candidates\r\n" in loop and "m=audio" in loop


def _rtp(seq: int) -> RtpPacket:
    pkt = RtpPacket(payload_type=111, sequence_number=seq & 0xFFFF, timestamp=(seq * 960) & 0xFFFFFFFF)
    pkt._data = bytes([seq & 0xFF])  # type: ignore[attr-defined]  # what the receiver sets after depayloading
    return pkt


def _released(buf: JitterBuffer, seqs: list[int]) -> list[tuple[int, int | None]]:
    """(arriving seq, first payload byte of the frame it releases)."""
    out = []
    for s in seqs:
        _, frame = buf.add(_rtp(s))
        out.append((s, None if frame is None else frame.data[0]))
    return out


def test_jitter_buffer_prefetch_and_loss_recovery() -> None:
    # In order: prefetch p releases frame n when n + p arrives; 0 releases each packet as it arrives.
    assert _released(AudioJitterBuffer(prefetch=1), list(range(5))) == [
        (0, None),
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 3),
    ]
    assert _released(AudioJitterBuffer(prefetch=0), list(range(3))) == [(0, 0), (1, 1), (2, 2)]
    p4 = _released(AudioJitterBuffer(prefetch=4), list(range(6)))
    assert p4 == _released(JitterBuffer(capacity=16, prefetch=4), list(range(6)))  # aiortc's own rule
    assert p4 == [(0, None), (1, None), (2, None), (3, None), (4, 0), (5, 1)]
    # A lost packet (3) costs that frame only: no stall, the delay stays one frame.
    seqs = [0, 1, 2, 4, 5, 6, 7, 8]
    buf = AudioJitterBuffer(prefetch=1)
    assert _released(buf, seqs) == [(0, None), (1, 0), (2, 1), (4, 2), (5, 4), (6, 5), (7, 6), (8, 7)]
    assert buf.holes_skipped == 1
    # aiortc's own buffer stalls on the hole until its 16 slots overflow, and then stays 14 frames behind.
    stock = _released(JitterBuffer(capacity=16, prefetch=1), seqs)
    assert [r for _, r in stock[3:]] == [None] * 5
    long_run = [0, 1, 2, *range(4, 60)]
    lag = [s - r for s, r in _released(JitterBuffer(capacity=16, prefetch=1), long_run) if r is not None]
    assert lag[-1] == 14
    lag = [s - r for s, r in _released(AudioJitterBuffer(prefetch=1), long_run) if r is not None]
    assert lag[-1] == 1
    # Reordering within the prefetch is repaired; beyond it the late packet is dropped, nothing stalls.
    assert _released(AudioJitterBuffer(prefetch=1), [0, 2, 1, 3, 4]) == [
        (0, None),
        (2, 0),
        (1, 1),
        (3, 2),
        (4, 3),
    ]
    assert _released(AudioJitterBuffer(prefetch=0), [0, 2, 1, 3]) == [(0, 0), (2, 2), (1, None), (3, 3)]
    # A burst loss longer than the buffer (aiortc's overflow path) recovers too.
    buf = AudioJitterBuffer(prefetch=1)
    rel = _released(buf, [0, 1, 2, *range(40, 45)])
    assert [r for _, r in rel] == [None, 0, 1, None, 40, 41, 42, 43]  # aiortc's overflow path drops 2


def test_jitter_buffer_drops_empty_payloads_so_the_opus_decoder_lives_on() -> None:
    """Found by benchmarks/fuzz_edges.py: an RTP packet with an empty payload reached aiortc's Opus decoder as an
    empty packet, which PyAV takes as end of stream; libopus then refused every later packet, so the caller went
    silent for the rest of the call. The buffer now drops it as a lost packet."""
    from aiortc.codecs.opus import OpusDecoder as AiortcOpusDecoder

    tone = (8000 * np.sin(2 * np.pi * 440 * np.arange(48_000) / 48_000)).astype(np.int16)
    packets = OpusEncoder().encode(tone)[:6]
    buf = AudioJitterBuffer(prefetch=0)
    decoder = AiortcOpusDecoder()
    decoded = 0
    for seq, payload in enumerate([packets[0], packets[1], b"", packets[2], packets[3], packets[4]]):
        pkt = RtpPacket(payload_type=111, sequence_number=seq, timestamp=seq * 960)
        pkt._data = payload  # type: ignore[attr-defined]
        _, frame = buf.add(pkt)
        if payload:
            assert frame is not None and frame.data == payload
            decoded += sum(f.samples for f in decoder.decode(frame))  # raises once the decoder was flushed
        else:
            assert frame is None
    assert buf.empty_dropped == 1
    assert decoded == 5 * 960


async def test_bad_offers_raise_sdp_error() -> None:
    from media.ingress import SessionLike

    class Dummy:
        rings = None
        closed = False

    dummy: SessionLike = Dummy()  # type: ignore[assignment]
    with pytest.raises(SdpError, match="no audio"):
        await answer_offer("v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n", dummy)
    with pytest.raises(SdpError, match="larger"):
        await answer_offer("m=audio " + "x" * 70_000, dummy)
    with pytest.raises(SdpError, match="cannot apply"):
        await answer_offer("m=audio this is not sdp\r\n", dummy)


async def _until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    eng = spawn_engine(adapter="loopback", loopback_delay_ms=LOOPBACK_DELAY_MS, max_sessions=8)
    yield eng
    eng.stop()


@pytest.fixture
def loopback_ice() -> Iterator[None]:
    was = loopback_ice_enabled()
    enable_loopback_ice()
    yield
    if not was:
        disable_loopback_ice()


def _best_ncc(template: np.ndarray, signal: np.ndarray) -> tuple[float, int]:
    """Normalised cross-correlation of ``template`` against every offset of ``signal`` (FFT)."""
    t = template.astype(np.float64) - template.mean()
    s = signal.astype(np.float64)
    n = len(s) + len(t)
    nfft = 1 << (n - 1).bit_length()
    corr = np.fft.irfft(np.fft.rfft(s, nfft) * np.conj(np.fft.rfft(t, nfft)), nfft)[: len(s) - len(t) + 1]
    csum = np.concatenate([[0.0], np.cumsum(s)])
    csum2 = np.concatenate([[0.0], np.cumsum(s * s)])
    m = len(t)
    win = csum[m:] - csum[:-m]
    win2 = csum2[m:] - csum2[:-m]
    energy = np.sqrt(np.maximum(win2 - win * win / m, 1e-9))
    ncc = corr / (energy * np.linalg.norm(t))
    i = int(np.argmax(ncc))
    return float(ncc[i]), i


def _matched_share(template: np.ndarray, signal: np.ndarray, window: int = 1280) -> tuple[float, int]:
    """Where ``template`` (16 kHz) best sits in ``signal``, and the share of its voiced 80 ms windows that match
    the signal there (NCC > 0.7), each searched within 40 ms of its place: a frame lost or concealed on a loaded
    machine shifts what follows by 20 ms and spoils a window or two, not the whole comparison as one NCC over
    the second would."""
    t = template.astype(np.float64)
    s = signal.astype(np.float64)
    _, at = _best_ncc(t, s)
    starts = range(0, len(t) - window + 1, window)
    rms = [float(np.sqrt(np.mean(t[i : i + window] ** 2))) for i in starts]
    slack = window // 2
    voiced = [i for i, r in zip(starts, rms, strict=True) if r >= 0.1 * max(rms)]
    matched = 0
    for i in voiced:
        lo = max(0, at + i - slack)
        ncc, _ = _best_ncc(t[i : i + window], s[lo : at + i + window + slack])
        matched += ncc > 0.7
    return matched / len(voiced), at


@pytest.mark.parametrize("encoder", ["media", "aiortc"])
async def test_webrtc_call_echoes_speech_and_carries_data_channel_events(
    engine: EngineProcess, loopback_ice: None, encoder: str
) -> None:
    client = await connect_engine(engine)
    session = await client.open_session(p.SessionConfig(adapter="loopback"))
    speech = synthesize_speech(
        "Hello, this is a test of the audio path.", rate=48000, lead_silence_ms=500, tail_silence_ms=200
    )
    caller = WebRTCCaller(speech, loop=False, datachannel="oai-events")
    got: list[str | bytes] = []
    states: list[str] = []

    async def on_message(m: str | bytes) -> None:
        got.append(m)
        peer.send_event({"type": "echo", "of": json.loads(m)["type"]})

    peer = await answer_offer(
        await caller.offer(),
        session,
        loopback_only=True,
        on_datachannel_message=on_message,
        on_connection_state=states.append,
        encoder=encoder,  # type: ignore[arg-type]
    )
    try:
        assert peer.codec == "audio/opus" and peer.player is not None and peer.player.rate == 48000
        assert "127.0.0.1" in peer.answer_sdp
        peer.send_event({"type": "session.created"})  # queued until the client's channel opens
        await caller.accept(peer.answer_sdp)
        await asyncio.wait_for(caller.opened.wait(), 10)
        caller.send(json.dumps({"type": "session.update"}))
        # Wait for the whole clip to go out and its echo to come back (by frame counts, not wall time, so a
        # busy machine only makes the test slower).
        clip_frames = -(-len(speech) // 960)
        echo_frames = clip_frames + LOOPBACK_DELAY_MS // 20 + 25
        await _until(lambda: caller.source.sent >= clip_frames and len(caller.chunks) >= echo_frames)
        await _until(lambda: len(caller.messages) >= 2)

        assert "connected" in states
        assert [json.loads(m)["type"] for m in got] == ["session.update"]
        assert [json.loads(m) for m in caller.messages] == [
            {"type": "session.created"},
            {"type": "echo", "of": "session.update"},
        ]
        stats = peer.stats()
        assert stats["input_frames"] >= 0.9 * len(speech) / 960
        # Drops happen only if this loop stalls for > 100 ms (possible on a shared, overloaded box).
        assert stats["input_frames_dropped"] <= 0.05 * stats["input_frames"]
        assert stats["ingress"]["overruns"] == 0

        # The echo: the speech came back through Opus twice, 16 kHz in the engine, and the loopback delay.
        rx = caller.received_audio()
        assert caller.rate == 48000 and len(rx) > len(speech)
        # The whole utterance, from the speech onset to the start of the tail: at the voice's own pace its first
        # second holds only seven voiced 80 ms windows, so one window spoiled by a loaded machine cost 14 % of the share.
        words = speech[24000 : len(speech) - 48000 * 200 // 1000]
        tmpl = soxr.resample(words, 48000, 16000)
        sig = soxr.resample(rx, 48000, 16000)
        share, at = _matched_share(tmpl, sig)
        assert share >= 0.75, (share, stats)
        # Where the template sits in the received stream: after the send start plus the loopback delay.
        assert at / 16000 > 0.5 + LOOPBACK_DELAY_MS / 1000
        reversed_share, _ = _matched_share(tmpl[::-1].copy(), sig)
        assert reversed_share <= 0.25, reversed_share  # the control: the same energy, not the same speech
    finally:
        await peer.close()
        await peer.close()  # idempotent
        await caller.close()
    assert peer.closed and not session.closed  # the peer never closes the engine session
    assert peer.send_event({"type": "late"}) is False
    await session.close()
    await client.close()


@pytest.mark.parametrize("encoder", ["media", "aiortc"])
async def test_webrtc_g711_only_offer_is_answered_in_g711(
    engine: EngineProcess, loopback_ice: None, encoder: str
) -> None:
    client = await connect_engine(engine)
    session = await client.open_session(p.SessionConfig(adapter="loopback"))
    t = np.arange(48000) / 48000
    tone = (9000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    caller = WebRTCCaller(tone, loop=True, datachannel=None, codecs=["audio/PCMU"])
    peer = await answer_offer(await caller.offer(), session, loopback_only=True, encoder=encoder)  # type: ignore[arg-type]
    try:
        assert peer.codec == "audio/pcmu" and peer.player is not None and peer.player.rate == 8000
        await caller.accept(peer.answer_sdp)
        await asyncio.wait_for(caller.connected.wait(), 10)
        await _until(lambda: len(caller.chunks) >= 75)  # 1.5 s of audio back
        rx = caller.received_audio()
        assert caller.rate == 8000
        tail = rx[-4000:].astype(np.float64)
        spec = np.abs(np.fft.rfft(tail * np.hanning(len(tail))))
        assert abs(np.fft.rfftfreq(len(tail), 1 / 8000)[spec.argmax()] - 440) < 5
        assert np.abs(tail).max() > 5000
    finally:
        await peer.close()
        await caller.close()
        await session.close()
        await client.close()


async def test_failed_connection_closes_the_peer(engine: EngineProcess, loopback_ice: None) -> None:
    client = await connect_engine(engine)
    session = await client.open_session(p.SessionConfig(adapter="loopback"))
    caller = WebRTCCaller(None, datachannel="oai-events")
    states: list[str] = []
    peer = await answer_offer(
        await caller.offer(), session, loopback_only=True, on_connection_state=states.append
    )
    try:
        await caller.accept(peer.answer_sdp)
        await asyncio.wait_for(caller.connected.wait(), 10)
        await caller.close()  # the client goes away: DTLS close_notify reaches the server
        for _ in range(100):
            if peer.closed:
                break
            await asyncio.sleep(0.05)
        assert peer.closed and states[-1] == "closed"
        assert not peer._tasks
    finally:
        await peer.close()
        await session.close()
        await client.close()
