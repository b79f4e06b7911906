"""``OmniGate``: the plugin's audio gate, which tells LiveKit where one assistant message (a burst of audio) begins
and ends in the model's output stream.

Its own module because both sides of the plugin need it: :class:`livekit_omni.plugin.model.OmniDuplexModel` hands
it to LiveKit (``audio_gate()``), and the co-located stream marks its frames with :data:`IN_REPLY` for it.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from livekit import rtc

#: The gate's silence floor (RMS, full scale 1.0). Between utterances we emit *digital zeros* (the egress player
#: zero-fills, and at 24 kHz nothing is resampled on the way out), so the true floor is 0 and any floor would do for
#: closing. What the value decides is where a burst *opens*: the adapter does not play frames before its gate opens.
#: LiveKit clamps a FixedGate floor to 1e-4 (-80 dBFS, ~3 LSB RMS); we use exactly that, so a burst opens at
#: 3e-4 (-70 dBFS, ~10 LSB) — the first audible frame of a reply, Piper's soft onsets included, is played — and a
#: frame counts as quiet below 1.8e-4 (-75 dBFS), which only our zeros and true near-silence reach.
GATE_SILENCE_RMS: Final = 1e-4
GATE_ACTIVATION_RATIO: Final = 3.0
GATE_DEACTIVATION_RATIO: Final = 1.8
#: How long the output must stay quiet before a burst (one assistant message) ends. Pauses between sentences stay
#: inside one message; GPT-Live uses the same 0.8 s. A barge-in zeroes the output at once, so an interrupted reply
#: ends 0.8 s after the cut, well before the caller's own turn ends and the next answer begins.
GATE_MIN_SILENCE_S: Final = 0.8
#: Co-located only: while the engine says a reply is still being produced, a gap in its audio (the next clause is
#: still being voiced; on a small CPU that takes longer than 0.8 s) does not end the burst, for up to this long.
#: Without it one answer reached LiveKit as three messages ("The capital of France" / "is" / "Paris.").
GATE_REPLY_PAUSE_S: Final = 4.0
#: The key in ``rtc.AudioFrame.userdata`` by which the co-located stream marks frames played while the engine's
#: reply is still in progress (the remote Live wire carries no reply boundaries, so its frames are never marked).
IN_REPLY: Final = "livekit_omni.in_reply"


class OmniGate:
    """LiveKit's ``FixedGate`` on our digital-zero silence (same floor, ratios and hangover semantics), plus the
    engine's reply boundaries: a quiet stretch inside a reply that is still being produced does not close the burst
    (for at most ``max_reply_pause`` seconds, so a reply whose end is never reported cannot hold it open)."""

    def __init__(
        self,
        silence: float = GATE_SILENCE_RMS,
        *,
        activation_ratio: float = GATE_ACTIVATION_RATIO,
        deactivation_ratio: float = GATE_DEACTIVATION_RATIO,
        min_silence_duration: float = GATE_MIN_SILENCE_S,
        max_reply_pause: float = GATE_REPLY_PAUSE_S,
    ) -> None:
        self._open_above = silence * activation_ratio
        self._quiet_below = silence * deactivation_ratio
        self._min_silence = min_silence_duration
        self._max_reply_pause = max_reply_pause
        self._open = False
        self._quiet = 0.0  # quiet audio counted towards closing
        self._paused = 0.0  # quiet audio inside a reply, not counted (bounded)

    def deactivate(self) -> None:
        self._open = False
        self._quiet = self._paused = 0.0

    def update(self, frame: rtc.AudioFrame) -> bool:
        samples = np.frombuffer(frame.data, dtype=np.int16).astype(np.float32)
        rms = float(np.sqrt(np.mean(np.square(samples)))) / 32768.0 if samples.size else 0.0
        if not self._open:
            if rms > self._open_above:
                self._open = True
                self._quiet = self._paused = 0.0
        elif rms < self._quiet_below:
            if frame.userdata.get(IN_REPLY) is True and self._paused < self._max_reply_pause:
                self._paused += frame.duration
            else:
                self._quiet += frame.duration
                if self._quiet >= self._min_silence:
                    self._open = False
        else:
            self._quiet = self._paused = 0.0
        return self._open
