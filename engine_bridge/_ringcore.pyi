# Types of the optional C extension built from engine_bridge/_ringcore.c (see engine_bridge/ring.py).
from typing import Any

import numpy as np
from typing_extensions import Buffer

class IngressCore:
    """The ingress ring's write/read_into over a segment laid out by engine_bridge.ring."""

    def __init__(self, segment: Buffer, name: str, ring_error: type[Exception]) -> None: ...
    def write(self, pcm: np.ndarray | bytes | bytearray, /) -> bool: ...
    def read_into(self, out: np.ndarray, /) -> int: ...
    def release(self) -> None: ...

class EgressCore:
    """The egress ring's consumer read_chunk over a segment laid out by engine_bridge.ring."""

    def __init__(
        self,
        segment: Buffer,
        name: str,
        ring_error: type[Exception],
        tag_type: type[tuple[int, int, int, int]],
    ) -> None: ...
    def read_chunk(self, out: np.ndarray, /) -> tuple[int, int, int, int] | None: ...
    def play(self, work: np.ndarray, cursor: PlayCursor, /) -> int: ...
    def release(self) -> None: ...

class PlayCursor:
    """The egress consumer's position: held chunk, epoch seen, gain state and the turn that played last."""

    chunk: np.ndarray
    pos: int
    len: int
    chunk_epoch: int
    chunk_turn: int
    epoch_seen: int
    gain: float
    last_epoch: int
    last_turn: int
    last: Any

    def __init__(self, chunk: np.ndarray) -> None: ...
