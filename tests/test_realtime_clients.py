"""Two more stock Realtime clients against the REAL engine (cascade: VAD → ASR → SmolLM2 → Piper), one spoken
exchange each: the OpenAI Agents SDK's realtime runner, and Pipecat's ``OpenAIRealtimeLLMService``.

The embedded models are needed: the exchange is a spoken question heard by the VAD and ASR and answered in speech.
The caller's speech is Piper-synthesized (tests/speech_fixtures.py).

* The Agents SDK (openai-agents, installed by the Makefile with --no-deps beside websockets 17.4) runs unchanged: ``RealtimeRunner(RealtimeAgent(...)).run()``
  with the server's URL and key, microphone audio through ``session.send_audio`` (tests/agents_sdk_caller.py, in
  a subprocess: this repository's own ``agents`` package shadows the SDK's in the test process). It validates every
  server event against the openai SDK's union itself and reports a failure as an ``error`` event, so the test also
  asserts that none came.
* Pipecat (pipecat-ai 1.14.0) pins ``soxr~=1.0.0`` against this project's ``soxr==1.1.0``, so it lives in a
  virtualenv of its own, ``.venv-pipecat`` (``make pipecat-venv``; ``make test`` builds it). Its
  ``OpenAIRealtimeLLMService``, with its defaults and the base URL pointed at this server, runs there in a
  pipeline (tests/pipecat_realtime_caller.py, a subprocess): it connects, sends its ``session.update``, speaks
  first (its context's opening user message), then hears a spoken question and answers it. Pipecat parses every
  server event with its own models and treats almost any ``error`` as fatal, so an answer means the server's
  events passed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ServerProcess, start_server
from tests.speech_fixtures import synthesize_speech

pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent
PIPECAT_PYTHON = ROOT / ".venv-pipecat" / "bin" / "python"

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


async def test_pipecat_realtime_service_connects_configures_and_answers(
    cascade_server: ServerProcess, tmp_path: Path
) -> None:
    """Pipecat's own ``OpenAIRealtimeLLMService`` (pipecat-ai 1.14.0, its defaults but the base URL and key;
    tests/pipecat_realtime_caller.py, run from the Pipecat virtualenv) connects, configures its session (its
    ``session.update`` answered by ``session.updated``), speaks first, then gets a spoken answer to a spoken
    question, with no error: Pipecat treats almost any ``error`` event, and any event its own models reject, as
    fatal."""
    if not PIPECAT_PYTHON.exists():
        pytest.fail(f"{PIPECAT_PYTHON} is missing: `make pipecat-venv` builds it (`make test` does)")
    pcm = tmp_path / "question.pcm"
    pcm.write_bytes(speech_then_silence(QUESTION, silence_s=20.0).astype("<i2").tobytes())
    base_url = cascade_server.url.replace("http://", "ws://") + "/v1/realtime"
    proc = await asyncio.create_subprocess_exec(
        str(PIPECAT_PYTHON),
        str(ROOT / "tests" / "pipecat_realtime_caller.py"),
        base_url,
        API_KEY,
        str(pcm),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    types = result["event_types"]
    assert not result["errors"], result
    assert "error" not in types, result
    assert types[:2] == ["session.created", "session.updated"], types
    assert result["session_ready"], result
    assert types.count("response.done") >= 2, types  # the greeting, then the answer
    assert result["greeting"].strip(), result
    assert "input_audio_buffer.speech_started" in types, types
    assert "paris" in result["answer"].lower(), result
    assert result["audio_bytes"] > 24000 * 2 * 0.5, result
