"""Single-producer single-consumer audio rings in POSIX shared memory.

Each session owns two rings, both created by the media side (the serving process or a co-located agent) and
attached by the engine:

* :class:`IngressRing` carries caller audio, PCM16 mono at the engine input rate. Cursors count samples.
* :class:`EgressRing` carries model audio as chunks tagged ``(epoch, turn_id, seq, nsamples)``. Cursors count
  bytes. The header holds the session's current **epoch** word: the engine bumps it *first* on barge-in, and the
  reader drops every chunk of an older epoch at its next read, so stale audio stops within one frame.

Layout of a segment (all integers little-endian; every hot word on its own 64-byte line so the producer and the
consumer never write to the same cache line)::

    0    magic u32, version u32, kind u32, sample_rate u32, capacity u64 (power of two), creator_pid u64
    64   write cursor u64 (monotonic; only the producer writes it)
    128  read cursor u64 (monotonic; only the consumer writes it)
    192  epoch u64 (only the engine writes it)
    200  output attenuation u64, Q16: 0 = unity, 65536 = mute (only the engine writes it; the barge-in duck)
    256  flags u64 (bit 0: producer closed, bit 1: consumer closed), overruns u64, stale_dropped u64
    320  playout: played_turn_id u64, played_samples u64, played_epoch u64 (written by the egress reader)
    512  data[capacity]

Ordering: the producer copies data, then publishes the write cursor; the consumer reads data, then publishes the
read cursor. Aligned 8-byte stores are atomic on the platforms we run on (x86-64, aarch64), and CPython's
interpreter loop plus the GIL-release points give program order for these numpy stores on x86's TSO model.

Hot path: the ingress ring's ``write``/``read_into`` run once per 20 ms frame per session on each side, and the
egress ring's ``read_chunk`` once per frame on the media side. When the optional C core ``engine_bridge._ringcore``
is built (it is compiled at install; ``NATIVE`` says whether it was), they are one C call each over the same
layout, with acquire/release atomics on the cursors; otherwise the pure-Python methods below run, and the tests
exercise both. The C core also does the media side's steady-state frame in one call (``EgressRing.play``: more of
the turn that played last at unity gain in an unchanged epoch, with its playout report); the Python ``play``
declines every frame, and the media player's general path, the reference, produces it. Every page of a segment is mapped when it is created
or attached, so no frame pays a page fault.

Invariants (checked): capacity is a power of two; cursors only grow; ``0 <= write - read <= capacity``. A producer
that would overrun the consumer never overwrites unread data: it drops the new frame and counts an overrun.

Segment names are ``lko_<creator pid>_<token>_<in|out>``. They are unlinked by their creator on close and at exit,
by the engine when the creator's control connection vanishes, and by :func:`remove_orphan_segments` at start-up
(only names with our prefix whose creator process is gone and whose header carries our magic).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import secrets
import struct
import weakref
from enum import IntEnum
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any, ClassVar, Final, NamedTuple

import numpy as np

try:  # the per-frame ring paths in C; optional (see engine_bridge/_ringcore.c and pyproject.toml)
    from engine_bridge import _ringcore
except ImportError:  # not built (no compiler at install time): the pure-Python path below is used
    _ringcore = None  # type: ignore[assignment]  # a module or None; NATIVE says which

log = logging.getLogger(__name__)

#: True when IngressRing.write/read_into and EgressRing.read_chunk run in C (engine_bridge._ringcore); False on the
#: pure-Python path.
NATIVE: Final = _ringcore is not None

MAGIC: Final = 0x4C4B4F52  # "LKOR"
VERSION: Final = 1
SEGMENT_PREFIX: Final = "lko_"
HEADER_BYTES: Final = 512
SHM_DIR: Final = Path("/dev/shm")

# Byte offsets of the header words.
_OFF_WRITE: Final = 64
_OFF_READ: Final = 128
_OFF_EPOCH: Final = 192
_OFF_ATTENUATION: Final = 200
_OFF_FLAGS: Final = 256
_OFF_OVERRUNS: Final = 264
_OFF_STALE: Final = 272
_OFF_PLAYED_TURN: Final = 320
_OFF_PLAYED_SAMPLES: Final = 328
_OFF_PLAYED_EPOCH: Final = 336
_STATIC = struct.Struct("<IIIIQQ")
_INT16 = np.dtype(np.int16)
# The same offsets as indexes into the header viewed as 64-bit words.
_W_WRITE: Final = _OFF_WRITE // 8
_W_READ: Final = _OFF_READ // 8
_W_EPOCH: Final = _OFF_EPOCH // 8
_W_ATTENUATION: Final = _OFF_ATTENUATION // 8
_W_FLAGS: Final = _OFF_FLAGS // 8
_W_OVERRUNS: Final = _OFF_OVERRUNS // 8
_W_STALE: Final = _OFF_STALE // 8
_W_PLAYED_TURN: Final = _OFF_PLAYED_TURN // 8
_W_PLAYED_SAMPLES: Final = _OFF_PLAYED_SAMPLES // 8
_W_PLAYED_EPOCH: Final = _OFF_PLAYED_EPOCH // 8

FLAG_PRODUCER_CLOSED: Final = 1
FLAG_CONSUMER_CLOSED: Final = 2

#: Unity gain in the Q16 attenuation word's scale.
_Q16: Final = 1 << 16

#: Egress chunk header: epoch u32, turn_id u32, seq u32, nsamples u32.
_CHUNK = struct.Struct("<IIII")
CHUNK_HEADER_BYTES: Final = _CHUNK.size


class RingKind(IntEnum):
    INGRESS = 1
    EGRESS = 2


class RingError(RuntimeError):
    """A segment that is not ours, has the wrong version or kind, or a broken invariant."""


class ChunkInfo(NamedTuple):
    """The tag of one egress chunk. ``nsamples`` PCM16 samples were copied into the caller's buffer.

    A tuple, so the C core builds it without running Python code (one per chunk on the media side's frame)."""

    epoch: int
    turn_id: int
    seq: int
    nsamples: int


class PlayCursor:
    """The egress consumer's position between frames (the pure-Python twin of ``_ringcore.PlayCursor``): the held
    chunk (its buffer, read position, length, epoch and turn), the epoch word seen at the previous frame, the gain
    that frame ended at, and the turn that played last with its record (``last``, whose ``played``
    :meth:`EgressRing.play` advances; None when no turn is current). ``media.egress.EgressPlayer`` owns it."""

    __slots__ = (
        "chunk",
        "chunk_epoch",
        "chunk_turn",
        "epoch_seen",
        "gain",
        "last",
        "last_epoch",
        "last_turn",
        "len",
        "pos",
    )

    def __init__(self, chunk: np.ndarray) -> None:
        self.chunk = chunk
        self.pos = self.len = self.chunk_epoch = self.chunk_turn = 0
        self.epoch_seen = -1
        self.gain = 1.0
        self.last_epoch = self.last_turn = 0
        self.last: Any = None


def _prefault(data: memoryview) -> None:
    """Map every page of the segment into this process now, at session set-up, rather than on the first frame
    that touches it. A first touch is a page fault (kernel entry, and a hypervisor exit on a VM); without this,
    every 4 KiB of audio cost one on each side for the ring's first lap (~1,700 faults per 10 s of 50 streams in
    benchmarks/ring_ipc.py). Reading one byte per page is enough: shared memory is mapped writable on a read fault.
    """
    np.frombuffer(data, dtype=np.uint8)[:: mmap.PAGESIZE].sum()


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def new_segment_name(kind: RingKind) -> str:
    suffix = "in" if kind is RingKind.INGRESS else "out"
    return f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}_{suffix}"


def _untrack(shm: shared_memory.SharedMemory) -> None:
    # Python 3.11's resource tracker unlinks every segment a process *attached* to when that process exits,
    # which would pull the ring from under the other side. Ownership is explicit here (see module docstring),
    # so an attaching process must not be tracked.
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # the tracker may not know the name; nothing to undo then
        pass


class _Ring:
    """Shared-memory segment, header views and the checked cursor protocol common to both rings."""

    kind: ClassVar[RingKind]
    #: The C core the per-frame methods are bound to (None on the Python path), and those methods' names.
    _core: _ringcore.IngressCore | _ringcore.EgressCore | None = None
    _core_methods: tuple[str, ...] = ()

    def __init__(self, shm: shared_memory.SharedMemory, *, owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        self.name = shm.name
        buf = shm.buf
        assert buf is not None  # None only once the segment is closed
        magic, version, kind, rate, capacity, creator = _STATIC.unpack_from(buf, 0)
        if magic != MAGIC:
            raise RingError(f"segment {shm.name!r} is not a livekit-omni ring (magic {magic:#x})")
        if version != VERSION:
            raise RingError(f"segment {shm.name!r} has ring version {version}, this build speaks {VERSION}")
        if kind != self.kind:
            raise RingError(f"segment {shm.name!r} is a {RingKind(kind).name} ring, not {self.kind.name}")
        if not is_power_of_two(capacity) or HEADER_BYTES + capacity > shm.size:
            raise RingError(f"segment {shm.name!r} has a bad capacity {capacity}")
        self.sample_rate: int = rate
        self.capacity_bytes: int = capacity
        self.creator_pid: int = creator
        # Plain memoryviews, not numpy: indexing a word or slicing the data costs ~50 ns this way instead of
        # ~300 ns for a numpy scalar, which is most of the per-frame cost of a 640-byte frame.
        self._words = buf[:HEADER_BYTES].cast("Q")
        self._data = buf[HEADER_BYTES : HEADER_BYTES + capacity]
        self._closed = False
        _prefault(self._data)

    # --- construction --------------------------------------------------------------------------------------
    @classmethod
    def _create_segment(
        cls, capacity_bytes: int, sample_rate: int, name: str | None
    ) -> shared_memory.SharedMemory:
        if not is_power_of_two(capacity_bytes):
            raise ValueError(f"ring capacity must be a power of two, got {capacity_bytes}")
        name = name or new_segment_name(cls.kind)
        if not name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"ring segment names must start with {SEGMENT_PREFIX!r}")
        shm = shared_memory.SharedMemory(name=name, create=True, size=HEADER_BYTES + capacity_bytes)
        buf = shm.buf
        assert buf is not None  # None only once the segment is closed
        buf[:HEADER_BYTES] = bytes(HEADER_BYTES)
        _STATIC.pack_into(buf, 0, MAGIC, VERSION, int(cls.kind), sample_rate, capacity_bytes, os.getpid())
        _register_owned(shm.name)
        return shm

    @classmethod
    def _attach_segment(cls, name: str) -> shared_memory.SharedMemory:
        if not name.startswith(SEGMENT_PREFIX):
            raise RingError(f"refusing to attach {name!r}: not a livekit-omni segment name")
        shm = shared_memory.SharedMemory(name=name, create=False)
        _untrack(shm)
        return shm

    # --- header words ----------------------------------------------------------------------------------------
    @property
    def write_cursor(self) -> int:
        return self._words[_W_WRITE]

    @property
    def read_cursor(self) -> int:
        return self._words[_W_READ]

    @property
    def epoch(self) -> int:
        return self._words[_W_EPOCH]

    @property
    def overruns(self) -> int:
        return self._words[_W_OVERRUNS]

    @property
    def stale_dropped(self) -> int:
        return self._words[_W_STALE]

    @property
    def flags(self) -> int:
        return self._words[_W_FLAGS]

    @property
    def producer_closed(self) -> bool:
        return bool(self.flags & FLAG_PRODUCER_CLOSED)

    @property
    def consumer_closed(self) -> bool:
        return bool(self.flags & FLAG_CONSUMER_CLOSED)

    def set_flag(self, flag: int) -> None:
        # Flags are set once and never cleared; a lost update between the two sides would only delay noticing
        # a close, never corrupt data, and each side sets its own bit.
        self._words[_W_FLAGS] |= flag

    def _publish_write(self, cursor: int) -> None:
        w = self._words
        old = w[_W_WRITE]
        if cursor < old:
            raise RingError(f"write cursor went backwards ({old} -> {cursor})")
        w[_W_WRITE] = cursor

    def _publish_read(self, cursor: int) -> None:
        w = self._words
        old = w[_W_READ]
        if cursor < old:
            raise RingError(f"read cursor went backwards ({old} -> {cursor})")
        w[_W_READ] = cursor

    def _count(self, word: int, n: int = 1) -> None:
        self._words[word] += n

    def _used_bytes(self) -> int:
        w = self._words
        used = w[_W_WRITE] - w[_W_READ]
        if not 0 <= used <= self.capacity_bytes:
            raise RingError(
                f"ring {self.name} invariant broken: write-read={used}, capacity={self.capacity_bytes}"
            )
        return used

    # --- byte copies with wraparound (no allocation: slices of the preallocated data view) ------------------
    def _copy_in(self, pos: int, src: np.ndarray | bytearray) -> None:
        flat = memoryview(src).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ is 3.12+
        n = len(flat)
        cap = self.capacity_bytes
        start = pos & (cap - 1)
        first = min(n, cap - start)
        self._data[start : start + first] = flat[:first]
        if first < n:
            self._data[: n - first] = flat[first:]

    def _copy_out(self, pos: int, dst: np.ndarray | bytearray) -> None:
        flat = memoryview(dst).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ is 3.12+
        n = len(flat)
        cap = self.capacity_bytes
        start = pos & (cap - 1)
        first = min(n, cap - start)
        flat[:first] = self._data[start : start + first]
        if first < n:
            flat[first:] = self._data[: n - first]

    # --- lifecycle -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Release our views first: SharedMemory.close() refuses while exported buffers are alive.
        self._release_fast_path()
        self._words.release()
        self._data.release()
        try:
            self._shm.close()
        except BufferError:  # a caller still holds a view into the ring; the mapping goes away at exit
            log.warning("ring %s closed while a view into it is still alive", self.name)
        if self.owner:
            unlink_segment(self.name)

    def __del__(self) -> None:
        # A ring dropped without close(): release the views so SharedMemory's own finalizer can unmap quietly.
        if not getattr(self, "_closed", True):
            self._closed = True
            self._release_fast_path()
            self._words.release()
            self._data.release()

    def _bind_core(
        self, core: _ringcore.IngressCore | _ringcore.EgressCore, methods: tuple[str, ...]
    ) -> None:
        """Route ``methods`` to the C core: bound on the instance, a per-frame call is one C call instead of a
        Python frame plus a C call. The core implements exactly the Python methods of the same names."""
        self._core = core
        self._core_methods = methods
        for m in methods:
            setattr(self, m, getattr(core, m))

    def _release_fast_path(self) -> None:
        """Drop the native core's export of the segment; the Python methods, which fail cleanly on a closed ring,
        take over."""
        core = self._core
        if core is not None:
            for m in self._core_methods:
                delattr(self, m)
            core.release()
            self._core = None

    @property
    def native(self) -> bool:
        """True when this ring's per-frame methods run in C."""
        return self._core is not None

    def _native_segment(self) -> memoryview:
        if _ringcore is None:
            raise RingError("the native ring core (engine_bridge._ringcore) is not built")
        segment = self._shm.buf
        assert segment is not None  # None only once the segment is closed
        return segment

    def unlink(self) -> None:
        """Remove the segment name (any side may do it when the owner is known to be gone)."""
        unlink_segment(self.name)

    def __enter__(self) -> _Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IngressRing(_Ring):
    """Caller PCM16 mono at the engine input rate. Cursors are in bytes; 2 bytes per sample."""

    kind = RingKind.INGRESS

    def __init__(self, shm: shared_memory.SharedMemory, *, owner: bool, native: bool = NATIVE) -> None:
        super().__init__(shm, owner=owner)
        if native:
            core = _ringcore.IngressCore(self._native_segment(), self.name, RingError)
            self._bind_core(core, ("write", "read_into"))

    @classmethod
    def create(
        cls, capacity_samples: int, sample_rate: int, name: str | None = None, *, native: bool = NATIVE
    ) -> IngressRing:
        return cls(cls._create_segment(capacity_samples * 2, sample_rate, name), owner=True, native=native)

    @classmethod
    def attach(cls, name: str, *, native: bool = NATIVE) -> IngressRing:
        return cls(cls._attach_segment(name), owner=False, native=native)

    @property
    def capacity_samples(self) -> int:
        return self.capacity_bytes // 2

    def available(self) -> int:
        """Samples written and not yet read."""
        return self._used_bytes() // 2

    # write() and read_into() run once per 20 ms frame per session on both sides, so they are written out flat:
    # no helper calls, the header words and the data through memoryviews, each invariant checked once.
    def write(self, pcm: np.ndarray | bytes | bytearray) -> bool:
        """Append PCM16: a 1-D int16 array or bytes of even length. Returns False, counting an overrun, if the
        consumer has not made room (never overwrites)."""
        if isinstance(pcm, bytes | bytearray):
            src = memoryview(pcm)
        elif isinstance(pcm, np.ndarray) and pcm.dtype == _INT16 and pcm.ndim == 1:
            src = memoryview(pcm).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ is 3.12+
        else:
            raise TypeError("ingress audio must be 1-D int16 PCM (an int16 array or bytes)")
        n = len(src)
        if n & 1:
            raise ValueError("ingress audio must be whole int16 samples (an even byte count)")
        cap = self.capacity_bytes
        words = self._words
        w = words[_W_WRITE]
        used = w - words[_W_READ]
        if not 0 <= used <= cap:
            raise RingError(f"ring {self.name} invariant broken: write-read={used}, capacity={cap}")
        if cap - used < n:
            if n > cap:
                raise ValueError(f"frame of {n} bytes is larger than the ring ({cap} bytes)")
            words[_W_OVERRUNS] += 1
            return False
        start = w & (cap - 1)
        end = start + n
        data = self._data
        if end <= cap:
            data[start:end] = src
        else:
            first = cap - start
            data[start:] = src[:first]
            data[: n - first] = src[first:]
        words[_W_WRITE] = w + n  # publish after the copy; n >= 0 keeps the cursor monotonic
        return True

    def read_into(self, out: np.ndarray) -> int:
        """Copy up to ``len(out)`` samples into ``out`` (int16); returns how many were copied."""
        if out.dtype != _INT16 or out.ndim != 1:
            raise TypeError("ingress audio must be read into a 1-D int16 array")
        words = self._words
        r = words[_W_READ]
        used = words[_W_WRITE] - r
        cap = self.capacity_bytes
        if not 0 <= used <= cap:
            raise RingError(f"ring {self.name} invariant broken: write-read={used}, capacity={cap}")
        n = min(used, 2 * out.shape[0]) & ~1
        if not n:
            return 0
        dst = memoryview(out).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ is 3.12+
        start = r & (cap - 1)
        end = start + n
        data = self._data
        if end <= cap:
            dst[:n] = data[start:end]
        else:
            first = cap - start
            dst[:first] = data[start:]
            dst[first:n] = data[: n - first]
        words[_W_READ] = r + n  # publish after the copy
        return n // 2


class EgressRing(_Ring):
    """Model audio chunks tagged ``(epoch, turn_id, seq, nsamples)``; cursors are in bytes."""

    kind = RingKind.EGRESS

    def __init__(self, shm: shared_memory.SharedMemory, *, owner: bool, native: bool = NATIVE) -> None:
        super().__init__(shm, owner=owner)
        # Preallocated header scratch, so neither side allocates per chunk.
        self._hdr = bytearray(CHUNK_HEADER_BYTES)
        if native:
            core = _ringcore.EgressCore(self._native_segment(), self.name, RingError, ChunkInfo)
            self._bind_core(core, ("read_chunk", "play"))

    @classmethod
    def create(
        cls, capacity_bytes: int, sample_rate: int, name: str | None = None, *, native: bool = NATIVE
    ) -> EgressRing:
        return cls(cls._create_segment(capacity_bytes, sample_rate, name), owner=True, native=native)

    @classmethod
    def attach(cls, name: str, *, native: bool = NATIVE) -> EgressRing:
        return cls(cls._attach_segment(name), owner=False, native=native)

    # --- engine side (producer) ----------------------------------------------------------------------------
    def bump_epoch(self, new_epoch: int | None = None) -> int:
        """Advance the epoch word (the first thing a barge-in does). Returns the new epoch."""
        cur = self.epoch
        nxt = cur + 1 if new_epoch is None else new_epoch
        if nxt < cur:
            raise RingError(f"epoch went backwards ({cur} -> {nxt})")
        self._words[_W_EPOCH] = nxt
        return nxt

    def set_gain(self, gain: float) -> None:
        """Scale what the media plane plays from its next frame on (1.0 = as written, 0.0 = mute), without
        touching the queued audio: the barge-in duck, undone when the caller's sound was only a backchannel.
        A zeroed header is unity, so a reader that never sees this word plays at full level."""
        if not 0.0 <= gain <= 1.0:
            raise ValueError(f"gain must be within [0, 1], not {gain}")
        self._words[_W_ATTENUATION] = _Q16 - round(gain * _Q16)

    def free_bytes(self) -> int:
        return self.capacity_bytes - self._used_bytes()

    def write_chunk(self, epoch: int, turn_id: int, seq: int, pcm: np.ndarray) -> bool:
        """Append one chunk. Returns False (and counts an overrun) when the reader has not made room."""
        if pcm.dtype != np.int16 or pcm.ndim != 1:
            raise TypeError("egress audio must be a 1-D int16 array")
        n = CHUNK_HEADER_BYTES + pcm.nbytes
        if n > self.capacity_bytes:
            raise ValueError(f"chunk of {n} bytes is larger than the ring ({self.capacity_bytes} bytes)")
        w = self.write_cursor
        if self.capacity_bytes - (w - self.read_cursor) < n:
            self._count(_W_OVERRUNS)
            return False
        hdr = self._hdr
        _CHUNK.pack_into(hdr, 0, epoch, turn_id, seq, pcm.shape[0])
        self._copy_in(w, hdr)
        self._copy_in(w + CHUNK_HEADER_BYTES, pcm)
        self._publish_write(w + n)
        return True

    # --- media side (consumer) -----------------------------------------------------------------------------
    def read_chunk(self, out: np.ndarray) -> ChunkInfo | None:
        """Copy the next current-epoch chunk into ``out`` (int16, large enough for any chunk).

        Chunks whose epoch is older than the header's epoch are skipped and counted in ``stale_dropped``.
        Returns None when nothing current is pending.
        """
        epoch_now = self.epoch
        hdr = self._hdr
        while True:
            r = self.read_cursor
            if self._used_bytes() < CHUNK_HEADER_BYTES:
                return None
            self._copy_out(r, hdr)
            epoch, turn_id, seq, nsamples = _CHUNK.unpack_from(hdr)
            end = r + CHUNK_HEADER_BYTES + 2 * nsamples
            if end > self.write_cursor:
                raise RingError(f"egress ring {self.name}: chunk runs past the write cursor")
            if epoch < epoch_now:
                self._count(_W_STALE)
                self._publish_read(end)
                continue
            if nsamples > out.shape[0]:
                raise ValueError(f"output buffer holds {out.shape[0]} samples, chunk has {nsamples}")
            self._copy_out(r + CHUNK_HEADER_BYTES, out[:nsamples])
            self._publish_read(end)
            return ChunkInfo(epoch, turn_id, seq, nsamples)

    def play_cursor(self, chunk: np.ndarray) -> PlayCursor:
        """A consumer position for :meth:`play` (the C cursor when this ring's per-frame methods are native)."""
        if self._core is not None:
            return _ringcore.PlayCursor(chunk)  # type: ignore[return-value]  # the same attributes
        return PlayCursor(chunk)

    def play(self, work: np.ndarray, cursor: PlayCursor) -> int:
        """The consumer's steady-state frame in one call: fill ``work`` when the gain is unity, the epoch is
        ``cursor.epoch_seen`` and everything the frame takes is more of the turn that played last; returns the model
        samples written (the rest zeroed) and advances the cursor, ``cursor.last.played`` and the playout words.
        Returns -1, changing nothing, for any other frame, which the caller produces on its general path.

        This Python path always declines: the C core (``_ringcore.c``, where the reason is written up) exists
        because this frame costs ~25 µs of interpreter time per call; in Python the general path is the same work."""
        return -1

    def drop_stale(self) -> int:
        """Discard queued chunks of older epochs without reading current ones; returns how many."""
        epoch_now = self.epoch
        dropped = 0
        hdr = self._hdr
        while self._used_bytes() >= CHUNK_HEADER_BYTES:
            r = self.read_cursor
            self._copy_out(r, hdr)
            epoch, _, _, nsamples = _CHUNK.unpack_from(hdr)
            if epoch >= epoch_now:
                break
            self._count(_W_STALE)
            self._publish_read(r + CHUNK_HEADER_BYTES + 2 * nsamples)
            dropped += 1
        return dropped

    # --- playout position (written by the media side, read by the engine) ---------------------------------
    @property
    def gain(self) -> float:
        """The output gain the engine asks for (see :meth:`set_gain`)."""
        return 1.0 - min(self._words[_W_ATTENUATION], _Q16) / _Q16

    def report_playout(self, epoch: int, turn_id: int, played_samples: int) -> None:
        """Record how many samples of ``turn_id`` have actually left the server (or been heard)."""
        w = self._words
        w[_W_PLAYED_EPOCH] = epoch
        w[_W_PLAYED_TURN] = turn_id
        w[_W_PLAYED_SAMPLES] = played_samples

    def playout(self) -> tuple[int, int, int]:
        """``(epoch, turn_id, played_samples)`` as last reported by the media side."""
        w = self._words
        return w[_W_PLAYED_EPOCH], w[_W_PLAYED_TURN], w[_W_PLAYED_SAMPLES]


# --- ownership bookkeeping and the janitor --------------------------------------------------------------------

_owned: set[str] = set()


def _register_owned(name: str) -> None:
    _owned.add(name)


def unlink_segment(name: str) -> bool:
    """Unlink a segment by name; True if it existed. Never raises for a missing segment."""
    _owned.discard(name)
    try:
        shm = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        return False
    try:
        shm.close()
        shm.unlink()  # also unregisters from the resource tracker
    except FileNotFoundError:
        return False
    return True


@atexit.register
def _unlink_owned_at_exit() -> None:
    for name in list(_owned):
        unlink_segment(name)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_our_segments() -> list[str]:
    """Names in /dev/shm that carry our prefix."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(SEGMENT_PREFIX))


def remove_orphan_segments() -> list[str]:
    """Unlink rings whose creator process is gone. Touches only our prefix *and* our magic."""
    removed: list[str] = []
    for name in list_our_segments():
        try:
            pid = int(name[len(SEGMENT_PREFIX) :].split("_", 1)[0])
        except ValueError:
            continue
        if _pid_alive(pid):
            continue
        path = SHM_DIR / name
        try:
            with path.open("rb") as f:
                head = f.read(8)
        except OSError:
            continue
        # Any version of ours counts: an orphan from an older build is still ours to clean.
        if len(head) < 8 or struct.unpack_from("<I", head)[0] != MAGIC:
            continue
        try:
            path.unlink()
            removed.append(name)
        except FileNotFoundError:
            continue
    if removed:
        log.info("janitor removed %d orphaned ring segment(s): %s", len(removed), ", ".join(removed))
    return removed


class RingPair:
    """The two rings of one session, as seen from one side."""

    def __init__(self, ingress: IngressRing, egress: EgressRing) -> None:
        self.ingress = ingress
        self.egress = egress
        self._finalizer = weakref.finalize(self, _close_pair, ingress, egress)

    @classmethod
    def create(
        cls,
        *,
        input_rate: int,
        output_rate: int,
        ingress_seconds: float = 4.0,
        egress_seconds: float = 8.0,
        native: bool = NATIVE,
    ) -> RingPair:
        """Create both rings sized to hold at least the given seconds of audio (rounded up to a power of two);
        ``native=False`` keeps this process's side of both on the Python path."""
        in_samples = _pow2_at_least(int(input_rate * ingress_seconds))
        out_bytes = _pow2_at_least(int(output_rate * egress_seconds * 2) + 64 * CHUNK_HEADER_BYTES)
        ingress = IngressRing.create(in_samples, input_rate, native=native)
        try:
            egress = EgressRing.create(out_bytes, output_rate, native=native)
        except BaseException:
            ingress.close()
            raise
        return cls(ingress, egress)

    @classmethod
    def attach(cls, ingress_name: str, egress_name: str) -> RingPair:
        ingress = IngressRing.attach(ingress_name)
        try:
            egress = EgressRing.attach(egress_name)
        except BaseException:
            ingress.close()
            raise
        return cls(ingress, egress)

    @property
    def names(self) -> tuple[str, str]:
        return self.ingress.name, self.egress.name

    def close(self) -> None:
        self._finalizer()


def _close_pair(ingress: IngressRing, egress: EgressRing) -> None:
    ingress.close()
    egress.close()


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
