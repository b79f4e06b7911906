"""Barge-in latency: first caller-speech frame written to ingress during model speech → the output ducked, and
→ the epoch bump (the flush).

Each trial opens a session on a real engine process (embedded CPU pipeline), makes the model speak (a
``commentary`` append), lets ~1 s of the answer play, then writes an interrupting utterance into the ingress ring
at real time. A poller thread watches the gain and epoch words in the egress ring header every 0.5 ms. Figures:

* ``engine_duck_p50_ms``/``engine_duck_p95_ms``: first speech frame written → the engine asks for the output
  ducked (the gain word below 1: what the caller hears first, the media side applies it to the next frame);
* ``p50_ms``/``p95_ms``: first speech frame written → epoch bump (the engine's decision: with the duck on, the
  flush waits for the interruption to be confirmed: its first pause plus the backchannel word check, or 1 s of
  speech; shorter sounds and backchannel words never flush);
* client stop: first speech frame → the last frame of the old answer played by the driver, which drops stale
  audio the way the media plane does (it does not apply the duck);
* baseline, same trials: a turn-based pipeline stops only when the caller's turn ends (the VAD endpoint), so its
  stop time is first speech frame → endpoint (SpeechStopped) — measured on the same utterances.

* ``--path webrtc`` (where the caller hears it): a real server (``make serve`` defaults) and an aiortc caller
  through the media plane (Opus both ways, jitter buffer), one fresh call per trial. The model tells a long story
  (a commentary append on the data channel); half a second into it the caller interrupts. From the caller's onset
  (the time the frame holding the interruption's first audible sample was sent) to the first received 10 ms window
  from which the output stays, up to 1.5 s after the onset:

  - ``duck_p50_ms``/``duck_p95_ms``: at least 30 dB below the story's level (the power mean of its audible windows
    over the 600 ms before the onset): the duck;
  - ``silent_p50_ms``/``silent_p95_ms``: below -45 dBFS, the floor every benchmark here uses for "audible": the
    old answer is inaudible;
  - ``flushed_p50_ms``: below -70 dBFS: the old answer is gone (the epoch flush; the duck leaves it near -60);

  counted only in trials where the server's barge-in counter moved. The baseline, same run, is a server started
  with ``duck_db=0``, which stops only at the epoch flush (the barge-in minimum of speech).

  ``backchannel_interrupt_rate``: calls where, half a second into the story, the caller says a backchannel
  (Piper's "mm-hm" (from its phonemes: Piper spells the written word), "Uh-huh.", "Yeah.", "Right.", or a
  synthetic seeded cough: 150-250 ms of band-limited noise)
  and the server barges in (its counter moves) or the story is not back within 10 dB of its level within 1 s after
  the sound ends; interrupted / trials (20, 4 per kind; --backchannels N, --quick 5), per kind, and the same on the ``duck_db=0`` server.

    python benchmarks/bargein.py [--path engine|webrtc|all] [--trials 20] [--backchannels 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from _callers import WEBRTC_RATE, CallerLeg, webrtc_leg
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


class RingWatcher(threading.Thread):
    """Polls the egress ring header: when the engine first ducked the output (its gain word below 1) and when it
    bumped the epoch (the flush)."""

    def __init__(self, ring) -> None:
        super().__init__(daemon=True)
        self.ring = ring
        self.start_epoch = ring.epoch
        self.ducked_at: float | None = None
        self.bumped_at: float | None = None
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.is_set() and self.bumped_at is None:
            if self.ducked_at is None and self.ring.gain < 1.0:
                self.ducked_at = time.monotonic()
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
        watcher = RingWatcher(session.rings.egress)
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
        duck_ms = (watcher.ducked_at - onset) * 1000 if watcher.ducked_at is not None else float("nan")
        if watcher.bumped_at is None:
            return {
                "duck_ms": duck_ms,
                "bump_ms": float("nan"),
                "client_stop_ms": float("nan"),
                "turn_based_ms": float("nan"),
            }
        old_turn = d.of(p.ReplyStarted)[0].turn_id
        last_old = max((pl.wall for pl in d.played if pl.turn_id == old_turn), default=onset)
        stopped = [t for t, e in d.timed(p.SpeechStopped) if t >= onset]
        return {
            "duck_ms": duck_ms,
            "bump_ms": (watcher.bumped_at - onset) * 1000,
            "client_stop_ms": max(0.0, last_old - onset) * 1000,
            "turn_based_ms": (stopped[0] - onset) * 1000 if stopped else float("nan"),
        }
    finally:
        await session.close()


# --- at the listener, over WebRTC --------------------------------------------------------------------------------
DUCK_BELOW_DB = 30.0
#: A 10 ms window below this is inaudible (the floor every benchmark here uses for "audible").
AUDIBLE_DBFS = -45.0
#: Below this the old answer is gone, not ducked: the 40 dB duck leaves a -20 dBFS answer near -60 dBFS, and the
#: epoch flush leaves the decoder's digital silence (under -90 dBFS).
FLUSHED_DBFS = -70.0
STOP_HOLD_S = 1.5
#: A backchannel "interrupts" unless the story is back within this long after the sound ends.
RESTORE_WITHIN_S = 1.0
#: "Back to its level": a window within this of the story's level before the sound.
RESTORED_WITHIN_DB = 10.0
#: What the caller says for each kind of backchannel (Piper's text, or "cough"). Piper reads "Mm-hm." as the
#: letters ("em em aitch em"), which no caller says, so the hum is written as its phonemes, a syllabic m, h, m.
BACKCHANNEL_SPEECH = {
    "mm-hm": "[[ ˈm̩hm̩ ]]",
    "uh-huh": "Uh-huh.",
    "yeah": "Yeah.",
    "right": "Right.",
    "cough": "cough",
}
BACKCHANNELS = list(BACKCHANNEL_SPEECH)
NAN = float("nan")


def story_level(leg: CallerLeg, before: float) -> float:
    """The story's level (dBFS, power mean of its audible windows over the 600 ms before ``before``); NaN if
    none was heard."""
    levels = leg.heard.levels or []
    loud = [d for d, t in levels if before - 0.6 <= t < before and d > AUDIBLE_DBFS]
    if not loud:
        return NAN
    return 10 * math.log10(sum(10 ** (d / 10) for d in loud) / len(loud))


def stays_below_ms(leg: CallerLeg, onset: float, floor_db: float) -> float:
    """Onset → the earliest received 10 ms window from which every window is below ``floor_db`` up to
    STOP_HOLD_S after the onset, in ms; NaN when it never stays down."""
    after = [(d, t) for d, t in leg.heard.levels or [] if onset <= t <= onset + STOP_HOLD_S]
    stop = NAN
    for d, t in reversed(after):
        if d >= floor_db:
            break
        stop = t
    return (stop - onset) * 1000


def cough(seed: int, rate: int) -> npt.NDArray[np.int16]:
    """A synthetic cough: 150-250 ms of noise band-limited to 300-3000 Hz, a 8 ms attack and a decay over the
    burst, peaking at -6 dBFS, after 200 ms of silence (as the spoken clips have); deterministic per seed."""
    rng = np.random.default_rng(seed)
    n = int(rng.uniform(0.15, 0.25) * rate)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / rate)
    spectrum[(freqs < 300) | (freqs > 3000)] = 0
    band = np.fft.irfft(spectrum, n)
    t = np.arange(n) / rate
    burst = band * (1 - np.exp(-t / 0.008)) * np.exp(-t / (n / rate / 3))
    burst *= 10 ** (-6 / 20) * 32767 / np.abs(burst).max()
    return np.concatenate([np.zeros(rate // 5), burst]).astype(np.int16)


async def webrtc_trials(
    n: int, n_backchannels: int, *, duck_db: float | None
) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """Interruption trials (until ``n`` barge-ins were counted) and ``n_backchannels`` backchannel trials on one
    server (``duck_db`` None: the default settings)."""
    env = {
        "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
        "LIVEKIT_OMNI_EVENT_LOG": "",
        "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
    }
    if duck_db is not None:
        env["LIVEKIT_OMNI_ENGINE__TURN_TAKING__DUCK_DB"] = str(duck_db)
    name = f"duck_db={duck_db if duck_db is not None else 'default'}"
    server = await asyncio.to_thread(start_server, adapter="cascade", env=env, ready_timeout=400)
    rows: list[dict[str, float]] = []
    bcs: list[dict[str, Any]] = []
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
                f"webrtc trial {len(rows):2d} ({name}): ducked {row['duck_ms']:5.0f} ms, inaudible "
                f"{row['silent_ms']:5.0f} ms, flushed {row['flushed_ms']:5.0f} ms after the onset "
                f"(answer at {row['level_dbfs']:5.1f} dBFS)",
                file=sys.stderr,
                flush=True,
            )
        j = 0
        while len(bcs) < n_backchannels and j < 3 * n_backchannels:
            kind = BACKCHANNELS[len(bcs) % len(BACKCHANNELS)]
            j += 1
            bc = await _backchannel_trial(server, kind, j)
            if bc is None:
                continue
            bcs.append(bc)
            print(
                f"backchannel trial {len(bcs):2d} ({name}): {kind:8} "
                f"{'INTERRUPTED' if bc['interrupted'] else 'kept'} (barge-in {bc['barged']}, story back "
                f"{bc['restored_ms']:5.0f} ms after the sound)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        await asyncio.to_thread(server.stop)
    return rows, bcs


async def _story(leg: CallerLeg) -> float | None:
    """Ask for the story; the time its first audible window was heard, or None."""
    assert leg.send is not None
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
    return None if first is None else first[1]


async def _webrtc_trial(server: ServerProcess, i: int) -> dict[str, float] | None:
    """One call: the story, the interruption half a second into it, the stop measured at the listener; None when
    no answer came or it ended on its own before the barge-in (its silence is no stop)."""
    leg = await webrtc_leg(server, keep_levels=True)
    try:
        first = await _story(leg)
        if first is None:
            print(f"webrtc trial {i}: no answer heard", file=sys.stderr)
            return None
        await asyncio.sleep(max(0.0, first + 0.5 - time.monotonic()))  # half a second of the story
        barge_ins = await asyncio.to_thread(_barge_ins, server.url)
        onset = await leg.say(INTERRUPTIONS[i % len(INTERRUPTIONS)], mark="onset")
        await asyncio.sleep(max(0.0, onset + STOP_HOLD_S + 0.3 - time.monotonic()))
        leg.heard.scan()
        if await asyncio.to_thread(_barge_ins, server.url) == barge_ins:
            print(f"webrtc trial {i}: the answer ended before the barge-in; retried", file=sys.stderr)
            return None
        level = story_level(leg, onset)
        return {
            "duck_ms": stays_below_ms(leg, onset, level - DUCK_BELOW_DB) if level == level else NAN,
            "silent_ms": stays_below_ms(leg, onset, AUDIBLE_DBFS),
            "flushed_ms": stays_below_ms(leg, onset, FLUSHED_DBFS),
            "level_dbfs": level,
        }
    finally:
        for close in leg.closers:
            await close()


async def _backchannel_trial(server: ServerProcess, kind: str, j: int) -> dict[str, Any] | None:
    """One call: the story, a backchannel half a second into it. Interrupted: the server counted a barge-in, or the
    story was not back to its level within RESTORE_WITHIN_S of the sound's end. None: no story came, or it ended
    before the sound did (nothing to interrupt)."""
    leg = await webrtc_leg(server, keep_levels=True)
    assert leg.say_pcm is not None
    try:
        first = await _story(leg)
        if first is None:
            print(f"backchannel trial {j}: no answer heard", file=sys.stderr)
            return None
        await asyncio.sleep(max(0.0, first + 0.5 - time.monotonic()))
        barge_ins = await asyncio.to_thread(_barge_ins, server.url)
        before = time.monotonic()
        if kind == "cough":
            end = await leg.say_pcm(cough(j, WEBRTC_RATE), mark="end")
        else:
            end = await leg.say(BACKCHANNEL_SPEECH[kind], mark="end")
        await asyncio.sleep(max(0.0, end + RESTORE_WITHIN_S + 0.3 - time.monotonic()))
        leg.heard.scan()
        barged = await asyncio.to_thread(_barge_ins, server.url) != barge_ins
        level = story_level(leg, before)
        if level != level:
            return None
        back = [t for d, t in leg.heard.levels or [] if t > end and d >= level - RESTORED_WITHIN_DB]
        restored_ms = (back[0] - end) * 1000 if back else NAN
        if not barged and not back:
            # Neither flushed nor back: the story may simply have ended; more than a second after the sound, any
            # loud window says it was still going.
            later = [t for d, t in leg.heard.levels or [] if t > end + RESTORE_WITHIN_S and d > AUDIBLE_DBFS]
            if not later:
                print(f"backchannel trial {j}: the story ended by itself; retried", file=sys.stderr)
                return None
        interrupted = barged or not (restored_ms <= RESTORE_WITHIN_S * 1000)
        return {"kind": kind, "barged": barged, "restored_ms": restored_ms, "interrupted": interrupted}
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
                f"trial {len(rows):2d}: ducked {r['duck_ms']:6.0f} ms, bump {r['bump_ms']:6.0f} ms, client stop {r['client_stop_ms']:6.0f} ms, "
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
    ap.add_argument(
        "--backchannels", type=int, default=20, help="backchannel trials over WebRTC (default 20)"
    )
    ap.add_argument("--quick", action="store_true", help="5 trials (3 over WebRTC, 5 backchannels)")
    args = ap.parse_args()
    n = 5 if args.quick else args.trials
    t0 = time.monotonic()
    out: dict[str, Any] = {}
    print()
    if args.path in ("engine", "all"):
        rows = await engine_trials(n)
        duck = _finite([r["duck_ms"] for r in rows])
        bump = _finite([r["bump_ms"] for r in rows])
        stop = _finite([r["client_stop_ms"] for r in rows])
        turn = _finite([r["turn_based_ms"] for r in rows])
        print(f"{'engine: barge-in (ms, n=' + str(len(rows)) + ')':44} {'p50':>8} {'p95':>8}")
        print(f"{'speech onset -> output ducked (gain word)':44} {pct(duck, 50):8.0f} {pct(duck, 95):8.0f}")
        print(f"{'speech onset -> epoch bump (the flush)':44} {pct(bump, 50):8.0f} {pct(bump, 95):8.0f}")
        print(f"{'speech onset -> last stale frame':44} {pct(stop, 50):8.0f} {pct(stop, 95):8.0f}")
        print(f"{'baseline: stop at turn end (VAD)':44} {pct(turn, 50):8.0f} {pct(turn, 95):8.0f}")
        print(
            f"missed bumps: {len(rows) - len(bump)}; the flush waits for the interruption's confirmation while "
            "the output is ducked (the duck is what the caller hears; at the listener: --path webrtc)"
        )
        out |= {
            "engine_duck_p50_ms": pct(duck, 50),
            "engine_duck_p95_ms": pct(duck, 95),
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
        nb = 5 if args.quick else args.backchannels
        ducked, bcs = await webrtc_trials(m, nb, duck_db=None)
        flushed, base_bcs = await webrtc_trials(m, len(BACKCHANNELS), duck_db=0.0)
        d = _finite([r["duck_ms"] for r in ducked])
        sil = _finite([r["silent_ms"] for r in ducked])
        fl = _finite([r["flushed_ms"] for r in ducked])
        f = _finite([r["duck_ms"] for r in flushed])
        fsil = _finite([r["silent_ms"] for r in flushed])
        ffl = _finite([r["flushed_ms"] for r in flushed])
        print()
        print(f"{'webrtc: caller onset -> (ms)':44} {'p50':>8} {'p95':>8} {'missed':>7}")
        for label, xs, rows in (
            ("old answer 30 dB down (duck)", d, ducked),
            ("old answer inaudible (< -45 dBFS)", sil, ducked),
            ("old answer flushed (< -70 dBFS)", fl, ducked),
            ("baseline duck_db=0: 30 dB down", f, flushed),
            ("baseline duck_db=0: inaudible", fsil, flushed),
            ("baseline duck_db=0: flushed", ffl, flushed),
        ):
            print(f"{label:44} {pct(xs, 50):8.0f} {pct(xs, 95):8.0f} {len(rows) - len(xs):7d}")
        rate = sum(b["interrupted"] for b in bcs) / len(bcs) if bcs else NAN
        base_rate = sum(b["interrupted"] for b in base_bcs) / len(base_bcs) if base_bcs else NAN
        print()
        print(f"{'backchannels: interrupted / trials':44} {'default':>8} {'duck_db=0':>10}")
        for kind in BACKCHANNELS:
            mine = [b for b in bcs if b["kind"] == kind]
            base = [b for b in base_bcs if b["kind"] == kind]
            print(
                f"{kind:44} {sum(b['interrupted'] for b in mine):3d} / {len(mine):2d} "
                f"{sum(b['interrupted'] for b in base):4d} / {len(base):2d}"
            )
        restored = _finite([b["restored_ms"] for b in bcs if not b["barged"]])
        print(f"{'all (rate)':44} {rate:8.2f} {base_rate:10.2f}")
        print(
            f"story back after a kept backchannel's end: p50 {pct(restored, 50):.0f} ms, max "
            f"{max(restored, default=NAN):.0f} ms"
        )
        print("targets: duck p50 <= 60 ms, inaudible p50 <= 200 ms, backchannels interrupt <= 5 %")
        out |= {
            "duck_p50_ms": pct(d, 50),
            "duck_p95_ms": pct(d, 95),
            "silent_p50_ms": pct(sil, 50),
            "silent_p95_ms": pct(sil, 95),
            "flushed_p50_ms": pct(fl, 50),
            "flushed_p95_ms": pct(fl, 95),
            "backchannel_interrupt_rate": rate,
            "backchannel_trials": len(bcs),
            "backchannel_interrupts_by_kind": {
                k: sum(b["interrupted"] for b in bcs if b["kind"] == k) for k in BACKCHANNELS
            },
            "baseline_backchannel_interrupt_rate": base_rate,
            "webrtc_duck_p50_ms": pct(d, 50),
            "webrtc_duck_p95_ms": pct(d, 95),
            "webrtc_flush_only_p50_ms": pct(f, 50),
            "webrtc_flush_only_silent_p50_ms": pct(fsil, 50),
            "webrtc_duck_missed": len(ducked) - len(d),
            "webrtc_trials": len(ducked),
        }
    print(f"wall time {time.monotonic() - t0:.0f} s")
    finish(out)


if __name__ == "__main__":
    asyncio.run(main())
