"""Voice-to-voice latency of the embedded CPU pipeline: end of caller speech → first reply audio in egress.

10 spoken questions (Piper) go into a real engine process through the ingress ring at real time; a driver that
behaves like the media plane reads egress at real time. Per turn it measures the end of speech (wall time of the
frame that holds the last speech sample) to the first reply audio read from egress, with a per-stage breakdown
from the engine's turn records:

* VAD endpoint: end of speech → the turn is declared over (the ``silence_ms`` setting, 500 ms by default);
* ASR final: whisper on the turn's audio (started speculatively ``speculative_ms`` into the silence);
* thinker first clause: reply started → first speakable clause;
* TTS first chunk: first clause → its audio queued.

Baseline in the same run: the same turns with the stages run one after another (no speculative ASR/reply before
the endpoint, no early first clause), i.e. the naive sum of the stages.

``--backend torch|vllm`` picks the thinker backend (``engine.thinker.backend``) for both modes; the engine's
start-up time (spawn → models loaded) is reported too, since it is the other half of choosing a default.

    python benchmarks/voice_to_voice.py [--turns 10] [--quick] [--backend torch|vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from _common import finish, pct

from engine_bridge import protocol as p
from tests.conftest import connect_engine, spawn_engine
from tests.engine_driver import SessionDriver
from tests.speech_fixtures import speech_bounds_ms, synthesize_speech

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What color is the sky?",
    "What is two plus two?",
    "What is the largest planet?",
    "How many days are in a week?",
    "What is the capital of Italy?",
    "What do bees make?",
    "What is the opposite of hot?",
    "What animal says moo?",
]


async def run_mode(
    name: str, engine_settings: dict[str, Any], turns: int, startup: dict[str, float]
) -> list[dict[str, Any]]:
    t_spawn = time.monotonic()
    eng = spawn_engine(adapter="cascade", **engine_settings)
    rows: list[dict[str, Any]] = []
    try:
        client = await connect_engine(eng)
        startup[name] = time.monotonic() - t_spawn
        session = await client.open_session()
        d = SessionDriver(session)
        await d.run(seconds=1.0)  # settle
        for i in range(turns):
            q = QUESTIONS[i % len(QUESTIONS)]
            audio = synthesize_speech(q, lead_silence_ms=400, tail_silence_ms=0)
            _, end_ms = speech_bounds_ms(audio)
            before = len(d.of(p.ReplyDone))
            marks_before = len(d.marks)
            await asyncio.wait_for(
                d.run(
                    audio, mark_sample=end_ms * 16 - 1, until=lambda d, n=before: len(d.of(p.ReplyDone)) > n
                ),
                60,
            )
            done = d.of(p.ReplyDone)[before]
            speech_end_wall = d.marks[marks_before]
            first = next((pl.wall for pl in d.played if pl.turn_id == done.turn_id), None)
            stats = await session.stats()
            rec = next((r for r in stats.extra["turn_records"] if r["turn_id"] == done.turn_id), {})
            v2v = (first - speech_end_wall) * 1000 if first is not None else float("nan")
            rows.append(
                {
                    "mode": name,
                    "question": q,
                    "reply": done.text,
                    "v2v_ms": v2v,
                    "endpoint_ms": engine_settings.get("turn_taking", {}).get("silence_ms", 500),
                    "asr_ms": rec.get("asr_ms", float("nan")),
                    "thinker_first_clause_ms": rec.get("reply_start_to_first_clause_ms", float("nan")),
                    "tts_first_chunk_ms": rec.get("tts_first_chunk_ms", float("nan")),
                    "speculative": rec.get("speculative"),
                }
            )
            print(
                f"[{name}] turn {i + 1}: {v2v:7.0f} ms  {q!r} -> {done.text!r}", file=sys.stderr, flush=True
            )
            await d.run(seconds=0.6)
        await session.close()
        await client.close()
    finally:
        eng.stop()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    def med(key: str) -> float:
        vals = [r[key] for r in rows if isinstance(r[key], int | float) and r[key] == r[key]]
        return statistics.median(vals) if vals else float("nan")

    v = [r["v2v_ms"] for r in rows if r["v2v_ms"] == r["v2v_ms"]]
    return {
        "p50_ms": pct(v, 50),
        "p95_ms": pct(v, 95),
        "vad_endpoint_ms": med("endpoint_ms"),
        "asr_final_ms": med("asr_ms"),
        "thinker_first_clause_ms": med("thinker_first_clause_ms"),
        "tts_first_chunk_ms": med("tts_first_chunk_ms"),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 turns per mode")
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    args = ap.parse_args()
    turns = 3 if args.quick else args.turns
    t0 = time.monotonic()
    thinker = {"thinker": {"backend": args.backend}}
    startup: dict[str, float] = {}
    overlapped = await run_mode("overlapped", thinker, turns, startup)
    sequential = await run_mode(
        "sequential",
        {**thinker, "turn_taking": {"speculative_ms": 0, "first_clause_words": 0}},
        turns,
        startup,
    )
    a, b = summarize(overlapped), summarize(sequential)
    print()
    print(f"{'voice-to-voice (ms)':28} {'overlapped (default)':>22} {'sequential baseline':>22}")
    for key in (
        "p50_ms",
        "p95_ms",
        "vad_endpoint_ms",
        "asr_final_ms",
        "thinker_first_clause_ms",
        "tts_first_chunk_ms",
    ):
        print(f"{key:28} {a[key]:22.0f} {b[key]:22.0f}")
    print(
        f"(backend {args.backend}; turns per mode: {turns}; engine start-up {startup['overlapped']:.1f} s; "
        f"wall time {time.monotonic() - t0:.0f} s; target p50 <= 1200 ms)"
    )
    finish(
        {
            **a,
            "sequential_p50_ms": b["p50_ms"],
            "sequential_p95_ms": b["p95_ms"],
            "turns": turns,
            "backend": args.backend,
            "engine_startup_s": startup["overlapped"],
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
