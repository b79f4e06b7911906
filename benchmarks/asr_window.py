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

Where the VAD cuts the utterance: it cuts a turn on its 30 ms frames, so the speech starts a little earlier or later
in the segment from call to call, and tiny.en in the fitted window heard some words differently 20 ms apart
("France" / "friends"). Each utterance is therefore also cut from one stream with its start shifted by -80 to +80 ms
in 20 ms steps (its lead of 300 ms made 220-380 ms), in three conditions (CONDITIONS: -50 dBFS noise, digital
silence, and digital silence with the segment ending where the speech's level falls), and transcribed in the fitted
window as the segment was cut (``before``) and as the product hands it over (``after``: from ONSET_LEAD_MS before
the speech to OFFSET_TAIL_MS after it): word errors per shift, and the wall time per transcription. Other onset
leads (``--leads``) are measured at the unshifted cut.

    python benchmarks/asr_window.py [--quick] [--repeats N] [--leads 240,360] [--shifts-only]

Last stdout line: one JSON object with ``asr_final_ms_full``, ``asr_final_ms_fit``, ``cpu_s_full``,
``cpu_s_fit``, ``word_errors_full``, ``word_errors_fit``, ``words``, ``wer_full``, ``wer_fit``,
``tail_full_window_ms`` and the per-utterance rows (not with ``--shifts-only``); ``shifts_ms``,
``word_errors_by_shift_before`` and ``word_errors_by_shift_after`` (summed over the conditions, ``words`` each),
``word_errors_by_shift_<condition>``, ``word_errors_by_lead``, ``asr_ms_before``, ``asr_ms_after`` (median wall
time over the shifted clips) and ``onset_lead_ms``.
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
from engine_bridge.speech.asr import ONSET_LEAD_MS, AsrWindow, Transcript, WhisperTranscriber
from engine_bridge.speech.text import normalize_text
from tests.speech_fixtures import speech_bounds_ms, synthesize_speech

WINDOWS: tuple[AsrWindow, ...] = ("full", "fit")
#: Shifts of the utterance's start against the 300 ms lead the VAD gives it.
SHIFTS_MS = tuple(range(-80, 81, 20))
LEAD_MS = 300


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


#: The audio conditions of the shifted clips: the benchmark's usual -50 dBFS background noise and 200 ms tail;
#: digital silence around the speech (what a WebRTC caller's track gives before the first word, and what the tests
#: feed); and digital silence with the segment ending where the speech's level falls under -45 dBFS, as the VAD's
#: speculative segment ended on the WebRTC track (whisper heard "France" there as "friends").
CONDITIONS: dict[str, tuple[float | None, bool]] = {
    "noise": (-50.0, False),
    "clean": (None, False),
    "clean-end": (None, True),
}


def cut(text: str, condition: str, shift_ms: int) -> Any:
    """The segment the VAD would hand over with the speech starting ``shift_ms`` later than at its usual 300 ms
    lead: cut from one stream (the same samples, noise included, whatever the shift), as the VAD's frame phase
    moves the cut in the caller's stream."""
    noise_db, at_speech_end = CONDITIONS[condition]
    stream = synthesize_speech(text, lead_silence_ms=LEAD_MS + 100, tail_silence_ms=200, noise_db=noise_db)
    end = speech_bounds_ms(stream)[1] * ENGINE_INPUT_RATE // 1000 if at_speech_end else len(stream)
    return stream[(100 - shift_ms) * ENGINE_INPUT_RATE // 1000 : end]


def shift_errors(texts: list[str], leads: list[int]) -> dict[str, Any]:
    """Per condition: word errors per start shift (SHIFTS_MS) in the fitted window ``before`` (the segment as cut)
    and ``after`` (the product: ONSET_LEAD_MS before the onset), and word errors per onset lead of ``leads`` at
    the unshifted cut (snapped, every shift gives the same segment). Each clip goes through the variants back to
    back, in an order rotated per clip, so the load of the moment hits all alike."""
    variants: dict[str, WhisperTranscriber] = {
        "before": WhisperTranscriber(threads=1, onset_lead_ms=None),
        "after": WhisperTranscriber(threads=1),
    }
    by_lead = {lead: WhisperTranscriber(threads=1, onset_lead_ms=lead) for lead in leads}  # OFFSET_TAIL_MS
    for asr in (*variants.values(), *by_lead.values()):
        asr.warmup()
    names = list(variants)
    out: dict[str, Any] = {"errors": {}, "lead_errors": {}, "ms": {n: [] for n in names}, "misses": []}
    k = 0
    for cond in CONDITIONS:
        errors = {n: [0] * len(SHIFTS_MS) for n in names}
        lead_errors = dict.fromkeys(leads, 0)
        for text in texts:
            for j, shift in enumerate(SHIFTS_MS):
                pcm = cut(text, cond, shift)
                k += 1
                for n in names[k % len(names) :] + names[: k % len(names)]:
                    tr = variants[n].transcribe(pcm)
                    out["ms"][n].append(tr.elapsed_ms)
                    e = word_errors(text, tr.text)
                    errors[n][j] += e
                    if e:
                        out["misses"].append((cond, n, shift, text, tr.text))
            lead_heard = []
            for lead, asr in by_lead.items():
                heard = asr.transcribe(cut(text, cond, 0)).text
                lead_errors[lead] += word_errors(text, heard)
                lead_heard.append(f"{lead}:{word_errors(text, heard)}")
            print(f"  leads: {' '.join(lead_heard)}", file=sys.stderr, flush=True)
            print(
                f"shifts, {cond}: {text!r}: " + ", ".join(f"{n} {sum(errors[n])}" for n in names),
                file=sys.stderr,
                flush=True,
            )
        out["errors"][cond] = errors
        out["lead_errors"][cond] = lead_errors
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 utterances, 1 repeat (smoke test)")
    ap.add_argument("--repeats", type=int, default=2, help="transcriptions per utterance and window")
    ap.add_argument(
        "--leads",
        default="240,360",
        help="onset leads (ms, comma-separated) whose word errors to measure at the unshifted cut",
    )
    ap.add_argument("--shifts-only", action="store_true", help="only the start shifts, not full against fit")
    args = ap.parse_args()
    texts = utterances()
    repeats = args.repeats
    if args.quick:
        texts, repeats = texts[:3] + texts[-1:], 1

    t0 = time.monotonic()
    result: dict[str, Any] = {}
    if not args.shifts_only:
        result.update(compare_windows(texts, repeats))
    n_words = sum(len(normalize_text(t).split()) for t in texts)
    shifted = shift_errors(texts, [int(v) for v in args.leads.split(",") if v.strip()])
    print()
    print(
        f"word errors in {n_words} words per start shift (ms), fitted window; asr p50 ms over the shifted clips"
    )
    print(
        f"{'condition':10} {'variant':8} " + " ".join(f"{d:>4}" for d in SHIFTS_MS) + "  total  max  p50 ms"
    )
    for cond, errors in shifted["errors"].items():
        for name, by_shift in errors.items():
            print(
                f"{cond:10} {name:8} "
                + " ".join(f"{e:4d}" for e in by_shift)
                + f" {sum(by_shift):6d} {max(by_shift):4d} {pct(shifted['ms'][name], 50):7.0f}"
            )
    print()
    leads = list(next(iter(shifted["lead_errors"].values())))
    print(
        "word errors per onset lead (ms) at the unshifted cut (snapped, every shift gives the same segment)"
    )
    print(f"{'condition':10} " + " ".join(f"{v:>4}" for v in leads))
    for cond, by_lead in shifted["lead_errors"].items():
        print(f"{cond:10} " + " ".join(f"{by_lead[v]:4d}" for v in leads))
    print()
    for cond, name, shift, text, heard in shifted["misses"]:
        print(f"  {cond} {name} {shift:+d} ms: {text!r} -> {heard!r}")
    print(f"wall {time.monotonic() - t0:.0f} s (the machine's load of the moment is in every figure)")

    def total(name: str) -> list[int]:
        return [sum(e[name][j] for e in shifted["errors"].values()) for j in range(len(SHIFTS_MS))]

    finish(
        {
            **result,
            "words": n_words,
            "quick": args.quick,
            "shifts_ms": list(SHIFTS_MS),
            "onset_lead_ms": ONSET_LEAD_MS,
            # Summed over the conditions: each shift counts words * len(CONDITIONS).
            "word_errors_by_shift_before": total("before"),
            "word_errors_by_shift_after": total("after"),
            **{f"word_errors_by_shift_{c}": e for c, e in shifted["errors"].items()},
            "word_errors_by_lead": {
                c: {str(k): v for k, v in e.items()} for c, e in shifted["lead_errors"].items()
            },
            "asr_ms_before": pct(shifted["ms"]["before"], 50),
            "asr_ms_after": pct(shifted["ms"]["after"], 50),
        }
    )


def compare_windows(texts: list[str], repeats: int) -> dict[str, Any]:
    """The 30 s window against the fitted one on the same clips, and the incremental approach's tail pass."""
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
        row: dict[str, Any] = {
            "text": text,
            "audio_ms": len(pcm) * 1000 // ENGINE_INPUT_RATE,
            # What whisper is handed: the speech from its onset lead to its tail (engine_bridge/speech/asr.py).
            "focused_ms": len(models["fit"].focus(pcm)[0]) * 1000 // ENGINE_INPUT_RATE,
        }
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
    print(f"tail pass of the incremental approach (last 1 s, 30 s window): p50 {pct(tails, 50):.0f} ms")
    return {
        "asr_final_ms_full": pct(wall["full"], 50),
        "asr_final_ms_fit": pct(wall["fit"], 50),
        "asr_final_p95_ms_full": pct(wall["full"], 95),
        "asr_final_p95_ms_fit": pct(wall["fit"], 95),
        "cpu_s_full": pct(cpu["full"], 50),
        "cpu_s_fit": pct(cpu["fit"], 50),
        "word_errors_full": errors["full"],
        "word_errors_fit": errors["fit"],
        "wer_full": errors["full"] / n_words,
        "wer_fit": errors["fit"] / n_words,
        "exact_full": exact["full"],
        "exact_fit": exact["fit"],
        "utterances": len(rows),
        "repeats": repeats,
        "tail_full_window_ms": pct(tails, 50),
        "rows": rows,
    }


if __name__ == "__main__":
    main()
