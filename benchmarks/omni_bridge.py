"""What the vLLM-Omni bridge adds: latency and CPU per 80 ms unit, ring → sidecar → ring, at 1 and 16 sessions.

Setup: a real engine process running the ``omni_bridge`` adapter with an 80 ms-unit preset (PCM16 16 kHz up,
PCM16 24 kHz down: Nemotron/PersonaPlex-sized units, MiniCPM-o's format), bridged to the stand-in sidecar
(``testkit/omni_standin.py``) in ``--echo`` mode: every append comes straight back as output audio,
so the round trip is the bridge's own work (base64 + JSON both ways, the WebSocket on loopback, the stand-in's
decode/encode, the engine's audio thread and the bridge's loop thread), with no model in it.

This process plays the media plane for every session: it writes caller audio into each ingress ring in 20 ms
frames at real time (ringing the engine's doorbell, as the media plane does), and a reader thread polls every
egress ring (every 0.2 ms) for the echoed units. Sessions are out of step, as callers are: session *i*'s units end
on tick *i* mod 4 of each 80 ms (a quarter of the sessions per 20 ms tick), not all on the same one.

* **added latency** of unit *k*: from the moment its last 20 ms frame was in the ingress ring to the moment its
  echo is in the egress ring. Accumulating the unit itself (80 ms) is the model's unit, not the bridge's cost,
  and is not counted.
* **CPU per unit**: the engine process's CPU time (user + system, all threads) over the measured window, divided
  by the units it bridged. It includes the audio thread's 20 ms ingress reads that every adapter pays, so it is an
  upper bound on the bridge's own cost. The stand-in's CPU is not counted (it stands for the sidecar).

The last line is one JSON object; ``added_latency_ms_p50``, ``added_latency_ms_p99`` and ``cpu_us_per_unit`` are
the 16-session figures (targets: p99 <= 5 ms, <= 500 µs per unit).

Run: ``python benchmarks/omni_bridge.py`` (``--seconds`` per configuration, ``--sessions 1 16``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _common import ROOT, finish, pct  # also puts the repository root on sys.path

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient, EngineSession
from engine_bridge.control import Address
from engine_bridge.formats import INPUT_FRAME_SAMPLES

UNIT_MS = 80
FRAMES_PER_UNIT = UNIT_MS // 20
OUT_UNIT_SAMPLES = 24_000 * UNIT_MS // 1000


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_standin(port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "testkit.omni_standin"),
                *("--port", str(port), "--echo", "true", "--max-sessions", "64"),
            ],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the stand-in did not start (see {log})") from None
            time.sleep(0.1)


def start_engine(standin_port: int, max_sessions: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = str(Path(tempfile.mkdtemp(prefix="lko-omnibench-")) / "engine.sock")
    preset = {
        "input_format": "pcm16",
        "input_rate": 16_000,
        "input_unit_ms": UNIT_MS,
        "output_rate": 24_000,
        "owns_turn_taking": True,
        "max_sessions": max_sessions,
    }
    settings = {
        "address": "unix:" + sock,
        "adapter": "omni_bridge",
        "max_sessions": max_sessions,
        "omni_bridge": {
            "url": f"ws://127.0.0.1:{standin_port}",
            "preset": "bench",
            "presets": {"bench": preset},
        },
    }
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_bridge.engine", "--settings-json", json.dumps(settings)],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "LIVEKIT_OMNI_LOG_LEVEL": "WARNING"},
        )
    return proc, "unix:" + sock


async def connect(address: str) -> EngineClient:
    deadline = time.monotonic() + 60
    while True:
        try:
            client = await EngineClient.connect(Address.parse(address), timeout=1.0)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    for _ in range(600):  # the bridge's load() waits for the sidecar's /health
        if (await client.ping()).state is p.EngineState.READY:
            return client
        await asyncio.sleep(0.1)
    raise TimeoutError("the engine did not get ready")


class Reader(threading.Thread):
    """Polls every session's egress ring and stamps each echoed unit as it lands."""

    def __init__(self, sessions: list[EngineSession]) -> None:
        super().__init__(daemon=True)
        self.sessions = sessions
        self.arrivals: list[list[float]] = [[] for _ in sessions]
        self._buf = np.zeros(1 << 16, dtype=np.int16)
        self._got = [0] * len(sessions)
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            for i, s in enumerate(self.sessions):
                while (info := s.rings.egress.read_chunk(self._buf)) is not None:
                    now = time.monotonic()
                    # One echoed unit is one chunk (1920 samples); count samples in case a unit ever splits.
                    before = self._got[i] // OUT_UNIT_SAMPLES
                    self._got[i] += info.nsamples
                    for _ in range(self._got[i] // OUT_UNIT_SAMPLES - before):
                        self.arrivals[i].append(now)
            time.sleep(0.0002)


async def run_config(client: EngineClient, engine_pid: int, n: int, seconds: float) -> dict[str, Any]:
    sessions = [await client.open_session(p.SessionConfig()) for _ in range(n)]
    reader = Reader(sessions)
    reader.start()
    rng = np.random.default_rng(0)
    frame = (rng.standard_normal(INPUT_FRAME_SAMPLES) * 3000).astype(np.int16)
    unit_done: list[list[float]] = [[] for _ in sessions]
    proc = psutil.Process(engine_pid)
    warmup = 1.0
    t0 = time.monotonic()
    cpu0 = None
    t_cpu0 = 0.0
    units_at_cpu0 = 0
    k = 0
    while True:
        now = time.monotonic()
        if now - t0 >= warmup + seconds:
            break
        if cpu0 is None and now - t0 >= warmup:
            c = proc.cpu_times()
            cpu0, t_cpu0 = c.user + c.system, now
            units_at_cpu0 = sum(len(a) for a in reader.arrivals)
        for i, s in enumerate(sessions):
            # Callers do not start in step: session i's units end on 20 ms tick i mod 4 of each 80 ms.
            if k == 0 and i % FRAMES_PER_UNIT:
                s.rings.ingress.write(np.zeros(INPUT_FRAME_SAMPLES * (i % FRAMES_PER_UNIT), dtype=np.int16))
            s.rings.ingress.write(frame)
            if (k + 1 + i) % FRAMES_PER_UNIT == 0:
                unit_done[i].append(time.monotonic())
        client.ring_doorbell()
        k += 1
        await asyncio.sleep(max(0.0, t0 + k * 0.02 - time.monotonic()))
    await asyncio.sleep(0.3)  # the last units come back
    c = proc.cpu_times()
    cpu1, t_cpu1 = c.user + c.system, time.monotonic()
    reader.stop_flag.set()
    reader.join()
    units_in_window = sum(len(a) for a in reader.arrivals) - units_at_cpu0
    lat: list[float] = []
    lost = 0
    for done, got in zip(unit_done, reader.arrivals, strict=True):
        for j, t_in in enumerate(done):
            if t_in - t0 < warmup:
                continue
            if j < len(got):
                lat.append((got[j] - t_in) * 1000)
            else:
                lost += 1
    for s in sessions:
        await s.close()
    assert cpu0 is not None
    return {
        "sessions": n,
        "units": len(lat),
        "lost_units": lost,
        "added_latency_ms_p50": pct(lat, 50),
        "added_latency_ms_p90": pct(lat, 90),
        "added_latency_ms_p99": pct(lat, 99),
        "added_latency_ms_max": max(lat) if lat else float("nan"),
        "cpu_us_per_unit": (cpu1 - cpu0) * 1e6 / max(1, units_in_window),
        "engine_cpu_percent": (cpu1 - cpu0) * 100 / max(1e-9, t_cpu1 - t_cpu0),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    logs = ROOT / "test-output"
    logs.mkdir(exist_ok=True)
    port = _free_port()
    standin = start_standin(port, logs / "omni-bridge-bench-standin.log")
    engine, address = start_engine(port, max(args.sessions), logs / "omni-bridge-bench-engine.log")
    client = None
    try:
        client = await connect(address)
        # This process stamps every echo: a full collection of its start-up heap (numpy, psutil, the engine
        # client) would stall the stamping thread and be counted as the bridge's latency.
        gc.collect()
        gc.freeze()
        rows = [await run_config(client, engine.pid, n, args.seconds) for n in args.sessions]
    finally:
        if client is not None:
            await client.close()
        engine.terminate()
        engine.wait(15)
        standin.terminate()
        standin.wait(15)
    print(
        f"{'sessions':>8} {'units':>6} {'lost':>5} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'max ms':>7} "
        f"{'CPU µs/unit':>11} {'engine CPU %':>12}"
    )
    for r in rows:
        print(
            f"{r['sessions']:>8} {r['units']:>6} {r['lost_units']:>5} {r['added_latency_ms_p50']:>7.2f} "
            f"{r['added_latency_ms_p90']:>7.2f} {r['added_latency_ms_p99']:>7.2f} {r['added_latency_ms_max']:>7.2f} "
            f"{r['cpu_us_per_unit']:>11.0f} {r['engine_cpu_percent']:>12.1f}"
        )
    last = rows[-1]
    return {
        "added_latency_ms_p50": last["added_latency_ms_p50"],
        "added_latency_ms_p99": last["added_latency_ms_p99"],
        "cpu_us_per_unit": last["cpu_us_per_unit"],
        "sessions": last["sessions"],
        "unit_ms": UNIT_MS,
        "rows": rows,
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per configuration")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    finish(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
