"""Ingress hand-off between two processes: shared-memory ring vs base64 JSON over WebSocket vs ZMQ.

What it measures
----------------
Caller audio as 20 ms PCM frames (16 kHz mono int16: 320 samples, 640 bytes) for 1, 10 and 50 concurrent
streams. One *producer* process plays the media plane (every stream's frames), one *consumer* process plays the
engine (or the facade); both are fresh ``multiprocessing`` spawn children, one pair per transport, reused across
stream counts. For each stream count the configurations run back to back: ``null`` first, then the transports.

Transports:

* ``ring`` -- one :class:`engine_bridge.ring.IngressRing` per stream (4 s of audio, like ``RingPair``), created
  by the producer and attached by the consumer, exactly as in production.
* ``ws`` -- one loopback WebSocket per stream (``websockets``, asyncio, both sides). Each frame is the OpenAI
  Live event ``{"type":"session.input_audio.append","audio":"<base64>"}``; the server decodes JSON and base64
  into an int16 numpy array, which is what a Live client plus our facade cost. permessage-deflate and keepalive
  pings are off: that is the *cheapest* configuration for WebSocket (deflate only burns CPU on base64 noise), so
  the ring is compared against WebSocket at its best.
* ``zmq`` -- one PUSH socket per stream connected to a single PULL bound on ``ipc://`` (the idiomatic ZMQ
  fan-in; the stream id is in the frame header), raw bytes, blocking sends, large high-water marks so nothing
  is dropped.
* ``null`` -- not a transport: the same producer loop handing every frame to a no-op, and a consumer that only
  waits. It always runs (``--transports`` cannot drop it) because it is the producer's harness floor below.

The harness (identical for every transport)
-------------------------------------------
The producer paces on absolute 20 ms ticks (``t0 + k*20 ms``) and at each tick produces frame ``k`` of every
stream, one after the other, as a media plane's pacer does per tick. The tick loop is one asyncio coroutine for
*every* transport, ``null`` included: WebSocket needs the event loop, and driving the ring's and ZMQ's sends
(plain synchronous calls) from the very same loop means the per-tick wake-up and the per-frame ``await
sender.send(...)`` are the same code on every row, so the ``null`` producer is exactly the part all rows share.
One wake-up per tick (50/s, amortised over N frames) rather than one per frame also keeps that floor small.

Per frame, identically on every transport: the producer takes ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one
clock for every process on Linux) just before handing the frame over, packs a 16-byte header (stamp u64, stream
u32, seq u32) in front of the 640 PCM bytes (656 bytes on every transport), chains a CRC-32 over it and records
its lag behind the tick (which includes its place in the tick's burst). The consumer takes ``monotonic_ns()`` as
soon as the frame is an int16 array in its memory and calls ``Tally.take``: sequence check, CRC-32 chain,
latency record. A stream is delivered *exactly* when every frame arrived once, in order, and the CRC chains of
both sides match. Because a tick's frames are handed over back to back, a frame's hand-off latency includes
waiting in the consumer behind the earlier frames of its own tick -- the same burst on every transport, and what
an engine that works per tick sees.

CPU accounting (what is subtracted, and why)
--------------------------------------------
*Total* per side: ``psutil.Process().cpu_times()`` user+system of each process (all its threads, so ZMQ's I/O
threads count), sampled in the process itself at ``t0`` and when the window ends, divided by frames delivered.
The producer's window ends only after the consumer has everything (so asynchronous sends finishing on ZMQ's I/O
thread are counted); the consumer's ends at the last frame. psutil counts in 10 ms clock ticks, so the same
figures from ``CLOCK_PROCESS_CPUTIME_ID`` (the same kernel counter, in ns) are in the JSON as ``*_hr``.

*Harness floor*, measured in the same run and subtracted so that what remains is the transport:

* producer floor: the ``null`` producer's total CPU per frame at the same stream count, measured just before
  the transports: tick wake-ups, stamping, header, CRC-32 and the ``await`` of a send that does nothing.
* consumer floor: the ``null`` consumer's CPU per frame at the same stream count (an idle process waiting, about
  zero: it shows the process itself costs nothing) plus the verification step measured in place on every
  transport: ``time.thread_time_ns()`` around every ``Tally.take(frame, monotonic_ns())`` call, the latency
  stamp included (thread CPU, so no other thread leaks in), plus one clock call per frame, calibrated in the consumer before ``t0``, for the half of the two clock
  calls per frame that the brackets cannot see. The instrumentation is harness too, identical on every row.

``transport CPU per frame = (producer total - producer floor) + (consumer total - consumer floor)``. What stays
in it is what the transport makes each side do: for the ring ``write`` and the doorbell, the consumer's
wake-ups, ``read_into`` passes and slicing out frames; for WebSocket JSON + base64 both ways, framing, socket
syscalls and the event-loop wake-ups the sockets cause; for ZMQ its send/recv calls and I/O threads. The
headline keys ``ring_cpu_us_per_frame``, ``ws_cpu_us_per_frame`` and ``zmq_cpu_us_per_frame`` are this
transport CPU at 50 streams (or the largest count run), both sides summed; the raw totals are next to them as
``*_total_cpu_us_per_frame``, and ``ring_vs_ws_cpu_ratio`` / ``ring_vs_ws_total_cpu_ratio`` are the two ratios.
The floor and the total are measured seconds apart on a shared box, so a small transport cost can come out a
little off, even negative; it is reported as measured, never clamped, and a ratio over a non-positive
denominator is ``null``.

The ring consumer (the design choice that decides the ring's CPU *and* latency)
-------------------------------------------------------------------------------
It reads like the engine's audio thread (``Engine._audio_loop``): one pass calls ``read_into`` on every ring
(an empty ring costs one call that loads two cursor words), then it sleeps on the engine's doorbell
(``engine_bridge.doorbell``: a FIFO the producer rings once per event-loop iteration after writing, exactly as
``EngineClient.ring_doorbell`` does for the media plane) with ``--poll-sleep-us`` as the safety-net timeout
(default 100 ms, the engine's ``AUDIO_IDLE_WAIT_S``). The doorbell is drained before the wait returns and rung
after every write, so no pass is needed to confirm that nothing arrived meanwhile: one wake-up and one pass
per tick. The doorbell's syscalls on both sides are charged to the ring. With ``--no-doorbell`` the consumer
sleeps on a timer after every pass instead (default 500 us); it never busy-spins: on a box whose two vCPUs are
shared, a spinning consumer would steal the producer's CPU. WebSocket and ZMQ consumers are event-driven and
need no such choice.

Where the ring's remaining CPU goes (measured on the 2-vCPU CI VM): ``write`` and ``read_into`` are one C call
each (``engine_bridge._ringcore``; the pure-Python path is ~2 us slower per call and is what runs when the
extension is not built, see the ``ring_native`` key; ``--pure-python`` measures it); every page of the segments is mapped at set-up, so no
frame takes a page fault; what is left is mostly the price of touching memory right after a wake-up (a few us
per ring on this VM, for any code) and the wake-up itself (~100 us of CPU, shared by the tick's frames).

Output: progress on stderr; a table and a legend on stdout; the last stdout line is one JSON object (keys in
``_summary``). Every child process, ring segment and ipc file is removed on every exit path (``finally`` in each
child and in the parent, SIGTERM turned into ``SystemExit``, and a last sweep of the ring names the parent saw).

Run: ``.venv/bin/python benchmarks/ring_ipc.py`` (10 s per configuration, 1/10/50 streams, null + all
transports: about 2.5 minutes) or ``--quick`` (2 s per configuration at 1 and 50 streams: about 30 s).
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import struct
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Final

import numpy as np
import psutil
import zmq
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve

from engine_bridge.doorbell import Doorbell, DoorbellButton
from engine_bridge.engine import AUDIO_IDLE_WAIT_S
from engine_bridge.ring import NATIVE, IngressRing, list_our_segments, unlink_segment

SAMPLE_RATE: Final = 16_000
PERIOD_NS: Final = 20_000_000
PCM_BYTES: Final = 640  # 20 ms of 16 kHz mono int16
HDR: Final = struct.Struct("<QII")  # producer monotonic_ns stamp, stream, seq
FRAME_BYTES: Final = HDR.size + PCM_BYTES
FRAME_SAMPLES: Final = FRAME_BYTES // 2
PCM_POOL_FRAMES: Final = 50  # 1 s of distinct random PCM per stream, cycled; content differs per stream
RING_CAPACITY_SAMPLES: Final = 1 << 16  # 4.1 s at 16 kHz, the power of two RingPair picks for 4 s
RING_READ_FRAMES: Final = 16  # read_into buffer: up to 16 pending frames per ring per pass
ZMQ_HWM: Final = 1_000_000  # never block or drop on the high-water mark; backlog shows up as latency
HELLO_SEQ: Final = 0xFFFF_FFFF  # ZMQ connection probe, sent before t0 and never counted
LEAD_NS: Final = 300_000_000  # go -> t0: time for both sides to be asleep and waiting for the same instant
GRACE_S: Final = 5.0  # after the last tick, how long the consumer waits for missing frames
SETUP_TIMEOUT_S: Final = 60.0
TRANSPORTS: Final = ("ring", "ws", "zmq")
BASELINE: Final = "null"  # the producer's tick loop + frame building + CRC, handed to nobody
TARGET_RATIO: Final = 10.0
TARGET_P99_MS: Final = 2.0

Msg = tuple[str, Any]


@dataclass(frozen=True, slots=True)
class Cfg:
    transport: str
    streams: int
    frames: int  # per stream
    poll_sleep_s: float
    run_dir: str  # a private temporary folder (ZMQ ipc endpoint)
    #: The ring consumer sleeps on the engine's doorbell (engine_bridge.doorbell) rather than a timer.
    doorbell: bool = True
    #: The ring's write/read_into in C (engine_bridge._ringcore) rather than the pure-Python path.
    native: bool = NATIVE

    @property
    def total(self) -> int:
        return self.streams * self.frames


class ChildError(RuntimeError):
    """A child process failed; the message carries its traceback."""


class ExitRequested(Exception):
    """The parent said "exit" in the middle of a configuration (it is shutting down): unwind and clean up."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cpu_now(proc: psutil.Process) -> tuple[float, int]:
    t = proc.cpu_times()
    return t.user + t.system, time.process_time_ns()


def _pct_ms(values: list[int], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.int64), q)) / 1e6


def _want(msg: Msg, kind: str) -> Any:
    if msg[0] == "exit" and kind != "exit":
        raise ExitRequested
    if msg[0] != kind:
        raise RuntimeError(f"protocol: expected {kind!r}, got {msg[0]!r}")
    return msg[1]


def _thread_clock_call_ns(calls: int = 20_000, batches: int = 5) -> float:
    """CPU cost of one ``time.thread_time_ns()`` call in this process (median of a few batches).

    CLOCK_THREAD_CPUTIME_ID has no vDSO fast path, so each call is a real syscall (a few hundred ns, more under
    a hypervisor); the consumer makes two per frame to time its verification, and this is how much of that
    instrumentation the brackets themselves cannot see.
    """
    clock = time.thread_time_ns
    per_call: list[float] = []
    for _ in range(batches):
        t = clock()
        for _ in range(calls):
            clock()
        per_call.append((clock() - t) / calls)
    return statistics.median(per_call)


# --- the per-frame measurement, identical for every transport ---------------------------------------------


class Source:
    """Builds stamped frames and remembers what was sent (CRC chain per stream, lag behind the tick)."""

    def __init__(self, streams: int) -> None:
        self.pcm: list[list[bytes]] = []
        for i in range(streams):
            rng = np.random.default_rng(1000 + i)
            block = rng.integers(-12000, 12000, size=(PCM_POOL_FRAMES, PCM_BYTES // 2), dtype=np.int16)
            self.pcm.append([row.tobytes() for row in block])
        self.crc = [0] * streams
        self.lag_ns: list[int] = []

    def frame(self, stream: int, seq: int, tick_ns: int) -> bytes:
        now = time.monotonic_ns()
        payload = HDR.pack(now, stream, seq) + self.pcm[stream][seq % PCM_POOL_FRAMES]
        self.crc[stream] = zlib.crc32(payload, self.crc[stream])
        self.lag_ns.append(now - tick_ns)
        return payload


class Tally:
    """Checks what arrived (sequence, CRC chain per stream) and records the hand-off latency of each frame.

    Every transport's consumer calls ``take(frame, monotonic_ns())`` once per frame, in the same way, between
    two thread-CPU clock reads whose difference it adds to ``verify_ns`` (the call and the latency stamp
    included), so that the measurement can be subtracted from the consumer's total as harness.
    """

    def __init__(self, streams: int, total: int) -> None:
        self.next_seq = [0] * streams
        self.crc = [0] * streams
        self.lat_ns: list[int] = []
        self.total = total
        self.count = 0  # every frame taken, in order or not
        self.in_order = 0
        self.out_of_order = 0
        self.verify_ns = 0  # thread CPU spent in take() calls, as bracketed by the callers

    def take(self, frame: np.ndarray, now_ns: int) -> None:
        stamp, stream, seq = HDR.unpack_from(frame)
        self.lat_ns.append(now_ns - stamp)
        if seq == self.next_seq[stream]:
            self.in_order += 1
        else:
            self.out_of_order += 1
        self.next_seq[stream] = seq + 1
        self.crc[stream] = zlib.crc32(frame, self.crc[stream])
        self.count += 1

    @property
    def done(self) -> bool:
        return self.count >= self.total


# --- producer side: one sender per transport, one tick loop for all ----------------------------------------


class Sender(abc.ABC):
    async def setup(self, cfg: Cfg) -> dict[str, Any]:
        return {}

    async def connect(self, peer: dict[str, Any]) -> None:
        return None

    @abc.abstractmethod
    async def send(self, stream: int, payload: bytes) -> None: ...

    async def close(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}


class RingSender(Sender):
    """Writes each stream's ring, then rings the consumer's doorbell once per event-loop iteration
    (``DoorbellButton.ring_soon``, what ``EngineClient.ring_doorbell`` uses: one syscall for all the frames
    written in that iteration)."""

    def __init__(self) -> None:
        self.rings: list[IngressRing] = []
        self.overruns = 0
        self.bell: DoorbellButton | None = None

    async def setup(self, cfg: Cfg) -> dict[str, Any]:
        for _ in range(cfg.streams):
            self.rings.append(IngressRing.create(RING_CAPACITY_SAMPLES, SAMPLE_RATE, native=cfg.native))
        return {"names": [r.name for r in self.rings]}

    async def connect(self, peer: dict[str, Any]) -> None:
        if peer.get("doorbell"):
            self.bell = DoorbellButton(peer["doorbell"])

    async def send(self, stream: int, payload: bytes) -> None:
        # A full ring drops the new frame (the ring's own overrun policy); the consumer then sees a gap.
        if not self.rings[stream].write(payload):
            self.overruns += 1
        if self.bell is not None:
            self.bell.ring_soon()

    async def close(self) -> None:
        for r in self.rings:
            r.close()  # the owner unlinks
        self.rings.clear()
        if self.bell is not None:
            self.bell.close()

    def stats(self) -> dict[str, Any]:
        return {"overruns": self.overruns, "doorbell_rings": self.bell.rings if self.bell else 0}


class WsSender(Sender):
    def __init__(self) -> None:
        self.conns: list[ClientConnection] = []

    async def connect(self, peer: dict[str, Any]) -> None:
        port = peer["port"]
        streams = peer["streams"]
        for i in range(streams):
            # proxy=None: a loopback benchmark must not be routed through an HTTP(S)_PROXY from the environment.
            ws = await connect(
                f"ws://127.0.0.1:{port}/stream/{i}", compression=None, ping_interval=None, proxy=None
            )
            self.conns.append(ws)

    async def send(self, stream: int, payload: bytes) -> None:
        msg = json.dumps(
            {"type": "session.input_audio.append", "audio": base64.b64encode(payload).decode("ascii")}
        )
        await self.conns[stream].send(msg)

    async def close(self) -> None:
        conns, self.conns = self.conns, []
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)


class ZmqSender(Sender):
    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self.socks: list[zmq.Socket[bytes]] = []

    async def connect(self, peer: dict[str, Any]) -> None:
        for i in range(peer["streams"]):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, ZMQ_HWM)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(peer["endpoint"])
            self.socks.append(s)
            # A PUSH with no connected peer blocks; sending one probe per socket here makes sure every pipe
            # is up before t0, so connection set-up never lands in the measured window.
            s.send(HDR.pack(0, i, HELLO_SEQ))

    async def send(self, stream: int, payload: bytes) -> None:
        self.socks[stream].send(payload)

    async def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.socks.clear()
        self.ctx.term()


class NullSender(Sender):
    """The harness floor: everything the producer does per frame except handing it to a transport."""

    async def send(self, stream: int, payload: bytes) -> None:
        return None


SENDERS: Final[dict[str, Callable[[], Sender]]] = {
    "ring": RingSender,
    "ws": WsSender,
    "zmq": ZmqSender,
    BASELINE: NullSender,
}


async def _tick_loop(cfg: Cfg, t0: int, sender: Sender, src: Source) -> None:
    """At every absolute 20 ms tick, produce and send frame ``k`` of every stream (same code for every transport)."""
    send = sender.send
    frame = src.frame
    streams = range(cfg.streams)
    for k in range(cfg.frames):
        tick = t0 + k * PERIOD_NS
        delay = tick - time.monotonic_ns()
        if delay > 0:
            await asyncio.sleep(delay / 1e9)
        for i in streams:
            await send(i, frame(i, k, tick))


async def _producer(conn: Connection, cfg: Cfg) -> None:
    loop = asyncio.get_running_loop()
    proc = psutil.Process()
    sender = SENDERS[cfg.transport]()

    async def recv() -> Msg:
        # Waiting on the parent in a worker thread keeps the event loop free (WebSocket handshakes).
        msg: Msg = await loop.run_in_executor(None, conn.recv)
        return msg

    try:
        conn.send(("info", await sender.setup(cfg)))
        await sender.connect(_want(await recv(), "peer"))
        src = Source(cfg.streams)
        conn.send(("ready", None))
        t0: int = _want(await recv(), "go")
        await asyncio.sleep(max(0, t0 - time.monotonic_ns()) / 1e9)
        cpu0, hr0 = _cpu_now(proc)
        await _tick_loop(cfg, t0, sender, src)
        paced_ns = time.monotonic_ns() - t0
        _want(await recv(), "stop")  # sent once the consumer has everything (or gave up)
        cpu1, hr1 = _cpu_now(proc)
        conn.send(
            (
                "result",
                {
                    "sent": cfg.frames * cfg.streams,
                    "crc": src.crc,
                    "cpu_s": cpu1 - cpu0,
                    "cpu_hr_s": (hr1 - hr0) / 1e9,
                    "paced_s": paced_ns / 1e9,
                    "lag_p50_ms": _pct_ms(src.lag_ns, 50),
                    "lag_p99_ms": _pct_ms(src.lag_ns, 99),
                    **sender.stats(),
                },
            )
        )
        _want(await recv(), "teardown")
    finally:
        await sender.close()
    conn.send(("closed", None))


# --- consumer side ------------------------------------------------------------------------------------------


class Sink(abc.ABC):
    def __init__(self, cfg: Cfg, tally: Tally) -> None:
        self.cfg = cfg
        self.tally = tally

    async def setup(self) -> dict[str, Any]:
        return {}

    async def connect(self, peer: dict[str, Any]) -> None:
        return None

    @abc.abstractmethod
    async def run(self, hard_deadline_ns: int) -> None: ...

    async def close(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}


class RingSink(Sink):
    """Reads like the engine's audio thread: a pass over every ring, then sleep on the doorbell (the engine's
    own primitive) until a producer rings or the fallback timeout passes."""

    def __init__(self, cfg: Cfg, tally: Tally) -> None:
        super().__init__(cfg, tally)
        self.rings: list[IngressRing] = []
        self.passes = 0
        self.empty = 0
        self.bell: Doorbell | None = None

    async def setup(self) -> dict[str, Any]:
        if not self.cfg.doorbell:
            return {}
        self.bell = Doorbell(Path(tempfile.mkdtemp(prefix="lko-bench-")) / "consumer.bell")
        return {"doorbell": str(self.bell.path)}

    async def connect(self, peer: dict[str, Any]) -> None:
        for name in peer["names"]:
            self.rings.append(IngressRing.attach(name, native=self.cfg.native))

    async def run(self, hard_deadline_ns: int) -> None:
        # The poll is a plain blocking loop, like the engine's audio thread; nothing else runs on this loop.
        self._poll(hard_deadline_ns)

    def _poll(self, hard_deadline_ns: int) -> None:
        rings = self.rings
        tally = self.tally
        sleep_s = self.cfg.poll_sleep_s
        bell = self.bell
        buf = np.zeros(RING_READ_FRAMES * FRAME_SAMPLES, dtype=np.int16)
        # Per-frame views into buf made once, so slicing a frame out costs nothing per frame.
        frames = [buf[j * FRAME_SAMPLES : (j + 1) * FRAME_SAMPLES] for j in range(RING_READ_FRAMES)]
        reads = [ring.read_into for ring in rings]
        take = tally.take
        monotonic_ns = time.monotonic_ns
        thread_time_ns = time.thread_time_ns
        passes = empty = 0  # locals in the loop, published once: the counters must not cost a pass anything
        while not tally.done:
            # One pass = read_into on every ring, as the engine's audio thread pumps every session per wake-up.
            # An empty ring costs one C call that loads two cursor words; no separate scan of the cursors first.
            passes += 1
            got = False
            for i, read in enumerate(reads):
                n = read(buf)
                if not n:
                    continue
                got = True
                if n % FRAME_SAMPLES:
                    raise RuntimeError(f"ring {rings[i].name}: read {n} samples, not whole frames")
                for k in range(n // FRAME_SAMPLES):
                    t = thread_time_ns()
                    take(frames[k], monotonic_ns())
                    tally.verify_ns += thread_time_ns() - t
            if tally.done or monotonic_ns() > hard_deadline_ns:
                break
            # Sleep after every pass, productive or not: the doorbell is drained before it returns, and a
            # producer rings *after* writing, so a frame written during the pass leaves a ring pending and the
            # wait returns at once. No confirmation pass is needed.
            empty += not got
            if bell is not None:
                bell.wait(sleep_s)
            else:
                time.sleep(sleep_s)
        self.passes, self.empty = passes, empty

    def stats(self) -> dict[str, Any]:
        return {"poll_passes": self.passes, "poll_empty": self.empty}

    async def close(self) -> None:
        for r in self.rings:
            r.close()  # detach only; the producer owns and unlinks
        self.rings.clear()
        if self.bell is not None:
            self.bell.close()


class WsSink(Sink):
    def __init__(self, cfg: Cfg, tally: Tally) -> None:
        super().__init__(cfg, tally)
        self.server: Server | None = None
        self.done = asyncio.Event()

    async def _handler(self, ws: ServerConnection) -> None:
        tally = self.tally
        async for msg in ws:
            obj = json.loads(msg)
            if obj["type"] != "session.input_audio.append":
                continue
            frame = np.frombuffer(base64.b64decode(obj["audio"]), dtype=np.int16)
            t = time.thread_time_ns()
            tally.take(frame, time.monotonic_ns())
            tally.verify_ns += time.thread_time_ns() - t
            if tally.done:
                self.done.set()

    async def setup(self) -> dict[str, Any]:
        self.server = await serve(self._handler, "127.0.0.1", 0, compression=None, ping_interval=None)
        port = next(iter(self.server.sockets)).getsockname()[1]
        return {"port": port, "streams": self.cfg.streams}

    async def run(self, hard_deadline_ns: int) -> None:
        timeout = max(0.0, (hard_deadline_ns - time.monotonic_ns()) / 1e9)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), timeout)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None


class ZmqSink(Sink):
    def __init__(self, cfg: Cfg, tally: Tally) -> None:
        super().__init__(cfg, tally)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self.sock: zmq.Socket[bytes] | None = None

    async def setup(self) -> dict[str, Any]:
        endpoint = f"ipc://{self.cfg.run_dir}/zmq-{os.getpid()}.ipc"
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, ZMQ_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        self.sock = sock
        return {"endpoint": endpoint, "streams": self.cfg.streams}

    async def connect(self, peer: dict[str, Any]) -> None:
        assert self.sock is not None
        self.sock.setsockopt(zmq.RCVTIMEO, int(SETUP_TIMEOUT_S * 1000))
        for _ in range(self.cfg.streams):
            _, _, seq = HDR.unpack(self.sock.recv())
            if seq != HELLO_SEQ:
                raise RuntimeError("zmq: a data frame arrived before t0")

    async def run(self, hard_deadline_ns: int) -> None:
        self._recv_loop(hard_deadline_ns)

    def _recv_loop(self, hard_deadline_ns: int) -> None:
        sock = self.sock
        assert sock is not None
        tally = self.tally
        # Blocking receive (no polling): the timeout only exists to notice the hard deadline.
        sock.setsockopt(zmq.RCVTIMEO, 100)
        monotonic_ns = time.monotonic_ns
        while not tally.done:
            try:
                msg = sock.recv()
            except zmq.Again:
                if monotonic_ns() > hard_deadline_ns:
                    return
                continue
            frame = np.frombuffer(msg, dtype=np.int16)
            t = time.thread_time_ns()
            tally.take(frame, monotonic_ns())
            tally.verify_ns += time.thread_time_ns() - t

    async def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.ctx.term()


class NullSink(Sink):
    """Nothing arrives; the window simply spans the producer's schedule (the consumer process's idle cost)."""

    async def run(self, hard_deadline_ns: int) -> None:
        await asyncio.sleep(max(0, hard_deadline_ns - int(GRACE_S * 1e9) - time.monotonic_ns()) / 1e9)


SINKS: Final[dict[str, Callable[[Cfg, Tally], Sink]]] = {
    "ring": RingSink,
    "ws": WsSink,
    "zmq": ZmqSink,
    BASELINE: NullSink,
}


async def _consumer(conn: Connection, cfg: Cfg) -> None:
    loop = asyncio.get_running_loop()
    proc = psutil.Process()
    tally = Tally(cfg.streams, cfg.total)
    sink = SINKS[cfg.transport](cfg, tally)

    async def recv() -> Msg:
        msg: Msg = await loop.run_in_executor(None, conn.recv)
        return msg

    try:
        conn.send(("info", await sink.setup()))
        await sink.connect(_want(await recv(), "peer"))
        clock_call_ns = _thread_clock_call_ns()  # before t0, so the calibration is outside the window
        conn.send(("ready", None))
        t0: int = _want(await recv(), "go")
        hard_deadline = t0 + cfg.frames * PERIOD_NS + int(GRACE_S * 1e9)
        await asyncio.sleep(max(0, t0 - time.monotonic_ns()) / 1e9)
        cpu0, hr0 = _cpu_now(proc)
        await sink.run(hard_deadline)
        cpu1, hr1 = _cpu_now(proc)
        window_ns = time.monotonic_ns() - t0
        conn.send(
            (
                "result",
                {
                    "received": tally.count,
                    "in_order": tally.in_order,
                    "out_of_order": tally.out_of_order,
                    "crc": tally.crc,
                    "verify_s": tally.verify_ns / 1e9,
                    "clock_call_ns": clock_call_ns,
                    "cpu_s": cpu1 - cpu0,
                    "cpu_hr_s": (hr1 - hr0) / 1e9,
                    "window_s": window_ns / 1e9,
                    "p50_ms": _pct_ms(tally.lat_ns, 50),
                    "p99_ms": _pct_ms(tally.lat_ns, 99),
                    "max_ms": max(tally.lat_ns) / 1e6 if tally.lat_ns else None,
                    **sink.stats(),
                },
            )
        )
        _want(await recv(), "teardown")
    finally:
        await sink.close()
    conn.send(("closed", None))


def _child_main(role: str, conn: Connection) -> None:
    """Entry point of a spawned child: run configurations until told to exit."""

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # run finally blocks and atexit, so our ring segments get unlinked

    signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C reaches the whole process group; the parent owns shutdown and will SIGTERM us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    body = _producer if role == "producer" else _consumer
    try:
        conn.send(("alive", os.getpid()))  # imports are done: the parent may start measuring
        while True:
            try:
                msg: Msg = conn.recv()
            except EOFError:  # the parent is gone
                return
            if msg[0] == "exit":
                return
            asyncio.run(body(conn, Cfg(**_want(msg, "setup"))))
    except (ExitRequested, EOFError):
        # Told to stop mid-configuration, or the parent vanished: the finally blocks inside the body have
        # already closed rings and sockets, and there is nobody to report to.
        return
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{role}: {traceback.format_exc()}"))
        raise


# --- parent ---------------------------------------------------------------------------------------------------


class Child:
    def __init__(self, ctx: Any, role: str, transport: str) -> None:
        self.role = role
        self.conn, child_conn = ctx.Pipe()
        self.proc: BaseProcess = ctx.Process(
            target=_child_main, args=(role, child_conn), name=f"ring-ipc-{transport}-{role}", daemon=True
        )
        self.proc.start()
        child_conn.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def send(self, msg: Msg) -> None:
        self.conn.send(msg)

    def expect(self, kind: str, timeout_s: float, others: tuple[Child, ...] = ()) -> Any:
        """The next message from this child, which must be ``kind``; fails fast if any child of the pair dies."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.conn.poll(0.2):
                return _want(self._recv(), kind)
            for c in (self, *others):
                if not c.proc.is_alive():
                    if c.conn.poll(0):
                        c._recv()  # raises with the child's traceback if it sent one
                    raise ChildError(f"{c.role} (pid {c.pid}) exited with code {c.proc.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role}: no {kind!r} within {timeout_s:.0f} s")

    def _recv(self) -> Msg:
        try:
            msg: Msg = self.conn.recv()
        except EOFError:
            self.proc.join(1)
            raise ChildError(
                f"{self.role} (pid {self.pid}) went away (exit code {self.proc.exitcode})"
            ) from None
        if msg[0] == "error":
            raise ChildError(msg[1])
        return msg

    def stop(self) -> None:
        """Ask politely, then SIGTERM, then SIGKILL; always reaps."""
        with contextlib.suppress(Exception):
            self.conn.send(("exit", None))
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def _host_busy_s() -> tuple[float, float]:
    """(busy CPU-seconds, idle CPU-seconds) of the whole host, all CPUs together."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - idle, idle


def _run_config(prod: Child, cons: Child, cfg: Cfg, ring_names: set[str]) -> dict[str, Any]:
    """One configuration: measured totals, latencies and the consumer's in-place verification cost."""
    pair = (prod, cons)
    for c in pair:
        c.send(("setup", asdict(cfg)))
    pinfo = prod.expect("info", SETUP_TIMEOUT_S, (cons,))
    ring_names.update(pinfo.get("names", ()))
    cinfo = cons.expect("info", SETUP_TIMEOUT_S, (prod,))
    prod.send(("peer", cinfo))
    cons.send(("peer", pinfo))
    prod.expect("ready", SETUP_TIMEOUT_S, (cons,))
    cons.expect("ready", SETUP_TIMEOUT_S, (prod,))

    t0 = time.monotonic_ns() + LEAD_NS
    for c in pair:
        c.send(("go", t0))
    time.sleep(max(0, t0 - time.monotonic_ns()) / 1e9)
    host0 = _host_busy_s()
    run_s = cfg.frames * PERIOD_NS / 1e9
    cres = cons.expect("result", run_s + GRACE_S + SETUP_TIMEOUT_S, (prod,))
    host1 = _host_busy_s()
    prod.send(("stop", None))
    pres = prod.expect("result", SETUP_TIMEOUT_S, (cons,))
    for c in pair:
        c.send(("teardown", None))
    for c in pair:
        c.expect("closed", SETUP_TIMEOUT_S)
    for name in list(ring_names):  # the producer unlinked them on teardown; this only catches a failure
        if unlink_segment(name):
            _log(f"  warning: ring segment {name} outlived its producer's teardown; unlinked")
        ring_names.discard(name)

    baseline = cfg.transport == BASELINE
    sent: int = pres["sent"]
    delivered: int = cres["in_order"]
    exact = None
    if not baseline:
        exact = (
            cres["received"] == sent
            and delivered == sent
            and cres["crc"] == pres["crc"]
            and not pres.get("overruns", 0)
        )
    # The baseline moves nothing, so both of its sides are spread over the frames the producer built.
    moved = sent if baseline else delivered

    def per_frame(cpu_s: float) -> float | None:
        return cpu_s * 1e6 / moved if moved else None

    prod_us, prod_hr = per_frame(pres["cpu_s"]), per_frame(pres["cpu_hr_s"])
    cons_us, cons_hr = per_frame(cres["cpu_s"]), per_frame(cres["cpu_hr_s"])
    # Verification measured in place: the bracketed time per frame plus the one clock call per frame the
    # brackets miss (see the module docstring). Taken over the frames actually verified.
    verify_us = None
    if cres["received"]:
        verify_us = cres["verify_s"] * 1e6 / cres["received"] + cres["clock_call_ns"] / 1e3
    busy = host1[0] - host0[0]
    total = busy + host1[1] - host0[1]
    ours = pres["cpu_s"] + cres["cpu_s"]
    poll: dict[str, Any] = {}
    if "poll_passes" in cres and cres["window_s"]:
        poll = {
            "ring_polls_per_s": cres["poll_passes"] / cres["window_s"],
            "ring_empty_poll_pct": 100 * cres["poll_empty"] / max(1, cres["poll_passes"]),
        }
    return {
        "transport": cfg.transport,
        "streams": cfg.streams,
        "sent": sent,
        "delivered": None if baseline else delivered,
        "exact": exact,
        "producer_total_cpu_us_per_frame": prod_us,
        "consumer_total_cpu_us_per_frame": cons_us,
        "total_cpu_us_per_frame": None if prod_us is None or cons_us is None else prod_us + cons_us,
        "producer_total_cpu_us_per_frame_hr": prod_hr,
        "consumer_total_cpu_us_per_frame_hr": cons_hr,
        "consumer_verify_us_per_frame": verify_us,
        "thread_clock_call_ns": cres["clock_call_ns"],
        "producer_cpu_pct": 100 * pres["cpu_s"] / pres["paced_s"] if pres["paced_s"] else None,
        "consumer_cpu_pct": 100 * cres["cpu_s"] / cres["window_s"] if cres["window_s"] else None,
        "p50_ms": cres["p50_ms"],
        "p99_ms": cres["p99_ms"],
        "max_ms": cres["max_ms"],
        "producer_lag_p99_ms": pres["lag_p99_ms"],
        "ring_overruns": pres.get("overruns"),
        # CPU used by everything else on the host during the window, as a share of all its CPUs: the noise.
        "host_other_busy_pct": 100 * max(0.0, busy - ours) / total if total > 0 else None,
        **poll,
    }


def _sum(*xs: float | None) -> float | None:
    """Sum of optional figures; None if any is missing."""
    if any(x is None for x in xs):
        return None
    return sum(x for x in xs if x is not None)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _add_floors(row: dict[str, Any], null: dict[str, Any] | None) -> None:
    """Add the harness floors (from ``null`` at the same stream count) and the transport CPU to ``row``.

    producer floor = the null producer's total; consumer floor = the null consumer's idle total plus this row's
    own in-place verification cost; transport = (producer total - producer floor) + (consumer total - consumer
    floor). The null row gets its own totals as floors and no transport figure (it has no transport).
    """
    if row["transport"] == BASELINE:
        row["producer_floor_us_per_frame"] = row["producer_total_cpu_us_per_frame"]
        row["consumer_floor_us_per_frame"] = row["consumer_total_cpu_us_per_frame"]
        row["harness_floor_us_per_frame"] = row["total_cpu_us_per_frame"]
        row["producer_transport_cpu_us_per_frame"] = None
        row["consumer_transport_cpu_us_per_frame"] = None
        row["transport_cpu_us_per_frame"] = None
        row["transport_cpu_us_per_frame_hr"] = None
        return
    base: dict[str, Any] = null or {}
    verify = row["consumer_verify_us_per_frame"]
    prod_floor = base.get("producer_total_cpu_us_per_frame")
    cons_floor = _sum(base.get("consumer_total_cpu_us_per_frame"), verify)
    prod_t = _diff(row["producer_total_cpu_us_per_frame"], prod_floor)
    cons_t = _diff(row["consumer_total_cpu_us_per_frame"], cons_floor)
    row["producer_floor_us_per_frame"] = prod_floor
    row["consumer_idle_floor_us_per_frame"] = base.get("consumer_total_cpu_us_per_frame")
    row["consumer_floor_us_per_frame"] = cons_floor
    row["harness_floor_us_per_frame"] = _sum(prod_floor, cons_floor)
    row["producer_transport_cpu_us_per_frame"] = prod_t
    row["consumer_transport_cpu_us_per_frame"] = cons_t
    row["transport_cpu_us_per_frame"] = _sum(prod_t, cons_t)
    # The same subtraction on the nanosecond CPU clock: a cross-check on psutil's 10 ms ticks.
    row["transport_cpu_us_per_frame_hr"] = _sum(
        _diff(row["producer_total_cpu_us_per_frame_hr"], base.get("producer_total_cpu_us_per_frame_hr")),
        _diff(
            row["consumer_total_cpu_us_per_frame_hr"],
            _sum(base.get("consumer_total_cpu_us_per_frame_hr"), verify),
        ),
    )


def _fmt(v: float | None, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0].rstrip("df") or 0)) if v is None else format(v, spec)


def _table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'transport':<9} {'streams':>7} {'sent':>6} {'deliv':>6} {'exact':>5} "
        f"{'prod tot':>8} {'cons tot':>8} {'sum tot':>8} {'prod flr':>8} {'cons flr':>8} {'TRANSP':>8} "
        f"{'(hr)':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'lag p99':>7} {'others%':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r['transport']:<9} {r['streams']:>7} {r['sent']:>6} {_fmt(r['delivered'], '6d')} "
            f"{'n/a' if r['exact'] is None else 'yes' if r['exact'] else 'NO':>5} "
            f"{_fmt(r['producer_total_cpu_us_per_frame'], '8.1f')} "
            f"{_fmt(r['consumer_total_cpu_us_per_frame'], '8.1f')} "
            f"{_fmt(r['total_cpu_us_per_frame'], '8.1f')} "
            f"{_fmt(r['producer_floor_us_per_frame'], '8.1f')} {_fmt(r['consumer_floor_us_per_frame'], '8.1f')} "
            f"{_fmt(r['transport_cpu_us_per_frame'], '8.1f')} {_fmt(r['transport_cpu_us_per_frame_hr'], '7.1f')} "
            f"{_fmt(r['p50_ms'], '7.3f')} {_fmt(r['p99_ms'], '7.3f')} {_fmt(r['max_ms'], '7.2f')} "
            f"{_fmt(r['producer_lag_p99_ms'], '7.3f')} {_fmt(r['host_other_busy_pct'], '7.1f')}"
        )
    return "\n".join(lines)


LEGEND: Final = """\
CPU columns are microseconds of CPU per frame delivered (psutil user+system of each whole process over its window).
  prod tot / cons tot / sum tot: everything each process burnt, nothing subtracted.
  prod flr: the null producer at the same stream count (tick loop, stamp, header, CRC-32, no-op send).
  cons flr: the null consumer at the same stream count (idle, ~0) + this row's verification (Tally.take and
            the latency stamp), timed around each call with thread_time_ns on every transport.
  TRANSP = sum tot - prod flr - cons flr: the transport's own CPU, both sides; (hr) = the same on the ns clock.
  The floors and totals are separate measurements on a shared box: small differences are noise and can go negative.
Latency: producer stamp just before the hand-off -> consumer holds the int16 frame; frames of a tick go back to
  back, so it includes queueing behind the same tick's frames. lag p99: producer stamp behind its 20 ms tick.
others%: CPU used by other processes on the host during the window (share of all CPUs): the noise level."""


def _ratio(num: float | None, den: float | None) -> float | None:
    # A transport figure that came out <= 0 is noise around zero; a ratio over it means nothing.
    return num / den if num is not None and den is not None and num > 0 and den > 0 else None


def _summary(
    results: list[dict[str, Any]], args: argparse.Namespace, child_pids: list[int]
) -> dict[str, Any]:
    by: dict[tuple[str, int], dict[str, Any]] = {(r["transport"], r["streams"]): r for r in results}
    head_n = 50 if 50 in args.streams else max(args.streams)

    def at(transport: str, key: str, n: int = head_n) -> Any:
        r = by.get((transport, n))
        return None if r is None else r[key]

    out: dict[str, Any] = {}
    # Headline: transport CPU per frame (total minus the same-run harness floor of both sides), both sides summed.
    for t in TRANSPORTS:
        out[f"{t}_cpu_us_per_frame"] = at(t, "transport_cpu_us_per_frame")
    out["ring_p99_ms_at_50"] = at("ring", "p99_ms", 50)
    # How many times less CPU per frame the ring needs than WebSocket (the target is >= 10), transport only...
    out["ring_vs_ws_cpu_ratio"] = _ratio(out["ws_cpu_us_per_frame"], out["ring_cpu_us_per_frame"])
    out["ring_vs_zmq_cpu_ratio"] = _ratio(out["zmq_cpu_us_per_frame"], out["ring_cpu_us_per_frame"])
    # ... and the raw totals the floor was subtracted from, with their ratios, so nothing is hidden.
    for t in TRANSPORTS:
        out[f"{t}_total_cpu_us_per_frame"] = at(t, "total_cpu_us_per_frame")
        out[f"{t}_harness_floor_us_per_frame"] = at(t, "harness_floor_us_per_frame")
    out["ring_vs_ws_total_cpu_ratio"] = _ratio(
        out["ws_total_cpu_us_per_frame"], out["ring_total_cpu_us_per_frame"]
    )
    out["ring_vs_zmq_total_cpu_ratio"] = _ratio(
        out["zmq_total_cpu_us_per_frame"], out["ring_total_cpu_us_per_frame"]
    )
    out["headline_streams"] = head_n
    out["harness_floor_producer_us_per_frame"] = at(BASELINE, "producer_total_cpu_us_per_frame")
    out["harness_floor_consumer_idle_us_per_frame"] = at(BASELINE, "consumer_total_cpu_us_per_frame")
    out["cpu_accounting"] = (
        "*_cpu_us_per_frame = transport only = (producer total - null producer total) + (consumer total - "
        "(null consumer total + in-place Tally.take cost)), same stream count, same run; "
        "*_total_cpu_us_per_frame = both processes' psutil user+system per delivered frame, nothing subtracted"
    )
    for t in TRANSPORTS:
        for key in (
            "transport_cpu_us_per_frame",
            "transport_cpu_us_per_frame_hr",
            "total_cpu_us_per_frame",
            "producer_total_cpu_us_per_frame",
            "consumer_total_cpu_us_per_frame",
            "harness_floor_us_per_frame",
            "consumer_verify_us_per_frame",
            "p50_ms",
            "p99_ms",
        ):
            # "<t>_cpu_us_per_frame_by_streams" keeps the headline's meaning (transport only) per stream count.
            name = "cpu_us_per_frame" if key == "transport_cpu_us_per_frame" else key
            out[f"{t}_{name}_by_streams"] = {
                str(n): by[(t, n)][key] for n in args.streams if (t, n) in by
            } or None
    for key in ("producer_total_cpu_us_per_frame", "consumer_total_cpu_us_per_frame"):
        out[f"{BASELINE}_{key}_by_streams"] = {
            str(n): by[(BASELINE, n)][key] for n in args.streams if (BASELINE, n) in by
        } or None
    measured = [r for r in results if r["transport"] != BASELINE]
    out["all_delivered_exact"] = bool(measured) and all(r["exact"] for r in measured)
    out["ring_native"] = NATIVE and not args.pure_python  # write/read_into in C, or the pure-Python path
    out["targets"] = {"ring_vs_ws_cpu_ratio_min": TARGET_RATIO, "ring_p99_ms_at_50_max": TARGET_P99_MS}
    ratio, total_ratio, p99 = (
        out["ring_vs_ws_cpu_ratio"],
        out["ring_vs_ws_total_cpu_ratio"],
        out["ring_p99_ms_at_50"],
    )
    out["targets_met"] = {
        "ring_vs_ws_cpu_ratio": None if ratio is None else ratio >= TARGET_RATIO,
        "ring_vs_ws_total_cpu_ratio": None if total_ratio is None else total_ratio >= TARGET_RATIO,
        "ring_p99_ms_at_50": None if p99 is None else p99 <= TARGET_P99_MS,
    }
    out["config"] = {
        "duration_s": args.duration,
        "streams": args.streams,
        "transports": args.transports,
        "poll_sleep_us": args.poll_sleep_us,
        "frame_payload_bytes": FRAME_BYTES,
        "cpus": os.cpu_count(),
        "child_pids": child_pids,
        "loadavg_end": list(os.getloadavg()),
        "cpu_source": "psutil Process.cpu_times() user+system, in-process, per window; *_hr = CLOCK_PROCESS_CPUTIME_ID",
    }
    out["results"] = results
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--duration", type=float, default=None, help="seconds per configuration (default 10)")
    ap.add_argument(
        "--streams", type=int, nargs="+", default=None, help="stream counts (default 1 10 50; --quick: 1 50)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 2 s per configuration at 1 and 50 streams"
    )
    ap.add_argument(
        "--transports",
        nargs="+",
        choices=(*TRANSPORTS, BASELINE),
        default=None,
        help=f"default: all; {BASELINE!r} (the producer's harness floor) always runs, first at each stream count",
    )
    ap.add_argument(
        "--poll-sleep-us",
        type=float,
        default=None,
        help="ring consumer: wait after each pass over all rings: on the doorbell with this safety-net timeout "
        "(default 100000, the engine's AUDIO_IDLE_WAIT_S) or, with --no-doorbell, a plain sleep (default 500)",
    )
    ap.add_argument(
        "--pure-python",
        action="store_true",
        help="run the ring's pure-Python write/read_into even when the C core is built (what a machine "
        "without a compiler gets)",
    )
    ap.add_argument(
        "--no-doorbell",
        action="store_true",
        help="ring consumer polls on a timer instead of waiting on the engine's doorbell FIFO",
    )
    args = ap.parse_args(argv)
    if args.poll_sleep_us is None:
        args.poll_sleep_us = 500.0 if args.no_doorbell else AUDIO_IDLE_WAIT_S * 1e6
    if args.duration is None:
        args.duration = 2.0 if args.quick else 10.0
    if args.streams is None:
        # Quick mode keeps the extremes so the smoke test stays well under a minute on a shared 2-vCPU box.
        args.streams = [1, 50] if args.quick else [1, 10, 50]
    # Every transport's CPU is reported net of the null floor, so the null always runs, and runs first.
    chosen = set(args.transports or TRANSPORTS)
    args.transports = [BASELINE, *(t for t in TRANSPORTS if t in chosen)]
    if args.duration <= 0 or any(n < 1 for n in args.streams) or args.poll_sleep_us < 0:
        ap.error("--duration, --streams and --poll-sleep-us must be positive")
    args.streams = sorted(set(args.streams))
    return args


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    def _handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(_parse(argv))
    except KeyboardInterrupt:
        _log("interrupted; child processes and ring segments were cleaned up")
        return 130


def _run(args: argparse.Namespace) -> int:
    frames = max(1, round(args.duration * 1e9 / PERIOD_NS))
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    ring_names: set[str] = set()
    children: list[Child] = []
    with _sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="lko-ring-ipc-") as run_dir:
        try:
            # Every child starts (and pays its imports) before anything is measured; idle ones block on their
            # pipe and cost nothing while the other transports run.
            _log(f"starting {2 * len(args.transports)} child processes (spawn)")
            pairs: dict[str, tuple[Child, Child]] = {}
            for transport in args.transports:
                prod = Child(ctx, "producer", transport)
                cons = Child(ctx, "consumer", transport)
                children += [prod, cons]
                pairs[transport] = (prod, cons)
            for c in children:
                c.expect("alive", SETUP_TIMEOUT_S)
            # Stream count outside, transport inside: each transport's floor (null, run first) is measured
            # seconds before it, under the same background load, not minutes apart.
            for n in args.streams:
                null_row: dict[str, Any] | None = None
                for transport in args.transports:
                    prod, cons = pairs[transport]
                    cfg = Cfg(
                        transport,
                        n,
                        frames,
                        args.poll_sleep_us / 1e6,
                        run_dir,
                        doorbell=not args.no_doorbell,
                        native=NATIVE and not args.pure_python,
                    )
                    _log(f"[{transport}] {n} stream(s), {frames} frames each ({args.duration:g} s) ...")
                    r = _run_config(prod, cons, cfg, ring_names)
                    if transport == BASELINE:
                        null_row = r
                    _add_floors(r, null_row)
                    results.append(r)
                    _log(
                        f"[{transport}] {n:>2} streams: delivered {_fmt(r['delivered'], 'd')}/{r['sent']} "
                        f"exact={r['exact']} total "
                        f"{_fmt(r['producer_total_cpu_us_per_frame'], '.1f')}+"
                        f"{_fmt(r['consumer_total_cpu_us_per_frame'], '.1f')} us/frame, floor "
                        f"{_fmt(r['producer_floor_us_per_frame'], '.1f')}+"
                        f"{_fmt(r['consumer_floor_us_per_frame'], '.1f')}, transport "
                        f"{_fmt(r['transport_cpu_us_per_frame'], '.1f')}; "
                        f"p50 {_fmt(r['p50_ms'], '.3f')} p99 {_fmt(r['p99_ms'], '.3f')} ms"
                    )
        finally:
            for c in children:
                c.stop()
            leaked = [n for n in ring_names if unlink_segment(n)]
            pids = {f"_{c.pid}_" for c in children if c.proc.pid is not None}
            # A child killed mid-setup may have created rings the parent never heard of; its pid names them.
            leaked += [n for n in list_our_segments() if any(p in n[3:] for p in pids) and unlink_segment(n)]
            if leaked:
                _log(f"cleanup: unlinked {len(leaked)} leftover ring segment(s)")
    print(_table(results))
    print(LEGEND)
    summary = _summary(results, args, [c.pid for c in children])
    print(
        f"\nat {summary['headline_streams']} streams, transport CPU (total - harness floor) us/frame: "
        f"ring {_fmt(summary['ring_cpu_us_per_frame'], '.1f')}, ws {_fmt(summary['ws_cpu_us_per_frame'], '.1f')}, "
        f"zmq {_fmt(summary['zmq_cpu_us_per_frame'], '.1f')}; "
        f"ring vs ws: {_fmt(summary['ring_vs_ws_cpu_ratio'], '.2f')}x transport-only, "
        f"{_fmt(summary['ring_vs_ws_total_cpu_ratio'], '.2f')}x in totals (target >= {TARGET_RATIO:g}x); "
        f"ring p99 at 50 streams: {_fmt(summary['ring_p99_ms_at_50'], '.3f')} ms (target <= {TARGET_P99_MS:g} ms); "
        f"all delivered bit-exact: {summary['all_delivered_exact']}; "
        f"ring path: {'C (engine_bridge._ringcore)' if summary['ring_native'] else 'pure Python'}"
    )
    print(json.dumps(summary), flush=True)
    return 0 if summary["all_delivered_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
