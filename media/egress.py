"""The per-session output clock: egress ring → exactly one 20 ms frame per call.

Whoever paces the session (the Live WebSocket sender, the WebRTC track, the LiveKit plugin) calls
:meth:`EgressPlayer.next_frame` once per 20 ms. Each call

1. reads the ring's gain word (the barge-in duck), then its epoch word; if the epoch moved, drops the locally held remainder of any older-epoch chunk and resets
   the resampler, and ``EgressRing.read_chunk`` skips queued older-epoch chunks — so after a barge-in bumps the
   epoch, the very next frame carries no stale audio;
2. fills 20 ms at the engine output rate (24 kHz) from the held chunk and then from the ring, zero-filling what is
   missing (digital silence when nothing is queued);
3. reports the playout position of the turn it just played (``EgressRing.report_playout``), which the engine uses
   to keep only what was heard after a barge-in;
4. scales the frame by the gain, ramping from the previous frame's gain over its first 2 ms (no click), so a
   duck the engine asks for is heard within one frame and undone as fast when the caller's sound was only a
   backchannel. The gain is read *before* the epoch: the engine lifts a duck only after bumping the epoch, so a
   frame that sees unity after a barge-in also sees the new epoch and carries no stale audio at full level;
5. releases the :class:`~engine_bridge.protocol.OutputTranscript` events whose ``start_sample`` has now been
   played, mapped onto the output timeline (ms since session start = frames emitted × 20). While the output is
   ducked nothing is released: words played under the duck were not heard, and the engine's verdict decides
   their fate: a backchannel lifts the duck in the same epoch (they go out then, with their play times), a
   barge-in bumps the epoch first (they are dropped as stale), so a client never shows words the model does not
   keep;
6. converts to the requested rate and encoding (PCM16 at 8/16/24/48 kHz — or any rate in a small ratio to 24 kHz —
   G.711 µ-law/A-law at 8 kHz).

Nearly every frame of a call is the same case: unity gain (no ramp pending), the epoch of the previous frame, and
only more audio of the turn that played last, or nothing. With the ring's C core that frame is one call
(``EgressRing.play``: steps 1-3 for that case) and, at the engine rate, is built in its output buffer without a
resampling pass; every other frame takes the Python path below, which stays the reference (a test runs both on the
same script of writes, frame for frame). Each frame runs on every session's 20 ms clock with the caches cold from the
sleep before it, where interpreter time is ~10x its warm figure: benchmarks/plugin_paths.py measured this call at
~25 µs per frame that way, ~18 µs with the C call, ~8 µs with the frame also built in place (and the PCM16
payload views made once).

Memory is fixed after the first frame: one chunk buffer as large as the ring (a chunk can never be larger), two
output buffers, a bounded transcript queue and a bounded table of recent turns. Once the session is closed the
rings are unmapped, so the player returns silence and never touches them again.
"""

from __future__ import annotations

import collections
import logging
import sys
from dataclasses import dataclass
from typing import Final

import msgspec
import numpy as np

from engine_bridge.formats import ENGINE_OUTPUT_RATE, FRAME_MS, OUTPUT_FRAME_SAMPLES
from engine_bridge.protocol import OutputTranscript
from engine_bridge.ring import EgressRing, PlayCursor
from media.codecs import G711_RATE, AudioEncoding, alaw_encode, parse_encoding, ulaw_encode
from media.ingress import SessionLike
from media.resample import IdentityResampler, PolyphaseResampler, Resampler

log = logging.getLogger(__name__)

#: Output transcripts waiting for their audio. The engine sends a handful per sentence; this is minutes of text.
TRANSCRIPT_QUEUE_LIMIT: Final = 256
#: Samples (at the engine rate) over which a gain change ramps at the start of a frame.
GAIN_RAMP_SAMPLES: Final = ENGINE_OUTPUT_RATE * 2 // 1000
#: Recent (epoch, turn) playout records kept for mapping transcripts that arrive after their audio played.
TURN_TABLE_LIMIT: Final = 16


@dataclass(frozen=True, slots=True)
class TranscriptDelta:
    """Model text due now. ``start_ms``/``end_ms`` are on the output timeline (ms since the session's first frame)."""

    turn_id: int
    epoch: int
    text: str
    start_ms: int
    end_ms: int
    start_sample: int
    end_sample: int


class OutputFrame(msgspec.Struct, frozen=True):
    """One 20 ms output frame.

    ``pcm`` (int16 at ``rate``) and ``payload`` (the bytes to send: PCM16 little-endian or G.711 codes) are views
    into the player's buffers, valid until the next-but-one :meth:`EgressPlayer.next_frame` call; copy them to keep
    them longer (``bytes(frame.payload)``).

    A frozen ``msgspec.Struct`` rather than a frozen dataclass: one is built per frame of every session, and the
    Struct's constructor is C (~0.2 µs against ~1.6 µs for the dataclass's eleven ``object.__setattr__`` calls). It
    is never encoded, so the array fields need no msgspec type.
    """

    index: int
    start_ms: int
    rate: int
    encoding: AudioEncoding
    pcm: np.ndarray
    payload: np.ndarray
    #: True when the frame carries model audio (partly or wholly).
    speaking: bool
    #: Model samples in this frame at the engine output rate (the rest is zero fill).
    model_samples: int
    #: Epoch and turn of the last model audio in the frame (0 and 0 for silence).
    epoch: int
    turn_id: int
    transcripts: tuple[TranscriptDelta, ...]

    def to_bytes(self) -> bytes:
        return self.payload.tobytes()


@dataclass(slots=True)
class _Turn:
    start_pos: int  # output-timeline position (engine-rate samples) of the turn's sample 0
    played: int = 0
    finished: bool = False


def _output_resampler(rate: int) -> Resampler:
    r = Resampler.for_rates(ENGINE_OUTPUT_RATE, rate)
    exact = isinstance(r, IdentityResampler) or (
        isinstance(r, PolyphaseResampler) and OUTPUT_FRAME_SAMPLES % r.down == 0
    )
    if not exact or rate * FRAME_MS % 1000:
        raise ValueError(f"unsupported output rate {rate}: need a small ratio to {ENGINE_OUTPUT_RATE} Hz")
    return r


class EgressPlayer:
    """Reads one session's egress ring at the caller's pace; see the module docstring."""

    def __init__(
        self,
        session: SessionLike,
        *,
        rate: int = ENGINE_OUTPUT_RATE,
        encoding: AudioEncoding | str = AudioEncoding.PCM16,
    ) -> None:
        enc = parse_encoding(encoding)
        if enc is not AudioEncoding.PCM16 and rate != G711_RATE:
            raise ValueError(f"{enc.value} output is 8 kHz, not {rate}")
        self._session = session
        self.rate = rate
        self.encoding = enc
        self._resampler = _output_resampler(rate)
        # At the engine rate the frame is built in its output buffer directly (the work buffer *is* that buffer):
        # no resampling pass and no copy.
        self._in_place = isinstance(self._resampler, IdentityResampler)
        self.frame_samples = rate * FRAME_MS // 1000
        self._closed = False
        self._ring = session.rings.egress
        # Engine-rate work buffer for one frame.
        self._work = np.zeros(OUTPUT_FRAME_SAMPLES, dtype=np.int16)
        # Where playback stands between frames: the held chunk (its buffer is allocated on first use, ring-sized),
        # the epoch seen, the gain the last frame ended at, the turn that played last and its record. A ring
        # object, so the ring's C ``play`` can do a steady-state frame in one call (see next_frame).
        self._cur: PlayCursor = self._ring.play_cursor(np.zeros(0, dtype=np.int16))
        # Two alternating output buffers, so a frame stays valid while its successor is produced.
        self._pcm_bufs = (np.zeros(self.frame_samples, np.int16), np.zeros(self.frame_samples, np.int16))
        # PCM16 payloads are the output buffers' bytes (little-endian hosts; a big-endian one swaps per frame).
        self._pcm_payloads: tuple[np.ndarray, np.ndarray] | None = (
            (self._pcm_bufs[0].view(np.uint8), self._pcm_bufs[1].view(np.uint8))
            if enc is AudioEncoding.PCM16 and sys.byteorder == "little"
            else None
        )
        self._code_bufs = (np.zeros(self.frame_samples, np.uint8), np.zeros(self.frame_samples, np.uint8))
        self._quiet = True  # resampler history is all zeros
        self._ramp = np.linspace(0.0, 1.0, GAIN_RAMP_SAMPLES, endpoint=False, dtype=np.float32)
        self._scaled = np.zeros(OUTPUT_FRAME_SAMPLES, dtype=np.float32)
        self._turns: collections.OrderedDict[tuple[int, int], _Turn] = collections.OrderedDict()
        self._pending: collections.deque[OutputTranscript] = collections.deque()
        self._speaking = False
        #: Frames emitted; frames with model audio; frames only partly filled (the engine fell behind);
        #: held chunks dropped on an epoch change; transcripts released / dropped as stale / dropped on overflow.
        self.frames = 0
        self.model_frames = 0
        self.underruns = 0
        self.stale_chunks_dropped = 0
        self.transcripts_released = 0
        self.transcripts_stale = 0
        self.transcripts_overflow = 0
        self.model_samples = 0

    # --- public surface ----------------------------------------------------------------------------------------
    @property
    def speaking(self) -> bool:
        """Whether the latest frame carried model audio."""
        return self._speaking

    @property
    def timeline_ms(self) -> int:
        """Output timeline: ms since the first frame (frames emitted × 20)."""
        return self.frames * FRAME_MS

    @property
    def epoch(self) -> int:
        return max(self._cur.epoch_seen, 0)

    def add_transcript(self, ev: OutputTranscript) -> None:
        """Queue model text; it is released with the frame in which its ``start_sample`` plays."""
        if self._closed:
            return
        if ev.epoch < self._cur.epoch_seen:
            self.transcripts_stale += 1
            return
        if len(self._pending) >= TRANSCRIPT_QUEUE_LIMIT:
            self._pending.popleft()
            self.transcripts_overflow += 1
            log.warning("egress: transcript queue full (%d); dropped the oldest", TRANSCRIPT_QUEUE_LIMIT)
        self._pending.append(ev)

    def next_frame(self) -> OutputFrame:
        """Produce the next 20 ms. Never blocks; call it from the thread that owns the session."""
        index = self.frames
        self.frames += 1
        if self._closed or self._session.closed:
            self._speaking = False
            if self._in_place:
                self._pcm_bufs[index & 1][:] = 0
            return self._emit(index, 0, 0, 0, ())
        ring = self._ring
        cur = self._cur
        work = self._pcm_bufs[index & 1] if self._in_place else self._work
        need = OUTPUT_FRAME_SAMPLES
        # Nearly every frame is more of the turn that played last at unity gain in an unchanged epoch: with the
        # native ring that frame is one C call doing what the loop below does for it (-1: any other frame).
        filled = ring.play(work, cur)
        if filled >= 0:
            if filled:
                self.model_frames += 1
                self.model_samples += filled
                if filled < need:
                    self.underruns += 1
            self._speaking = filled > 0
            released = self._release_transcripts(cur.epoch_seen) if self._pending else ()
            return self._emit(
                index, filled, cur.last_epoch if filled else 0, cur.last_turn if filled else 0, released
            )

        gain = ring.gain  # before the epoch: see the module docstring
        epoch_now = ring.epoch
        if epoch_now != cur.epoch_seen:
            self._on_epoch(epoch_now)
        filled = 0
        last_epoch = last_turn = 0
        turn: _Turn | None = None
        while filled < need:
            if cur.pos >= cur.len and not self._read_chunk(ring):
                break
            pos = cur.pos
            take = min(need - filled, cur.len - pos)
            work[filled : filled + take] = cur.chunk[pos : pos + take]
            cur.pos = pos + take
            last_epoch, last_turn = cur.chunk_epoch, cur.chunk_turn
            turn = self._account(last_epoch, last_turn, filled, take)
            filled += take
        if filled < need:
            work[filled:] = 0
            if filled:
                self.underruns += 1

        if gain != 1.0 or cur.gain != 1.0:
            self._apply_gain(work, filled, gain)
        if turn is not None:
            ring.report_playout(last_epoch, last_turn, turn.played)
            self.model_frames += 1
            self.model_samples += filled
        self._speaking = filled > 0
        released = self._release_transcripts(epoch_now) if self._pending and gain == 1.0 else ()
        return self._emit(index, filled, last_epoch, last_turn, released)

    def stats(self) -> dict[str, int]:
        return {
            "frames": self.frames,
            "model_frames": self.model_frames,
            "underruns": self.underruns,
            "stale_chunks_dropped": self.stale_chunks_dropped,
            "transcripts_released": self.transcripts_released,
            "transcripts_stale": self.transcripts_stale,
            "transcripts_overflow": self.transcripts_overflow,
            "transcripts_pending": len(self._pending),
        }

    def close(self) -> None:
        """Stop reading the ring and release the chunk buffer; later frames are silence. Idempotent."""
        self._closed = True
        cur = self._cur
        cur.chunk = np.zeros(0, dtype=np.int16)
        cur.pos = cur.len = 0
        cur.last = None
        self._pending.clear()
        self._turns.clear()

    # --- internals -----------------------------------------------------------------------------------------
    def _apply_gain(self, work: np.ndarray, filled: int, gain: float) -> None:
        """Scale the first ``filled`` samples of the work buffer: ramp from the last gain, then hold."""
        prev = self._cur.gain
        self._cur.gain = gain
        if not filled:
            return
        work = work[:filled]
        scaled = self._scaled[:filled]
        np.multiply(work, gain, out=scaled, casting="unsafe")
        n = min(filled, GAIN_RAMP_SAMPLES)
        if prev != gain:
            scaled[:n] = work[:n] * (prev + (gain - prev) * self._ramp[:n])
        np.rint(scaled, out=scaled)
        np.copyto(work, scaled, casting="unsafe")

    def _on_epoch(self, epoch_now: int) -> None:
        cur = self._cur
        if cur.pos < cur.len and cur.chunk_epoch < epoch_now:
            cur.pos = cur.len = 0
            self.stale_chunks_dropped += 1
        if not self._quiet:
            # The filter still holds ~1 ms of the interrupted audio; it must not leak into the next frame.
            self._resampler.reset()
            self._quiet = True
        for key in [k for k in self._turns if k[0] < epoch_now]:
            del self._turns[key]
        if cur.last is not None and cur.last_epoch < epoch_now:
            cur.last = None
        cur.epoch_seen = epoch_now

    def _read_chunk(self, ring: EgressRing) -> bool:
        cur = self._cur
        if cur.chunk.shape[0] < ring.capacity_bytes // 2:
            cur.chunk = np.zeros(ring.capacity_bytes // 2, dtype=np.int16)
        info = ring.read_chunk(cur.chunk)  # one C call with the native ring core
        if info is None:
            return False
        cur.pos = 0
        cur.len = info.nsamples
        cur.chunk_epoch = info.epoch
        cur.chunk_turn = info.turn_id
        return True

    def _account(self, epoch: int, turn_id: int, offset: int, n: int) -> _Turn:
        """Count ``n`` samples of ``(epoch, turn_id)`` as played, starting at ``offset`` in this frame; returns its
        record."""
        key = (epoch, turn_id)
        st = self._turns.get(key)
        if st is None:
            cur = self._cur
            if cur.last is not None:
                # The ring is FIFO: once a new turn plays, every sample of the previous one has played.
                cur.last.finished = True
            st = _Turn(start_pos=(self.frames - 1) * OUTPUT_FRAME_SAMPLES + offset)
            self._turns[key] = st
            while len(self._turns) > TURN_TABLE_LIMIT:
                self._turns.popitem(last=False)  # the oldest: never the one just added, so never ``cur.last``
            cur.last_epoch, cur.last_turn, cur.last = epoch, turn_id, st
        st.played += n
        return st

    def _release_transcripts(self, epoch_now: int) -> tuple[TranscriptDelta, ...]:
        out: list[TranscriptDelta] = []
        keep: collections.deque[OutputTranscript] = collections.deque()
        newest_turn = self._cur.last_turn if self._cur.last is not None else -1
        for ev in self._pending:
            if ev.epoch < epoch_now:
                self.transcripts_stale += 1
                continue
            st = self._turns.get((ev.epoch, ev.turn_id))
            if st is not None and (st.played > ev.start_sample or st.finished):
                base = st.start_pos
            elif st is None and ev.epoch == epoch_now and ev.turn_id < newest_turn:
                # Its turn ended without (more) audio, or fell out of the turn table: due now.
                base = (self.frames - 1) * OUTPUT_FRAME_SAMPLES - ev.start_sample
            else:
                keep.append(ev)
                continue
            start = base + ev.start_sample
            end = max(start, base + ev.end_sample)
            out.append(
                TranscriptDelta(
                    turn_id=ev.turn_id,
                    epoch=ev.epoch,
                    text=ev.text,
                    start_ms=start * 1000 // ENGINE_OUTPUT_RATE,
                    end_ms=end * 1000 // ENGINE_OUTPUT_RATE,
                    start_sample=ev.start_sample,
                    end_sample=ev.end_sample,
                )
            )
        self._pending = keep
        self.transcripts_released += len(out)
        return tuple(out)

    def _emit(
        self,
        index: int,
        filled: int,
        epoch: int,
        turn_id: int,
        transcripts: tuple[TranscriptDelta, ...],
    ) -> OutputFrame:
        pcm = self._pcm_bufs[index & 1]
        if self._in_place:
            pass  # next_frame built the frame (zero-filled past ``filled``) in ``pcm`` itself
        elif filled == 0 and (self._quiet or self._closed or self._session.closed):
            # Silence with a zero filter history (or a closed session) is exactly zero: skip the filter.
            pcm[:] = 0
            if not self._quiet:
                self._resampler.reset()
                self._quiet = True
        else:
            # The work buffer is zero-filled past ``filled``; after one silent frame the filter history is zero.
            pcm[:] = self._resampler.process(self._work)
            self._quiet = filled == 0
        if self._pcm_payloads is not None:
            payload = self._pcm_payloads[index & 1]
        elif self.encoding is AudioEncoding.PCM16:
            payload = pcm.astype("<i2", copy=False).view(np.uint8)
        elif self.encoding is AudioEncoding.PCMU:
            payload = ulaw_encode(pcm, out=self._code_bufs[index & 1])
        else:
            payload = alaw_encode(pcm, out=self._code_bufs[index & 1])
        return OutputFrame(
            index=index,
            start_ms=index * FRAME_MS,
            rate=self.rate,
            encoding=self.encoding,
            pcm=pcm,
            payload=payload,
            speaking=filled > 0,
            model_samples=filled,
            epoch=epoch,
            turn_id=turn_id,
            transcripts=transcripts,
        )
