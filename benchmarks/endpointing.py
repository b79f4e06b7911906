"""End of turn: does the engine cut a caller off in a pause mid-sentence, and how soon does it end a finished turn?

Each utterance is a question spoken in two parts with silence between them ("What is the capital" … "of
France?"): Piper speaks each part, the parts are cut at their first and last audible sample (the 10 ms windows
above -45 dBFS) and joined with exactly ``pause`` ms of digital silence. Each utterance goes to a real engine
process (the embedded CPU pipeline, ``make serve``'s defaults: the semantic end-of-turn model) at real time, in a
fresh session, followed by silence until its answer has played.

* A **cut-off**: answer audio played before the caller's last word (the frame holding the last audible sample).
* **Right**: the answer holds the question's keyword ("paris" for the capital of France).
* **Turn end**: the caller's last audible sample to the engine's ``SpeechStopped`` (wall clock), for the questions
  without a pause, with the default (the end-of-turn model) and, in the same run and engine, with a session that
  ends turns by silence alone (``end_of_turn = "silence"``, 500 ms: the engine before the model).
* The end-of-turn model's cost per pause (its pass on the worker thread), from the session stats.

    python benchmarks/endpointing.py [--pauses 0 300 600 1000 1500] [--quick]

Last line: JSON with ``false_cutoff_rate_at_600ms``, ``false_cutoff_rate_at_1000ms``,
``false_cutoff_rate_at_1500ms``, ``right_rate_unpaused``, ``right_rate_at_1000ms``, ``complete_turn_end_ms_p50``,
``complete_turn_end_ms_p50_silence_only``, ``eot_model_ms_p50`` and the counts per pause.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import finish, pct

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from engine_bridge.speech.text import normalize_text
from tests.conftest import connect_engine, spawn_engine
from tests.engine_driver import SessionDriver
from tests.speech_fixtures import speech_bounds_ms, synthesize_speech

RATE = 16_000
LEAD_MS = 400
#: Questions split where a caller might stop to think, and a word the right answer holds.
SPLIT_QUESTIONS: list[tuple[str, str, tuple[str, ...]]] = [
    ("What is the capital", "of France?", ("paris",)),
    ("How many legs", "does a spider have?", ("eight", "8")),
    ("What color", "is the sky?", ("blue",)),
    ("What is two", "plus two?", ("four", "4")),
    ("What is the largest", "planet?", ("jupiter",)),
    ("How many days", "are in a week?", ("seven", "7")),
    ("What is the capital", "of Italy?", ("rome",)),
    ("What do bees", "make?", ("honey",)),
    ("What is the opposite", "of hot?", ("cold",)),
    ("What animal", "says moo?", ("cow",)),
]
SILENCE_ONLY = p.TurnTakingConfig(end_of_turn="silence")


def audible(text: str) -> npt.NDArray[np.int16]:
    pcm = synthesize_speech(text, rate=RATE, lead_silence_ms=0, tail_silence_ms=0)
    start_ms, end_ms = speech_bounds_ms(pcm, RATE)
    return pcm[start_ms * RATE // 1000 : end_ms * RATE // 1000]


def utterance(first: str, second: str, pause_ms: int) -> npt.NDArray[np.int16]:
    lead = np.zeros(RATE * LEAD_MS // 1000, np.int16)
    gap = np.zeros(RATE * pause_ms // 1000, np.int16)
    return np.concatenate([lead, audible(first), gap, audible(second)])


async def ask(
    client: EngineClient,
    first: str,
    second: str,
    keys: tuple[str, ...],
    pause_ms: int,
    tt: p.TurnTakingConfig,
) -> dict[str, Any]:
    """One utterance in a fresh session: cut off, right, turn end, the model's cost."""
    session = await client.open_session(p.SessionConfig(turn_taking=tt))
    d = SessionDriver(session)
    await d.run(seconds=0.3)
    audio = utterance(first, second, pause_ms)
    # Until an answer has finished after the whole utterance was heard (a cut-off answers the first part, is
    # barged in by the second part, and the second part is answered too).
    await asyncio.wait_for(
        d.run(
            audio,
            mark_sample=audio.shape[0] - 1,
            until=lambda d: any(not e.interrupted for e in d.of(p.ReplyDone)),
        ),
        90,
    )
    await d.run(seconds=0.5)
    last_word = d.marks[-1]
    answered = [e for e in d.of(p.ReplyDone) if not e.interrupted]
    answer = normalize_text(answered[-1].text) if answered else ""
    stopped = d.timed(p.SpeechStopped)
    stats = await session.stats()
    await session.close()
    return {
        "pause_ms": pause_ms,
        "question": f"{first} … {second}",
        "turns": len(stopped),
        "cut": any(pl.wall < last_word for pl in d.played),
        "right": any(k in answer.split() for k in keys),
        "answer": answer,
        "turn_end_ms": (stopped[-1][0] - last_word) * 1000 if stopped else float("nan"),
        "eot_ms": list(stats.extra.get("eot_ms", [])),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pauses", type=int, nargs="+", default=[0, 300, 600, 1000, 1500], help="pauses in ms")
    ap.add_argument("--quick", action="store_true", help="2 questions per pause")
    args = ap.parse_args()
    questions = SPLIT_QUESTIONS[:2] if args.quick else SPLIT_QUESTIONS
    t0 = time.monotonic()
    runs: list[tuple[str, int, p.TurnTakingConfig]] = [
        ("model", pause, p.TurnTakingConfig()) for pause in args.pauses
    ]
    runs.append(("silence", 0, SILENCE_ONLY))
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    eng = spawn_engine(adapter="cascade")
    try:
        client = await connect_engine(eng)
        for mode, pause, tt in runs:
            for first, second, keys in questions:
                row = await ask(client, first, second, keys, pause, tt)
                rows.setdefault((mode, pause), []).append(row)
                print(
                    f"{mode:7} pause {pause:4d} ms: {row['question']!r}: {row['turns']} turn(s), "
                    f"turn end {row['turn_end_ms']:.0f} ms{'  <- cut off' if row['cut'] else ''}"
                    f"{'' if row['right'] else '  (wrong)'}: {row['answer'][:60]!r}",
                    file=sys.stderr,
                    flush=True,
                )
        await client.close()
    finally:
        eng.stop()
    print()
    print(
        f"{'end of turn':9} {'pause':>7} {'utterances':>10} {'cut off':>8} {'right':>6} {'turn end p50':>13}"
    )
    out: dict[str, Any] = {"questions": len(questions), "load_avg_1m": os.getloadavg()[0], "pauses": {}}
    for (mode, pause), rs in rows.items():
        cut = sum(r["cut"] for r in rs) / len(rs)
        right = sum(r["right"] for r in rs) / len(rs)
        end_p50 = pct([r["turn_end_ms"] for r in rs if r["turn_end_ms"] == r["turn_end_ms"]], 50)
        print(f"{mode:9} {pause:5d} ms {len(rs):10d} {cut:8.0%} {right:6.0%} {end_p50:10.0f} ms")
        key = f"{mode}_{pause}ms"
        out["pauses"][key] = {
            "utterances": len(rs),
            "cut_off_rate": cut,
            "right_rate": right,
            "turn_end_p50": end_p50,
        }
        if mode == "model":
            out[f"false_cutoff_rate_at_{pause}ms"] = cut
            if pause == 0:
                out["right_rate_unpaused"] = right
                out["complete_turn_end_ms_p50"] = end_p50
            else:
                out[f"right_rate_at_{pause}ms"] = right
        else:
            out["complete_turn_end_ms_p50_silence_only"] = end_p50
            out["right_rate_unpaused_silence_only"] = right
    eot = [ms for rs in rows.values() for r in rs for ms in r["eot_ms"]]
    out["eot_model_ms_p50"] = pct(eot, 50)
    out["eot_model_ms_p95"] = pct(eot, 95)
    out["eot_model_calls"] = len(eot)
    print(
        f"(end-of-turn model: {len(eot)} passes, p50 {out['eot_model_ms_p50']:.0f} ms; wall time "
        f"{time.monotonic() - t0:.0f} s; load average {out['load_avg_1m']:.2f}; targets: cut-offs <= 10 % at 600 and "
        "1000 ms, right at 1000 ms within 0.1 of unpaused, turn end below silence-only)"
    )
    finish(out)


if __name__ == "__main__":
    asyncio.run(main())
