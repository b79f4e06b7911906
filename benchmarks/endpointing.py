"""False cut-offs: does the engine end the caller's turn in a pause in the middle of a sentence?

Each utterance is a question spoken in two parts with silence between them ("What is the capital" … "of
France?"): Piper speaks each part, the parts are cut at their first and last audible sample (the 10 ms windows
above -45 dBFS) and joined with exactly ``pause`` ms of digital silence. The utterances go to a real engine
process (the embedded CPU pipeline, ``make serve``'s defaults) at real time, one session per pause length, each
utterance followed by silence until its answer has played.

A **cut-off** is an utterance the engine split: more than one caller turn ended (``SpeechStopped``) between its
first sample and its answer. The issue's figure is the rate at a 300 ms pause (target <= 10 %). In the same run:

* no pause (the parts joined directly): the baseline, no turn should end early;
* a pause longer than the endpoint silence (``engine.turn_taking.silence_ms``, 500 ms): the control, every
  utterance should be cut, which shows the count sees a cut-off when there is one.

    python benchmarks/endpointing.py [--pauses 0 300 900] [--quick]

Last line: JSON with ``false_cutoff_rate_300ms`` and the rate and counts per pause.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
import numpy.typing as npt
from _common import finish

from engine_bridge import protocol as p
from tests.conftest import connect_engine, spawn_engine
from tests.engine_driver import SessionDriver
from tests.speech_fixtures import speech_bounds_ms, synthesize_speech

RATE = 16_000
#: Questions split where a caller might stop to think.
SPLIT_QUESTIONS = [
    ("What is the capital", "of France?"),
    ("How many legs", "does a spider have?"),
    ("What color", "is the sky?"),
    ("What is two", "plus two?"),
    ("What is the largest", "planet?"),
    ("How many days", "are in a week?"),
    ("What is the capital", "of Italy?"),
    ("What do bees", "make?"),
    ("What is the opposite", "of hot?"),
    ("What animal", "says moo?"),
]


def audible(text: str) -> npt.NDArray[np.int16]:
    pcm = synthesize_speech(text, rate=RATE, lead_silence_ms=0, tail_silence_ms=0)
    start_ms, end_ms = speech_bounds_ms(pcm, RATE)
    return pcm[start_ms * RATE // 1000 : end_ms * RATE // 1000]


def utterance(first: str, second: str, pause_ms: int) -> npt.NDArray[np.int16]:
    lead = np.zeros(RATE * 400 // 1000, np.int16)
    gap = np.zeros(RATE * pause_ms // 1000, np.int16)
    return np.concatenate([lead, audible(first), gap, audible(second)])


async def run_pause(pause_ms: int, questions: list[tuple[str, str]]) -> list[dict[str, object]]:
    eng = spawn_engine(adapter="cascade")
    rows: list[dict[str, object]] = []
    try:
        client = await connect_engine(eng)
        session = await client.open_session()
        d = SessionDriver(session)
        await d.run(seconds=1.0)
        for first, second in questions:
            stopped_before = len(d.of(p.SpeechStopped))
            done_before = len(d.of(p.ReplyDone))
            audio = utterance(first, second, pause_ms)
            # Until an answer has finished after the whole utterance was heard (a cut-off answers the first part,
            # is barged in by the second part, and the second part is answered too).
            await asyncio.wait_for(
                d.run(
                    audio,
                    until=lambda d, s=stopped_before, r=done_before: (
                        len(d.of(p.ReplyDone)) > r
                        and not d.of(p.ReplyDone)[-1].interrupted
                        and len(d.of(p.SpeechStopped)) > s
                    ),
                ),
                90,
            )
            await d.run(seconds=0.8)  # the answer plays out; no caller speech
            turns = len(d.of(p.SpeechStopped)) - stopped_before
            rows.append(
                {"pause_ms": pause_ms, "question": f"{first} … {second}", "turns": turns, "cut": turns > 1}
            )
            print(
                f"pause {pause_ms:4d} ms: {first!r} … {second!r}: {turns} caller turn(s)"
                f"{'  <- cut off' if turns > 1 else ''}",
                file=sys.stderr,
                flush=True,
            )
        await session.close()
        await client.close()
    finally:
        eng.stop()
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pauses", type=int, nargs="+", default=[0, 300, 900], help="pause lengths in ms")
    ap.add_argument("--quick", action="store_true", help="3 questions per pause")
    args = ap.parse_args()
    questions = SPLIT_QUESTIONS[:3] if args.quick else SPLIT_QUESTIONS
    t0 = time.monotonic()
    per_pause: dict[int, list[dict[str, object]]] = {}
    for pause in args.pauses:
        per_pause[pause] = await run_pause(pause, questions)
    print()
    print(f"{'pause between the parts':28} {'utterances':>10} {'cut off':>8} {'rate':>6}  role")
    roles = {0: "baseline (no pause)", 300: "the issue's figure"}
    out: dict[str, object] = {
        "false_cutoff_rate_300ms": float("nan"),
        "questions": len(questions),
        "pauses": {},
    }
    for pause, rows in per_pause.items():
        cut = sum(1 for r in rows if r["cut"])
        rate = cut / len(rows) if rows else float("nan")
        role = roles.get(pause, "control (longer than the endpoint)" if pause > 500 else "")
        print(f"{str(pause) + ' ms':28} {len(rows):10d} {cut:8d} {rate:6.0%}  {role}")
        out["pauses"][str(pause)] = {"utterances": len(rows), "cut_off": cut, "rate": rate}  # type: ignore[index]
        if pause == 300:
            out["false_cutoff_rate_300ms"] = rate
    print(
        f"(engine endpoint: 500 ms of silence; wall time {time.monotonic() - t0:.0f} s; target at 300 ms <= 10 %)"
    )
    finish(out)


if __name__ == "__main__":
    asyncio.run(main())
