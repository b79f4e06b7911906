"""One cascade reply: the object that owns where it stands (its :class:`~engine_bridge.reply.ReplyPhase`), its
text and its audio.

Threads: the scheduler thread creates the reply, steps its generation and drives every phase transition through
:meth:`Reply.advance`. The TTS worker only adds voiced audio (:meth:`Reply.add_audio`) and reads the phase to
decide whether that audio is held (speculative), queued (confirmed) or dropped (finished). ``lock`` guards the
audio timeline (``samples``, ``seq``, ``words``, ``held``) and the phase, so a confirmation and a clause landing
at the same moment cannot reorder the audio.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np
import numpy.typing as npt

from engine_bridge import protocol as p
from engine_bridge.formats import ENGINE_OUTPUT_RATE
from engine_bridge.reply import ReplyPhase, ReplySnapshot, check_transition
from engine_bridge.session import DuplexSession
from engine_bridge.speech.text import ClauseSplitter
from engine_bridge.speech.tts import OutputResampler, Synthesizer

#: Reply audio is queued in 100 ms pieces so a barge-in fence drops the rest of a long clause cleanly.
QUEUE_PIECE_SAMPLES = ENGINE_OUTPUT_RATE // 10


@dataclass(frozen=True, slots=True)
class Word:
    """One spoken word of a reply, on the reply's sample timeline."""

    text: str
    start_sample: int
    end_sample: int


@dataclass(frozen=True, slots=True)
class Cut:
    """How an interrupted reply ended: what the caller heard of it."""

    #: The words whose audio was played completely: what the conversation keeps.
    committed_text: str
    played_samples: int
    #: The barge-in that cut it: (new epoch, caller position in ms). None for a client interrupt, which
    #: announces no ``BargeIn``.
    barge_in: tuple[int, int] | None


class _Usage(TypedDict):
    """ReplyDone's token counts."""

    input_tokens: int
    cached_tokens: int
    output_tokens: int


Voiced = tuple[npt.NDArray[np.int16], list[p.OutputTranscript]]


@dataclass(eq=False, slots=True)
class Reply:
    session: DuplexSession
    turn_id: int
    epoch: int
    #: Thinker log length before the reply (its checkpoint), and before the caller's words it answers.
    ckpt_log_len: int
    user_ckpt_log_len: int | None
    #: Length of the session's conversation log before the caller's words (what a discarded speculation restores).
    log_mark: int
    resampler: OutputResampler
    #: The synthesizer that voices it (the session's voice when the reply started) and that voice's name.
    tts: Synthesizer
    voice: str = ""
    #: Its decoding temperature (0: greedy).
    temperature: float = 0.0
    started_wall: float = field(default_factory=time.monotonic)
    #: How the caller's message went into the KV: {user_tokens, prefill_tokens, cached_tokens, log_before}.
    append_stats: dict[str, int] = field(default_factory=dict)
    #: Its token cap is the client's (``max_output_tokens``), tighter than the engine's reply limit; ``capped``:
    #: generation stopped there (``ReplyDone.capped``).
    client_cap: bool = False
    capped: bool = False
    #: The function call the reply ended in (``ReplyDone.tool_calls``; a reply cut before it ends makes none).
    tool_call: p.ToolCallItem | None = None
    phase: ReplyPhase = ReplyPhase.NEW
    # --- scheduler thread -------------------------------------------------------------------------------------
    splitter: ClauseSplitter = field(default_factory=ClauseSplitter)
    clauses_sent: int = 0
    clauses_done: int = 0
    text: str = ""
    #: Tokens the thinker generated for it.
    tokens: int = 0
    first_clause_wall: float | None = None
    # --- under ``lock`` (the TTS worker writes, the scheduler reads at barge-in) ------------------------------
    lock: threading.Lock = field(default_factory=threading.Lock)
    samples: int = 0
    seq: int = 0
    words: list[Word] = field(default_factory=list)
    held: list[Voiced] = field(default_factory=list)
    first_audio_wall: float | None = None

    # --- the lifecycle ----------------------------------------------------------------------------------------
    def advance(self, to: ReplyPhase, *, cut: Cut | None = None) -> None:
        """Move to phase ``to`` (scheduler thread only), or raise :class:`~engine_bridge.reply.IllegalTransition`
        leaving everything as it was. Publishes the new snapshot, then emits the events of the transition:

        * entering a confirmed phase from NEW or a speculative one: ``ReplyStarted``, then the held audio (with
          its ``OutputTranscript`` events), then the session state (speaking if any audio exists, else thinking);
        * DONE: ``ReplyDone(interrupted=False)`` with the whole text;
        * INTERRUPTED (``cut`` required): ``BargeIn`` for a barge-in, then ``ReplyDone(interrupted=True)`` with
          the played text;
        * CANCELLED and the others: nothing (held audio of a cancelled reply is dropped).
        """
        current = self.phase
        check_transition(self.turn_id, current, to)
        if (cut is None) == (to is ReplyPhase.INTERRUPTED):
            raise ValueError("a Cut is given exactly when a reply is interrupted")
        s = self.session
        announce = to.is_confirmed and not current.is_confirmed
        with self.lock:
            self.phase = to
            s.reply = ReplySnapshot(self.turn_id, self.epoch, to)
            if to.is_finished:
                self.held.clear()
            elif announce:
                s.emit(p.ReplyStarted(session_id=s.id, turn_id=self.turn_id, epoch=self.epoch))
                held, self.held = self.held, []
                for pcm, transcripts in held:
                    self._queue_locked(pcm, transcripts)
        if announce:
            s.set_state(p.SessionState.SPEAKING if self.samples else p.SessionState.THINKING)
        elif to is ReplyPhase.DONE:
            s.emit(
                p.ReplyDone(
                    session_id=s.id,
                    turn_id=self.turn_id,
                    epoch=self.epoch,
                    interrupted=False,
                    text=self.text.strip(),
                    total_samples=self.samples,
                    capped=self.capped,
                    tool_calls=[self.tool_call] if self.tool_call is not None else [],
                    **self._usage(),
                )
            )
        elif cut is not None:
            if cut.barge_in is not None:
                epoch, at_ms = cut.barge_in
                s.emit(
                    p.BargeIn(
                        session_id=s.id,
                        epoch=epoch,
                        turn_id=self.turn_id,
                        at_ms=at_ms,
                        played_samples=cut.played_samples,
                    )
                )
            s.emit(
                p.ReplyDone(
                    session_id=s.id,
                    turn_id=self.turn_id,
                    epoch=self.epoch,
                    interrupted=True,
                    text=cut.committed_text,
                    total_samples=self.samples,
                    **self._usage(),
                )
            )

    def _usage(self) -> _Usage:
        """ReplyDone's token counts: the context it was generated from (the checkpoint), of which the part the
        KV lease already held (everything but the caller's newly prefilled words), and the generated tokens."""
        prefilled = self.append_stats.get("prefill_tokens", 0)
        return {
            "input_tokens": self.ckpt_log_len,
            "cached_tokens": max(0, self.ckpt_log_len - prefilled),
            "output_tokens": self.tokens,
        }

    @property
    def stale(self) -> bool:
        """Nothing more of it will be heard: it finished, or the epoch fence went up since it started (the
        fence refuses its audio). TTS work for it stops at the next chunk."""
        return self.phase.is_finished or self.epoch != self.session.epoch

    def played_words(self, played_samples: int) -> list[Word]:
        """The words whose audio lies entirely within the first ``played_samples``."""
        with self.lock:
            return [w for w in self.words if w.end_sample <= played_samples]

    # --- audio (TTS worker) -----------------------------------------------------------------------------------
    def add_audio(self, text: str, pcm: npt.NDArray[np.int16]) -> None:
        """Place one voiced clause on the reply's sample timeline, its words spread over it in proportion to
        their length (Piper gives no word times); queue it for egress, or hold it while speculative."""
        words = text.split()
        if not words or not pcm.shape[0]:
            return
        s = self.session
        with self.lock:
            if self.stale:
                return
            start = self.samples
            self.samples += pcm.shape[0]
            weights = np.array([len(w) + 1 for w in words], dtype=np.float64)
            bounds = start + np.round(
                np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum() * pcm.shape[0]
            ).astype(int)
            transcripts = []
            for i, w in enumerate(words):
                word = Word(w, int(bounds[i]), int(bounds[i + 1]))
                self.words.append(word)
                transcripts.append(
                    p.OutputTranscript(
                        session_id=s.id,
                        turn_id=self.turn_id,
                        epoch=self.epoch,
                        text=w + " ",
                        start_sample=word.start_sample,
                        end_sample=word.end_sample,
                    )
                )
            if self.phase.is_speculative:
                self.held.append((pcm, transcripts))
                return
            for i in range(0, pcm.shape[0], QUEUE_PIECE_SAMPLES):
                piece = pcm[i : i + QUEUE_PIECE_SAMPLES]
                due = [t for t in transcripts if start + i <= t.start_sample < start + i + piece.shape[0]]
                self._queue_locked(piece, due)
            confirmed = self.phase.is_confirmed
        if s.state is not p.SessionState.SPEAKING and confirmed:
            s.set_state(p.SessionState.SPEAKING)

    def _queue_locked(self, pcm: npt.NDArray[np.int16], transcripts: list[p.OutputTranscript]) -> None:
        """Queue audio for egress in timeline order (``lock`` held); its transcripts go out once it is queued."""
        seq = self.seq
        self.seq += 1
        if self.session.queue_audio(self.epoch, self.turn_id, seq, pcm):
            if self.first_audio_wall is None:
                self.first_audio_wall = time.monotonic()
            for t in transcripts:
                self.session.emit(t)
