"""Barge-in latency: first caller-speech frame written to ingress during model speech → epoch bump.

Each trial opens a session on a real engine process (embedded CPU pipeline), makes the model speak (a
``commentary`` append), lets ~1 s of the answer play, then writes an interrupting utterance into the ingress ring
at real time. A poller thread watches the epoch word in the egress ring header every 0.5 ms. Figures:

* ``p50_ms``/``p95_ms``: first speech frame written → epoch bump (the engine's decision; includes the barge-in
  minimum of 200 ms of speech, by design: shorter sounds are backchannels);
* client stop: first speech frame → the last frame of the old answer played by the driver, which drops stale
  audio the way the media plane does (what a caller hears);
* baseline, same trials: a turn-based pipeline stops only when the caller's turn ends (the VAD endpoint), so its
  stop time is first speech frame → endpoint (SpeechStopped) — measured on the same utterances.

* ``--path webrtc`` (where the caller hears it): a real server (``make serve`` defaults) and an aiortc caller
  through the media plane (Opus both ways, jitter buffer). The model tells a long story (a commentary append on
  the data channel); after 1 s of it the caller interrupts. **Stop** = the caller's onset (the time the frame that
  holds the interruption's first audible sample was sent) → the first received 10 ms window from which the model's
  output stays at least 30 dB below its level (its loud windows over the 600 ms before the onset) up to 1.5 s after
  the onset. The duck (``engine.turn_taking.duck_db``, 40 dB by default) lowers the output at the first frames of
  caller speech; the baseline, same run, is a server started with ``duck_db=0``, which stops only at the epoch
  flush (the barge-in minimum of speech).

    python benchmarks/bargein.py [--path engine|webrtc|all] [--trials 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import threading
import time

from _callers import CallerLeg, webrtc_leg
from _common import finish, pct
from _load import scrape

from engine_bridge import protocol as p
from tests.conftest import ServerProcess, connect_engine, spawn_engine, start_server
from tests.engine_driver import SessionDriver
from tests.speech_fixtures import speech_bounds_ms, synthesize_speech

INTERRUPTIONS = [
    "Wait, stop please.",
    "Hold on a second.",
    "No, that is not what I asked.",
    "Sorry, one moment.",
]
STORY = (
    "Tell the caller a story: a small fox crossed the frozen river at night, found a lantern in the snow, "
    "and carried it home to the old barn where the other animals were waiting."
)


class EpochWatcher(threading.Thread):
    def __init__(self, ring) -> None:
        super().__init__(daemon=True)
        self.ring = ring
        self.start_epoch = ring.epoch
        self.bumped_at: float | None = None
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.is_set() and self.bumped_at is None:
            if self.ring.epoch != self.start_epoch:
                self.bumped_at = time.monotonic()
                return
            time.sleep(0.0005)

    def stop(self) -> None:
        self._stop.set()


async def trial(client, i: int) -> dict[str, float] | None:
    session = await client.open_session()
    d = SessionDriver(session)
    try:
        await session.append_text("commentary", STORY)
        await asyncio.wait_for(d.run(seconds=0, until=lambda d: d.played_seconds() > 1.0), 30)
        if d.reply_done():
            return None  # the answer was too short to interrupt
        speech = synthesize_speech(
            INTERRUPTIONS[i % len(INTERRUPTIONS)], lead_silence_ms=0, tail_silence_ms=0
        )
        onset_ms, _ = speech_bounds_ms(speech)
        watcher = EpochWatcher(session.rings.egress)
        watcher.start()
        marks = len(d.marks)
        await asyncio.wait_for(
            d.run(
                speech, mark_sample=onset_ms * 16, seconds=1.5, until=lambda d: bool(d.of(p.SpeechStopped))
            ),
            30,
        )
        watcher.stop()
        onset = d.marks[marks]
        if watcher.bumped_at is None:
            return {"bump_ms": float("nan"), "client_stop_ms": float("nan"), "turn_based_ms": float("nan")}
        old_turn = d.of(p.ReplyStarted)[0].turn_id
        last_old = max((pl.wall for pl in d.played if pl.turn_id == old_turn), default=onset)
        stopped = [t for t, e in d.timed(p.SpeechStopped) if t >= onset]
        return {
            "bump_ms": (watcher.bumped_at - onset) * 1000,
            "client_stop_ms": max(0.0, last_old - onset) * 1000,
            "turn_based_ms": (stopped[0] - onset) * 1000 if stopped else float("nan"),
        }
    finally:
        await session.close()


# --- at the listener, over WebRTC --------------------------------------------------------------------------------
DUCK_BELOW_DB = 30.0
STOP_HOLD_S = 1.5
NAN = float("nan")


def output_stop_ms(leg: CallerLeg, onset: float) -> tuple[float, float]:
    """(onset → the output stays DUCK_BELOW_DB under its level, in ms; the answer's level in dBFS) from the
    caller's received windows (see the module docstring); NaN when it never stays down."""
    levels = leg.heard.levels or []
    before = [d for d, t in levels if onset - 0.6 <= t < onset and d > -45.0]
    if not before:
        return NAN, NAN
    level = 10 * math.log10(sum(10 ** (d / 10) for d in before) / len(before))
    after = [(d, t) for d, t in levels if onset <= t <= onset + STOP_HOLD_S]
    stop = NAN
    for d, t in reversed(after):  # the earliest window from which every later one is quiet
        if d > level - DUCK_BELOW_DB:
            break
        stop = t
    return (stop - onset) * 1000, level


async def webrtc_trials(n: int, *, duck_db: float | None) -> list[dict[str, float]]:
    env = {
        "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
        "LIVEKIT_OMNI_EVENT_LOG": "",
        "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
    }
    if duck_db is not None:
        env["LIVEKIT_OMNI_ENGINE__TURN_TAKING__DUCK_DB"] = str(duck_db)
    server = await asyncio.to_thread(start_server, adapter="cascade", env=env, ready_timeout=400)
    rows: list[dict[str, float]] = []
    try:
        i = 0
        while len(rows) < n and i < 3 * n:
            i += 1
            # A fresh call per trial, as on the engine path: no trial answers in the shadow of the one before
            # (a greedy model fed the same interruptions drifts into one-line answers too short to cut).
            row = await _webrtc_trial(server, i)
            if row is None:
                continue
            rows.append(row)
            print(
                f"webrtc trial {len(rows):2d} (duck_db={duck_db if duck_db is not None else 'default'}): "
                f"output down {row['stop_ms']:6.0f} ms after the onset (answer at {row['level_dbfs']:5.1f} dBFS)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        await asyncio.to_thread(server.stop)
    return rows


async def _webrtc_trial(server: ServerProcess, i: int) -> dict[str, float] | None:
    """One call: the story, the interruption half a second into it, the stop measured at the listener; None when
    no answer came or it ended on its own before the barge-in (its silence is no stop)."""
    leg = await webrtc_leg(server, keep_levels=True)
    assert leg.send is not None
    try:
        await asyncio.sleep(0.5)
        leg.heard.scan()
        w0 = leg.heard.windows_received()
        await leg.send({"type": "session.commentary.append", "content": STORY, "delegation_id": None})
        t0 = time.monotonic()
        first = None
        while first is None and time.monotonic() < t0 + 30:
            await asyncio.sleep(0.05)
            leg.heard.scan()
            first = leg.heard.first_loud_after(t0, w0)
        if first is None:
            print(f"webrtc trial {i}: no answer heard", file=sys.stderr)
            return None
        await asyncio.sleep(max(0.0, first[1] + 0.5 - time.monotonic()))  # half a second of the story
        barge_ins = await asyncio.to_thread(_barge_ins, server.url)
        onset = await leg.say(INTERRUPTIONS[i % len(INTERRUPTIONS)], mark="onset")
        await asyncio.sleep(max(0.0, onset + STOP_HOLD_S + 0.3 - time.monotonic()))
        leg.heard.scan()
        if await asyncio.to_thread(_barge_ins, server.url) == barge_ins:
            print(f"webrtc trial {i}: the answer ended before the barge-in; retried", file=sys.stderr)
            return None
        stop, level = output_stop_ms(leg, onset)
        return {"stop_ms": stop, "level_dbfs": level}
    finally:
        for close in leg.closers:
            await close()


def _barge_ins(url: str) -> float:
    """The server's count of caller barge-ins (its /metrics)."""
    return sum(v for (name, _), v in scrape(url).items() if name == "livekit_omni_barge_ins_total")


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if x == x]


async def engine_trials(n: int) -> list[dict[str, float]]:
    eng = spawn_engine(adapter="cascade")
    rows: list[dict[str, float]] = []
    try:
        client = await connect_engine(eng)
        i = 0
        while len(rows) < n and i < 3 * n:
            r = await trial(client, i)
            i += 1
            if r is None:
                print(f"trial {i}: answer too short, retried", file=sys.stderr)
                continue
            rows.append(r)
            print(
                f"trial {len(rows):2d}: bump {r['bump_ms']:6.0f} ms, client stop {r['client_stop_ms']:6.0f} ms, "
                f"turn-based {r['turn_based_ms']:6.0f} ms",
                file=sys.stderr,
                flush=True,
            )
        await client.close()
    finally:
        eng.stop()
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="all", choices=("engine", "webrtc", "all"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="5 trials (3 over WebRTC)")
    args = ap.parse_args()
    n = 5 if args.quick else args.trials
    t0 = time.monotonic()
    out: dict[str, float | int] = {}
    print()
    if args.path in ("engine", "all"):
        rows = await engine_trials(n)
        bump = _finite([r["bump_ms"] for r in rows])
        stop = _finite([r["client_stop_ms"] for r in rows])
        turn = _finite([r["turn_based_ms"] for r in rows])
        print(f"{'engine: barge-in (ms, n=' + str(len(rows)) + ')':44} {'p50':>8} {'p95':>8}")
        print(f"{'speech onset -> epoch bump':44} {pct(bump, 50):8.0f} {pct(bump, 95):8.0f}")
        print(f"{'speech onset -> last stale frame':44} {pct(stop, 50):8.0f} {pct(stop, 95):8.0f}")
        print(f"{'baseline: stop at turn end (VAD)':44} {pct(turn, 50):8.0f} {pct(turn, 95):8.0f}")
        print(f"missed bumps: {len(rows) - len(bump)}; targets p50 <= 250, p95 <= 350")
        out |= {
            "p50_ms": pct(bump, 50),
            "p95_ms": pct(bump, 95),
            "client_stop_p50_ms": pct(stop, 50),
            "client_stop_p95_ms": pct(stop, 95),
            "turn_based_stop_p50_ms": pct(turn, 50),
            "missed": len(rows) - len(bump),
            "trials": len(rows),
        }
    if args.path in ("webrtc", "all"):
        m = 3 if args.quick else min(n, 10)
        ducked = await webrtc_trials(m, duck_db=None)
        flushed = await webrtc_trials(m, duck_db=0.0)
        d = _finite([r["stop_ms"] for r in ducked])
        f = _finite([r["stop_ms"] for r in flushed])
        print()
        print(f"{'webrtc: onset -> output -30 dB (ms)':44} {'p50':>8} {'p95':>8} {'missed':>7}")
        print(f"{'duck (default settings)':44} {pct(d, 50):8.0f} {pct(d, 95):8.0f} {len(ducked) - len(d):7d}")
        print(
            f"{'baseline: flush only (duck_db=0)':44} {pct(f, 50):8.0f} {pct(f, 95):8.0f} {len(flushed) - len(f):7d}"
        )
        out |= {
            "webrtc_duck_p50_ms": pct(d, 50),
            "webrtc_duck_p95_ms": pct(d, 95),
            "webrtc_flush_only_p50_ms": pct(f, 50),
            "webrtc_duck_missed": len(ducked) - len(d),
            "webrtc_trials": len(ducked),
        }
    print(f"wall time {time.monotonic() - t0:.0f} s")
    finish(out)


if __name__ == "__main__":
    asyncio.run(main())
