"""Audio formats the engine speaks. One place, so that every side agrees on them."""

from __future__ import annotations

from typing import Final

#: Caller audio in the ingress ring: PCM16 mono at this rate.
ENGINE_INPUT_RATE: Final = 16_000
#: Model audio in the egress ring: PCM16 mono at this rate (the OpenAI Live default rate).
ENGINE_OUTPUT_RATE: Final = 24_000
#: The media plane's frame: 20 ms.
FRAME_MS: Final = 20
INPUT_FRAME_SAMPLES: Final = ENGINE_INPUT_RATE * FRAME_MS // 1000
OUTPUT_FRAME_SAMPLES: Final = ENGINE_OUTPUT_RATE * FRAME_MS // 1000


def samples_to_ms(samples: int, rate: int) -> int:
    """Whole milliseconds covered by ``samples`` at ``rate`` (floored, so timelines never run ahead)."""
    return samples * 1000 // rate


def ms_to_samples(ms: int, rate: int) -> int:
    return ms * rate // 1000
