"""Media-plane cost per 20 ms frame, and how many WebRTC sessions one media-plane process holds in real time.

What it measures
----------------
(a) **decode path**: Opus 48 kHz packet → PCM → 16 kHz → ingress ring, per 20 ms frame. The packets are 32 kbps
    mono Opus of a voice-like signal. Rows: libopus decode alone (``media.codecs.OpusDecoder``, mono s16); the
    media work alone (``IngressWriter.write_pcm16``: resample 48→16 kHz, level, ring write); the whole chain in one
    timed call. The WebRTC path differs in one step (aiortc decodes to s16 *stereo* in its own thread and the writer
    downmixes ``AudioFrame``\\ s), so its two rows are measured too.
(b) **encode path**: egress ring (24 kHz chunks) → 48 kHz → Opus, per frame. Rows: ``EgressPlayer.next_frame()``
    alone (ring read, epoch check, playout report, 24→48 kHz); libopus encode alone (``media.codecs.OpusEncoder``,
    mono 32 kbps voip — what the WebRTC track runs by default); the chain; and aiortc's own Opus encoder (stereo
    96 kbps plus its libswresample step, ``answer_offer(encoder="aiortc")``) for comparison.

    CPU is ``time.thread_time()`` (CLOCK_THREAD_CPUTIME_ID, ns resolution) around the timed calls only, summed over
    ``--frames`` frames after a warm-up; the engine side of the ring (chunk writes, ingress drains) is outside the
    timed region. One clock read costs ~0.3 µs; nothing is subtracted.
(c) **concurrent sessions**: N aiortc callers in a separate process (``WebRTCCaller``: each sends a 440 Hz tone as
    pre-encoded Opus, so the client side stays light) call N peers made by ``answer_offer()`` in this process, each
    backed by a session of a real engine process running the loopback echo fixture, all on 127.0.0.1. For
    N = 1, 2, 4, 8, 12, 16, 24, 32, … (bounded by ``--max-sessions`` and a ``--time-cap``) it connects all callers,
    waits ``--warmup`` seconds and observes a ``--window``-second window. ``--encoder aiortc`` lets aiortc encode the
    outgoing audio instead of the track (see ``media.webrtc.EgressTrack``).

    **Real time** means, for *every* session over the window:
      * the caller received ≥ 98 % of 50 frames/s from the server (the egress clock kept up),
      * the p95 inter-arrival gap of those frames was < 60 ms (no stalls of more than two frames),
      * the server's ingress got ≥ 98 % of 50 frames/s from the caller (the receive path kept up).
    The echo (frames above -40 dBFS at the caller) is reported as a sanity check, not part of the criterion.
    ``max_sessions_realtime`` is the largest N that met it. All three processes share this machine's cores, so
    the CPU of each is reported: the figure is what one box holds, not the media plane's limit alone.
    ``--workers 1,2``: instead of peers in this process, (c) runs against a real ``livekit-omni serve --workers N``
    (loopback engine) for each N in turn: the callers post Live WebRTC offers to ``/v1/live/sessions``, one fresh
    connection each, so the kernel spreads them over the workers (each row shows the split). Real time is the same
    caller-side criterion, with the server's side taken from ``/metrics`` (caller audio received, all workers,
    ≥ 98 % of real time per session). Server CPU is the parent and its workers (one process with N = 1), never the
    engine. The JSON adds ``max_sessions_by_workers`` and ``server_cpu_pct_per_session_by_workers`` (at each
    count's largest real-time step, % of one core) and the rows under ``sessions_workers<N>``.
(d) ``--jitter``: one-way caller → server latency for aiortc receive jitter-buffer prefetch values, with
    ``media.webrtc.AudioJitterBuffer``: a caller sends 100 ms tone bursts every 500 ms; latency is from the
    moment the burst's first frame is handed to aiortc to the moment the server's ingress writer sees it.

The last stdout line is one JSON object: ``decode_us_per_frame``, ``encode_us_per_frame`` (Opus included),
``max_sessions_realtime``, and the breakdown (``*_excl_opus``, ``opus_*``, ``webrtc_*``, per-step ``sessions``;
``machine_cpu_pct`` there is the whole machine's busy CPU in % of one core, other users' work included).

    .venv/bin/python benchmarks/media_plane.py [--frames 5000] [--max-sessions 48] [--window 10] [--jitter]
        [--workers 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fractions
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import av
import numpy as np
import psutil
from _common import ROOT, finish, pct  # also puts the repository root on sys.path
from aiortc.codecs.opus import OpusEncoder as AiortcOpusEncoder
from prometheus_client.parser import text_string_to_metric_families

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient, EngineSession
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE
from engine_bridge.ring import RingPair
from livekit_omni.worker_ids import owner_of
from media.codecs import OpusDecoder, OpusEncoder
from media.egress import EgressPlayer
from media.ingress import IngressWriter, frame_to_mono_pcm16
from media.webrtc import WebRTCPeer, answer_offer, enable_loopback_ice
from testkit.webrtc_caller import WebRTCCaller
from tests.speech_fixtures import voice_like

STEPS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
REALTIME_FPS = 0.98 * 50
REALTIME_P95_GAP_MS = 60.0


@dataclass
class FakeSession:
    rings: RingPair
    closed: bool = False


def _timed(fn: Callable[[int], None], frames: int, warmup: int = 200) -> float:
    """µs of thread CPU per call of ``fn(i)``; ``fn`` returns after its timed part (untimed prep goes in ``pre``)."""
    for i in range(warmup):
        fn(i)
    total = 0.0
    for i in range(frames):
        t0 = time.thread_time()
        fn(warmup + i)
        total += time.thread_time() - t0
    return total / frames * 1e6


# --- (a) and (b): CPU per frame ---------------------------------------------------------------------------------


def bench_cpu(frames: int) -> dict[str, float]:
    n = frames + 400
    src = voice_like(n * 0.02)
    packets = OpusEncoder().encode(src)
    res: dict[str, float] = {}

    rings = RingPair.create(input_rate=ENGINE_INPUT_RATE, output_rate=ENGINE_OUTPUT_RATE)
    try:
        sess = FakeSession(rings)
        drain = np.zeros(rings.ingress.capacity_samples, np.int16)

        # (a) decode alone
        dec = OpusDecoder()
        pcm48 = [dec.decode(pk) for pk in packets[:50]]  # warm and keep a few frames for the media-only rows
        dec = OpusDecoder()
        res["opus_decode_us"] = _timed(lambda i: dec.decode(packets[i % len(packets)]), frames)

        # (a) media work alone: resample 48→16 kHz + level + ring write
        writer = IngressWriter(sess)

        def ingress_only(i: int) -> None:
            writer.write_pcm16(pcm48[i % 50], 48_000)

        res["ingress_us"] = _timed_with_drain(ingress_only, frames, rings, drain)

        # (a) the whole chain in one timed call
        dec2 = OpusDecoder()
        writer2 = IngressWriter(sess)

        def chain_in(i: int) -> None:
            writer2.write_pcm16(dec2.decode(packets[i % len(packets)]), 48_000)

        res["decode_chain_us"] = _timed_with_drain(chain_in, frames, rings, drain)

        # (a) the WebRTC variant: aiortc-style s16 stereo AudioFrames (aiortc decodes them in its own thread)
        ctx = av.CodecContext.create("libopus", "r")
        ctx.sample_rate, ctx.layout, ctx.format = 48_000, "stereo", "s16"
        res["aiortc_opus_decode_us"] = _timed(
            lambda i: ctx.decode(av.Packet(packets[i % len(packets)])), frames
        )
        st_frames = [ctx.decode(av.Packet(pk))[0] for pk in packets[:50]]
        writer3 = IngressWriter(sess)
        res["ingress_from_stereo_frame_us"] = _timed_with_drain(
            lambda i: writer3.write_frame(st_frames[i % 50]), frames, rings, drain
        )

        # (b) egress: the engine writes one 20 ms chunk per frame (untimed), the media side reads one frame
        eg = rings.egress
        chunk = voice_like(0.02, 24_000)
        player = EgressPlayer(sess, rate=48_000)
        enc = OpusEncoder()

        def feed(i: int) -> None:
            eg.write_chunk(eg.epoch, 1, i, chunk)

        res["egress_us"] = _timed_with_feed(lambda i: player.next_frame(), feed, frames)
        out48 = [player.next_frame().pcm.copy() for _ in range(2)]  # silence now; use the voice frames below
        frames48 = [voice_like(0.02, 48_000), *out48]
        res["opus_encode_us"] = _timed(lambda i: enc.encode(frames48[0]), frames)

        player2 = EgressPlayer(sess, rate=48_000)
        enc2 = OpusEncoder()
        res["encode_chain_us"] = _timed_with_feed(
            lambda i: enc2.encode(player2.next_frame().pcm), feed, frames
        )

        aenc = AiortcOpusEncoder()
        stereo = np.repeat(frames48[0], 2)
        tb = fractions.Fraction(1, 48_000)

        def aiortc_encode(i: int) -> None:
            f = av.AudioFrame.from_ndarray(stereo.reshape(1, -1), format="s16", layout="stereo")
            f.sample_rate = 48_000
            f.pts = i * 960
            f.time_base = tb
            aenc.encode(f)

        res["aiortc_opus_encode_us"] = _timed(aiortc_encode, frames)
    finally:
        rings.close()
    return res


def _timed_with_drain(fn: Callable[[int], None], frames: int, rings: RingPair, drain: np.ndarray) -> float:
    total = 0.0
    for i in range(frames + 200):
        t0 = time.thread_time()
        fn(i)
        dt = time.thread_time() - t0
        if i >= 200:
            total += dt
        rings.ingress.read_into(drain)  # the engine's side: outside the timed region
    return total / frames * 1e6


def _timed_with_feed(fn: Callable[[int], Any], feed: Callable[[int], None], frames: int) -> float:
    total = 0.0
    for i in range(frames + 200):
        feed(i)
        t0 = time.thread_time()
        fn(i)
        dt = time.thread_time() - t0
        if i >= 200:
            total += dt
    return total / frames * 1e6


# --- (c) concurrent WebRTC sessions ---------------------------------------------------------------------------


def spawn_engine(max_sessions: int, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = str(tmp / "engine.sock")
    cfg = {
        "adapter": "loopback",
        "address": "unix:" + sock,
        "max_sessions": max_sessions,
        "loopback_delay_ms": 100,
    }
    log = (tmp / "engine.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_bridge.engine", "--settings-json", json.dumps(cfg)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, "unix:" + sock


async def connect_engine(proc: subprocess.Popen[bytes], address: str) -> EngineClient:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}")
        try:
            client = await EngineClient.connect(address, timeout=1.0, client_name="media_plane_bench")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    for _ in range(600):
        if (await client.ping()).state is p.EngineState.READY:
            return client
        await asyncio.sleep(0.1)
    raise RuntimeError("engine did not become ready")


async def run_step(
    n: int, client: EngineClient, engine_pid: int, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    sessions: list[EngineSession] = [
        await client.open_session(p.SessionConfig(adapter="loopback")) for _ in range(n)
    ]
    peers: list[WebRTCPeer] = []
    sock_path = str(tmp / f"signal-{n}.sock")
    lags: list[float] = []
    measuring = False

    async def drain_events(s: EngineSession) -> None:
        # A facade consumes session events; an unread queue would eventually fail the session.
        async for _ in s.iter_events():
            pass

    async def loop_lag() -> None:
        # How late a 5 ms timer fires: the event loop's responsiveness (stalls, or the process not scheduled).
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.005)
            if measuring:
                lags.append((time.monotonic() - t0 - 0.005) * 1000)

    helpers = [asyncio.create_task(drain_events(s)) for s in sessions]
    helpers.append(asyncio.create_task(loop_lag()))

    async def on_signal(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            offer = json.loads(line)["offer"]
            peer = await answer_offer(offer, sessions[len(peers)], loopback_only=True, encoder=args.encoder)
            peers.append(peer)
            writer.write((json.dumps({"answer": peer.answer_sdp}) + "\n").encode())
            await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(on_signal, sock_path)
    me = psutil.Process()

    async def window_start() -> dict[str, Any]:
        nonlocal measuring
        measuring = True
        return {
            "me": sum(me.cpu_times()[:2]),
            "frames": [pe.input_frames for pe in peers],
            "sent": [pe.track.frames_sent if pe.track else 0 for pe in peers],
            "late": sum(pe.track.pacer.late for pe in peers if pe.track),
        }

    async def window_end(snap: dict[str, Any], dt: float) -> dict[str, Any]:
        nonlocal measuring
        measuring = False
        server_fps = [(pe.input_frames - f0) / dt for pe, f0 in zip(peers, snap["frames"], strict=True)]
        tx_fps = [
            ((pe.track.frames_sent if pe.track else 0) - s0) / dt
            for pe, s0 in zip(peers, snap["sent"], strict=True)
        ]
        return {
            "server_cpu_pct": 100 * (sum(me.cpu_times()[:2]) - snap["me"]) / dt,
            "server_rx_fps_min": min(server_fps),
            "server_tx_fps_min": min(tx_fps),
            "loop_lag_p99_ms": pct(lags, 99),
            "loop_lag_max_ms": max(lags, default=0.0),
            "pacer_late": sum(pe.track.pacer.late for pe in peers if pe.track) - snap["late"],
        }

    try:
        result = await _drive_client_worker(sock_path, n, engine_pid, args, window_start, window_end)
    finally:
        server.close()
        for pe in peers:
            await pe.close()
        for s in sessions:
            await s.close()
        for h in helpers:
            h.cancel()
    result["realtime"] = _realtime(result, n, result.get("server_rx_fps_min", 0) >= REALTIME_FPS)
    return result


WindowStart = Callable[[], Awaitable[dict[str, Any]]]
WindowEnd = Callable[[dict[str, Any], float], Awaitable[dict[str, Any]]]


async def _drive_client_worker(
    signal: str, n: int, engine_pid: int, args: argparse.Namespace, start: WindowStart, end: WindowEnd
) -> dict[str, Any]:
    """Run the ``n`` callers in a client worker process (``signal``: see :func:`client_worker`) and measure its
    window: the engine's, the client's and the machine's CPU here, the server's side through ``start`` (a
    snapshot at the window's start) and ``end`` (its figures from the snapshot and the window's length)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).resolve()),
        "--client-worker",
        signal,
        str(n),
        str(args.warmup),
        str(args.window),
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    engine = psutil.Process(engine_pid)
    client_ps = psutil.Process(proc.pid)
    result: dict[str, Any] = {"n": n}
    snap: dict[str, Any] = {}
    try:
        assert proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(proc.stdout.readline(), timeout=args.warmup + args.window + 60 + n)
            if not raw:
                raise RuntimeError("client worker exited early")
            msg = json.loads(raw)
            if msg.get("event") == "window_start":
                psutil.cpu_percent(interval=None)  # starts the machine-wide CPU interval
                snap = {
                    "t": time.monotonic(),
                    "engine": sum(engine.cpu_times()[:2]),
                    "client": sum(client_ps.cpu_times()[:2]),
                    "server": await start(),
                }
            elif msg.get("event") == "window_end":
                dt = time.monotonic() - snap["t"]
                result.update(
                    engine_cpu_pct=100 * (sum(engine.cpu_times()[:2]) - snap["engine"]) / dt,
                    client_cpu_pct=100 * (sum(client_ps.cpu_times()[:2]) - snap["client"]) / dt,
                    machine_cpu_pct=psutil.cpu_percent(interval=None) * psutil.cpu_count(),
                    **await end(snap["server"], dt),
                )
            elif msg.get("event") == "result":
                result.update(msg["result"])
                break
        await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return result


def _realtime(result: dict[str, Any], n: int, server_receives: bool) -> bool:
    """Every caller connected and hearing real time, and the server receiving every caller in real time."""
    return bool(
        result.get("connected") == n
        and result.get("rx_fps_min", 0) >= REALTIME_FPS
        and result.get("gap_p95_ms_max", 1e9) < REALTIME_P95_GAP_MS
        and server_receives
    )


async def client_worker(signal: str, n: int, warmup: float, window: float) -> None:
    """``n`` callers; ``signal`` is this benchmark's Unix signalling socket, or (``http://...``) a server whose
    ``POST /v1/live/sessions`` answers the offers, one fresh connection each (so the kernel spreads them over
    the server's workers)."""
    enable_loopback_ice()
    t = np.arange(48_000) / 48_000
    tone = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    served = signal.startswith("http://")
    writer: asyncio.StreamWriter | None = None
    if not served:
        reader, writer = await asyncio.open_unix_connection(signal)
    callers: list[WebRTCCaller] = []
    owners: list[int | None] = []
    for _ in range(n):
        c = WebRTCCaller(
            tone,
            loop=True,
            datachannel="oai-events" if served else None,
            record_audio=False,
            record_seconds=warmup + window + 10,
        )
        if served:
            body = {"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": await c.offer()}}
            async with (
                aiohttp.ClientSession() as http,
                http.post(signal + "/v1/live/sessions", json=body) as r,
            ):
                reply = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"offer refused: {r.status} {reply}")
            answer = reply["transport"]["sdp"]
            owners.append(owner_of(reply["session"]["id"]))
        else:
            assert writer is not None
            writer.write((json.dumps({"offer": await c.offer()}) + "\n").encode())
            await writer.drain()
            answer = json.loads(await reader.readline())["answer"]
        await c.accept(answer)
        callers.append(c)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(c.connected.wait() for c in callers)), 30)
    connected = sum(c.connected.is_set() for c in callers)
    await asyncio.sleep(warmup)
    print(json.dumps({"event": "window_start"}), flush=True)
    t0 = time.monotonic()
    await asyncio.sleep(window)
    t1 = time.monotonic()
    print(json.dumps({"event": "window_end"}), flush=True)
    fps, gaps, echo = [], [], []
    for c in callers:
        arr = [(a, lv) for a, lv in zip(c.arrivals, c.levels, strict=False) if t0 <= a <= t1]
        times = np.array([a for a, _ in arr])
        fps.append(len(times) / (t1 - t0))
        g = np.diff(times) * 1000 if len(times) > 1 else np.array([1e9])
        gaps.append(float(np.percentile(g, 95)))
        echo.append(float(np.mean([lv > -40 for _, lv in arr])) if arr else 0.0)
    result: dict[str, Any] = {
        "connected": connected,
        "rx_fps_min": min(fps),
        "rx_fps_mean": float(np.mean(fps)),
        "gap_p95_ms_max": max(gaps),
        "echo_frac_min": min(echo),
    }
    if served:
        # A single server's ids carry no worker tag: all its sessions are worker 0's.
        tags = ["0" if w is None else str(w) for w in owners]
        result["sessions_by_worker"] = {w: tags.count(w) for w in sorted(set(tags))}
    print(json.dumps({"event": "result", "result": result}), flush=True)
    if writer is not None:
        writer.close()
    for c in callers:
        await c.close()


async def bench_sessions(args: argparse.Namespace) -> tuple[int, list[dict[str, Any]]]:
    enable_loopback_ice()
    tmp = Path(tempfile.mkdtemp(prefix="lko-mpb-"))
    proc, address = spawn_engine(max(args.max_sessions, 1) + 4, tmp)
    rows: list[dict[str, Any]] = []
    best = 0
    start = time.monotonic()
    try:
        client = await connect_engine(proc, address)
        for n in [s for s in STEPS if s <= args.max_sessions]:
            step_estimate = args.warmup + args.window + 3 + 0.15 * n
            if time.monotonic() - start + step_estimate > args.time_cap:
                print(f"  (stopping before N={n}: time cap {args.time_cap:.0f} s)", flush=True)
                break
            row = await run_step(n, client, proc.pid, args, tmp)
            rows.append(row)
            print(
                f"  N={n:3d}  to caller {row.get('rx_fps_min', 0):4.1f}/s (server sent {row.get('server_tx_fps_min', 0):4.1f})"
                f"  gap p95 {row.get('gap_p95_ms_max', 0):5.1f} ms  to server {row.get('server_rx_fps_min', 0):4.1f}/s"
                f"  echo {100 * row.get('echo_frac_min', 0):3.0f}%  CPU% server {row.get('server_cpu_pct', 0):3.0f}"
                f" engine {row.get('engine_cpu_pct', 0):3.0f} client {row.get('client_cpu_pct', 0):3.0f}"
                f" machine {row.get('machine_cpu_pct', 0):3.0f}  loop lag p99/max {row.get('loop_lag_p99_ms', 0):.0f}/"
                f"{row.get('loop_lag_max_ms', 0):.0f} ms  {'real time' if row['realtime'] else 'LATE'}",
                flush=True,
            )
            if not row["realtime"]:
                break
            best = n
        await client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return best, rows


# --- (c) with --workers: the same callers against a real ``livekit-omni serve --workers N`` -----------------


def start_served(workers: int, max_sessions: int, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A real server (loopback engine, 127.0.0.1 ICE only) with ``workers`` media processes; returns when ready."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    env = {
        **os.environ,
        "LIVEKIT_OMNI_ENGINE__ADDRESS": f"unix:{tmp}/engine-w{workers}.sock",
        "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": str(max_sessions),
        "LIVEKIT_OMNI_ENGINE__LOOPBACK_DELAY_MS": "100",
        "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
        "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = tmp / f"server-w{workers}.log"
    cmd = [sys.executable, "-m", "livekit_omni.cli", "serve", "--port", str(port), "--adapter", "loopback"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*cmd, "--workers", str(workers)], cwd=ROOT, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while "livekit-omni engine ready:" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server with {workers} workers did not start:\n{log_path.read_text()}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return dict(json.loads(r.read()))


def _audio_in_seconds(url: str) -> float:
    """Caller audio the server received, summed over its workers (``livekit_omni_audio_in_seconds_total``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "livekit_omni_audio_in_seconds_total"
    )


def _server_processes(proc: subprocess.Popen[bytes], engine_pid: int) -> list[psutil.Process]:
    """The serving processes: the parent and its workers (one process with --workers 1), not the engine."""
    root = psutil.Process(proc.pid)
    return [root] + [c for c in root.children(recursive=True) if c.pid != engine_pid]


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p_ in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(p_.cpu_times()[:2])
    return total


async def run_served_step(
    n: int, url: str, server: list[psutil.Process], engine_pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    async def window_start() -> dict[str, Any]:
        return {"cpu": _cpu_s(server), "audio_in": await asyncio.to_thread(_audio_in_seconds, url)}

    async def window_end(snap: dict[str, Any], dt: float) -> dict[str, Any]:
        audio_in = await asyncio.to_thread(_audio_in_seconds, url)
        server_cpu = 100 * (_cpu_s(server) - snap["cpu"]) / dt
        return {
            "server_cpu_pct": server_cpu,
            "server_cpu_pct_per_session": server_cpu / n,
            # Seconds of caller audio per second per session, all workers together.
            "server_rx_rate": (audio_in - snap["audio_in"]) / dt / n,
        }

    result = await _drive_client_worker(url, n, engine_pid, args, window_start, window_end)
    result["realtime"] = _realtime(result, n, result.get("server_rx_rate", 0) >= REALTIME_FPS / 50)
    return result


async def bench_served(args: argparse.Namespace, workers: int) -> tuple[int, list[dict[str, Any]]]:
    tmp = Path(tempfile.mkdtemp(prefix="lko-mpw-"))
    proc, url = start_served(workers, max(args.max_sessions, 1) + 4, tmp)
    rows: list[dict[str, Any]] = []
    best = 0
    start = time.monotonic()
    try:
        engine_pid = int((await asyncio.to_thread(_get_json, url + "/health"))["engine"]["pid"])
        server = _server_processes(proc, engine_pid)
        assert len(server) == (1 if workers == 1 else workers + 1), [p_.cmdline() for p_ in server]
        for n in [s for s in STEPS if s <= args.max_sessions]:
            step_estimate = args.warmup + args.window + 3 + 0.15 * n
            if time.monotonic() - start + step_estimate > args.time_cap:
                print(f"  (stopping before N={n}: time cap {args.time_cap:.0f} s)", flush=True)
                break
            row = await run_served_step(n, url, server, engine_pid, args)
            rows.append(row)
            split = " ".join(f"w{w}:{v}" for w, v in sorted(row.get("sessions_by_worker", {}).items()))
            print(
                f"  workers={workers} N={n:3d}  to caller {row.get('rx_fps_min', 0):4.1f}/s"
                f"  gap p95 {row.get('gap_p95_ms_max', 0):5.1f} ms  to server {50 * row.get('server_rx_rate', 0):4.1f}/s"
                f"  echo {100 * row.get('echo_frac_min', 0):3.0f}%  split {split:11s}  CPU% server"
                f" {row.get('server_cpu_pct', 0):3.0f} ({row.get('server_cpu_pct_per_session', 0):4.1f}/session)"
                f" engine {row.get('engine_cpu_pct', 0):3.0f} client {row.get('client_cpu_pct', 0):3.0f}"
                f" machine {row.get('machine_cpu_pct', 0):3.0f}  {'real time' if row['realtime'] else 'LATE'}",
                flush=True,
            )
            if not row["realtime"]:
                break
            best = n
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return best, rows


# --- (d) receive jitter-buffer prefetch ------------------------------------------------------------------------


async def _jitter_once(prefetch: int, clip: np.ndarray, bursts: int) -> list[float]:
    rings = RingPair.create(input_rate=ENGINE_INPUT_RATE, output_rate=ENGINE_OUTPUT_RATE)
    sess = FakeSession(rings)
    onsets: list[float] = []
    loud = False

    def on_input(frame: av.AudioFrame) -> None:
        nonlocal loud
        now = time.monotonic()
        lvl = 20 * np.log10(np.abs(frame_to_mono_pcm16(frame)).max() / 32768 + 1e-9)
        if lvl > -20 and not loud:
            onsets.append(now)
        loud = lvl > -20

    caller = WebRTCCaller(clip, loop=True, datachannel=None, record_audio=False, jitter_prefetch=prefetch)
    peer = await answer_offer(
        await caller.offer(), sess, loopback_only=True, jitter_prefetch=prefetch, on_input_frame=on_input
    )
    try:
        await caller.accept(peer.answer_sdp)
        await asyncio.wait_for(caller.connected.wait(), 10)
        await asyncio.sleep(0.5 * bursts + 1.0)
        sent = dict(caller.source.sent_at)
    finally:
        await peer.close()
        await caller.close()
        rings.close()
    lat = []
    burst_starts = sorted(t for i, t in sent.items() if i % 25 == 0)
    for on in onsets:
        # the burst whose first frame was handed to aiortc last before this onset (a burst every 25 frames)
        before = [t for t in burst_starts if t <= on]
        if before:
            lat.append((on - before[-1]) * 1000)
    return lat[1:]  # the first burst overlaps connection set-up


async def bench_jitter(prefetches: list[int], bursts: int) -> dict[int, list[float]]:
    enable_loopback_ice()
    t = np.arange(4800) / 48_000
    clip = np.zeros(24_000, np.int16)  # 500 ms: 100 ms of tone, then silence
    clip[:4800] = (12000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    return {pf: await _jitter_once(pf, clip, bursts) for pf in prefetches}


def report_cpu(frames: int, result: dict[str, Any]) -> None:
    print(f"(a)/(b) CPU per 20 ms frame, {frames} frames each (thread CPU time; pid {os.getpid()})")
    cpu = bench_cpu(frames)
    rows = [
        ("(a) libopus decode (mono s16)", cpu["opus_decode_us"]),
        ("(a) resample 48→16 kHz + level + ring write", cpu["ingress_us"]),
        ("(a) chain: decode + resample + ring write", cpu["decode_chain_us"]),
        ("(a) WebRTC: aiortc-style decode (stereo s16)", cpu["aiortc_opus_decode_us"]),
        ("(a) WebRTC: AudioFrame downmix + resample + ring", cpu["ingress_from_stereo_frame_us"]),
        ("(b) ring read + epoch/playout + 24→48 kHz", cpu["egress_us"]),
        ("(b) libopus encode (mono 32 kbps voip)", cpu["opus_encode_us"]),
        ("(b) chain: ring read + resample + encode", cpu["encode_chain_us"]),
        ("(b) WebRTC: aiortc's Opus encoder (stereo 96k)", cpu["aiortc_opus_encode_us"]),
    ]
    for name, us in rows:
        print(f"  {name:<52s} {us:8.1f} µs")
    budget = 200.0
    print(
        f"  budget {budget:.0f} µs/frame/direction excluding Opus: decode side {cpu['ingress_us']:.1f} µs, "
        f"encode side {cpu['egress_us']:.1f} µs"
    )
    result.update(
        decode_us_per_frame=cpu["decode_chain_us"],
        encode_us_per_frame=cpu["encode_chain_us"],
        decode_us_per_frame_excl_opus=cpu["ingress_us"],
        encode_us_per_frame_excl_opus=cpu["egress_us"],
        opus_decode_us=cpu["opus_decode_us"],
        opus_encode_us=cpu["opus_encode_us"],
        webrtc_decode_us_per_frame=cpu["aiortc_opus_decode_us"] + cpu["ingress_from_stereo_frame_us"],
        webrtc_encode_us_per_frame=cpu["aiortc_opus_encode_us"] + cpu["egress_us"],
    )


# --- main -------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=5000, help="frames per CPU row (a, b)")
    ap.add_argument("--max-sessions", type=int, default=48)
    ap.add_argument("--window", type=float, default=10.0, help="measurement window per step (s)")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--time-cap", type=float, default=240.0, help="stop adding steps after this many seconds")
    ap.add_argument(
        "--encoder",
        choices=["media", "aiortc"],
        default="media",
        help="who encodes outgoing audio (EgressTrack)",
    )
    ap.add_argument(
        "--workers",
        default=None,
        metavar="N,N,...",
        help="run (c) against a real `livekit-omni serve --workers N` for each N instead of in-process peers",
    )
    ap.add_argument("--skip-sessions", action="store_true")
    ap.add_argument("--skip-cpu", action="store_true", help="skip (a)/(b)")
    ap.add_argument("--jitter", action="store_true", help="also measure jitter-buffer prefetch latency")
    ap.add_argument("--jitter-only", action="store_true")
    ap.add_argument(
        "--client-worker", nargs=4, metavar=("SIGNAL", "N", "WARMUP", "WINDOW"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()

    if args.client_worker:
        sock, n, warmup, window = args.client_worker
        asyncio.run(client_worker(sock, int(n), float(warmup), float(window)))
        return

    result: dict[str, Any] = {}
    if args.jitter or args.jitter_only:
        print("(d) caller → server latency by aiortc receive prefetch (tone-burst onset, 127.0.0.1)")
        lat = asyncio.run(bench_jitter([4, 2, 1, 0], bursts=30))
        for pf, xs in lat.items():
            print(f"  prefetch {pf}: median {pct(xs, 50):6.1f} ms  p90 {pct(xs, 90):6.1f} ms  (n={len(xs)})")
            result[f"jitter_prefetch{pf}_median_ms"] = pct(xs, 50)
        if args.jitter_only:
            finish(result)
            return

    if not args.skip_cpu:
        report_cpu(args.frames, result)
    best = 0
    if args.workers and not args.skip_sessions:
        counts = [int(x) for x in args.workers.split(",")]
        print(
            f"(c) concurrent WebRTC sessions against `livekit-omni serve --workers N` on 127.0.0.1 (Live WebRTC "
            f"offers, loopback engine; real time = every session ≥ {REALTIME_FPS:.0f} frames/s to the caller, p95 "
            f"gap < {REALTIME_P95_GAP_MS:.0f} ms, and the server receiving ≥ {REALTIME_FPS:.0f} frames/s per "
            f"session over {args.window:.0f} s; server CPU = parent + workers, not the engine; "
            f"{psutil.cpu_count()} CPUs shared by all)"
        )
        by_workers: dict[str, int] = {}
        per_session: dict[str, float | None] = {}
        for w in counts:
            w_best, steps = asyncio.run(bench_served(args, w))
            by_workers[str(w)] = w_best
            at_best = [r for r in steps if r["n"] == w_best]
            per_session[str(w)] = at_best[0]["server_cpu_pct_per_session"] if at_best else None
            result[f"sessions_workers{w}"] = [
                {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in steps
            ]
            print(f"  workers={w}: max sessions in real time {w_best}", flush=True)
        result["max_sessions_by_workers"] = by_workers
        # At each worker count's largest real-time step (% of one core per session).
        result["server_cpu_pct_per_session_by_workers"] = per_session
        result["max_sessions_realtime"] = max(by_workers.values(), default=0)
        finish(result)
        return
    if not args.skip_sessions:
        print(
            f"(c) concurrent WebRTC sessions on 127.0.0.1 (engine: loopback fixture; encoder: {args.encoder}; "
            f"real time = every session ≥ {REALTIME_FPS:.0f} frames/s both ways and p95 gap < "
            f"{REALTIME_P95_GAP_MS:.0f} ms over {args.window:.0f} s; {psutil.cpu_count()} CPUs shared by all)"
        )
        best, steps = asyncio.run(bench_sessions(args))
        result["sessions"] = [
            {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in steps
        ]
        print(f"  max sessions in real time: {best}")
    result["max_sessions_realtime"] = best if not args.skip_sessions else None
    finish(result)


if __name__ == "__main__":
    main()
