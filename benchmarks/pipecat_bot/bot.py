"""Pipecat 1.14's voice pipeline with our three models, for benchmarks/anchor_pipecat.py. Runs in the Pipecat
virtualenv (``make pipecat-venv``: its pins conflict with ours), never in the project's: it sits in a folder of its
own so that ``make bench`` (every ``benchmarks/*.py``) does not run it.

    .venv-pipecat/bin/python benchmarks/pipecat_bot/bot.py --port N --llm-base-url http://HOST:PORT/v1 \
        --whisper-model DIR --piper-dir DIR --context JSON [--voice en_US-joe-medium] [--temperature T] [--max-tokens N]

The pipeline is Pipecat's quick-start one, with its defaults wherever we give none:

    SingleClientWebsocketServerTransport (in) -> WhisperSTTService (faster-whisper, int8)
      -> user aggregator (Silero VAD; Smart Turn v3 ends the turn: Pipecat's default stop strategy)
      -> OpenAILLMService (our POST /v1/chat/completions: SmolLM2-135M) -> PiperTTSService (joe, local)
      -> SingleClientWebsocketServerTransport (out: paced at real time, as a device plays) -> assistant aggregator

Each WebSocket connection is a new conversation: the context opens with the messages ``--context`` gives (the benchmark passes our voice sessions' system prompt
and example turns), and the LLM decodes with ``--temperature`` and ``--max-tokens`` (it passes ours).

The caller's side of the WebSocket is raw PCM16 mono both ways (binary messages: 16 kHz in, 24 kHz out): a
serializer of four lines, so the benchmark's caller needs no Pipecat code. What each stage did, and when, goes to
stdout as one JSON object a line, ``{"event": ..., "t": time.monotonic(), ...}`` (the same clock as the caller's:
CLOCK_MONOTONIC is system-wide), so the benchmark can split the voice-to-voice time into Pipecat's stages:

* ``ready``: the models are loaded and the WebSocket server is listening;
* ``vad_stopped``: Silero's stop (``stop_secs`` after the speech), ``turn_ended``: the turn is over (Smart Turn);
* ``transcript``: whisper's text of the turn; ``llm_text``: the first text of the reply;
* ``tts_audio``: the reply's first audio from Piper; ``interruption``: Pipecat's barge-in (its InterruptionFrame).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMTextFrame,
    OutputAudioRawFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    UserStoppedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.serializers.base_serializer import FrameSerializer
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.services.piper.tts import PiperTTSService
from pipecat.services.whisper.stt import WhisperSTTService
from pipecat.transports.websocket.server import (
    SingleClientWebsocketServerParams,
    SingleClientWebsocketServerTransport,
)
from pipecat.workers.runner import WorkerRunner

IN_RATE = 16_000
OUT_RATE = 24_000


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


class RawPCMSerializer(FrameSerializer):
    """Binary messages are PCM16 mono: the caller's at IN_RATE in, the bot's at the pipeline's output rate out."""

    async def serialize(self, frame: Frame) -> str | bytes | None:
        if isinstance(frame, OutputAudioRawFrame):
            return frame.audio
        return None

    async def deserialize(self, data: str | bytes) -> Frame | None:
        if isinstance(data, bytes):
            return InputAudioRawFrame(audio=data, sample_rate=IN_RATE, num_channels=1)
        return None


class Report(FrameProcessor):
    """Passes every frame on; reports the first of each kind it watches per turn on stdout (see the module doc)."""

    def __init__(self, watch: dict[type[Frame], str]) -> None:
        super().__init__()
        self._watch = watch
        self._reported: set[str] = set()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        for kind, event in self._watch.items():
            if isinstance(frame, kind):
                if event in ("turn_ended", "interruption"):
                    self._reported.clear()  # a new turn's stages are reported afresh
                    emit(event)
                elif event == "transcript":
                    emit(event, text=getattr(frame, "text", ""))
                elif event == "llm_text":
                    emit(event, text=getattr(frame, "text", ""), first=event not in self._reported)
                    self._reported.add(event)
                elif event not in self._reported:
                    self._reported.add(event)
                    emit(event)
                break


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--llm-base-url", required=True)
    ap.add_argument("--whisper-model", required=True, help="a faster-whisper (CTranslate2) model folder")
    ap.add_argument("--piper-dir", required=True, help="the folder holding VOICE.onnx and VOICE.onnx.json")
    ap.add_argument("--voice", default="en_US-joe-medium")
    ap.add_argument("--context", required=True, help="the opening messages, a JSON list of {role, content}")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    args = ap.parse_args()

    transport = SingleClientWebsocketServerTransport(
        params=SingleClientWebsocketServerParams(
            audio_in_enabled=True,
            audio_out_enabled=True,
            audio_in_sample_rate=IN_RATE,
            audio_out_sample_rate=OUT_RATE,
            serializer=RawPCMSerializer(),
        ),
        host="127.0.0.1",
        port=args.port,
    )
    stt = WhisperSTTService(
        settings=WhisperSTTService.Settings(model=args.whisper_model), device="cpu", compute_type="int8"
    )
    llm = OpenAILLMService(
        api_key="none",
        base_url=args.llm_base_url,
        settings=OpenAILLMService.Settings(
            model="SmolLM2-135M-Instruct",
            temperature=args.temperature,
            max_completion_tokens=args.max_tokens,
        ),
    )
    tts = PiperTTSService(
        settings=PiperTTSService.Settings(voice=args.voice), download_dir=Path(args.piper_dir)
    )
    opening = json.loads(args.context)
    context = LLMContext(messages=list(opening))
    user_agg, assistant_agg = LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer())
    )
    after_stt = Report(
        {
            TranscriptionFrame: "transcript",
            VADUserStoppedSpeakingFrame: "vad_stopped",
            UserStoppedSpeakingFrame: "turn_ended",
        }
    )
    after_llm = Report({LLMTextFrame: "llm_text"})
    before_out = Report({TTSAudioRawFrame: "tts_audio", InterruptionFrame: "interruption"})
    pipeline = Pipeline(
        [
            transport.input(),
            stt,
            after_stt,
            user_agg,
            llm,
            after_llm,
            tts,
            before_out,
            transport.output(),
            assistant_agg,
        ]
    )
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(audio_in_sample_rate=IN_RATE, audio_out_sample_rate=OUT_RATE),
        idle_timeout_secs=None,
    )

    @transport.event_handler("on_websocket_ready")
    async def _ready(_transport: Any) -> None:
        emit("ready")

    @transport.event_handler("on_client_connected")
    async def _connected(_transport: Any, _ws: Any) -> None:
        context.set_messages(
            list(opening)
        )  # each connection is a new conversation, as a new call is for ours
        emit("connected")

    runner = WorkerRunner(handle_sigint=True)
    await runner.add_workers(worker)
    await runner.run()


if __name__ == "__main__":
    # Pipecat logs to stderr (loguru); stdout carries only the JSON events.
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="INFO")
    asyncio.run(main())
