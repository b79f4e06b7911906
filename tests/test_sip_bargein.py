"""Barge-in on a SIP call, heard by a real softphone: baresip asks the embedded models (VAD → whisper → SmolLM2 →
Piper, told to tell long stories) for a story over G.711, then speaks over the answer; in what baresip recorded, the
answer goes quiet within 300 ms of the caller's onset (the engine's duck at the first frame of caller speech, then
the epoch flush; the RTP peer plays the session's own egress player) and stays quiet while the caller talks.

Its own module (and server) because the session's instructions differ from tests/test_sip_baresip.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ServerProcess, start_server
from tests.sip_peers import Baresip, frame_levels, free_udp_port, require, sip_env
from tests.speech_fixtures import silence, synthesize_speech, write_wav
from tests.test_sip_baresip import wait_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.models]

STORYTELLER = "You are a storyteller. Always answer at length, in many sentences."
STORY = "Tell me a long story about a dragon and a knight."
INTERRUPTION = "Stop. What is the capital of France?"
#: When the caller speaks over the answer, after its question ends (the answer starts 1-4 s after it on this CPU).
INTERRUPT_AFTER_S = 7.0
#: Quiet means under -40 dBFS in a 20 ms frame (the duck is 40 dB down from speech at about -20 dBFS).
QUIET_RMS = 327.0


@pytest.fixture(scope="module")
def storyteller_sip_server() -> Iterator[tuple[ServerProcess, int]]:
    require("baresip")
    port = free_udp_port()
    s = start_server(adapter="cascade", env=sip_env(port, session=f'{{"instructions": "{STORYTELLER}"}}'))
    yield s, port
    s.stop()


def test_baresip_barge_in_stops_the_answer_within_300_ms(
    storyteller_sip_server: tuple[ServerProcess, int], output_dir: Path
) -> None:
    """The caller speaks over a long answer: in what baresip heard, the answer goes quiet within 300 ms of the
    caller's onset (the duck at the first frame of speech, then the flush), and stays quiet while the caller talks."""
    server, port = storyteller_sip_server
    rate = 8000
    lead = silence(500, rate)
    story = synthesize_speech(STORY, rate=rate)
    interruption = synthesize_speech(INTERRUPTION, rate=rate)
    pcm = np.concatenate(
        [lead, story, silence(int(INTERRUPT_AFTER_S * 1000), rate), interruption, silence(6000, rate)]
    )
    wav = output_dir / "caller.wav"
    write_wav(wav, pcm, rate)
    phone = Baresip(wav)
    phone.start(f"sip:omni@127.0.0.1:{port}")
    try:
        phone.wait_call_end(90)
    finally:
        phone.stop()
    wait_until_idle(server, 3.0)
    heard, _ = phone.recording()
    sent, _ = phone.sent()
    write_wav(output_dir / "heard.wav", heard, rate)
    heard_levels = frame_levels(heard, rate)
    sent_levels = frame_levels(sent, rate)
    # The caller's onset in what baresip sent (its own timeline; the recording of what it heard starts with it).
    start = (lead.shape[0] + story.shape[0]) // 160 + int(INTERRUPT_AFTER_S * 50) - 10
    onset = start + int(np.argmax(sent_levels[start:] > QUIET_RMS))
    spoken = int(np.argmax(sent_levels[onset:] < QUIET_RMS / 4))  # frames until the caller's first pause
    (output_dir / "levels.txt").write_text(
        f"onset frame {onset}\n"
        + "".join("#" if x > QUIET_RMS else "." for x in heard_levels)
        + "\n"
        + "".join("#" if x > QUIET_RMS else "." for x in sent_levels)
        + "\n"
    )
    before = heard_levels[onset - 50 : onset]
    assert (before > QUIET_RMS).sum() >= 25, "the answer was not playing in the second before the barge-in"
    window = heard_levels[onset : onset + max(spoken, 40)]
    loud = np.flatnonzero(window > QUIET_RMS)
    stopped_ms = 0 if loud.shape[0] == 0 else (int(loud[-1]) + 1) * 20
    assert stopped_ms <= 300, f"the answer was still heard {stopped_ms} ms after the caller's onset"
