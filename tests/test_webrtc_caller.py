"""The test caller (testkit/webrtc_caller.py) is quiet when its clip is over: every WebRTC test and
benchmark relies on the server hearing silence between a caller's questions."""

from __future__ import annotations

import numpy as np

from media.codecs import OPUS_FRAME_SAMPLES, OPUS_RATE, OpusDecoder, rms_dbfs
from testkit.webrtc_caller import _SourceTrack


async def test_opus_caller_sends_silence_after_its_clip() -> None:
    t = np.arange(OPUS_RATE // 5) / OPUS_RATE  # a 200 ms tone: 10 frames
    clip = (12000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    track = _SourceTrack(clip, loop=False, codec=lambda: "audio/opus")
    dec = OpusDecoder()
    decoded = []
    for _ in range(40):
        pkt = await track.recv()
        decoded.append(np.asarray(dec.decode(bytes(pkt))).reshape(-1))
    during = np.concatenate(decoded[2:9])
    after = np.concatenate(decoded[20:])
    assert during.shape[0] >= 7 * OPUS_FRAME_SAMPLES
    assert rms_dbfs(during) > -30  # the clip is heard
    # The repeated silence packet decodes to silence (before the fix: about -24 dBFS, a steady loud signal).
    assert rms_dbfs(after) < -60, rms_dbfs(after)
