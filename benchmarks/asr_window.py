"""Whisper's encoder window: the fixed 30 s (``full``) against one fitted to the utterance (``fit``), on the same
utterances in the same run.

The utterances are benchmarks/answer_quality.py's spoken set (its 20 questions, the 5 "My name is <Name>. <question>"
turns and "What is my name?"), synthesised by Piper and shaped like what the VAD hands the ASR worker (300 ms of
prefix padding, 200 ms of tail, -50 dBFS background noise). Each utterance goes through both windows back to back,
alternating which runs first, so the machine's load of the moment hits both alike.

Per window:

* ``asr_final_ms``: the wall time of one transcription (what the engine's turn records call ``asr_ms``, the
  "ASR final" stage of benchmarks/voice_to_voice.py), median and p95;
* ``cpu_s``: CPU seconds of the process per transcription (whisper runs one thread; nothing else runs meanwhile);
* word errors against the text that was spoken (edit distance over normalised words), and the count of
  utterances heard exactly.

The other way to cut the stage, transcribing the utterance while it is spoken and only its tail at the endpoint,
is measured too, as the cost of the tail pass that approach leaves at the endpoint: the last 1 s of each
utterance through the 30 s window, with the words before it as the prompt (``tail_full_window_ms``).

    python benchmarks/asr_window.py [--quick] [--repeats N]

Last stdout line: one JSON object with ``asr_final_ms_full``, ``asr_final_ms_fit``, ``cpu_s_full``,
``cpu_s_fit``, ``word_errors_full``, ``word_errors_fit``, ``words``, ``wer_full``, ``wer_fit``,
``tail_full_window_ms`` and the per-utterance rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import finish, pct
from answer_quality import EXCHANGES, NAME_QUESTION, QUESTIONS

from engine_bridge.formats import ENGINE_INPUT_RATE
from engine_bridge.speech.asr import AsrWindow, Transcript, WhisperTranscriber
from engine_bridge.speech.text import normalize_text
from tests.speech_fixtures import synthesize_speech

WINDOWS: tuple[AsrWindow, ...] = ("full", "fit")


def utterances() -> list[str]:
    return [q for q, _ in QUESTIONS] + [f"My name is {n}. {q}" for n, q, _ in EXCHANGES] + [NAME_QUESTION]


def word_errors(reference: str, heard: str) -> int:
    """Word-level edit distance (substitutions, insertions, deletions) between the normalised texts."""
    ref, hyp = normalize_text(reference).split(), normalize_text(heard).split()
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        diag, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diag + (r != h))
    return row[-1]


def timed(asr: WhisperTranscriber, pcm: Any) -> tuple[Transcript, float]:
    c0 = time.process_time()
    tr = asr.transcribe(pcm)
    return tr, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 utterances, 1 repeat (smoke test)")
    ap.add_argument("--repeats", type=int, default=2, help="transcriptions per utterance and window")
    args = ap.parse_args()
    texts = utterances()
    repeats = args.repeats
    if args.quick:
        texts, repeats = texts[:3] + texts[-1:], 1

    t0 = time.monotonic()
    models = {w: WhisperTranscriber(threads=1, window=w) for w in WINDOWS}
    tail_asr = WhisperTranscriber(threads=1, window="full")
    for asr in (*models.values(), tail_asr):
        asr.warmup()
    clips = [synthesize_speech(t, lead_silence_ms=300, tail_silence_ms=200, noise_db=-50.0) for t in texts]

    rows: list[dict[str, Any]] = []
    wall: dict[str, list[float]] = {w: [] for w in WINDOWS}
    cpu: dict[str, list[float]] = {w: [] for w in WINDOWS}
    tails: list[float] = []
    for i, (text, pcm) in enumerate(zip(texts, clips, strict=True)):
        row: dict[str, Any] = {"text": text, "audio_ms": len(pcm) * 1000 // ENGINE_INPUT_RATE}
        for k in range(repeats):
            order = WINDOWS if (i + k) % 2 == 0 else WINDOWS[::-1]
            for w in order:
                tr, cpu_s = timed(models[w], pcm)
                wall[w].append(tr.elapsed_ms)
                cpu[w].append(cpu_s)
                row[f"heard_{w}"] = tr.text
                row[f"window_ms_{w}"] = tr.window_ms
                row.setdefault(f"ms_{w}", []).append(round(tr.elapsed_ms, 1))
        for w in WINDOWS:
            row[f"errors_{w}"] = word_errors(text, row[f"heard_{w}"])
        # The incremental approach's endpoint work: the last second, the words before it as the prompt.
        words = text.split()
        tail_asr.initial_prompt = " ".join(words[: max(0, len(words) - 2)]) or None
        tail = tail_asr.transcribe(pcm[-ENGINE_INPUT_RATE:])
        tails.append(tail.elapsed_ms)
        row["tail_full_window_ms"] = round(tail.elapsed_ms, 1)
        rows.append(row)
        print(
            f"[{i + 1}/{len(texts)}] {text!r}: full {row['ms_full']} fit {row['ms_fit']} ms",
            file=sys.stderr,
            flush=True,
        )

    n_words = sum(len(normalize_text(t).split()) for t in texts)
    errors = {w: sum(r[f"errors_{w}"] for r in rows) for w in WINDOWS}
    exact = {w: sum(r[f"errors_{w}"] == 0 for r in rows) for w in WINDOWS}

    print(f"{'utterance':48} {'audio':>6} {'full ms':>8} {'fit ms':>7}  heard (fit window, where it differs)")
    for r in rows:
        diff = "" if r["heard_fit"] == r["heard_full"] else f"{r['heard_fit']!r} vs full {r['heard_full']!r}"
        print(
            f"{r['text'][:48]:48} {r['audio_ms']:6d} {min(r['ms_full']):8.0f} {min(r['ms_fit']):7.0f}  {diff}"
        )
    print()
    print(f"{'window':8} {'asr p50 ms':>10} {'p95 ms':>7} {'CPU-s/utt':>9} {'word errors':>12} {'exact':>6}")
    for w in WINDOWS:
        print(
            f"{w:8} {pct(wall[w], 50):10.0f} {pct(wall[w], 95):7.0f} {pct(cpu[w], 50):9.3f} "
            f"{errors[w]:>6}/{n_words:<5} {exact[w]:>3}/{len(rows)}"
        )
    print(
        f"tail pass of the incremental approach (last 1 s, 30 s window): p50 {pct(tails, 50):.0f} ms; "
        f"wall {time.monotonic() - t0:.0f} s (the machine's load of the moment is in every figure)"
    )
    finish(
        {
            "asr_final_ms_full": pct(wall["full"], 50),
            "asr_final_ms_fit": pct(wall["fit"], 50),
            "asr_final_p95_ms_full": pct(wall["full"], 95),
            "asr_final_p95_ms_fit": pct(wall["fit"], 95),
            "cpu_s_full": pct(cpu["full"], 50),
            "cpu_s_fit": pct(cpu["fit"], 50),
            "word_errors_full": errors["full"],
            "word_errors_fit": errors["fit"],
            "words": n_words,
            "wer_full": errors["full"] / n_words,
            "wer_fit": errors["fit"] / n_words,
            "exact_full": exact["full"],
            "exact_fit": exact["fit"],
            "utterances": len(rows),
            "repeats": repeats,
            "tail_full_window_ms": pct(tails, 50),
            "quick": args.quick,
            "rows": rows,
        }
    )


if __name__ == "__main__":
    main()
