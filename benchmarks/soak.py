"""A real-model soak: N spoken conversations on one ``livekit-omni serve`` for ``--minutes``, in windows.

The same server and scripted callers as benchmarks/capacity.py (cascade engine, default models; Live WebSocket
callers that stream at real time, ask questions, hear the answers and barge in on every third turn), run
continuously: a caller whose session ends is counted and replaced. N is ``--sessions``, else the
``sessions_realtime`` of a capacity result file (``--capacity-result``), else 2.

Every ``--window-s`` (5 minutes by default) it records:

* **RSS** of the server process and of its engine (psutil when installed, else /proc), and their sum;
* **latency** p50/p95 of the turns whose question ended in the window (voice-to-voice, where the caller hears it);
* **ring overruns** (ingress and egress), **egress underruns** and **dropped events** (the server's
  ``livekit_omni_ring_overruns_total``, ``livekit_omni_egress_underruns_total`` and
  ``livekit_omni_dropped_events_total`` on /metrics), counted from the start of the run;
* **engine restarts** (``engine.restarts`` in /health) and the engine's ``audio_tick_overruns``.

The baseline is the run itself: RSS drift is measured from the first window that ends at or after minute 5 (the
first window when the run is shorter: warm-up is over) to the last; latency compares the last window's p95 with the
first's. Targets (not asserted here): RSS within ±10 %, p95 within 1.2x, nothing dropped, no restart.

    python benchmarks/soak.py [--sessions N | --capacity-result capacity.json] [--minutes 30] [--window-s 300]
                              [--backend torch|vllm] [--quick]

Last stdout line: one JSON object with ``rss_drift_pct`` (last window over the reference, server + engine),
``rss_max_drift_pct`` (the largest excursion after the reference), ``p95_last_over_first``, ``dropped_events``,
``ring_overruns``, ``engine_restarts``, and the per-window rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from _common import finish, pct
from _load import NAN, ScriptedCaller, Turn, health, losses, rss_bytes
from capacity import STAGGER_S, server_env

from tests.conftest import ServerProcess, start_server

#: RSS drift is measured from the first window ending at or after this minute.
REFERENCE_MINUTE = 5.0


def sessions_from(path: Path | None) -> int:
    if path is None:
        return 2
    return max(1, int(json.loads(path.read_text())["sessions_realtime"]))


class Console:
    """Progress lines: rich when installed, else plain prints (flushed: a pipe shows them as they come)."""

    def __init__(self) -> None:
        try:
            from rich.console import Console as RichConsole
        except ImportError:
            self._rich = None
        else:
            self._rich = RichConsole(stderr=True, highlight=False)

    def line(self, text: str) -> None:
        if self._rich is not None:
            self._rich.print(text, markup=False, soft_wrap=True)
        else:
            print(text, file=sys.stderr, flush=True)


async def caller_loop(
    server: ServerProcess, index: int, sessions: int, until: float, turns: list[Turn], lost: list[str]
) -> None:
    """One seat of the call centre: a conversation until ``until``; a session that ends early is replaced."""
    await asyncio.sleep(index * STAGGER_S / sessions)
    while time.monotonic() < until:
        try:
            caller = await ScriptedCaller.open(server.url, index)
        except Exception as e:  # refused (the engine restarting, the limit): count it, try again shortly
            lost.append(f"caller {index}: open failed: {e}")
            await asyncio.sleep(2.0)
            continue
        try:
            await caller.converse(until=until, on_turn=turns.append)
            if not caller.alive:
                lost.append(f"caller {index}: session ended (close {caller.client.close_code})")
        finally:
            await caller.close()


def window_latency(turns: list[Turn], start: float, end: float) -> dict[str, Any]:
    """Latency of the turns whose question ended in [start, end) (monotonic times)."""
    inside = [t for t in turns if start <= t.speech_end < end]
    v2v = [t.v2v_ms for t in inside if t.v2v_ms == t.v2v_ms]
    return {
        "turns": len(inside),
        "no_answer": len(inside) - len(v2v),
        "p50_ms": pct(v2v, 50),
        "p95_ms": pct(v2v, 95),
    }


def window_row(
    server: ServerProcess,
    w: int,
    start: float,
    end: float,
    t0: float,
    turns: list[Turn],
    base: dict[str, float],
) -> dict[str, Any]:
    h = health(server.url)
    engine = h.get("engine", {})
    pid = engine.get("pid")
    now = losses(server.url)
    server_rss = rss_bytes(server.proc.pid)
    engine_rss = 0
    with contextlib.suppress(Exception):
        engine_rss = rss_bytes(int(pid)) if pid else 0
    return {
        "window": w,
        "start_s": start - t0,
        "end_s": end - t0,
        "end_min": (end - t0) / 60,
        **window_latency(turns, start, end),
        "server_rss_mb": server_rss / 2**20,
        "engine_rss_mb": engine_rss / 2**20,
        "rss_mb": (server_rss + engine_rss) / 2**20,
        "ring_overruns": now["ingress_overruns"]
        - base["ingress_overruns"]
        + now["egress_overruns"]
        - base["egress_overruns"],
        "egress_underruns": now["egress_underruns"] - base["egress_underruns"],
        "dropped_events": now["dropped_events"] - base["dropped_events"],
        "engine_restarts": int(engine.get("restarts", 0)),
        "audio_tick_overruns": int(engine.get("audio_tick_overruns", 0)),
        "status": h.get("status"),
    }


def summarize(rows: list[dict[str, Any]], restarts0: int) -> dict[str, Any]:
    ref = next((r for r in rows if r["end_min"] >= REFERENCE_MINUTE - 1e-6), rows[0])
    after = [r for r in rows if r["window"] >= ref["window"]]
    last = rows[-1]
    first_p95, last_p95 = rows[0]["p95_ms"], last["p95_ms"]
    drift = [(r["rss_mb"] - ref["rss_mb"]) / ref["rss_mb"] * 100 for r in after]
    return {
        "rss_drift_pct": drift[-1],
        "rss_max_drift_pct": max(drift, key=abs),
        "rss_reference_min": ref["end_min"],
        "p95_first_ms": first_p95,
        "p95_last_ms": last_p95,
        "p95_last_over_first": last_p95 / first_p95 if first_p95 == first_p95 and first_p95 else NAN,
        "dropped_events": last["dropped_events"],
        "ring_overruns": last["ring_overruns"],
        "egress_underruns": last["egress_underruns"],
        "engine_restarts": last["engine_restarts"] - restarts0,
    }


def print_table(rows: list[dict[str, Any]], sessions: int) -> None:
    print()
    print(f"soak: {sessions} spoken conversations, per window (counters from the start of the run)")
    print(
        f"{'win':>3} {'end min':>7} {'turns':>5} {'none':>4} {'p50':>6} {'p95':>6} {'srv MB':>7} {'eng MB':>7} "
        f"{'sum MB':>7} {'overruns':>8} {'under':>6} {'dropped':>7} {'restarts':>8}"
    )
    for r in rows:
        print(
            f"{r['window']:>3} {r['end_min']:7.1f} {r['turns']:>5} {r['no_answer']:>4} {r['p50_ms']:6.0f} "
            f"{r['p95_ms']:6.0f} {r['server_rss_mb']:7.0f} {r['engine_rss_mb']:7.0f} {r['rss_mb']:7.0f} "
            f"{r['ring_overruns']:>8.0f} {r['egress_underruns']:>6.0f} {r['dropped_events']:>7.0f} "
            f"{r['engine_restarts']:>8}"
        )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sessions", type=int, help="concurrent conversations (default: --capacity-result, else 2)"
    )
    ap.add_argument("--capacity-result", type=Path, help="a benchmarks/capacity.py --result file")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--window-s", type=float, default=300.0)
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    ap.add_argument("--quick", action="store_true", help="30 s in 10 s windows, at most 2 sessions")
    args = ap.parse_args()
    sessions = args.sessions or sessions_from(args.capacity_result)
    minutes, window_s = args.minutes, args.window_s
    if args.quick:
        sessions, minutes, window_s = min(sessions, 2), 0.5, 10.0
    out = Console()
    t_start = time.monotonic()
    server = await asyncio.to_thread(
        start_server, adapter="cascade", env=server_env(args.backend, sessions + 1), ready_timeout=400
    )
    startup_s = time.monotonic() - t_start
    turns: list[Turn] = []
    lost: list[str] = []
    rows: list[dict[str, Any]] = []
    try:
        base = await asyncio.to_thread(losses, server.url)
        restarts0 = int(health(server.url).get("engine", {}).get("restarts", 0))
        t0 = time.monotonic()
        until = t0 + minutes * 60
        seats = [
            asyncio.create_task(caller_loop(server, i, sessions, until, turns, lost)) for i in range(sessions)
        ]
        n_windows = max(1, round(minutes * 60 / window_s))
        for w in range(n_windows):
            start, end = t0 + w * window_s, min(until, t0 + (w + 1) * window_s)
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            if w == n_windows - 1:
                # The last window also holds the turns under way at the end: let them finish.
                await asyncio.gather(*seats, return_exceptions=True)
                end = max(end, max((t.speech_end for t in turns), default=end) + 1e-3)
            row = await asyncio.to_thread(window_row, server, w + 1, start, end, t0, turns, base)
            rows.append(row)
            out.line(
                f"window {w + 1}/{n_windows} ({row['end_min']:.1f} min): {row['turns']} turns answered so far, "
                f"p50 {row['p50_ms']:.0f} ms, p95 {row['p95_ms']:.0f} ms, RSS {row['rss_mb']:.0f} MB "
                f"(server {row['server_rss_mb']:.0f}, engine {row['engine_rss_mb']:.0f}), overruns "
                f"{row['ring_overruns']:.0f}, underruns {row['egress_underruns']:.0f}, dropped "
                f"{row['dropped_events']:.0f}, restarts {row['engine_restarts'] - restarts0}"
            )
        await asyncio.gather(*seats, return_exceptions=True)
        # A turn is recorded once its answer has played out, so a window's last turns were recorded after it
        # ended: its latency figures are computed again now that every turn is in.
        for row in rows:
            row.update(window_latency(turns, t0 + row["start_s"], t0 + row["end_s"]))
    finally:
        await asyncio.to_thread(server.stop)
    print_table(rows, sessions)
    summary = summarize(rows, restarts0)
    print(
        f"(backend {args.backend}; RSS drift from minute {summary['rss_reference_min']:.1f}: "
        f"{summary['rss_drift_pct']:+.1f} % at the end, largest {summary['rss_max_drift_pct']:+.1f} %; "
        f"p95 last/first {summary['p95_last_over_first']:.2f}; sessions lost {len(lost)}; "
        f"server start-up {startup_s:.0f} s; wall time {time.monotonic() - t_start:.0f} s)"
    )
    for why in lost:
        print(f"  lost: {why}")
    finish(
        {
            **summary,
            "sessions": sessions,
            "minutes": minutes,
            "window_s": window_s,
            "turns": len(turns),
            "no_answer": sum(1 for t in turns if t.v2v_ms != t.v2v_ms),
            "sessions_lost": len(lost),
            "backend": args.backend,
            "startup_s": startup_s,
            "windows": rows,
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
