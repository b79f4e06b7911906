"""Drives an engine session the way the media plane does, for engine tests and benchmarks.

It writes caller audio into the ingress ring in 20 ms frames at real time, plays the egress ring at real time
(one 20 ms frame per tick, dropping audio of a stale epoch, exactly as the media plane must), reports the
playout position in the ring header, and records every event and every played chunk with wall-clock times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine_bridge import protocol as p
from engine_bridge.client import EngineSession
from engine_bridge.formats import ENGINE_OUTPUT_RATE, INPUT_FRAME_SAMPLES, OUTPUT_FRAME_SAMPLES


@dataclass
class Played:
    wall: float
    epoch: int
    turn_id: int
    pcm: np.ndarray


@dataclass
class SessionDriver:
    session: EngineSession
    events: list[tuple[float, p.SessionEvent]] = field(default_factory=list)
    played: list[Played] = field(default_factory=list)
    #: (wall time, ring epoch) every time the driver saw the epoch word change.
    epoch_changes: list[tuple[float, int]] = field(default_factory=list)
    input_frames: int = 0
    #: Wall time at which the frame holding a marked input sample was written (see ``run(mark_sample=...)``).
    marks: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._buf = np.zeros(1 << 16, dtype=np.int16)
        self._pending = np.zeros(0, dtype=np.int16)
        self._pending_tag: tuple[int, int] = (0, 0)
        self._turn_played: dict[tuple[int, int], int] = {}
        self._epoch_seen = self.session.rings.egress.epoch
        self.t0 = time.monotonic()
        self._next = self.t0

    # --- one 20 ms tick ----------------------------------------------------------------------------------
    def _tick(self, frame: np.ndarray | None) -> None:
        s = self.session
        if s.closed:
            return
        if frame is not None:
            s.rings.ingress.write(frame)
            s.ring_doorbell()  # as the media plane's IngressWriter does: the engine reads it now
            self.input_frames += 1
        eg = s.rings.egress
        epoch = eg.epoch
        if epoch != self._epoch_seen:
            self._epoch_seen = epoch
            self.epoch_changes.append((time.monotonic(), epoch))
            if self._pending_tag[0] < epoch:
                self._pending = np.zeros(0, dtype=np.int16)  # stale audio never plays
        while self._pending.shape[0] < OUTPUT_FRAME_SAMPLES:
            info = eg.read_chunk(self._buf)
            if info is None:
                break
            self._pending = np.concatenate([self._pending, self._buf[: info.nsamples]])
            self._pending_tag = (info.epoch, info.turn_id)
        if self._pending.shape[0]:
            out, self._pending = self._pending[:OUTPUT_FRAME_SAMPLES], self._pending[OUTPUT_FRAME_SAMPLES:]
            key = self._pending_tag
            self._turn_played[key] = self._turn_played.get(key, 0) + out.shape[0]
            eg.report_playout(key[0], key[1], self._turn_played[key])
            self.played.append(Played(time.monotonic(), key[0], key[1], out.copy()))
        while not s.events.empty():
            self.events.append((time.monotonic(), s.events.get_nowait()))

    async def run(
        self,
        audio: np.ndarray | None = None,
        *,
        seconds: float = 0.0,
        until: Callable[[SessionDriver], bool] | None = None,
        mark_sample: int | None = None,
    ) -> None:
        """Feed ``audio`` (16 kHz int16) then silence, at real time, for at least ``seconds`` in total or until
        ``until(driver)`` is true (checked every tick). With ``mark_sample``, the wall time at which the frame
        holding that sample of ``audio`` is written goes to :attr:`marks`."""
        mark_frame = None if mark_sample is None else mark_sample // INPUT_FRAME_SAMPLES
        frames = (
            []
            if audio is None
            else [audio[i : i + INPUT_FRAME_SAMPLES] for i in range(0, len(audio), INPUT_FRAME_SAMPLES)]
        )
        silence = np.zeros(INPUT_FRAME_SAMPLES, dtype=np.int16)
        start = time.monotonic()
        i = 0
        while True:
            frame = frames[i] if i < len(frames) else silence
            if frame.shape[0] < INPUT_FRAME_SAMPLES:
                frame = np.concatenate([frame, silence[: INPUT_FRAME_SAMPLES - frame.shape[0]]])
            self._tick(frame)
            if i == mark_frame:
                self.marks.append(time.monotonic())
            i += 1
            done_audio = i >= len(frames)
            if done_audio and time.monotonic() - start >= seconds and (until is None or until(self)):
                return
            if until is not None and done_audio and seconds == 0 and until(self):
                return
            self._next += 0.02
            delay = self._next - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self._next = time.monotonic()

    # --- queries -------------------------------------------------------------------------------------------
    def of(self, kind: type) -> list:
        return [e for _, e in self.events if isinstance(e, kind)]

    def timed(self, kind: type) -> list[tuple[float, object]]:
        return [(t, e) for t, e in self.events if isinstance(e, kind)]

    def audio_of_turn(self, turn_id: int) -> np.ndarray:
        parts = [pl.pcm for pl in self.played if pl.turn_id == turn_id]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)

    def reply_done(self, turn_id: int | None = None) -> bool:
        return any(turn_id is None or e.turn_id == turn_id for e in self.of(p.ReplyDone))

    def played_seconds(self) -> float:
        return sum(pl.pcm.shape[0] for pl in self.played) / ENGINE_OUTPUT_RATE


# --- test signals (tones stand in for speech where the words do not matter) ---------------------------------------
def speech(ms: int, rate: int = 16_000, freq: float = 300.0) -> np.ndarray:
    t = np.arange(rate * ms // 1000) / rate
    return (8000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def silence(ms: int, rate: int = 16_000) -> np.ndarray:
    return np.zeros(rate * ms // 1000, dtype=np.int16)


def dominant_hz(pcm: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(pcm.astype(np.float64) * np.hanning(len(pcm))))
    return float(np.fft.rfftfreq(len(pcm), 1 / rate)[int(np.argmax(spec))])


def turn_played_ms(d: SessionDriver, turn_id: int) -> float:
    """Milliseconds of reply ``turn_id`` the driver has played (24 kHz output)."""
    return sum(x.pcm.shape[0] for x in d.played if x.turn_id == turn_id) / 24
