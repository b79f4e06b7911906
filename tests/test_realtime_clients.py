"""Two more stock Realtime clients against the REAL engine (cascade: VAD → ASR → SmolLM2 → Piper), one spoken
exchange each: the OpenAI Agents SDK's realtime runner, and Pipecat's ``OpenAIRealtimeLLMService`` startup.

The embedded models are needed: the exchange is a spoken question heard by the VAD and ASR and answered in speech.
The caller's speech is Piper-synthesized (tests/speech_fixtures.py).

* The Agents SDK (openai-agents, installed by the Makefile with --no-deps beside websockets 17.4) runs unchanged: ``RealtimeRunner(RealtimeAgent(...)).run()``
  with the server's URL and key, microphone audio through ``session.send_audio`` (tests/agents_sdk_caller.py, in
  a subprocess: this repository's own ``agents`` package shadows the SDK's in the test process). It validates every
  server event against the openai SDK's union itself and reports a failure as an ``error`` event, so the test also
  asserts that none came.
* Pipecat (pipecat-ai 1.14.0) is NOT installed: it pins ``soxr~=1.0.0`` and this project pins ``soxr==1.1.0``, so
  ``pip install -e '.[dev]'`` cannot resolve with it. Instead the test replays its exact WebSocket conversation as
  recorded from its source: wait for ``session.created``; ``session.update`` with only ``type``, ``instructions``
  and ``tools: []``; wait for ``session.updated``; the context's messages as ``conversation.item.create`` with
  client item ids; ``session.update`` again; ``response.create {response: {output_modalities}}`` (the bot speaks
  first); then microphone audio as one ``input_audio_buffer.append`` per 20 ms frame at 24 kHz. Pipecat treats any
  ``error`` as fatal (but three codes this exchange cannot provoke) and validates known events with its own
  models, whose extra demands on the server's echo (``rate`` 24000, a string ``tool_choice``, ``noise_reduction``
  with a ``type``) are checked here; every event also validates against the openai SDK's union, strictly.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from tests.conftest import ServerProcess, start_server
from tests.realtime_checks import ServerEventLog
from tests.speech_fixtures import synthesize_speech

pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent

API_KEY = "sk-test"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
FRAME = 480  # 20 ms at 24 kHz


@pytest.fixture(scope="module")
def cascade_server() -> Iterator[ServerProcess]:
    s = start_server(adapter="cascade", env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY])})
    yield s
    s.stop()


def speech_then_silence(text: str, silence_s: float = 30.0) -> np.ndarray:
    speech = synthesize_speech(text, rate=24000)
    return np.concatenate([speech, np.zeros(int(silence_s * 24000), np.int16)])


async def test_agents_sdk_realtime_runner_spoken_exchange(
    cascade_server: ServerProcess, tmp_path: Path
) -> None:
    """The Agents SDK's ``RealtimeRunner`` (tests/agents_sdk_caller.py, in a subprocess: see its docstring) asks
    a spoken question and gets a spoken answer, with no error event (so every server event passed its checks)."""
    pcm = tmp_path / "question.pcm"
    pcm.write_bytes(speech_then_silence(QUESTION).astype("<i2").tobytes())
    ws_url = cascade_server.url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    env = dict(os.environ)
    # Without the repository on the path: its own ``agents`` package would shadow the SDK's.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-P",
        str(ROOT / "tests" / "agents_sdk_caller.py"),
        ws_url,
        API_KEY,
        INSTRUCTIONS,
        str(pcm),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 150)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    assert not result["errors"], result
    assert "paris" in result["answer"].lower(), result
    assert result["audio_bytes"] > 24000 * 2 * 0.5, result


def check_pipecat_demands(ev: dict[str, Any]) -> None:
    """What Pipecat's own event models demand of the server beyond the SDK's union (a failure raises in its
    receive loop, which ends the service)."""
    assert isinstance(ev.get("event_id"), str) and ev["event_id"], ev
    session = ev.get("session")
    if isinstance(session, dict):
        assert isinstance(session.get("tool_choice", "auto"), str), session
        for side in ("input", "output"):
            fmt = ((session.get("audio") or {}).get(side) or {}).get("format")
            if fmt is not None and fmt.get("type") == "audio/pcm":
                assert fmt.get("rate") == 24000, session
        nr = ((session.get("audio") or {}).get("input") or {}).get("noise_reduction")
        if nr is not None:
            assert "type" in nr, session
    for part in (ev.get("item") or {}).get("content") or []:
        assert part.get("type") in (
            "text",
            "audio",
            "input_text",
            "input_audio",
            "output_text",
            "output_audio",
        ), ev


async def test_pipecat_startup_and_spoken_exchange_replayed(cascade_server: ServerProcess) -> None:
    log = ServerEventLog()
    ws_url = cascade_server.url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(ws_url, headers={"Authorization": f"Bearer {API_KEY}"}) as ws:

            async def recv(etype: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
                deadline = time.monotonic() + timeout
                while True:
                    msg = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
                    assert msg.type == aiohttp.WSMsgType.TEXT, msg
                    ev = log.add(msg.data)
                    check_pipecat_demands(ev)
                    assert ev["type"] != "error", f"Pipecat ends on this error: {ev}"
                    if ev["type"] == etype and all(ev.get(k) == v for k, v in match.items()):
                        return ev

            async def send(ev: dict[str, Any]) -> None:
                await ws.send_str(json.dumps(ev))

            await recv("session.created", 10)
            await send(
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "instructions": INSTRUCTIONS, "tools": []},
                }
            )
            await recv("session.updated", 10)
            await send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "id": "pipecat_msg_1",
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Say hello to me in a few words."}],
                    },
                }
            )
            await send(
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "instructions": INSTRUCTIONS, "tools": []},
                }
            )
            await send({"type": "response.create", "response": {"output_modalities": ["audio"]}})
            greeting = await recv("response.done", 60)
            assert greeting["response"]["status"] == "completed", greeting

            # The spoken exchange: one append per 20 ms frame, at real time.
            audio = speech_then_silence(QUESTION, silence_s=20.0)
            answered: dict[str, Any] = {}

            async def mic() -> None:
                t0 = time.monotonic()
                for n, i in enumerate(range(0, len(audio), FRAME)):
                    chunk = audio[i : i + FRAME].astype("<i2").tobytes()
                    await send(
                        {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
                    )
                    await asyncio.sleep(max(0.0, t0 + (n + 1) * 0.02 - time.monotonic()))

            feeder = asyncio.create_task(mic())
            try:
                await recv("input_audio_buffer.speech_started", 20)
                answered = await recv("response.done", 60)
            finally:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder
    assert log.of("conversation.item.added")[0]["item"]["id"] == "pipecat_msg_1"
    assert answered["response"]["status"] == "completed", answered
    transcript = answered["response"]["output"][0]["content"][0]["transcript"]
    assert "paris" in transcript.lower(), transcript
    assert log.of("response.output_audio.delta"), "the answer was spoken"
    log.validate()
