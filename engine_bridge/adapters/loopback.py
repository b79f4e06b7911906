"""Loopback *test fixture*: echoes the caller's audio back after a fixed delay. Not the product.

It exists so the data plane (rings, control channel, media plane, facade) can be tested and benchmarked end to
end without loading models. Each 20 ms of caller audio becomes one egress chunk ``delay`` later, resampled from
the engine input rate to the output rate.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import soxr

from engine_bridge import protocol as p
from engine_bridge.adapters.base import AdapterCaps, ModelAdapter
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE, INPUT_FRAME_SAMPLES
from engine_bridge.session import AdapterState, DuplexSession


@dataclass
class _LoopbackState(AdapterState):
    resampler: soxr.ResampleStream = field(
        default_factory=lambda: soxr.ResampleStream(ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE, 1, dtype="int16")
    )
    # (due time, pcm at the output rate); bounded by delay x input rate, since input arrives at real time.
    line: collections.deque[tuple[float, np.ndarray]] = field(default_factory=collections.deque)
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    seq: int = 0


class LoopbackFixtureAdapter(ModelAdapter):
    name = "loopback"
    caps = AdapterCaps(owns_turn_taking=True, resident_kv=False, exact_rollback=False)

    def open(self, session: DuplexSession) -> None:
        session.adapter_state = _LoopbackState()
        session.turn_id = 1
        session.emit(p.ReplyStarted(session_id=session.id, turn_id=1, epoch=session.epoch))

    def close(self, session: DuplexSession) -> None:
        session.adapter_state = None

    def on_audio(self, session: DuplexSession, pcm: np.ndarray) -> None:
        st = session.adapter_state
        if not isinstance(st, _LoopbackState):
            return
        st.pending = np.concatenate([st.pending, pcm]) if st.pending.size else pcm.copy()
        due = time.monotonic() + self.settings.loopback_delay_ms / 1000
        while st.pending.shape[0] >= INPUT_FRAME_SAMPLES:
            frame, st.pending = st.pending[:INPUT_FRAME_SAMPLES], st.pending[INPUT_FRAME_SAMPLES:]
            out = st.resampler.resample_chunk(frame)
            if out.size:
                st.line.append((due, out))
        # Echo straight from the audio thread once due: no scheduler involvement, so the fixture measures the
        # data plane, not the scheduler.
        now = time.monotonic()
        while st.line and st.line[0][0] <= now:
            _, out = st.line.popleft()
            session.queue_audio(session.epoch, session.turn_id, st.seq, out)
            st.seq += 1

    def handle(self, session: DuplexSession, msg: Any) -> None:
        # Text appends and interrupts have no meaning for an echo; the engine core already acknowledged them.
        return None

    def step(self, sessions: list[DuplexSession]) -> bool:
        return False
