"""The LiveKit plugin's two data paths: co-located (shared-memory rings to a local engine) vs remote (the Live
WebSocket to a ``livekit-omni serve``), per 20 ms frame of a call.

What it measures
----------------
One :class:`livekit_omni.OmniDuplexModel` session per mode, driven as LiveKit's ``AgentSession`` drives it: a
caller frame (48 kHz mono int16, 20 ms, a room's format) handed to ``push_audio`` on absolute 20 ms ticks, and
the session's ``audio_stream`` read as fast as it yields (the agent's speaker). Both modes talk to the loopback
echo engine (a test fixture: no models), so the engine's work is the same and small, and what differs is the
path.

* **CPU per frame**: user+system CPU (all threads; ``time.process_time`` here, the process CPU-time clock for
  ``serve``, both ns resolution) of every process on the path *except the engine*,
  over ``--seconds`` of real-time audio, divided by the frames pushed. Co-located: the agent process alone (it
  resamples into the ingress ring and paces the egress ring itself). Remote: the agent process (resample,
  base64, JSON, WebSocket) plus the ``serve`` process (WebSocket, JSON, base64, ring write, egress pacing, the
  deltas back); its engine child is not counted. One frame is 20 ms of duplex audio: the caller's frame in and
  the 20 ms of model audio out.
* **Baseline, same run**: the harness alone (the tick loop building a 48 kHz ``rtc.AudioFrame`` per tick and
  handing it to a no-op), measured just before the modes in every round; it is subtracted from that round's
  figures, so they are the plugin's path.
* **Rounds**: ``--rounds`` rounds of ``--seconds`` per mode, interleaved (baseline, then the three co-located
  and remote measurements in an order that rotates each round), each mode with a fresh session; the figures are
  the medians over the rounds and the ratio is the ratio of the medians. On this VM one 10-second window moves by
  ±30 µs per frame with the machine's state (the baseline alone ranged 73-102 µs in three runs of an hour), which
  is as large as the co-located figure itself: one window per mode, as before 2026-12-06, gave ratios from 3.2x
  to 5.4x on the same code within five minutes.
* **Co-located floor, same run**: what any co-located implementation pays per frame on this machine whatever its
  output path does: the real ``push_audio`` (the 48 → 16 kHz resampling into the ingress ring and the doorbell)
  plus the one wake-up of a consumer task per 20 ms frame that LiveKit's ``audio_stream`` needs, the consumer
  yielding a prebuilt frame (no ring read, no pacer). Baseline subtracted like the modes. ``remote / floor`` is the
  highest ratio any co-located output path could reach in this run.
* **Caller audio → engine latency**: from ``push_audio(frame)`` to the moment the engine's ingress ring write
  cursor next advances (the frame is in the ring the engine reads; the doorbell wakes it then). A second pass,
  after the first round's CPU pass, so the probe's cost is not in the CPU figures: a thread polls the write cursor every
  ~50 µs of the ring attached read-only (co-located: the ring this process created; remote: the ring the
  ``serve`` process created, found in /dev/shm by its creator's pid). Resampler look-ahead is not in it (the
  first advance after a push is that push's hand-off).

Last line: JSON with ``colocated_us_per_frame``, ``remote_us_per_frame`` (baseline subtracted, medians over the
rounds), ``ratio`` (remote / co-located; target >= 5), ``colocated_floor_us_per_frame`` and ``ratio_ceiling``
(remote / floor), the latency percentiles, the per-round figures and the raw ones.

    python benchmarks/plugin_paths.py [--seconds 5] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
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
    """User+system CPU seconds of ``procs`` (all threads, those that ended included), from each process's CPU-time
    clock (Linux: ``clock_gettime`` on the clock id ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``, ns resolution,
    like CLOCK_PROCESS_CPUTIME_ID for this process). /proc's figures count in 10 ms ticks, which over a 5-second
    round of 250 frames is 40 µs per frame, as much as the co-located path's whole figure; psutil's are the
    fallback where that clock is refused."""
    total = 0.0
    for p in procs:
        try:
            total += time.clock_gettime(((~p.pid) << 3) | 2)
        except OSError:
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
    *,
    latency: bool,
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
        if not latency:
            return ModeResult(name, n, agent, server, outputs, [])
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


@dataclass
class Round:
    baseline: float
    colocated: ModeResult
    remote: ModeResult
    floor: float  # agent CPU per frame, baseline not subtracted

    @property
    def figures(self) -> dict[str, float]:
        co, re_ = self.colocated.us_per_frame(self.baseline), self.remote.us_per_frame(self.baseline)
        return {
            "baseline": self.baseline,
            "colocated": co,
            "remote": re_,
            "floor": self.floor - self.baseline,
            "remote_agent": self.remote.agent_cpu_s * 1e6 / self.remote.frames,
            "remote_server": self.remote.server_cpu_s * 1e6 / self.remote.frames,
            "colocated_agent": self.colocated.agent_cpu_s * 1e6 / self.colocated.frames,
            "ratio": re_ / co if co > 0 else float("nan"),
        }


async def main_async(seconds: float, rounds: int) -> dict[str, Any]:
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    engine: EngineProcess = spawn_engine(adapter="loopback", max_sessions=2)
    server: ServerProcess | None = None
    done: list[Round] = []
    try:
        client = await connect_engine(engine)
        await client.close()
        server = start_server(adapter="loopback", ready_timeout=60)
        serve_proc = psutil.Process(server.proc.pid)

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

        async def colocated(latency: bool) -> ModeResult:
            return await run_mode(
                "co-located (rings)",
                OmniDuplexModel(engine_address=engine.address),
                [],
                colocated_ring,
                seconds,
                latency=latency,
            )

        async def remote(latency: bool) -> ModeResult:
            assert server is not None
            before.clear()
            before.update(list_our_segments())
            return await run_mode(
                "remote (Live WebSocket)",
                OmniDuplexModel(base_url=server.url + "/v1"),
                [serve_proc],
                remote_ring,
                seconds,
                latency=latency,
            )

        async def floor(latency: bool) -> float:
            return await floor_us_per_frame(OmniDuplexModel(engine_address=engine.address), seconds)

        for r in range(rounds):
            baseline = await baseline_us_per_frame(seconds)
            # The three measurements in a rotating order, so none always follows the baseline or another.
            steps: list[Callable[[bool], Awaitable[Any]]] = [colocated, floor, remote]
            steps = steps[r % 3 :] + steps[: r % 3]
            got: dict[Any, Any] = {}
            for step in steps:
                got[step] = await step(r == 0)  # the latency pass in the first round only
            done.append(Round(baseline, got[colocated], got[remote], got[floor]))
            f = done[-1].figures
            print(
                f"round {r + 1}/{rounds}: baseline {f['baseline']:.1f}, co-located {f['colocated']:.1f},"
                f" remote {f['remote']:.1f}, floor {f['floor']:.1f} µs/frame: {f['ratio']:.1f}x",
                flush=True,
            )
    finally:
        if server is not None:
            server.stop()
        engine.stop()

    figs = [rd.figures for rd in done]

    def median(key: str) -> float:
        return statistics.median(f[key] for f in figs)

    co, re_, fl, base = median("colocated"), median("remote"), median("floor"), median("baseline")
    ratio = re_ / co if co > 0 else float("nan")
    ceiling = re_ / fl if fl > 0 else float("nan")
    colocated0, remote0 = done[0].colocated, done[0].remote
    print()
    print(
        f"{rounds} rounds of {seconds:.0f} s of 20 ms frames per mode, 48 kHz caller frames, loopback echo engine;"
        " µs per frame, baseline subtracted per round"
    )
    print(
        f"{'round':>5} {'baseline':>9} {'co-located':>11} {'floor':>7} {'remote':>8} {'(agent':>8} {'+ serve)':>9}"
        f" {'ratio':>6}"
    )
    for i, f in enumerate(figs, 1):
        print(
            f"{i:>5} {f['baseline']:9.1f} {f['colocated']:11.1f} {f['floor']:7.1f} {f['remote']:8.1f}"
            f" {f['remote_agent']:8.1f} {f['remote_server']:9.1f} {f['ratio']:5.1f}x"
        )
    print(
        f"{'median':>5} {base:9.1f} {co:11.1f} {fl:7.1f} {re_:8.1f} {median('remote_agent'):8.1f}"
        f" {median('remote_server'):9.1f} {ratio:5.1f}x"
    )
    print()
    print(f"{'path (round 1)':26} {'out s':>7} {'lat p50 ms':>11} {'p95':>7} {'p99':>7}")
    for m in (colocated0, remote0):
        print(
            f"{m.name:26} {m.output_s:7.1f} {pct(m.latencies_ms, 50):11.2f} {pct(m.latencies_ms, 95):7.2f}"
            f" {pct(m.latencies_ms, 99):7.2f}"
        )
    print(f"\nratio remote / co-located CPU per frame (medians): {ratio:.1f}x (target >= 5)")
    print(
        f"ceiling remote / co-located floor: {ceiling:.1f}x (floor: push_audio plus one wake-up per frame, the"
        " output free; the most any co-located output path could reach in this run)"
    )
    return {
        "colocated_us_per_frame": co,
        "remote_us_per_frame": re_,
        "ratio": ratio,
        "colocated_floor_us_per_frame": fl,
        "ratio_ceiling": ceiling,
        "baseline_us_per_frame": base,
        "colocated_agent_us_per_frame": median("colocated_agent"),
        "remote_agent_us_per_frame": median("remote_agent"),
        "remote_server_us_per_frame": median("remote_server"),
        "colocated_latency_ms": {q: pct(colocated0.latencies_ms, q) for q in (50, 95, 99)},
        "remote_latency_ms": {q: pct(remote0.latencies_ms, q) for q in (50, 95, 99)},
        "latency_samples": [len(colocated0.latencies_ms), len(remote0.latencies_ms)],
        "output_s": [colocated0.output_s, remote0.output_s],
        "per_round": figs,
        "rounds": rounds,
        "seconds": seconds,
        "frames": colocated0.frames,
        "load_avg_start": load[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--seconds", type=float, default=5.0, help="real-time audio per mode and round (CPU pass)"
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the figures are their medians")
    args = ap.parse_args()
    if args.rounds < 1 or args.seconds <= 0:
        ap.error("--rounds must be >= 1 and --seconds > 0")
    finish(asyncio.run(main_async(args.seconds, args.rounds)))


if __name__ == "__main__":
    main()
