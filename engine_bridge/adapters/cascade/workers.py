"""The ASR, end-of-turn and TTS workers: one thread each (whisper, torch and Piper release the GIL), shared by
every session.

Each job reports back by posting a message to its session's mailbox (:class:`~.messages.AsrDone`,
:class:`~.messages.EotDone`, :class:`~.messages.TtsDone`) and waking the scheduler. The executors are parameters so a test can run the jobs
when it chooses (see tests/test_turn_machine.py).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time

import numpy as np
import numpy.typing as npt

from engine_bridge.adapters.cascade.messages import AsrDone, EotDone, TtsDone
from engine_bridge.adapters.cascade.reply import Reply
from engine_bridge.session import DuplexSession
from engine_bridge.speech.asr import DEFAULT_DECODING, Decoding, Transcriber, Transcript
from engine_bridge.speech.eot import EndOfTurnModel
from engine_bridge.speech.tts import Synthesizer

log = logging.getLogger(__name__)


class AsrWorker:
    def __init__(self, asr: Transcriber, executor: concurrent.futures.Executor | None = None) -> None:
        self.asr = asr
        self._pool = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-asr")
        self._jobs = itertools.count(1)
        self._jobs_lock = threading.Lock()

    def next_job(self) -> int:
        with self._jobs_lock:
            return next(self._jobs)

    def submit(
        self,
        session: DuplexSession,
        job: int,
        audio: npt.NDArray[np.int16],
        decoding: Decoding = DEFAULT_DECODING,
    ) -> None:
        """Transcribe ``audio`` as ``decoding`` says; the session gets ``AsrDone(job, ...)`` (an empty text if the model failed)."""
        asr = self.asr

        def run() -> None:
            t0 = time.monotonic()
            try:
                tr = asr.transcribe(audio, decoding)
            except Exception:
                log.exception("session %s: ASR failed", session.id)
                tr = Transcript(text="")
            session.post(AsrDone(job, tr, (time.monotonic() - t0) * 1000))  # wakes the scheduler

        self._pool.submit(run)


class EotWorker:
    """Runs the end-of-turn model off the audio and scheduler threads (its pass takes tens of milliseconds)."""

    def __init__(self, model: EndOfTurnModel, executor: concurrent.futures.Executor | None = None) -> None:
        self.model = model
        self._pool = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-eot")

    def submit(self, session: DuplexSession, job: int, text: str) -> None:
        """Score ``text``; the session gets ``EotDone(job, ...)`` (probability 0, "not finished", if it failed)."""
        model = self.model

        def run() -> None:
            t0 = time.monotonic()
            try:
                prob = model.probability(text)
            except Exception:
                log.exception("session %s: end-of-turn model failed", session.id)
                prob = 0.0
            session.post(EotDone(job, prob, (time.monotonic() - t0) * 1000))  # wakes the scheduler

        self._pool.submit(run)


class TtsWorker:
    def __init__(self, tts: Synthesizer, executor: concurrent.futures.Executor | None = None) -> None:
        self.tts = tts
        self._pool = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-tts")

    @property
    def sample_rate(self) -> int:
        return self.tts.sample_rate

    def speak(self, reply: Reply, text: str) -> None:
        """Voice one clause of ``reply`` (empty text: nothing to voice); the session gets ``TtsDone`` either way,
        so the reply can count its clauses."""
        session = reply.session

        def run() -> None:
            try:
                if text and not reply.stale:
                    self._synthesize(reply, text)
            except Exception:
                log.exception("session %s: TTS failed for %r", session.id, text)
            finally:
                session.post(TtsDone(reply.turn_id, reply.epoch))  # wakes the scheduler

        self._pool.submit(run)

    def _synthesize(self, reply: Reply, text: str) -> None:
        chunks: list[npt.NDArray[np.int16]] = []
        resampler = reply.resampler
        # The reply's first audio starts at the voice's onset, not after its leading silence (a latency cut).
        opening = reply.samples == 0
        tts = reply.tts  # the reply's voice, which need not be the default one
        for chunk in tts.synthesize_opening(text) if opening else tts.synthesize(text):
            if reply.stale:
                return
            out = resampler.process(chunk)
            if out.size:
                chunks.append(out)
        tail = resampler.flush()
        if tail.size:
            chunks.append(tail)
        if chunks:
            reply.add_audio(text, np.concatenate(chunks))
