"""Drive the omni stand-in sidecar with vLLM-Omni 0.30's own client, and compare its events with the wheel's classes.

Not a test of the suite (it needs the vllm-omni wheel, which cannot share this project's environment): the check
behind ``testkit/omni_standin.py``, run by hand (docs/omni-models.md, "The stand-in")::

    python -m venv /tmp/omni-venv
    /tmp/omni-venv/bin/pip install --no-deps vllm-omni==0.30.0 && /tmp/omni-venv/bin/pip install websockets pybase64 numpy
    python -m testkit.omni_standin --port 18091 --max-sessions 1 &   # this project's environment
    /tmp/omni-venv/bin/python tests/omni_wheel_check.py 18091

``vllm_omni/__init__.py`` imports torch and vllm, so the package is registered without running it; the client
(``vllm_omni.clients.duplex``) and the event classes (``vllm_omni.protocol.duplex.events``) need neither.
"""

import asyncio
import importlib.util
import json
import pathlib
import sys
import types
import urllib.request

import numpy as np

_spec = importlib.util.find_spec("vllm_omni")
assert _spec is not None and _spec.origin is not None, "install the vllm-omni 0.30.0 wheel (--no-deps)"
_pkg = types.ModuleType("vllm_omni")
_pkg.__path__ = [str(pathlib.Path(_spec.origin).parent)]
sys.modules["vllm_omni"] = _pkg

from vllm_omni.clients.duplex import DuplexClient, DuplexProtocolError, ReconnectPolicy, SessionConfig  # noqa: E402  (after the package bypass)
from vllm_omni.clients.minicpmo_4_5 import create_duplex_session_config  # noqa: E402  (after the package bypass)
from vllm_omni.protocol.duplex import events as E  # noqa: E402  (after the package bypass)

PORT = int(sys.argv[1])
URL = f"ws://127.0.0.1:{PORT}"
HTTP = f"http://127.0.0.1:{PORT}"

# wire type -> the wheel's class rendering it
CLASSES = {
    "session.created": E.SessionCreated(session={}, attachment_generation=1, resume_token="t"),
    "session.updated": E.SessionUpdated(session={}),
    "session.resumed": E.SessionResumed(session={}, attachment_generation=1, resume_token="t"),
    "response.created": E.ResponseCreated(response={}, response_id="r"),
    "response.done": E.ResponseDone(response={}, response_id="r"),
    "response.output_audio.delta": E.AudioDelta(
        response_id="r", delta="", sample_rate_hz=24000, metadata={"epoch": 0}
    ),
    "response.output_audio.done": E.AudioDone(response_id="r"),
    "response.output_audio_transcript.delta": E.TranscriptDelta(response_id="r", delta="x"),
    "response.output_audio_transcript.done": E.TranscriptDone(response_id="r", transcript="x"),
    "input_audio_buffer.speech_started": E.SpeechStarted(audio_start_ms=0),
    "input_audio_buffer.speech_stopped": E.SpeechStopped(audio_end_ms=0),
    "conversation.item.input_audio_transcription.completed": E.InputTranscriptionCompleted(
        item_id="i", transcript="t"
    ),
    "output_audio_buffer.cleared": E.OutputAudioCleared(response_id="r"),
    "session.heartbeat_ack": E.SessionHeartbeatAck(),
    "session.closed": E.SessionClosed(reason="x"),
    "error": E.error_event("resource_exhausted", "m"),
}
seen: dict[str, set] = {}


class Tap:
    """The websockets connection, recording the keys of every server frame (handshake and errors included)."""

    def __init__(self, ws):
        self.ws = ws

    async def send(self, data):
        await self.ws.send(data)

    async def recv(self):
        raw = await self.ws.recv()
        ev = json.loads(raw)
        seen.setdefault(ev["type"], set()).update(k for k in ev if k != "server_event_seq")
        return raw

    async def close(self):
        await self.ws.close()


async def tapped(url):
    import websockets

    return Tap(await websockets.connect(url, max_size=64 << 20))


def speech(ms, rate=16000):
    t = np.arange(int(rate * ms / 1000)) / rate
    return (8000 * np.sin(2 * np.pi * 300 * t)).astype("<i2").tobytes()


def silence(ms, rate=16000):
    return bytes(int(rate * ms / 1000) * 2)


def state():
    return json.loads(urllib.request.urlopen(HTTP + "/standin/state").read())


async def main():
    cfg = create_duplex_session_config()
    async with DuplexClient(
        URL,
        model="openbmb/MiniCPM-o-4_5",
        config=cfg,
        reconnect=ReconnectPolicy(max_attempts=5, backoff_s=(0.05, 0.2)),
        connect=tapped,
    ) as client:
        print("session", client.session_id, "resume token", bool(client.resume_token))
        # turn 1: speak, go quiet; the model answers (model-owned turn-taking)
        await client.stream_pcm(speech(600) + silence(600), chunk_ms=200, realtime=False)
        responses = client.responses()
        r = await asyncio.wait_for(responses.__anext__(), 10)
        n = 0
        async for chunk in r.audio():
            n += len(chunk)
            await client.ack_playback(r.played_ms, response_id=r.response_id)
        print(
            "turn 1:",
            r.decision,
            "audio bytes",
            n,
            "transcript",
            repr(r.transcript),
            "done",
            r.done_event.raw["response"]["status"],
        )
        assert r.done_event.raw["response"]["status"] == "completed" and n == 1200 * 48
        # turn 2: barge in after ~300 ms of reply
        await client.stream_pcm(speech(600) + silence(600), chunk_ms=200, realtime=False)
        r2 = await asyncio.wait_for(responses.__anext__(), 10)
        got = 0
        async for chunk in r2.audio():
            got += len(chunk)
            await client.ack_playback(r2.played_ms, response_id=r2.response_id)
            if r2.played_ms >= 300:
                await client.send({"type": "barge_in"})
                break
        await r2.wait(5)
        md = r2.done_event.raw["response"]["metadata"]
        print(
            "turn 2:",
            r2.done_event.raw["response"]["status"],
            {k: md[k] for k in ("type", "cancelled_epoch", "epoch", "committed_ms")},
        )
        assert (
            r2.done_event.raw["response"]["status"] == "cancelled"
            and md["committed_ms"] >= 300
            and md["epoch"] == md["cancelled_epoch"] + 1
        )
        # transport drop: the client resumes with its token
        urllib.request.urlopen(urllib.request.Request(HTTP + "/standin/drop", method="POST")).read()  # noqa: ASYNC210
        ev = await client.wait_for("connection.resumed", timeout_s=5)
        print("resumed:", ev.raw, "state resumes", state()["sessions"][0]["resumes"])
        # model-initiated speech after the resume
        urllib.request.urlopen(urllib.request.Request(HTTP + "/standin/speak", method="POST")).read()  # noqa: ASYNC210
        r3 = await asyncio.wait_for(responses.__anext__(), 10)
        await r3.wait(5)
        print("turn 3 (model-initiated):", r3.done_event.raw["response"]["status"])
        # capacity: the stand-in runs with --max-sessions 1
        try:
            async with DuplexClient(URL, model="m", config=SessionConfig(), reconnect=None, connect=tapped):
                raise AssertionError("second session was admitted")
        except DuplexProtocolError as e:
            print("refused:", e.code, str(e))
            assert e.code == "resource_exhausted"
        await client.send({"type": "session.heartbeat"})
        await asyncio.sleep(0.2)
        await client.close()
    print("stand-in state:", {k: v for k, v in state()["sessions"][0].items() if k != "acks"})
    bad = []
    for typ, keys in sorted(seen.items()):
        if typ == "connection.resumed":
            continue
        ref = set(CLASSES[typ].to_realtime()) if typ in CLASSES else None
        status = (
            "no wheel class"
            if ref is None
            else ("same keys" if keys == ref else f"DIFF stand-in={sorted(keys)} wheel={sorted(ref)}")
        )
        if ref is not None and keys != ref:
            bad.append(typ)
        print(f"  {typ}: {status}")
    assert not bad, bad
    print("OK")


asyncio.run(main())
