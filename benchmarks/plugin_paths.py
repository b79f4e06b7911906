"""The LiveKit plugin's two data paths: co-located (shared-memory rings to a local engine) vs remote (the Live
WebSocket to a ``livekit-omni serve``), per 20 ms frame of a call.

What it measures
----------------
One :class:`livekit_omni.OmniDuplexModel` session per mode, driven as LiveKit's ``AgentSession`` drives it: a
caller frame (48 kHz mono int16, 20 ms, a room's format) handed to ``push_audio`` on absolute 20 ms ticks, and
the session's ``audio_stream`` read as fast as it yields (the agent's speaker). Both modes talk to the loopback
echo engine (a test fixture: no models), so the engine's work is the same and small, and what differs is the
path.

* **CPU per frame**: user+system CPU (all threads; ``time.process_time`` here, ``psutil`` for ``serve``) of every process on the path *except the engine*,
  over ``--seconds`` of real-time audio, divided by the frames pushed. Co-located: the agent process alone (it
  resamples into the ingress ring and paces the egress ring itself). Remote: the agent process (resample,
  base64, JSON, WebSocket) plus the ``serve`` process (WebSocket, JSON, base64, ring write, egress pacing, the
  deltas back); its engine child is not counted. One frame is 20 ms of duplex audio: the caller's frame in and
  the 20 ms of model audio out.
* **Baseline, same run**: the harness alone (the tick loop building a 48 kHz ``rtc.AudioFrame`` per tick and
  handing it to a no-op), measured just before the modes; it is subtracted from both, so the figures are the
  plugin's path.
* **Co-located floor, same run**: what any co-located implementation pays per frame on this machine whatever its
  output path does: the real ``push_audio`` (the 48 → 16 kHz resampling into the ingress ring and the doorbell)
  plus the one wake-up of a consumer task per 20 ms frame that LiveKit's ``audio_stream`` needs, the consumer
  yielding a prebuilt frame (no ring read, no pacer). Baseline subtracted like the modes. ``remote / floor`` is the
  highest ratio any co-located output path could reach in this run.
* **Caller audio → engine latency**: from ``push_audio(frame)`` to the moment the engine's ingress ring write
  cursor next advances (the frame is in the ring the engine reads; the doorbell wakes it then). A second pass,
  after the CPU pass, so the probe's cost is not in the CPU figures: a thread polls the write cursor every
  ~50 µs of the ring attached read-only (co-located: the ring this process created; remote: the ring the
  ``serve`` process created, found in /dev/shm by its creator's pid). Resampler look-ahead is not in it (the
  first advance after a push is that push's hand-off).

Last line: JSON with ``colocated_us_per_frame``, ``remote_us_per_frame`` (baseline subtracted), ``ratio``
(remote / co-located; target >= 5), ``colocated_floor_us_per_frame`` and ``ratio_ceiling`` (remote / floor), the
latency percentiles and the raw figures.

    python benchmarks/plugin_paths.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
from _common import finish, pct  # also puts the repository root on sys.path
from livekit import rtc
from livekit.agents import llm

from engine_bridge.ring import SEGMENT_PREFIX, IngressRing, list_our_segments
from livekit_omni import OmniDuplexModel
from livekit_omni.plugin.colocated import ColocatedSession
from livekit_omni.plugin.remote import RemoteSession
from tests.conftest import EngineProcess, ServerProcess, connect_engine, spawn_engine, start_server

RATE = 48_000
FRAME = RATE // 50  # 20 ms
TICK_S = 0.02


def caller_frames(n: int) -> list[rtc.AudioFrame]:
    """``n`` 20 ms frames of a 300 Hz tone (speech-like level), built before timing starts."""
    t = np.arange(n * FRAME) / RATE
    pcm = (0.3 * np.sin(2 * np.pi * 300 * t) * 32767).astype(np.int16)
    return [rtc.AudioFrame(pcm[i * FRAME : (i + 1) * FRAME].tobytes(), RATE, 1, FRAME) for i in range(n)]


def cpu_s(procs: list[psutil.Process]) -> float:
    """User+system CPU seconds of ``procs`` (all threads). This process's own comes from
    CLOCK_PROCESS_CPUTIME_ID (ns resolution); another's from /proc (10 ms ticks, fine over seconds)."""
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


async def paced(frames: list[rtc.AudioFrame], push: Callable[[rtc.AudioFrame], None]) -> list[float]:
    """Hand one frame per absolute 20 ms tick to ``push``; returns the monotonic time of each hand-off."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stamps: list[float] = []
    for k, frame in enumerate(frames):
        delay = t0 + k * TICK_S - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        stamps.append(time.monotonic())
        push(frame)
    return stamps


class CursorProbe(threading.Thread):
    """Polls an ingress ring's write cursor; records (monotonic time, cursor) at every change."""

    def __init__(self, ring: IngressRing) -> None:
        super().__init__(daemon=True, name="cursor-probe")
        self.ring = ring
        self.changes: list[tuple[float, int]] = []
        self._done = threading.Event()

    def run(self) -> None:
        last = self.ring.write_cursor
        while not self._done.is_set():
            cur = self.ring.write_cursor
            if cur != last:
                self.changes.append((time.monotonic(), cur))
                last = cur
            time.sleep(50e-6)

    def stop(self) -> None:
        self._done.set()
        self.join(5)


def arrival_latencies_ms(
    pushes: list[float], base: int, changes: list[tuple[float, int]], bytes_per_frame: int
) -> list[float]:
    """For push ``k``, the time until the write cursor (bytes) covers it: ``base + (k+1)*bytes_per_frame``.

    ``base`` is the cursor when the pass starts, after the earlier audio has settled; a resampler's hold-back is
    the same at the start and after every frame in steady state, so it cancels out of the target (2 samples of
    slack for the resampler's rounding). A path that batches frames shows its batching wait here, as it should."""
    out: list[float] = []
    j = 0
    for k, t in enumerate(pushes):
        target = base + (k + 1) * bytes_per_frame - 4
        while j < len(changes) and changes[j][1] < target:
            j += 1
        if j == len(changes):
            break
        out.append((changes[j][0] - t) * 1000)
    return out


@dataclass
class ModeResult:
    name: str
    frames: int
    agent_cpu_s: float
    server_cpu_s: float
    #: Seconds of model audio the stream yielded during the CPU pass (the echo: about the pass's length).
    output_s: float
    latencies_ms: list[float]

    def us_per_frame(self, baseline_us: float) -> float:
        return (self.agent_cpu_s + self.server_cpu_s) * 1e6 / self.frames - baseline_us


async def open_session(model: OmniDuplexModel) -> llm.RealtimeSession:
    s = model.session()
    await s._update_session(
        instructions="", chat_ctx=llm.ChatContext.empty(), tools=[]
    )  # as AgentSession does
    assert await asyncio.wait_for(s.wait_ready(), 30), "the plugin session did not open"
    return s


async def drain_output(session: Any, played_s: list[float]) -> None:
    item: llm.DuplexAudioFrame
    async for item in session.audio_stream:
        played_s[0] += item.frame.samples_per_channel / item.frame.sample_rate


async def close_session(reader: asyncio.Task[None], session: Any, model: OmniDuplexModel) -> None:
    """Stop the output reader, then close the plugin session and its model."""
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    await session.aclose()
    await model.aclose()


async def run_mode(
    name: str,
    model: OmniDuplexModel,
    server_procs: list[psutil.Process],
    find_ring: Callable[[Any], Awaitable[IngressRing]],
    seconds: float,
) -> ModeResult:
    session = await open_session(model)
    out = [0.0]
    reader = asyncio.create_task(drain_output(session, out))
    try:
        await asyncio.sleep(0.5)  # settled: the first frames and the stream are flowing
        n = int(seconds / TICK_S)
        frames = caller_frames(n)
        a0, s0 = time.process_time(), cpu_s(server_procs)
        out0 = out[0]
        await paced(frames, session.push_audio)
        await asyncio.sleep(0.2)  # the last frames' way through
        agent, server = time.process_time() - a0, cpu_s(server_procs) - s0
        outputs = out[0] - out0
        # Latency pass (the probe thread costs CPU, so it runs after the CPU window).
        ring = await find_ring(session)
        base = ring.write_cursor
        probe = CursorProbe(ring)
        probe.start()
        pushes = await paced(caller_frames(min(n, 500)), session.push_audio)
        await asyncio.sleep(0.3)
        probe.stop()
        bytes_per_frame = ring.sample_rate // 50 * 2  # PCM16; the ingress cursors count bytes
        ring.close()
        lat = arrival_latencies_ms(pushes, base, probe.changes, bytes_per_frame)
    finally:
        await close_session(reader, session, model)
    return ModeResult(name, n, agent, server, outputs, lat)


async def floor_us_per_frame(model: OmniDuplexModel, seconds: float) -> float:
    """Agent CPU per frame of a co-located session whose output costs nothing: ``push_audio`` as in the modes, and
    a consumer task woken by each push (as the pacer's nudge wakes the real stream) that yields one prebuilt
    ``DuplexAudioFrame``. Baseline not subtracted."""
    session = await open_session(model)
    loop = asyncio.get_running_loop()
    due: list[asyncio.Future[None]] = [loop.create_future()]
    prebuilt = llm.DuplexAudioFrame(frame=rtc.AudioFrame(bytes(960), 24_000, 1, 480), start_ms=0)

    async def stream() -> AsyncIterator[llm.DuplexAudioFrame]:
        while True:
            await due[0]
            due[0] = loop.create_future()
            yield prebuilt

    async def drain() -> None:
        async for _ in stream():
            pass

    def push(frame: rtc.AudioFrame) -> None:
        session.push_audio(frame)
        if not due[0].done():
            due[0].set_result(None)

    reader = asyncio.create_task(drain())
    try:
        await asyncio.sleep(0.5)
        await paced(caller_frames(25), push)  # the resampler and the ring warmed up
        frames = caller_frames(int(seconds / TICK_S))
        c0 = time.process_time()
        await paced(frames, push)
        return (time.process_time() - c0) * 1e6 / len(frames)
    finally:
        await close_session(reader, session, model)


async def baseline_us_per_frame(seconds: float) -> float:
    frames = caller_frames(int(seconds / TICK_S))
    c0 = time.process_time()
    await paced(frames, lambda f: None)
    return (time.process_time() - c0) * 1e6 / len(frames)


async def main_async(seconds: float) -> dict[str, Any]:
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    engine: EngineProcess = spawn_engine(adapter="loopback", max_sessions=2)
    server: ServerProcess | None = None
    try:
        client = await connect_engine(engine)
        await client.close()
        server = start_server(adapter="loopback", ready_timeout=60)
        serve_proc = psutil.Process(server.proc.pid)

        baseline = await baseline_us_per_frame(seconds)

        async def colocated_ring(session: Any) -> IngressRing:
            assert isinstance(session, ColocatedSession) and session._es is not None
            return IngressRing.attach(session._es.rings.ingress.name)

        before: set[str] = set()

        async def remote_ring(session: Any) -> IngressRing:
            assert isinstance(session, RemoteSession)
            prefix = f"{SEGMENT_PREFIX}{serve_proc.pid}_"
            new = [
                n
                for n in list_our_segments()
                if n.startswith(prefix) and n.endswith("_in") and n not in before
            ]
            assert len(new) == 1, f"expected one new ingress ring of the serve process, found {new}"
            return IngressRing.attach(new[0])

        colocated = await run_mode(
            "co-located (rings)", OmniDuplexModel(engine_address=engine.address), [], colocated_ring, seconds
        )
        floor = await floor_us_per_frame(OmniDuplexModel(engine_address=engine.address), seconds)
        before.update(list_our_segments())
        remote = await run_mode(
            "remote (Live WebSocket)",
            OmniDuplexModel(base_url=server.url + "/v1"),
            [serve_proc],
            remote_ring,
            seconds,
        )
    finally:
        if server is not None:
            server.stop()
        engine.stop()

    print()
    print(f"{seconds:.0f} s of 20 ms frames per mode, 48 kHz caller frames, loopback echo engine")
    print(
        f"{'path':26} {'agent µs/fr':>12} {'server µs/fr':>13} {'total−base':>11} {'out s':>11}"
        f" {'lat p50 ms':>11} {'p95':>7} {'p99':>7}"
    )
    print(
        f"{'baseline (harness only)':26} {baseline:12.1f} {'':>13} {'':>11} {'':>11} {'':>11} {'':>7} {'':>7}"
    )
    for r in (colocated, remote):
        print(
            f"{r.name:26} {r.agent_cpu_s * 1e6 / r.frames:12.1f} {r.server_cpu_s * 1e6 / r.frames:13.1f}"
            f" {r.us_per_frame(baseline):11.1f} {r.output_s:11.1f} {pct(r.latencies_ms, 50):11.2f}"
            f" {pct(r.latencies_ms, 95):7.2f} {pct(r.latencies_ms, 99):7.2f}"
        )
    print(f"{'co-located floor':26} {floor:12.1f} {'':>13} {floor - baseline:11.1f}")
    co, re_ = colocated.us_per_frame(baseline), remote.us_per_frame(baseline)
    ratio = re_ / co if co > 0 else float("nan")
    ceiling = re_ / (floor - baseline) if floor > baseline else float("nan")
    print(f"\nratio remote / co-located CPU per frame: {ratio:.1f}x (target >= 5)")
    print(
        f"ceiling remote / co-located floor: {ceiling:.1f}x (floor: push_audio plus one wake-up per frame, the"
        " output free; the most any co-located output path could reach in this run)"
    )
    return {
        "colocated_us_per_frame": co,
        "remote_us_per_frame": re_,
        "ratio": ratio,
        "colocated_floor_us_per_frame": floor - baseline,
        "ratio_ceiling": ceiling,
        "baseline_us_per_frame": baseline,
        "colocated_agent_us_per_frame": colocated.agent_cpu_s * 1e6 / colocated.frames,
        "remote_agent_us_per_frame": remote.agent_cpu_s * 1e6 / remote.frames,
        "remote_server_us_per_frame": remote.server_cpu_s * 1e6 / remote.frames,
        "colocated_latency_ms": {q: pct(colocated.latencies_ms, q) for q in (50, 95, 99)},
        "remote_latency_ms": {q: pct(remote.latencies_ms, q) for q in (50, 95, 99)},
        "latency_samples": [len(colocated.latencies_ms), len(remote.latencies_ms)],
        "output_s": [colocated.output_s, remote.output_s],
        "seconds": seconds,
        "frames": colocated.frames,
        "load_avg_start": load[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="real-time audio per mode for the CPU pass")
    args = ap.parse_args()
    finish(asyncio.run(main_async(args.seconds)))


if __name__ == "__main__":
    main()
