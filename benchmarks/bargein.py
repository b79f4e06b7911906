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

    python benchmarks/bargein.py [--trials 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time

from _common import finish, pct

from engine_bridge import protocol as p
from tests.conftest import connect_engine, spawn_engine
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


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="5 trials")
    args = ap.parse_args()
    n = 5 if args.quick else args.trials
    eng = spawn_engine(adapter="cascade")
    rows: list[dict[str, float]] = []
    t0 = time.monotonic()
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
    bump = [r["bump_ms"] for r in rows if r["bump_ms"] == r["bump_ms"]]
    stop = [r["client_stop_ms"] for r in rows if r["client_stop_ms"] == r["client_stop_ms"]]
    turn = [r["turn_based_ms"] for r in rows if r["turn_based_ms"] == r["turn_based_ms"]]
    print()
    print(f"{'barge-in (ms, n=' + str(len(rows)) + ')':34} {'p50':>8} {'p95':>8}")
    print(f"{'speech onset -> epoch bump':34} {pct(bump, 50):8.0f} {pct(bump, 95):8.0f}")
    print(f"{'speech onset -> last stale frame':34} {pct(stop, 50):8.0f} {pct(stop, 95):8.0f}")
    print(f"{'baseline: stop at turn end (VAD)':34} {pct(turn, 50):8.0f} {pct(turn, 95):8.0f}")
    print(
        f"missed bumps: {len(rows) - len(bump)}; wall time {time.monotonic() - t0:.0f} s; targets p50 <= 250, p95 <= 350"
    )
    finish(
        {
            "p50_ms": pct(bump, 50),
            "p95_ms": pct(bump, 95),
            "client_stop_p50_ms": pct(stop, 50),
            "client_stop_p95_ms": pct(stop, 95),
            "turn_based_stop_p50_ms": pct(turn, 50),
            "missed": len(rows) - len(bump),
            "trials": len(rows),
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
