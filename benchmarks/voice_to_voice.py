"""Voice-to-voice latency where the caller hears it: the caller's last audible sample → the first audible sample of
the answer (10 ms windows above -45 dBFS on both sides; benchmarks/_callers.py), over three paths:

* ``engine``: a real engine process driven through its rings at real time (tests/engine_driver.py, which plays
  egress the way the media plane does); no server, no network. The stage breakdown comes from the engine's turn
  records (session stats):
  - VAD endpoint: end of speech → the turn is declared over (the silence it waited: the end-of-turn model's
    verdict, or ``silence_ms``);
  - ASR final: whisper on the turn's audio (started speculatively ``speculative_ms`` into the silence);
  - thinker first clause: reply started → first speakable clause;
  - TTS first chunk: first clause → its audio queued;
  - lead silence: first reply frame played → its first audible sample (the voice's leading silence).
  Baseline in the same run (``sequential``): the same turns with the stages run one after another (no
  speculative ASR/reply before the endpoint, no early first clause), i.e. the naive sum of the stages.
* ``ws``: a real ``livekit-omni serve`` (cascade, default settings) and a Live WebSocket client that speaks PCM
  24 kHz in 20 ms appends at real time (silence between questions, like a microphone) and hears the server's
  paced output deltas.
* ``webrtc``: the same server, an aiortc caller through the real media plane: Opus both ways, the server's
  pacing, aiortc's jitter buffer; heard = the decoded frame's arrival after the jitter buffer.

Each path is one conversation of the same ``--turns`` questions (10 by default), each asked once the previous
answer has played out (1.2 s of quiet output). The server's turn records are not on the wire, so the ws and webrtc
rows carry no stage breakdown: the engine path of the same run gives it (same settings, same models).
``turn10_over_turn1`` is the last turn over the first of one conversation: does a longer conversation get slower?
One turn over one other is noisy (different questions, different answers), so the trend is reported beside it:
``late_over_early_p50`` (the median of the second half of the turns over that of the first half) and
``ms_per_turn_by_path`` (the least-squares slope of voice-to-voice over the turn number).

For ws and webrtc the server's own ``livekit_omni_turn_latency_seconds`` (its /metrics: the engine's end-of-turn
decision → the reply's first frame sent) is reported too, as a mean per path: what the transport adds on top of it
is the difference to the caller's figure minus the endpoint.

The machine's other load shows in every figure: compare paths of one run, not runs of different minutes.

    python benchmarks/voice_to_voice.py [--path engine|ws|webrtc|all] [--turns 10] [--quick] [--no-baseline]
                                        [--backend torch|vllm] [--asr-window-baseline]

``--asr-window-baseline`` runs the engine path once more with whisper's 30 s encoder window
(``engine.models.asr_window = full``; the default fits the window to the utterance) and reports its
``asr_final_ms_full_window`` and ``full_window_p50_ms`` beside the default's.

Last stdout line: one JSON object with ``p50_ms``/``p95_ms`` (engine), ``sequential_p50_ms``, ``ws_p50_ms``,
``webrtc_p50_ms``, ``webrtc_p95_ms``, ``turn10_over_turn1`` (webrtc when it ran, else the first path run), the
stage medians (``asr_final_ms`` and more), and the per-turn rows.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import urllib.request
from typing import Any

from _callers import QUESTIONS, CallerLeg, HeardAudio, hear_answer, webrtc_leg, ws_leg
from _common import finish, pct

from engine_bridge import protocol as p
from engine_bridge.formats import ENGINE_OUTPUT_RATE
from tests.conftest import ServerProcess, connect_engine, spawn_engine, start_server
from tests.engine_driver import SessionDriver
from tests.speech_fixtures import speech_bounds_ms, synthesize_speech

PATHS = ("engine", "ws", "webrtc")
#: An answer is over once this much received output has been quiet after its last audible window.
QUIET_AFTER_REPLY_S = 1.2
TURN_TIMEOUT_S = 25.0
NAN = float("nan")


def _ok(x: Any) -> bool:
    return isinstance(x, int | float) and x == x


# ------------------------------------------------------------------------------------------------ engine path
async def run_engine(
    mode: str, engine_settings: dict[str, Any], turns: int, startup: dict[str, float]
) -> list[dict[str, Any]]:
    t_spawn = time.monotonic()
    eng = spawn_engine(adapter="cascade", **engine_settings)
    rows: list[dict[str, Any]] = []
    try:
        client = await connect_engine(eng)
        startup[mode] = time.monotonic() - t_spawn
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
            speech_end = d.marks[marks_before]
            heard = HeardAudio(ENGINE_OUTPUT_RATE)
            frames = [pl for pl in d.played if pl.turn_id == done.turn_id]
            for pl in frames:
                heard.add(pl.wall, pl.pcm)
            heard.scan()
            first = heard.loud[0][1] if heard.loud else None
            stats = await session.stats()
            rec = next((r for r in stats.extra["turn_records"] if r["turn_id"] == done.turn_id), {})
            rows.append(
                {
                    "path": "engine",
                    "mode": mode,
                    "turn": i + 1,
                    "question": q,
                    "reply": done.text,
                    "v2v_ms": (first - speech_end) * 1000 if first is not None else NAN,
                    "first_frame_ms": (frames[0].wall - speech_end) * 1000 if frames else NAN,
                    "lead_silence_ms": (first - frames[0].wall) * 1000 if first is not None else NAN,
                    # The silence the endpoint waited (the end-of-turn model decides it per turn).
                    "endpoint_ms": rec.get("silence_ms", NAN),
                    "asr_ms": rec.get("asr_ms", NAN),
                    "thinker_first_clause_ms": rec.get("reply_start_to_first_clause_ms", NAN),
                    "tts_first_chunk_ms": rec.get("tts_first_chunk_ms", NAN),
                    "speculative": rec.get("speculative"),
                }
            )
            _progress(rows[-1])
            await d.run(seconds=0.6)
        await session.close()
        await client.close()
    finally:
        eng.stop()
    return rows


# ------------------------------------------------------------------------------------------------ ws / webrtc
async def spoken_turn(leg: CallerLeg, i: int, q: str) -> dict[str, Any]:
    seen = len(leg.transcripts())
    leg.heard.scan()
    start_window = leg.heard.windows_received()  # what arrives from now on belongs to this turn
    speech_end = await leg.say(q)
    first = await hear_answer(
        leg.heard, speech_end, start_window, timeout=TURN_TIMEOUT_S, quiet_s=QUIET_AFTER_REPLY_S
    )
    texts = leg.transcripts()[seen:]
    row = {
        "path": leg.path,
        "mode": "default",
        "turn": i + 1,
        "question": q,
        "heard": " ".join(t for k, t in texts if k == "input").strip(),
        "reply": "".join(t for k, t in texts if k == "output").strip(),
        "v2v_ms": (first - speech_end) * 1000 if first is not None else NAN,
    }
    _progress(row)
    return row


async def run_server_paths(
    paths: list[str], turns: int, backend: str, startup: dict[str, float], server_side: dict[str, float]
) -> list[dict]:
    t0 = time.monotonic()
    server = await asyncio.to_thread(
        start_server,
        adapter="cascade",
        env={
            "LIVEKIT_OMNI_ENGINE__THINKER__BACKEND": backend,
            "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
            "LIVEKIT_OMNI_EVENT_LOG": "",
            "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
        },
        ready_timeout=400,
    )
    startup["server"] = time.monotonic() - t0
    rows: list[dict[str, Any]] = []
    try:
        for path in paths:
            leg = await (ws_leg(server) if path == "ws" else webrtc_leg(server))
            before = await asyncio.to_thread(server_turn_latency, server)
            try:
                await asyncio.sleep(1.0)  # settle: the caller's microphone is open, silent
                for i in range(turns):
                    rows.append(await spoken_turn(leg, i, QUESTIONS[i % len(QUESTIONS)]))
                    await asyncio.sleep(0.3)
            finally:
                for close in leg.closers:
                    await close()
            after = await asyncio.to_thread(server_turn_latency, server)
            n = after[1] - before[1]
            server_side[path] = (after[0] - before[0]) / n * 1000 if n else NAN
    finally:
        await asyncio.to_thread(server.stop)
    return rows


def server_turn_latency(server: ServerProcess) -> tuple[float, float]:
    """(sum, count) of the server's ``livekit_omni_turn_latency_seconds``: the engine's end-of-turn decision
    (SpeechStopped, i.e. after the VAD endpoint) → the reply's first audio frame sent by the server."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("livekit_omni_turn_latency_seconds_sum", "livekit_omni_turn_latency_seconds_count"):
            values[name.rsplit("_", 1)[1]] = float(value)
    return values.get("sum", NAN), values.get("count", NAN)


# ------------------------------------------------------------------------------------------------ report
def _progress(row: dict[str, Any]) -> None:
    label = row["path"] if row["mode"] == "default" else f"{row['path']}/{row['mode']}"
    print(
        f"[{label}] turn {row['turn']}: {row['v2v_ms']:7.0f} ms  {row['question']!r} -> {row['reply']!r}",
        file=sys.stderr,
        flush=True,
    )


def _med(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if _ok(r.get(key))]
    return statistics.median(vals) if vals else NAN


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    v = [r["v2v_ms"] for r in rows if _ok(r["v2v_ms"])]
    first, last = (rows[0]["v2v_ms"], rows[-1]["v2v_ms"]) if rows else (NAN, NAN)
    out = {
        "p50_ms": pct(v, 50),
        "p95_ms": pct(v, 95),
        "turn1_ms": first,
        "last_turn_ms": last,
        "turn10_over_turn1": last / first if _ok(first) and _ok(last) and first else NAN,
        "no_reply": sum(1 for r in rows if not _ok(r["v2v_ms"])),
    }
    # One turn over another is one sample over one sample (different questions, different answers); the trend
    # over all turns says better whether a longer conversation gets slower.
    pts = [(i, r["v2v_ms"]) for i, r in enumerate(rows) if _ok(r["v2v_ms"])]
    half = len(rows) // 2
    early = [r["v2v_ms"] for r in rows[:half] if _ok(r["v2v_ms"])]
    late = [r["v2v_ms"] for r in rows[half:] if _ok(r["v2v_ms"])]
    xs, ys = [float(i) for i, _ in pts], [v for _, v in pts]
    out["ms_per_turn"] = statistics.linear_regression(xs, ys).slope if len(pts) >= 2 else NAN
    out["late_over_early_p50"] = statistics.median(late) / statistics.median(early) if early and late else NAN
    for key in (
        "endpoint_ms",
        "asr_ms",
        "thinker_first_clause_ms",
        "tts_first_chunk_ms",
        "lead_silence_ms",
        "first_frame_ms",
    ):
        out[key] = _med(rows, key)
    return out


def print_report(groups: dict[str, list[dict[str, Any]]], sums: dict[str, dict[str, float]]) -> None:
    names = list(groups)
    print()
    print("voice-to-voice, ms: caller's last audible sample -> first audible answer sample where it arrives")
    print(f"{'turn':>4}  " + "  ".join(f"{n:>18}" for n in names))
    turns = max(len(g) for g in groups.values())
    for i in range(turns):
        cells = []
        for n in names:
            v = groups[n][i]["v2v_ms"] if i < len(groups[n]) else NAN
            cells.append(f"{v:18.0f}" if _ok(v) else f"{'-':>18}")
        print(f"{i + 1:>4}  " + "  ".join(cells))
    print()
    print(f"{'':34}" + "  ".join(f"{n:>18}" for n in names))
    for key, label in (
        ("p50_ms", "p50"),
        ("p95_ms", "p95"),
        ("turn10_over_turn1", "last turn / turn 1"),
        ("late_over_early_p50", "p50 second half / first half"),
        ("ms_per_turn", "trend, ms per turn (least squares)"),
        ("no_reply", "turns without an answer"),
        ("endpoint_ms", "stage: VAD endpoint (measured)"),
        ("asr_ms", "stage: ASR final"),
        ("thinker_first_clause_ms", "stage: thinker first clause"),
        ("tts_first_chunk_ms", "stage: TTS first chunk"),
        ("first_frame_ms", "speech end -> first reply frame"),
        ("lead_silence_ms", "first reply frame -> audible"),
        ("server_endpoint_to_audio_ms", "server: endpoint -> audio (mean)"),
    ):
        cells = []
        for n in names:
            v = sums[n].get(key, NAN)
            fmt = f"{v:18.2f}" if key in ("turn10_over_turn1", "late_over_early_p50") else f"{v:18.0f}"
            cells.append(fmt if _ok(v) else f"{'-':>18}")
        print(f"{label:34}" + "  ".join(cells))
    print(
        "(stages: the engine's turn records, engine path only; ws/webrtc run the same settings. server: the "
        "server's livekit_omni_turn_latency_seconds, the engine's end-of-turn decision -> first reply frame sent)"
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="all", choices=(*PATHS, "all"))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 turns per path")
    ap.add_argument("--no-baseline", action="store_true", help="skip the engine path's sequential baseline")
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    ap.add_argument(
        "--asr-window-baseline",
        action="store_true",
        help="the engine path once more with whisper's full 30 s window (engine.models.asr_window = full)",
    )
    args = ap.parse_args()
    turns = 3 if args.quick else args.turns
    paths = list(PATHS) if args.path == "all" else [args.path]
    t0 = time.monotonic()
    thinker = {"thinker": {"backend": args.backend}}
    startup: dict[str, float] = {}
    server_side: dict[str, float] = {}  # path -> mean of the server's own turn latency
    groups: dict[str, list[dict[str, Any]]] = {}
    if "engine" in paths:
        groups["engine"] = await run_engine("overlapped", thinker, turns, startup)
        if args.asr_window_baseline:
            groups["engine asr 30 s"] = await run_engine(
                "asr-full-window", {**thinker, "models": {"asr_window": "full"}}, turns, startup
            )
        if not args.no_baseline:
            groups["engine sequential"] = await run_engine(
                "sequential",
                {**thinker, "turn_taking": {"speculative_ms": 0, "first_clause_words": 0}},
                turns,
                startup,
            )
    server_paths = [x for x in paths if x != "engine"]
    if server_paths:
        rows = await run_server_paths(server_paths, turns, args.backend, startup, server_side)
        for x in server_paths:
            groups[x] = [r for r in rows if r["path"] == x]
    sums = {n: summarize(g) for n, g in groups.items()}
    for n, v in server_side.items():
        sums[n]["server_endpoint_to_audio_ms"] = v
    print_report(groups, sums)
    print(
        f"(backend {args.backend}; {turns} turns per path; start-up: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in startup.items())
        + f"; wall time {time.monotonic() - t0:.0f} s)"
    )
    main_path = "webrtc" if "webrtc" in sums else next(iter(sums))
    eng = sums.get("engine", {})
    result: dict[str, Any] = {
        "p50_ms": eng.get("p50_ms", NAN),
        "p95_ms": eng.get("p95_ms", NAN),
        "sequential_p50_ms": sums.get("engine sequential", {}).get("p50_ms", NAN),
        "sequential_p95_ms": sums.get("engine sequential", {}).get("p95_ms", NAN),
        "ws_p50_ms": sums.get("ws", {}).get("p50_ms", NAN),
        "ws_p95_ms": sums.get("ws", {}).get("p95_ms", NAN),
        "webrtc_p50_ms": sums.get("webrtc", {}).get("p50_ms", NAN),
        "webrtc_p95_ms": sums.get("webrtc", {}).get("p95_ms", NAN),
        "turn10_over_turn1": sums[main_path]["turn10_over_turn1"],
        "turn10_over_turn1_path": main_path,
        "turn10_over_turn1_by_path": {n: s["turn10_over_turn1"] for n, s in sums.items()},
        "late_over_early_p50": sums[main_path]["late_over_early_p50"],
        "ms_per_turn_by_path": {n: s["ms_per_turn"] for n, s in sums.items()},
        "vad_endpoint_ms": eng.get("endpoint_ms", NAN),
        "asr_final_ms": eng.get("asr_ms", NAN),
        "asr_final_ms_full_window": sums.get("engine asr 30 s", {}).get("asr_ms", NAN),
        "full_window_p50_ms": sums.get("engine asr 30 s", {}).get("p50_ms", NAN),
        "thinker_first_clause_ms": eng.get("thinker_first_clause_ms", NAN),
        "tts_first_chunk_ms": eng.get("tts_first_chunk_ms", NAN),
        "lead_silence_ms": eng.get("lead_silence_ms", NAN),
        "server_endpoint_to_audio_mean_ms": server_side,
        "turns": turns,
        "paths": paths,
        "backend": args.backend,
        "startup_s": startup,
        "rows": [r for g in groups.values() for r in g],
    }
    finish(result)


if __name__ == "__main__":
    asyncio.run(main())
