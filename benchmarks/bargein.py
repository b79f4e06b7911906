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

  taken over the trials where the server's barge-in counter moved. Every trial started is counted (no retries):
  each has an outcome, ``barged``, ``missed`` (no barge-in counted while the story was still audible or ducked
  at the end of the watch), ``ended`` (no barge-in counted and the output fell to digital silence, below -70
  dBFS, and stayed: the story ended; the Live dialect sends no reply-done event, so this is told from the
  listener's audio, where a ducked story stays near -60 dBFS) or ``no_answer``, and the rates are over all
  trials started. The baseline, same run, is a server started with ``duck_db=0``, which stops only at the epoch
  flush (the barge-in minimum of speech).

  ``backchannel_interrupt_rate``: calls where, half a second into the story, the caller says a backchannel
  (Piper's "mm-hm" (from its phonemes: Piper spells the written word), "Uh-huh.", "Yeah.", "Right.", or a
  synthetic seeded cough: 150-250 ms of band-limited noise)
  and the server barges in (its counter moves), or the story is back within 10 dB of its level only later than
  1 s after the sound ends, or never within the watch while the output is not silent (``stuck``: the duck never
  lifted); interrupted / trials started (20, 4 per kind; --backchannels N, --quick 5), per kind, and the same on
  the ``duck_db=0`` server. A story that fell silent and stayed so is ``ended`` (neither kept nor interrupted),
  one never heard ``no_answer``; both stay in the denominator.

Every session gets storyteller instructions and the story is asked as a commentary ("Tell the caller a story:
..."), a request for length, so the answer runs past the two-sentence rule. Last line: JSON with
``trials_started``, ``missed_bargeins``, ``ended_before_bargein``, ``no_answer``, ``stuck_after_backchannel`` and
the outcome counts per path (``engine_outcomes``, ``webrtc_outcomes``, ``backchannel_outcomes``, ...) beside the
latency percentiles.

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
#: The session's instructions: a storyteller, so that the story runs long enough to be interrupted (the commentary
#: is a request for length too, which lifts the spoken two-sentence rule: ``prompting.asks_for_length``).
STORYTELLER = "You are a storyteller. Always answer at length, in many sentences."
#: Outcomes of an interruption trial (engine path; the WebRTC path says ``ended`` for ``ended_before``: its end is
#: told from the listener's audio, before or during the confirmation).
ENGINE_OUTCOMES = ("barged", "missed", "ended_before", "no_answer")
WEBRTC_OUTCOMES = ("barged", "missed", "ended", "no_answer")
#: Outcomes of a backchannel trial, and those that count as the backchannel interrupting the story.
BACKCHANNEL_OUTCOMES = ("resumed", "barged", "resumed_late", "stuck", "ended", "no_answer")
INTERRUPTED = frozenset({"barged", "resumed_late", "stuck"})


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


async def trial(client, i: int) -> dict[str, Any]:
    """One engine trial, counted whatever happens. ``outcome``: ``barged`` (the epoch bumped: the flush),
    ``missed`` (the story was still going and no bump came within 1.5 s of the interruption's end),
    ``ended_before`` (the engine's ``ReplyDone(interrupted=False)`` for the story came before the flush: before
    the barge-in point, or while the interruption was being confirmed), ``no_answer`` (no second of story played
    within 30 s)."""
    nan = float("nan")
    row: dict[str, Any] = {
        "outcome": "no_answer",
        "duck_ms": nan,
        "bump_ms": nan,
        "client_stop_ms": nan,
        "turn_based_ms": nan,
    }
    session = await client.open_session(p.SessionConfig(instructions=STORYTELLER))
    d = SessionDriver(session)
    try:
        await session.append_text("commentary", STORY)
        try:
            await asyncio.wait_for(d.run(seconds=0, until=lambda d: d.played_seconds() > 1.0), 30)
        except TimeoutError:
            return row
        if d.reply_done():
            row["outcome"] = "ended_before"  # the whole story played before the barge-in point
            return row
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
        row["duck_ms"] = (watcher.ducked_at - onset) * 1000 if watcher.ducked_at is not None else nan
        old_turn = d.of(p.ReplyStarted)[0].turn_id
        if watcher.bumped_at is None:
            ended = any(e.turn_id == old_turn and not e.interrupted for e in d.of(p.ReplyDone))
            row["outcome"] = "ended_before" if ended else "missed"
            return row
        last_old = max((pl.wall for pl in d.played if pl.turn_id == old_turn), default=onset)
        stopped = [t for t, e in d.timed(p.SpeechStopped) if t >= onset]
        row |= {
            "outcome": "barged",
            "bump_ms": (watcher.bumped_at - onset) * 1000,
            "client_stop_ms": max(0.0, last_old - onset) * 1000,
            "turn_based_ms": (stopped[0] - onset) * 1000 if stopped else nan,
        }
        return row
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
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Exactly ``n`` interruption trials and ``n_backchannels`` backchannel trials on one server (``duck_db``
    None: the default settings), every one counted with its outcome (no retries)."""
    env = {
        "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
        "LIVEKIT_OMNI_EVENT_LOG": "",
        "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
    }
    if duck_db is not None:
        env["LIVEKIT_OMNI_ENGINE__TURN_TAKING__DUCK_DB"] = str(duck_db)
    name = f"duck_db={duck_db if duck_db is not None else 'default'}"
    server = await asyncio.to_thread(start_server, adapter="cascade", env=env, ready_timeout=400)
    rows: list[dict[str, Any]] = []
    bcs: list[dict[str, Any]] = []
    try:
        for i in range(1, n + 1):
            # A fresh call per trial, as on the engine path: no trial answers in the shadow of the one before
            # (a greedy model fed the same interruptions drifts into one-line answers too short to cut).
            row = await _webrtc_trial(server, i)
            rows.append(row)
            print(
                f"webrtc trial {i:2d}/{n} ({name}): {row['outcome']:12} {row.get('words_after_onset', 0):3d} words after"
                f" the onset, ducked {row['duck_ms']:5.0f} ms, inaudible "
                f"{row['silent_ms']:5.0f} ms, flushed {row['flushed_ms']:5.0f} ms after the onset "
                f"(answer at {row['level_dbfs']:5.1f} dBFS)",
                file=sys.stderr,
                flush=True,
            )
        for j in range(1, n_backchannels + 1):
            kind = BACKCHANNELS[(j - 1) % len(BACKCHANNELS)]
            bc = await _backchannel_trial(server, kind, j)
            bcs.append(bc)
            print(
                f"backchannel trial {j:2d}/{n_backchannels} ({name}): {kind:8} {bc['outcome']:12} "
                f"{'INTERRUPTED' if bc['interrupted'] else ''} (barge-in {bc['barged']}, {bc.get('words_after_sound', 0)} words"
                f" after the sound, story back "
                f"{bc['restored_ms']:5.0f} ms after the sound, silent from {bc['silent_from_ms']:5.0f} ms)",
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


async def watch_words(leg: CallerLeg, until: float) -> list[float]:
    """Poll the call until ``until``; the times at which output transcript deltas (the story's words, released
    with the audio they describe, ducked or not) were seen."""
    seen = len([k for k, _ in leg.transcripts() if k == "output"])
    times: list[float] = []
    while time.monotonic() < until:
        await asyncio.sleep(0.05)
        n = len([k for k, _ in leg.transcripts() if k == "output"])
        times += [time.monotonic()] * (n - seen)
        seen = n
    return times


def silent_from(leg: CallerLeg, t0: float, t1: float) -> float:
    """The time from which every received 10 ms window up to ``t1`` is digital silence (below FLUSHED_DBFS: the
    story is over, not ducked), searching from ``t0``; NaN when the output is not silent at ``t1``."""
    after = [(d, t) for d, t in leg.heard.levels or [] if t0 <= t <= t1]
    stop = NAN
    for d, t in reversed(after):
        if d >= FLUSHED_DBFS:
            break
        stop = t
    return stop


async def _webrtc_trial(server: ServerProcess, i: int) -> dict[str, Any]:
    """One call: the story, the interruption half a second into it, the stop measured at the listener. Every
    call is counted; ``outcome``:

    * ``barged``: the server's barge-in counter moved (its latencies are the figures);
    * ``missed``: it did not move, and the story was still audible or ducked (above -70 dBFS) at the end of the
      watch, 1.8 s after the onset: the interruption was not taken as one;
    * ``ended``: it did not move and the output fell to digital silence (below -70 dBFS) within the watch and
      stayed there: the story ended by itself before the barge-in was confirmed (``ended_ms``: when, from the
      onset; 0 or less: before the caller spoke). The Live dialect sends no reply-done event, so the end is told
      from what the listener hears: a ducked story stays near -60 dBFS, an ended one is the decoder's silence;
    * ``no_answer``: no story was heard within 30 s."""
    row: dict[str, Any] = {
        "outcome": "no_answer",
        "duck_ms": NAN,
        "silent_ms": NAN,
        "flushed_ms": NAN,
        "level_dbfs": NAN,
        "ended_ms": NAN,
    }
    leg = await webrtc_leg(server, keep_levels=True, instructions=STORYTELLER)
    try:
        first = await _story(leg)
        if first is None:
            return row
        await asyncio.sleep(max(0.0, first + 0.5 - time.monotonic()))  # half a second of the story
        barge_ins = await asyncio.to_thread(_barge_ins, server.url)
        onset = await leg.say(INTERRUPTIONS[i % len(INTERRUPTIONS)], mark="onset")
        watch_end = onset + STOP_HOLD_S + 0.3
        words = await watch_words(leg, watch_end)
        leg.heard.scan()
        level = story_level(leg, onset)
        row["level_dbfs"] = level
        row["words_after_onset"] = len(words)
        if await asyncio.to_thread(_barge_ins, server.url) == barge_ins:
            quiet = silent_from(leg, first, watch_end)
            # Ended: silent at the end of the watch and no word of the story in its last 0.5 s (a ducked story
            # goes on releasing its words; through Opus its audio can fall below -70 dBFS too).
            still_talking = any(t > watch_end - 0.5 for t in words)
            row["outcome"] = "ended" if quiet == quiet and not still_talking else "missed"
            row["ended_ms"] = (quiet - onset) * 1000
            return row
        row |= {
            "outcome": "barged",
            "duck_ms": stays_below_ms(leg, onset, level - DUCK_BELOW_DB) if level == level else NAN,
            "silent_ms": stays_below_ms(leg, onset, AUDIBLE_DBFS),
            "flushed_ms": stays_below_ms(leg, onset, FLUSHED_DBFS),
        }
        return row
    finally:
        for close in leg.closers:
            await close()


async def _backchannel_trial(server: ServerProcess, kind: str, j: int) -> dict[str, Any]:
    """One call: the story, a backchannel half a second into it. Every call is counted; ``outcome``:

    * ``resumed``: no barge-in, and the story was back within 10 dB of its level within RESTORE_WITHIN_S of the
      sound's end (kept);
    * ``barged``: the server counted a barge-in (interrupted);
    * ``resumed_late``: no barge-in, the story came back, but later than RESTORE_WITHIN_S (interrupted);
    * ``stuck``: no barge-in, the story never came back within the watch (RESTORE_WITHIN_S + 0.3 s after the
      sound) and the output is not silent: the duck never lifted (interrupted);
    * ``ended``: no barge-in, the story not back, and the output fell to digital silence (below -70 dBFS) and
      stayed: the story ended by itself (neither kept nor interrupted; ``silent_from_ms``: when, from the
      sound's end);
    * ``no_answer``: no story was heard, or none before the sound (neither)."""
    row: dict[str, Any] = {
        "kind": kind,
        "outcome": "no_answer",
        "barged": False,
        "restored_ms": NAN,
        "silent_from_ms": NAN,
        "interrupted": False,
    }
    leg = await webrtc_leg(server, keep_levels=True, instructions=STORYTELLER)
    assert leg.say_pcm is not None
    try:
        first = await _story(leg)
        if first is None:
            return row
        await asyncio.sleep(max(0.0, first + 0.5 - time.monotonic()))
        barge_ins = await asyncio.to_thread(_barge_ins, server.url)
        before = time.monotonic()
        if kind == "cough":
            end = await leg.say_pcm(cough(j, WEBRTC_RATE), mark="end")
        else:
            end = await leg.say(BACKCHANNEL_SPEECH[kind], mark="end")
        watch_end = end + RESTORE_WITHIN_S + 0.3
        words = await watch_words(leg, watch_end)
        row["words_after_sound"] = len(words)
        leg.heard.scan()
        barged = await asyncio.to_thread(_barge_ins, server.url) != barge_ins
        row["barged"] = barged
        level = story_level(leg, before)
        if level != level:
            return row  # nothing audible before the sound: no story to keep
        back = [t for d, t in leg.heard.levels or [] if t > end and d >= level - RESTORED_WITHIN_DB]
        row["restored_ms"] = (back[0] - end) * 1000 if back else NAN
        quiet = silent_from(leg, end, watch_end)
        row["silent_from_ms"] = (quiet - end) * 1000
        if barged:
            row["outcome"] = "barged"
        elif back:
            row["outcome"] = "resumed" if row["restored_ms"] <= RESTORE_WITHIN_S * 1000 else "resumed_late"
        else:
            still_talking = any(t > watch_end - 0.5 for t in words)
            row["outcome"] = "ended" if quiet == quiet and not still_talking else "stuck"
        row["interrupted"] = row["outcome"] in INTERRUPTED
        return row
    finally:
        for close in leg.closers:
            await close()


def _barge_ins(url: str) -> float:
    """The server's count of caller barge-ins (its /metrics)."""
    return sum(v for (name, _), v in scrape(url).items() if name == "livekit_omni_barge_ins_total")


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if x == x]


async def engine_trials(n: int) -> list[dict[str, Any]]:
    """Exactly ``n`` engine trials, each counted with its outcome (no retries)."""
    eng = spawn_engine(adapter="cascade")
    rows: list[dict[str, Any]] = []
    try:
        client = await connect_engine(eng)
        for i in range(n):
            r = await trial(client, i)
            rows.append(r)
            print(
                f"trial {i + 1:2d}/{n}: {r['outcome']:12} ducked {r['duck_ms']:6.0f} ms, bump {r['bump_ms']:6.0f} ms, "
                f"client stop {r['client_stop_ms']:6.0f} ms, turn-based {r['turn_based_ms']:6.0f} ms",
                file=sys.stderr,
                flush=True,
            )
        await client.close()
    finally:
        eng.stop()
    return rows


def outcomes(rows: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, int]:
    """How many of ``rows`` had each outcome (every name present, zeros included)."""
    return {k: sum(r["outcome"] == k for r in rows) for k in names}


def _rate(k: int, n: int) -> float:
    return k / n if n else NAN


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
    started = missed = ended = no_answer = 0
    print()
    if args.path in ("engine", "all"):
        rows = await engine_trials(n)
        barged = [r for r in rows if r["outcome"] == "barged"]
        duck = _finite([r["duck_ms"] for r in rows])
        bump = _finite([r["bump_ms"] for r in barged])
        stop = _finite([r["client_stop_ms"] for r in barged])
        turn = _finite([r["turn_based_ms"] for r in barged])
        counts = outcomes(rows, ENGINE_OUTCOMES)
        print(
            f"{'engine: barge-in (ms, ' + str(len(rows)) + ' trials started)':44} {'p50':>8} {'p95':>8} {'n':>4}"
        )
        for label, xs in (
            ("speech onset -> output ducked (gain word)", duck),
            ("speech onset -> epoch bump (the flush)", bump),
            ("speech onset -> last stale frame", stop),
            ("baseline: stop at turn end (VAD)", turn),
        ):
            print(f"{label:44} {pct(xs, 50):8.0f} {pct(xs, 95):8.0f} {len(xs):4d}")
        print(
            "outcomes of the trials started: "
            + ", ".join(f"{k} {v} ({_rate(v, len(rows)):.2f})" for k, v in counts.items())
            + "; the flush waits for the interruption's confirmation while the output is ducked (the duck is "
            "what the caller hears; at the listener: --path webrtc)"
        )
        started += len(rows)
        missed += counts["missed"]
        ended += counts["ended_before"]
        no_answer += counts["no_answer"]
        out |= {
            "engine_duck_p50_ms": pct(duck, 50),
            "engine_duck_p95_ms": pct(duck, 95),
            "p50_ms": pct(bump, 50),
            "p95_ms": pct(bump, 95),
            "client_stop_p50_ms": pct(stop, 50),
            "client_stop_p95_ms": pct(stop, 95),
            "turn_based_stop_p50_ms": pct(turn, 50),
            "engine_trials_started": len(rows),
            "engine_outcomes": counts,
            "engine_bargein_rate": _rate(counts["barged"], len(rows)),
            "missed": counts["missed"],
            "trials": len(rows),
        }
    if args.path in ("webrtc", "all"):
        m = 3 if args.quick else min(n, 10)
        nb = 5 if args.quick else args.backchannels
        ducked, bcs = await webrtc_trials(m, nb, duck_db=None)
        flushed, base_bcs = await webrtc_trials(m, len(BACKCHANNELS), duck_db=0.0)
        got = [r for r in ducked if r["outcome"] == "barged"]
        base_got = [r for r in flushed if r["outcome"] == "barged"]
        d = _finite([r["duck_ms"] for r in got])
        sil = _finite([r["silent_ms"] for r in got])
        fl = _finite([r["flushed_ms"] for r in got])
        f = _finite([r["duck_ms"] for r in base_got])
        fsil = _finite([r["silent_ms"] for r in base_got])
        ffl = _finite([r["flushed_ms"] for r in base_got])
        counts = outcomes(ducked, WEBRTC_OUTCOMES)
        base_counts = outcomes(flushed, WEBRTC_OUTCOMES)
        print()
        print(
            f"{'webrtc: caller onset -> (ms)':44} {'p50':>8} {'p95':>8} {'n':>4} {'not there':>10}"
            "   (n: barged trials with the figure; not there: started trials without it)"
        )
        for label, xs, rows in (
            ("old answer 30 dB down (duck)", d, ducked),
            ("old answer inaudible (< -45 dBFS)", sil, ducked),
            ("old answer flushed (< -70 dBFS)", fl, ducked),
            ("baseline duck_db=0: 30 dB down", f, flushed),
            ("baseline duck_db=0: inaudible", fsil, flushed),
            ("baseline duck_db=0: flushed", ffl, flushed),
        ):
            print(f"{label:44} {pct(xs, 50):8.0f} {pct(xs, 95):8.0f} {len(xs):4d} {len(rows) - len(xs):10d}")
        print()
        print(f"{'interruption trials: outcome / started':44} {'default':>12} {'duck_db=0':>12}")
        for k in WEBRTC_OUTCOMES:
            print(
                f"{k:44} {counts[k]:4d} / {len(ducked):2d} ({_rate(counts[k], len(ducked)):.2f})"
                f" {base_counts[k]:4d} / {len(flushed):2d}"
            )
        bc_counts = outcomes(bcs, BACKCHANNEL_OUTCOMES)
        base_bc_counts = outcomes(base_bcs, BACKCHANNEL_OUTCOMES)
        rate = _rate(sum(b["interrupted"] for b in bcs), len(bcs))
        base_rate = _rate(sum(b["interrupted"] for b in base_bcs), len(base_bcs))
        print()
        print(f"{'backchannels: outcome / started':44} {'default':>12} {'duck_db=0':>12}")
        for k in BACKCHANNEL_OUTCOMES:
            tag = " (interrupted)" if k in INTERRUPTED else ""
            print(
                f"{k + tag:44} {bc_counts[k]:4d} / {len(bcs):2d} ({_rate(bc_counts[k], len(bcs)):.2f})"
                f" {base_bc_counts[k]:4d} / {len(base_bcs):2d}"
            )
        print(f"{'by kind: interrupted / started':44}")
        for kind in BACKCHANNELS:
            mine = [b for b in bcs if b["kind"] == kind]
            base = [b for b in base_bcs if b["kind"] == kind]
            print(
                f"{'  ' + kind:44} {sum(b['interrupted'] for b in mine):4d} / {len(mine):2d}"
                f"        {sum(b['interrupted'] for b in base):4d} / {len(base):2d}"
            )
        restored = _finite([b["restored_ms"] for b in bcs if b["outcome"] == "resumed"])
        print(f"{'interrupt rate (over all started)':44} {rate:12.2f} {base_rate:12.2f}")
        print(
            f"story back after a kept backchannel's end: p50 {pct(restored, 50):.0f} ms, max "
            f"{max(restored, default=NAN):.0f} ms"
        )
        print("targets: duck p50 <= 60 ms, inaudible p50 <= 200 ms, backchannels interrupt <= 5 %")
        started += len(ducked) + len(flushed) + len(bcs) + len(base_bcs)
        missed += counts["missed"] + base_counts["missed"]
        ended += counts["ended"] + base_counts["ended"] + bc_counts["ended"] + base_bc_counts["ended"]
        no_answer += (
            counts["no_answer"]
            + base_counts["no_answer"]
            + bc_counts["no_answer"]
            + base_bc_counts["no_answer"]
        )
        out |= {
            "duck_p50_ms": pct(d, 50),
            "duck_p95_ms": pct(d, 95),
            "silent_p50_ms": pct(sil, 50),
            "silent_p95_ms": pct(sil, 95),
            "flushed_p50_ms": pct(fl, 50),
            "flushed_p95_ms": pct(fl, 95),
            "webrtc_bargein_rate": _rate(counts["barged"], len(ducked)),
            "webrtc_outcomes": counts,
            "webrtc_baseline_outcomes": base_counts,
            "backchannel_interrupt_rate": rate,
            "backchannel_trials": len(bcs),
            "backchannel_outcomes": bc_counts,
            "backchannel_interrupts_by_kind": {
                k: sum(b["interrupted"] for b in bcs if b["kind"] == k) for k in BACKCHANNELS
            },
            "baseline_backchannel_interrupt_rate": base_rate,
            "baseline_backchannel_outcomes": base_bc_counts,
            "stuck_after_backchannel": bc_counts["stuck"],
            "webrtc_duck_p50_ms": pct(d, 50),
            "webrtc_duck_p95_ms": pct(d, 95),
            "webrtc_flush_only_p50_ms": pct(f, 50),
            "webrtc_flush_only_silent_p50_ms": pct(fsil, 50),
            "webrtc_duck_missed": len(ducked) - len(d),
            "webrtc_trials": len(ducked),
        }
    out |= {
        "trials_started": started,
        "missed_bargeins": missed,
        "ended_before_bargein": ended,
        "no_answer": no_answer,
    }
    print(
        f"\nall paths: {started} trials started, {missed} missed barge-ins, {ended} answers that ended by themselves,"
        f" {no_answer} without an answer"
        + (
            f", {out['stuck_after_backchannel']} stuck after a backchannel"
            if "stuck_after_backchannel" in out
            else ""
        )
    )
    print(f"wall time {time.monotonic() - t0:.0f} s")
    finish(out)


if __name__ == "__main__":
    asyncio.run(main())
