"""Pipecat's own ``OpenAIRealtimeLLMService`` (pipecat-ai 1.14.0) as a caller of our ``/v1/realtime``, run by
tests/test_realtime_clients.py in a subprocess from the Pipecat virtualenv (``make pipecat-venv``: Pipecat pins
soxr~=1.0.0 against our 1.1.0, so it cannot live in the project's).

Usage: ``.venv-pipecat/bin/python tests/pipecat_realtime_caller.py <ws-base-url> <api-key> <pcm-file>``, where
the base URL is ``ws://HOST:PORT/v1/realtime`` (the service adds ``?model=``) and the file holds PCM16 mono 24 kHz
to speak at real time.

The service runs with its defaults (only ``base_url`` and ``api_key`` given), in a pipeline the way Pipecat's
realtime examples build it: a microphone processor (InputAudioRawFrame, 20 ms at real time), the context
aggregators, the service, and a sink that keeps what it pushes downstream. The context opens with one user
message, so the bot speaks first (an ``LLMRunFrame``, as the examples do); once that greeting's
``response.done`` has come the microphone speaks the question, then silence, until the answer's
``response.done``. Every server event the service parses is recorded by type (its own parser, wrapped).

Prints one JSON object: ``event_types`` (the server events in order), ``session_ready`` (the service saw its
``session.updated``: its session configuration was accepted; read before it disconnects), ``greeting`` and ``answer`` (the text of each
response), ``user_transcript``, ``audio_bytes`` (answer audio pushed as TTSAudioRawFrame), ``errors`` (the
ErrorFrames the service pushed: it treats almost any ``error`` event as fatal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMRunFrame,
    LLMTextFrame,
    StartFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

RATE = 24_000
FRAME = RATE // 50  # 20 ms
GREETING_REQUEST = "Say hello to me in a few words."

seen: list[str] = []  # server event types, in order
#: Set at the first and the second ``response.done`` (the greeting, the answer), or at an error.
RESPONSES_DONE = (asyncio.Event(), asyncio.Event())
_parse = events.parse_server_event


def _recording_parse(message: Any) -> Any:
    evt = _parse(message)
    try:
        seen.append(json.loads(message)["type"])
    except (ValueError, KeyError, TypeError):
        seen.append("?")
    n = seen.count("response.done")
    if seen[-1] == "response.done" and n <= len(RESPONSES_DONE):
        RESPONSES_DONE[n - 1].set()
    return evt


events.parse_server_event = _recording_parse  # the service calls it as events.parse_server_event


class Microphone(FrameProcessor):
    """Speaks ``pcm`` at real time once ``go`` is set; silence before and after (an open microphone)."""

    def __init__(self, pcm: bytes, go: asyncio.Event) -> None:
        super().__init__()
        self._pcm = pcm
        self._go = go
        self._task: asyncio.Task[None] | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, (EndFrame, CancelFrame)) and self._task is not None:
            await self.cancel_task(self._task)
            self._task = None
        await self.push_frame(frame, direction)
        if isinstance(frame, StartFrame) and self._task is None:
            self._task = self.create_task(self._speak())

    async def _speak(self) -> None:
        t0 = time.monotonic()
        n = 0
        pos = 0
        step = FRAME * 2
        while True:
            if self._go.is_set() and pos < len(self._pcm):
                chunk = self._pcm[pos : pos + step].ljust(step, b"\0")
                pos += step
            else:
                chunk = bytes(step)
            await self.push_frame(InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))
            n += 1
            await asyncio.sleep(max(0.0, t0 + n * 0.02 - time.monotonic()))


class Sink(FrameProcessor):
    """Keeps what the service pushes downstream: its text per response, the answer audio, transcripts, errors."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: dict[int, str] = {}
        self.audio_bytes = 0
        self.user_transcript = ""
        self.errors: list[str] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        done = seen.count("response.done")
        if isinstance(frame, LLMTextFrame):
            self.texts[done] = self.texts.get(done, "") + frame.text
        elif isinstance(frame, TTSAudioRawFrame) and done >= 1:
            self.audio_bytes += len(frame.audio)
        elif isinstance(frame, TranscriptionFrame):
            self.user_transcript += frame.text
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame.error)
            for done_event in RESPONSES_DONE:
                done_event.set()
        await self.push_frame(frame, direction)


async def main(base_url: str, key: str, pcm_path: str) -> dict[str, Any]:
    pcm = Path(pcm_path).read_bytes()
    go = asyncio.Event()
    llm = OpenAIRealtimeLLMService(api_key=key, base_url=base_url)
    context = LLMContext(messages=[{"role": "user", "content": GREETING_REQUEST}])
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    sink = Sink()
    pipeline = Pipeline([Microphone(pcm, go), user_agg, llm, sink, assistant_agg])
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
        idle_timeout_secs=None,
    )
    runner = WorkerRunner(handle_sigint=False)
    session_ready = False

    async def drive() -> None:
        nonlocal session_ready
        await worker.queue_frames([LLMRunFrame()])  # the bot speaks first
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(RESPONSES_DONE[0].wait(), 60)
        go.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(RESPONSES_DONE[1].wait(), 90)
        session_ready = bool(getattr(llm, "_api_session_ready", False))  # reset when it disconnects
        await asyncio.sleep(0.5)  # the last frames reach the sink
        await worker.queue_frame(EndFrame())

    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return {
        "event_types": seen,
        "session_ready": session_ready,
        "greeting": sink.texts.get(0, ""),
        "answer": sink.texts.get(1, ""),
        "user_transcript": sink.user_transcript,
        "audio_bytes": sink.audio_bytes,
        "errors": sink.errors,
    }


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="INFO")
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))), flush=True)
