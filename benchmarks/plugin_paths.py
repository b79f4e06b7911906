"""The LiveKit plugin's two data paths: co-located (shared-memory rings to a local engine) vs remote (the Live
WebSocket to a ``livekit-omni serve``), per 20 ms frame of a call.

What it measures
----------------
One :class:`livekit_omni.OmniDuplexModel` session per mode, driven as LiveKit's ``AgentSession`` drives it: a
caller frame (48 kHz mono int16, 20 ms, a room's format) handed to ``push_audio`` on absolute 20 ms ticks, and
the session's ``audio_stream`` read as fast as it yields (the agent's speaker). Both modes talk to the loopback
echo engine (a test fixture: no models), so the engine's work is the same and small, and what differs is the
path.

* **CPU per frame**: user+system CPU (all threads; ``time.process_time`` in each mode's process, the process
  CPU-time clock for ``serve``, both ns resolution) of every process on the path *except the engine*, over
  ``--seconds`` of real-time audio, divided by the frames pushed. Co-located: the agent process alone (it
  resamples into the ingress ring and paces the egress ring itself). Remote: the agent process (resample,
  base64, JSON, WebSocket) plus the ``serve`` process (WebSocket, JSON, base64, ring write, egress pacing, the
  deltas back); its engine child is not counted. One frame is 20 ms of duplex audio: the caller's frame in and
  the 20 ms of model audio out.
* **The modes at once**: each mode runs in its own process (this script with ``--worker``), and all four measure
  the same window, their 20 ms ticks 5 ms apart so no two wake together, the order of the four slots rotating
  each round. Why: on this VM the cost of a frame
  moves with the machine's state by more than the co-located figure itself (the baseline alone ranged 47-146 µs
  between 5-second windows minutes apart on 2026-12-06), so modes measured one after another, even interleaved
  in rounds with medians (the method until 2026-12-06), were compared across different machine states: one
  run's rounds ranged from 2.6x to 78.8x. Measured in the same window, the machine's state is the same for all.
* **Baseline, same window**: the harness alone (the tick loop handing prebuilt 48 kHz ``rtc.AudioFrame`` objects to a
  no-op), in its own process like the modes; its per-frame CPU is subtracted from the modes' in the same round,
  so they are the plugin's path.
* **Rounds**: ``--rounds`` windows (8, two turns of the slot rotation) of ``--seconds``, each with fresh sessions (opened in the 3 s between windows,
  then 0.5 s of frames before the window opens); the figures are the medians over the rounds and the ratio is
  the ratio of the medians.
* **Co-located floor, same window**: what any co-located implementation pays per frame on this machine whatever
  its output path does: the real ``push_audio`` (the 48 → 16 kHz resampling into the ingress ring and the
  doorbell) plus the one wake-up of a consumer task per 20 ms frame that LiveKit's ``audio_stream`` needs, the
  consumer yielding a prebuilt frame (no ring read, no pacer). Baseline subtracted like the modes.
  ``remote / floor`` is the highest ratio any co-located output path could reach in this run.
* **Caller audio → engine latency**: from ``push_audio(frame)`` to the moment the engine's ingress ring write
  cursor next advances (the frame is in the ring the engine reads; the doorbell wakes it then). A pass of its
  own after the CPU rounds, one path after the other, so the probe's cost is in no CPU figure: a thread polls
  the write cursor every ~50 µs of the ring attached read-only (co-located: the ring this process created;
  remote: the ring the ``serve`` process created, found in /dev/shm by its creator's pid). Resampler look-ahead
  is not in it (the first advance after a push is that push's hand-off).

Last line: JSON with ``colocated_us_per_frame``, ``remote_us_per_frame`` (baseline subtracted, medians over the
rounds), ``ratio`` (remote / co-located; target >= 5), ``colocated_floor_us_per_frame`` and ``ratio_ceiling``
(remote / floor), ``colocated_total_us_per_frame``, ``remote_total_us_per_frame`` and ``ratio_totals`` (the
same medians with nothing subtracted: the co-located agent's CPU per frame, the remote agent's plus the serve
process's, and their ratio; the subtraction of the harness's baseline from both sides raises the ratio, so the
totals stand beside it), the latency percentiles, the per-round figures and the raw ones.

    python benchmarks/plugin_paths.py [--seconds 5] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

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


async def paced(
    frames: list[rtc.AudioFrame],
    push: Callable[[rtc.AudioFrame], None],
    *,
    start: float | None = None,
    before_push: Callable[[int], None] | None = None,
) -> list[float]:
    """Hand frame ``k`` to ``push`` at ``start + k × 20 ms`` (monotonic; now when None); returns the monotonic time
    of each hand-off. ``before_push(k)`` runs just before each push."""
    loop = asyncio.get_running_loop()  # its clock is time.monotonic
    t0 = loop.time() if start is None else start
    stamps: list[float] = []
    for k, frame in enumerate(frames):
        delay = t0 + k * TICK_S - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if before_push is not None:
            before_push(k)
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


async def latency_pass(
    model: OmniDuplexModel, find_ring: Callable[[Any], Awaitable[IngressRing]], frames: int
) -> list[float]:
    """Caller audio → engine latency per push (ms), with a thread polling the ring's write cursor. Run on its own,
    after the CPU rounds, so the probe's CPU is in no CPU figure."""
    session = await open_session(model)
    out = [0.0]
    reader = asyncio.create_task(drain_output(session, out))
    try:
        await paced(caller_frames(25), session.push_audio)  # the resampler, the rings and the stream flowing
        await asyncio.sleep(0.2)
        ring = await find_ring(session)
        base = ring.write_cursor
        probe = CursorProbe(ring)
        probe.start()
        pushes = await paced(caller_frames(frames), session.push_audio)
        await asyncio.sleep(0.3)
        probe.stop()
        bytes_per_frame = ring.sample_rate // 50 * 2  # PCM16; the ingress cursors count bytes
        ring.close()
        return arrival_latencies_ms(pushes, base, probe.changes, bytes_per_frame)
    finally:
        await close_session(reader, session, model)


# --- the CPU rounds: one process per mode, all four at once ------------------------------------------------------

#: The modes measured in each round, each in its own process. ``baseline``: the harness alone (the tick loop
#: handing prebuilt frames to a no-op). ``floor``: a co-located session whose output costs nothing (the real
#: ``push_audio``, and a consumer woken by each push, as the pacer's nudge wakes the real stream, yielding one
#: prebuilt frame).
MODES: Final = ("baseline", "colocated", "floor", "remote")


#: Where a mode's ticks fall inside the 20 ms period, so no two processes wake at the same moment on 2 vCPUs: mode
#: ``i`` takes slot ``(i + round) % len(MODES)``, so each mode wakes in every position (first after the quiet gap,
#: right after another process, ...) as often as the others over the rounds: a fixed order favoured some modes
#: by 20-40 µs per frame on the EPYC VM.
def phase_s(mode: str, round_index: int) -> float:
    return TICK_S * ((MODES.index(mode) + round_index) % len(MODES)) / len(MODES)


#: Between two rounds' windows: close the round's sessions, open fresh ones, and WARM_S of frames before the window.
ROUND_GAP_S: Final = 3.0
WARM_S: Final = 0.5


@dataclass
class Window:
    """One mode's CPU over one round's window (its own process)."""

    cpu_s: float
    frames: int
    #: Seconds of model audio the stream yielded in the window (the echo: about the window's length; 0 for the
    #: baseline and the floor).
    output_s: float
    #: The process was not ready when the window opened (its figures do not cover the window): the run fails.
    late: bool


async def open_floor(
    model: OmniDuplexModel,
) -> tuple[Callable[[rtc.AudioFrame], None], Callable[[], Awaitable[None]]]:
    """The floor's push and its teardown (see MODES)."""
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
    return push, lambda: close_session(reader, session, model)


async def measure_window(
    mode: str, engine_address: str, server_url: str, t_start: float, seconds: float, phase: float
) -> Window:
    """Open ``mode``'s path, play WARM_S of frames, then measure this process's CPU over ``seconds`` of frames
    from ``t_start`` (monotonic), on a 20 ms grid shifted by the mode's phase."""
    out = [0.0]
    close: Callable[[], Awaitable[None]] | None = None
    push: Callable[[rtc.AudioFrame], None] = lambda f: None  # noqa: E731  # the baseline's
    if mode == "floor":
        push, close = await open_floor(OmniDuplexModel(engine_address=engine_address))
    elif mode in ("colocated", "remote"):
        model = (
            OmniDuplexModel(engine_address=engine_address)
            if mode == "colocated"
            else OmniDuplexModel(base_url=server_url + "/v1")
        )
        session = await open_session(model)
        reader = asyncio.create_task(drain_output(session, out))
        push = session.push_audio

        async def close_it() -> None:
            await close_session(reader, session, model)

        close = close_it
    try:
        n_warm, n = int(WARM_S / TICK_S), int(seconds / TICK_S)
        grid0 = t_start + phase - n_warm * TICK_S
        late = time.monotonic() > grid0
        frames = caller_frames(n_warm + n)
        cpu0 = out0 = 0.0

        def mark(k: int) -> None:
            nonlocal cpu0, out0
            if k == n_warm:
                cpu0, out0 = time.process_time(), out[0]

        await paced(frames, push, start=grid0, before_push=mark)
        return Window(time.process_time() - cpu0, n, out[0] - out0, late)
    finally:
        if close is not None:
            await close()


async def worker_async(mode: str, engine_address: str, server_url: str, seconds: float, rounds: int) -> None:
    """A mode's process: say READY, read the first window's start (monotonic) on stdin, measure ``rounds`` windows
    one period apart, print their figures as one JSON line."""
    print("READY", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    start = float(line)
    got = []
    for r in range(rounds):
        w = await measure_window(
            mode, engine_address, server_url, start + r * (seconds + ROUND_GAP_S), seconds, phase_s(mode, r)
        )
        got.append(w.__dict__)
    print(json.dumps(got), flush=True)


@dataclass
class Worker:
    mode: str
    proc: asyncio.subprocess.Process

    @classmethod
    async def spawn(
        cls, mode: str, engine_address: str, server_url: str, seconds: float, rounds: int
    ) -> Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--worker",
            mode,
            "--engine-address",
            engine_address,
            "--server-url",
            server_url,
            "--seconds",
            str(seconds),
            "--rounds",
            str(rounds),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(mode, proc)

    async def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(
                f"the {self.mode} worker exited (code {await self.proc.wait()}) before it answered"
            )
        return line.decode().strip()

    async def ready(self) -> None:
        if (line := await self._line(180)) != "READY":
            raise RuntimeError(f"the {self.mode} worker said {line!r} instead of READY")

    def go(self, start: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{start!r}\n".encode())

    async def windows(self, timeout: float) -> list[Window]:
        got = [Window(**w) for w in json.loads(await self._line(timeout))]
        if any(w.late for w in got):
            raise RuntimeError(f"the {self.mode} worker was not ready when a window opened")
        return got

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@dataclass
class Round:
    """One round's windows, all measured at the same time. µs per frame; the modes' own figures have the
    baseline's per-frame CPU, measured in the same window, subtracted."""

    windows: dict[str, Window]
    serve_cpu_s: float

    def per_frame(self, mode: str) -> float:
        w = self.windows[mode]
        return w.cpu_s * 1e6 / w.frames

    @property
    def figures(self) -> dict[str, float]:
        base = self.per_frame("baseline")
        n = self.windows["remote"].frames
        remote_server = self.serve_cpu_s * 1e6 / n
        co = self.per_frame("colocated") - base
        re_ = self.per_frame("remote") + remote_server - base
        return {
            "baseline": base,
            "colocated": co,
            "remote": re_,
            "floor": self.per_frame("floor") - base,
            "remote_agent": self.per_frame("remote"),
            "remote_server": remote_server,
            "colocated_agent": self.per_frame("colocated"),
            "ratio": re_ / co if co > 0 else float("nan"),
            # The totals: what each path's processes spent per frame, the harness included (nothing subtracted).
            "colocated_total": self.per_frame("colocated"),
            "remote_total": self.per_frame("remote") + remote_server,
            "ratio_totals": (self.per_frame("remote") + remote_server) / self.per_frame("colocated")
            if self.per_frame("colocated") > 0
            else float("nan"),
        }


async def main_async(seconds: float, rounds: int) -> dict[str, Any]:
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    engine: EngineProcess = spawn_engine(adapter="loopback", max_sessions=4)
    server: ServerProcess | None = None
    workers: list[Worker] = []
    done: list[Round] = []
    try:
        client = await connect_engine(engine)
        await client.close()
        server = start_server(adapter="loopback", ready_timeout=60)
        serve_proc = psutil.Process(server.proc.pid)
        workers = [await Worker.spawn(m, engine.address, server.url, seconds, rounds) for m in MODES]
        for w in workers:
            await w.ready()
        period = seconds + ROUND_GAP_S
        start = time.monotonic() + ROUND_GAP_S
        for w in workers:
            w.go(start)
        # The serve process works for the remote worker's session alone: its CPU over that worker's windows.
        serve_cpu: list[float] = []
        for r in range(rounds):
            t0 = start + r * period + phase_s("remote", r)
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            c0 = cpu_s([serve_proc])
            await asyncio.sleep(max(0.0, t0 + seconds - time.monotonic()))
            serve_cpu.append(cpu_s([serve_proc]) - c0)
        got = {w.mode: await w.windows(60 + period) for w in workers}
        for r in range(rounds):
            done.append(Round({m: got[m][r] for m in MODES}, serve_cpu[r]))
            f = done[-1].figures
            print(
                f"round {r + 1}/{rounds}: baseline {f['baseline']:.1f}, co-located {f['colocated']:.1f},"
                f" remote {f['remote']:.1f}, floor {f['floor']:.1f} µs/frame: {f['ratio']:.1f}x",
                flush=True,
            )

        # Latency, one path after the other, after the CPU rounds.
        async def colocated_ring(session: Any) -> IngressRing:
            assert isinstance(session, ColocatedSession) and session._es is not None
            return IngressRing.attach(session._es.rings.ingress.name)

        before: set[str] = set(list_our_segments())

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

        n_lat = min(int(seconds / TICK_S), 500)
        lat_co = await latency_pass(OmniDuplexModel(engine_address=engine.address), colocated_ring, n_lat)
        before.update(list_our_segments())
        lat_re = await latency_pass(OmniDuplexModel(base_url=server.url + "/v1"), remote_ring, n_lat)
    finally:
        for w in workers:
            await w.stop()
        if server is not None:
            server.stop()
        engine.stop()

    figs = [rd.figures for rd in done]

    def median(key: str) -> float:
        return statistics.median(f[key] for f in figs)

    co, re_, fl, base = median("colocated"), median("remote"), median("floor"), median("baseline")
    ratio = re_ / co if co > 0 else float("nan")
    ceiling = re_ / fl if fl > 0 else float("nan")
    co_total, re_total = median("colocated_total"), median("remote_total")
    ratio_totals = re_total / co_total if co_total > 0 else float("nan")
    frames = done[0].windows["colocated"].frames
    output_s = [done[0].windows["colocated"].output_s, done[0].windows["remote"].output_s]
    print()
    print(
        f"{rounds} rounds of {seconds:.0f} s of 20 ms frames, the four modes at once (one process each),"
        " 48 kHz caller frames, loopback echo engine; µs per frame, the same window's baseline subtracted,"
        " then the totals (nothing subtracted: the co-located agent; the remote agent plus serve) and their ratio"
    )
    print(
        f"{'round':>5} {'baseline':>9} {'co-located':>11} {'floor':>7} {'remote':>8} {'(agent':>8} {'+ serve)':>9}"
        f" {'ratio':>6} {'| co total':>10} {'re total':>9} {'ratio':>6}"
    )
    for i, f in enumerate(figs, 1):
        print(
            f"{i:>5} {f['baseline']:9.1f} {f['colocated']:11.1f} {f['floor']:7.1f} {f['remote']:8.1f}"
            f" {f['remote_agent']:8.1f} {f['remote_server']:9.1f} {f['ratio']:5.1f}x"
            f" | {f['colocated_total']:8.1f} {f['remote_total']:9.1f} {f['ratio_totals']:5.1f}x"
        )
    print(
        f"{'median':>5} {base:9.1f} {co:11.1f} {fl:7.1f} {re_:8.1f} {median('remote_agent'):8.1f}"
        f" {median('remote_server'):9.1f} {ratio:5.1f}x"
        f" | {co_total:8.1f} {re_total:9.1f} {ratio_totals:5.1f}x"
    )
    print()
    print(f"{'path':26} {'out s (round 1)':>16} {'lat p50 ms':>11} {'p95':>7} {'p99':>7}")
    for name, out_s, lat in (
        ("co-located (rings)", output_s[0], lat_co),
        ("remote (Live WebSocket)", output_s[1], lat_re),
    ):
        print(f"{name:26} {out_s:16.1f} {pct(lat, 50):11.2f} {pct(lat, 95):7.2f} {pct(lat, 99):7.2f}")
    print(
        f"\nratio remote / co-located CPU per frame (medians, the baseline {base:.0f} µs subtracted from both):"
        f" {ratio:.1f}x (target >= 5)"
    )
    print(
        f"ratio of the totals (nothing subtracted): remote {re_total:.0f} / co-located {co_total:.0f} µs ="
        f" {ratio_totals:.1f}x"
    )
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
        "colocated_total_us_per_frame": co_total,
        "remote_total_us_per_frame": re_total,
        "ratio_totals": ratio_totals,
        "colocated_agent_us_per_frame": median("colocated_agent"),
        "remote_agent_us_per_frame": median("remote_agent"),
        "remote_server_us_per_frame": median("remote_server"),
        "colocated_latency_ms": {q: pct(lat_co, q) for q in (50, 95, 99)},
        "remote_latency_ms": {q: pct(lat_re, q) for q in (50, 95, 99)},
        "latency_samples": [len(lat_co), len(lat_re)],
        "output_s": output_s,
        "per_round": figs,
        "rounds": rounds,
        "seconds": seconds,
        "frames": frames,
        "method": "concurrent",
        "load_avg_start": load[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--seconds", type=float, default=5.0, help="real-time audio per mode and round (CPU pass)"
    )
    ap.add_argument("--rounds", type=int, default=8, help="rounds; the figures are their medians")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # one mode's process (internal)
    ap.add_argument("--engine-address", help=argparse.SUPPRESS)
    ap.add_argument("--server-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.seconds <= 0:
        ap.error("--rounds must be >= 1 and --seconds > 0")
    if args.worker:
        asyncio.run(
            worker_async(args.worker, args.engine_address, args.server_url, args.seconds, args.rounds)
        )
        return
    finish(asyncio.run(main_async(args.seconds, args.rounds)))


if __name__ == "__main__":
    main()
