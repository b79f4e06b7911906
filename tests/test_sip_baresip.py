"""A real softphone calls the server: Debian's headless baresip dials ``livekit-omni serve``'s SIP endpoint on
loopback over G.711, plays a WAV into the call (its ``aufile`` source) and records what it hears (its ``sndfile``
module); when the WAV ends, baresip hangs up.

* On the loopback echo engine (no models): the call's audio makes the round trip (baresip hears itself), and the
  caller's hang-up closes the engine session at once.
* On the embedded models (VAD → whisper → SmolLM2 → Piper): baresip asks Piper's "What is the capital of France?"
  over PCMU and whisper hears "Paris" in baresip's recording of the answer; the hang-up leaves nothing in
  ``/health``'s counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soxr

from engine_bridge.speech.text import text_words
from tests.conftest import ServerProcess, start_server
from tests.sip_peers import Baresip, frame_levels, free_udp_port, require, sip_env
from tests.speech_fixtures import silence, synthesize_speech, write_wav

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
ANSWER = "paris"
INSTRUCTIONS = "You are a helpful assistant on the phone. Answer in one short sentence."
#: A call centre's tool: every call on the models opens its session with it (issue 39, point 4: function tools work
#: on SIP calls as on any other way in; an engine that refused it would fail the call with 500).
TRANSFER_TOOL = {
    "type": "function",
    "name": "transfer_to_agent",
    "description": "Transfer the caller to a human agent when they ask for one.",
    "parameters": {"type": "object", "properties": {"reason": {"type": "string"}}, "required": ["reason"]},
}


def active_sessions(server: ServerProcess) -> int:
    return int(server.health()[1]["engine"]["active_sessions"])


def wait_until_idle(server: ServerProcess, timeout: float) -> float:
    """Seconds until the engine holds no session and the SIP endpoint no call."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        body = server.health()[1]
        if body["engine"]["active_sessions"] == 0 and body["sip"]["calls"] == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"still busy after {timeout} s: {server.health()[1].get('sip')}")


def caller_wav(path: Path, text: str, *, after_s: float) -> Path:
    """Piper's ``text`` at 8 kHz, then ``after_s`` of silence (baresip hangs up when the file ends)."""
    pcm = np.concatenate(
        [silence(500, 8000), synthesize_speech(text, rate=8000), silence(int(after_s * 1000), 8000)]
    )
    write_wav(path, pcm, 8000)
    return path


@pytest.fixture(scope="module")
def echo_sip_server() -> Iterator[tuple[ServerProcess, int]]:
    require("baresip")
    port = free_udp_port()
    s = start_server(adapter="loopback", env=sip_env(port))
    yield s, port
    s.stop()


@pytest.mark.parametrize("codec", ["PCMU", "PCMA"])
def test_baresip_hears_itself_and_its_hangup_ends_the_session(
    echo_sip_server: tuple[ServerProcess, int], output_dir: Path, codec: str
) -> None:
    server, port = echo_sip_server
    wav = caller_wav(output_dir / "caller.wav", QUESTION, after_s=1.5)
    phone = Baresip(wav, codec=codec)
    phone.start(f"sip:omni@127.0.0.1:{port}")
    try:
        phone.wait_call_end(30)
    finally:
        phone.stop()
    log = phone.log()
    assert f"Set audio decoder: {codec} 8000Hz" in log, log[-3000:]
    assert "Call established" in log and "terminated" in log, log[-3000:]
    # The hang-up (baresip's BYE at the end of its file) ended the engine session at once.
    assert wait_until_idle(server, 3.0) < 1.0
    heard, rate = phone.recording()
    sent, _ = phone.sent()
    assert rate == 8000
    heard_loud = frame_levels(heard, rate) > 300
    sent_loud = frame_levels(sent, rate) > 300
    # The echo: about as much speech came back as went out.
    assert heard_loud.sum() >= 0.7 * sent_loud.sum(), (heard_loud.sum(), sent_loud.sum())


@pytest.fixture(scope="module")
def cascade_sip_server() -> Iterator[tuple[ServerProcess, int]]:
    require("baresip")
    port = free_udp_port()
    s = start_server(
        adapter="cascade",
        env=sip_env(port, session=json.dumps({"instructions": INSTRUCTIONS, "tools": [TRANSFER_TOOL]})),
    )
    yield s, port
    s.stop()


@pytest.mark.models
def test_baresip_asks_and_hears_paris(
    cascade_sip_server: tuple[ServerProcess, int], output_dir: Path
) -> None:
    from engine_bridge.speech.asr import WhisperTranscriber

    server, port = cascade_sip_server
    wav = caller_wav(output_dir / "question.wav", QUESTION, after_s=12.0)
    phone = Baresip(wav, codec="PCMU")
    phone.start(f"sip:omni@127.0.0.1:{port}")
    try:
        phone.wait_call_end(60)
    finally:
        phone.stop()
    assert wait_until_idle(server, 3.0) < 1.0, "the caller's hang-up ends the engine session"
    heard, rate = phone.recording()
    write_wav(output_dir / "heard.wav", heard, rate)
    # What baresip heard after the question (it hears silence while it asks).
    text = WhisperTranscriber().transcribe(soxr.resample(heard, rate, 16_000).astype(np.int16)).text
    (output_dir / "heard.txt").write_text(text)
    assert ANSWER in text_words(text), f"whisper heard {text!r} in the call"
