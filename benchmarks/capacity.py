"""How many concurrent spoken conversations one ``livekit-omni serve`` holds at real time with the embedded models.

One real server (cascade engine, default models: Silero VAD, whisper, SmolLM2 on the ``--backend`` thinker, Piper)
and, in this process, N scripted callers over the Live WebSocket (benchmarks/_load.py): each streams its
microphone at real time for the whole call, asks ``--turns`` questions (Piper speech), measures each answer where it
hears it (its last audible sample → the answer's first audible sample) and waits for the answer to play out, except
on every third turn, where it barges in half a second into the answer with its next question. The callers start
staggered over two seconds, as real callers do not speak in lockstep. Each conversation starts with
``--history-tokens`` of earlier turns (its own questions and answers, as ``session.start`` input): 1,600 by default,
the context a conversation settles at after a few minutes (the thinker trims at 2,048 tokens down to 1,536). A
ramp of fresh conversations measures their first minute only, and overstates what holds for half an hour: the
engine's decode steps and attention grow with the context (``--history-tokens 0`` measures fresh ones).

N = 1, 2, 3, ... up to ``--max-sessions``; an N holds **at real time** when:

* every turn got an answer and the p95 voice-to-voice latency is under ``--p95-bound-ms``;
* no ring overran (caller audio the engine did not take in time, reply audio the player did not take);
* the output fell behind rarely: egress underruns (frames only partly filled with reply audio) at most
  ``--max-underruns-per-turn`` per turn;
* every caller received output audio at >= 0.98 of real time (the server sends silence between answers, so a
  session whose output clock falls behind receives less).

The ramp stops at the first N that fails; ``sessions_realtime`` is the last N that passed. N = 1 is the baseline
row of the same run (one conversation alone on the server). Engine and server CPU are % of one core over the step.
Everything shares this machine's cores (server, engine, callers): the figure is what this box holds.

    python benchmarks/capacity.py [--max-sessions 16] [--turns 4] [--p95-bound-ms 4000] [--backend torch|vllm]
                                  [--history-tokens 1600] [--result capacity.json] [--quick]

Last stdout line: one JSON object with ``sessions_realtime`` and ``p50_ms``/``p95_ms`` at that N (null when even
N = 1 failed), the per-N rows and the bounds. ``--result`` also writes it to a file benchmarks/soak.py reads.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from _common import dumps, finish, pct
from _load import NAN, ScriptedCaller, Turn, cpu_seconds, losses

from tests.conftest import ServerProcess, start_server

RECEIVED_RATE_MIN = 0.98
STAGGER_S = 2.0


def server_env(backend: str, max_sessions: int) -> dict[str, str]:
    return {
        "LIVEKIT_OMNI_ENGINE__THINKER__BACKEND": backend,
        "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": str(max_sessions),
        "LIVEKIT_OMNI_EVENT_LOG": "",
        "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
    }


def _progress(turn: Turn, n: int) -> None:
    kind = "barge-in" if turn.barge_in else "question"
    print(
        f"[N={n}] caller {turn.caller} turn {turn.turn} ({kind}): {turn.v2v_ms:6.0f} ms  {turn.question!r}",
        file=sys.stderr,
        flush=True,
    )


async def run_step(
    server: ServerProcess,
    n: int,
    turns: int,
    barge_every: int,
    bounds: dict[str, float],
    history_tokens: int,
) -> dict[str, Any]:
    engine_pid = server.engine_pid()
    # One after another: each open prefills its history in the engine before session.started.
    callers = [await ScriptedCaller.open(server.url, i, history_tokens=history_tokens) for i in range(n)]
    try:
        await asyncio.sleep(1.0)  # settle: every microphone open, silent
        before = await asyncio.to_thread(losses, server.url)
        e0, s0, t0 = cpu_seconds(engine_pid), cpu_seconds(server.proc.pid), time.monotonic()
        recv0 = [c.received_s() for c in callers]

        async def one(c: ScriptedCaller) -> None:
            await asyncio.sleep(c.index * STAGGER_S / n)
            await c.converse(turns=turns, barge_every=barge_every, on_turn=lambda t: _progress(t, n))

        await asyncio.gather(*(one(c) for c in callers))
        elapsed = time.monotonic() - t0
        e1, s1 = cpu_seconds(engine_pid), cpu_seconds(server.proc.pid)
        after = await asyncio.to_thread(losses, server.url)
        received = [(c.received_s() - r0) / elapsed for c, r0 in zip(callers, recv0, strict=True)]
        alive = all(c.alive for c in callers)
    finally:
        await asyncio.gather(*(c.close() for c in callers), return_exceptions=True)
    rows = [t for c in callers for t in c.turns]
    v2v = [t.v2v_ms for t in rows if t.v2v_ms == t.v2v_ms]
    d = {k: after[k] - before[k] for k in after}
    step: dict[str, Any] = {
        "sessions": n,
        "turns": len(rows),
        "barge_ins": sum(t.barge_in for t in rows),
        "no_answer": len(rows) - len(v2v),
        "p50_ms": pct(v2v, 50),
        "p95_ms": pct(v2v, 95),
        "ingress_overruns": d["ingress_overruns"],
        "egress_overruns": d["egress_overruns"],
        "egress_underruns": d["egress_underruns"],
        "dropped_events": d["dropped_events"],
        "received_rate_min": min(received),
        "engine_cpu_pct": (e1 - e0) / elapsed * 100,
        "server_cpu_pct": (s1 - s0) / elapsed * 100,
        "elapsed_s": elapsed,
        "sessions_alive": alive,
        "v2v_ms": [t.v2v_ms for t in rows],
    }
    why = []
    if step["no_answer"]:
        why.append(f"{step['no_answer']} turns unanswered")
    if not v2v or step["p95_ms"] > bounds["p95_ms"]:
        why.append(f"p95 over {bounds['p95_ms']:.0f} ms")
    if step["ingress_overruns"] or step["egress_overruns"]:
        why.append("ring overruns")
    if step["egress_underruns"] > bounds["underruns_per_turn"] * max(1, len(rows)):
        why.append("egress underruns")
    if step["received_rate_min"] < RECEIVED_RATE_MIN:
        why.append(f"output at {step['received_rate_min']:.3f} of real time")
    if step["dropped_events"]:
        why.append("dropped events")
    if not alive:
        why.append("a session ended")
    step["realtime"] = not why
    step["why_not"] = "; ".join(why)
    return step


def print_table(steps: list[dict[str, Any]], bounds: dict[str, float]) -> None:
    print()
    print("concurrent spoken conversations on one server (voice-to-voice ms where the caller hears it)")
    head = (
        f"{'N':>3} {'p50':>7} {'p95':>7} {'turns':>5} {'none':>4} {'ovr in/out':>10} {'under':>6} "
        f"{'recv':>6} {'eng cpu':>8} {'srv cpu':>8}  real time"
    )
    print(head)
    for s in steps:
        label = "yes" if s["realtime"] else f"no: {s['why_not']}"
        if s["sessions"] == 1:
            label += "  (baseline: one conversation alone)"
        print(
            f"{s['sessions']:>3} {s['p50_ms']:7.0f} {s['p95_ms']:7.0f} {s['turns']:>5} {s['no_answer']:>4} "
            f"{s['ingress_overruns']:>4.0f}/{s['egress_overruns']:<5.0f} {s['egress_underruns']:>6.0f} "
            f"{s['received_rate_min']:6.3f} {s['engine_cpu_pct']:7.0f}% {s['server_cpu_pct']:7.0f}%  {label}"
        )
    print(
        f"(real time: every turn answered, p95 < {bounds['p95_ms']:.0f} ms, no ring overrun, egress underruns "
        f"<= {bounds['underruns_per_turn']:g}/turn, each caller's output >= {RECEIVED_RATE_MIN} of real time; "
        "CPU in % of one core)"
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4, help="questions per caller at each N")
    ap.add_argument("--barge-every", type=int, default=3, help="every k-th turn barges in (0: never)")
    ap.add_argument("--p95-bound-ms", type=float, default=4000.0)
    ap.add_argument("--max-underruns-per-turn", type=float, default=2.0)
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    ap.add_argument(
        "--history-tokens",
        type=int,
        default=1600,
        help="earlier turns each conversation starts with (0: fresh conversations)",
    )
    ap.add_argument(
        "--result", type=Path, help="also write the JSON result here (benchmarks/soak.py reads it)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="N up to 2, 3 turns each (one a barge-in), 200 tokens of history"
    )
    args = ap.parse_args()
    max_n, turns = (min(2, args.max_sessions), 3) if args.quick else (args.max_sessions, args.turns)
    barge_every = 2 if args.quick else args.barge_every  # a barge-in in every caller's few turns
    history_tokens = min(200, args.history_tokens) if args.quick else args.history_tokens
    bounds = {"p95_ms": args.p95_bound_ms, "underruns_per_turn": args.max_underruns_per_turn}
    t0 = time.monotonic()
    server = await asyncio.to_thread(
        start_server, adapter="cascade", env=server_env(args.backend, max_n + 1), ready_timeout=400
    )
    startup_s = time.monotonic() - t0
    steps: list[dict[str, Any]] = []
    try:
        for n in range(1, max_n + 1):
            steps.append(await run_step(server, n, turns, barge_every, bounds, history_tokens))
            s = steps[-1]
            print(
                f"N={n}: p50 {s['p50_ms']:.0f} ms, p95 {s['p95_ms']:.0f} ms, "
                f"{'real time' if s['realtime'] else 'not real time: ' + s['why_not']}",
                file=sys.stderr,
                flush=True,
            )
            if not s["realtime"]:
                break
            await asyncio.sleep(1.0)
    finally:
        await asyncio.to_thread(server.stop)
    print_table(steps, bounds)
    passed = [s for s in steps if s["realtime"]]
    best = passed[-1] if passed else None
    print(
        f"(backend {args.backend}; {turns} turns per caller, each conversation starting with ~{history_tokens} "
        f"tokens of earlier turns; server start-up {startup_s:.0f} s; "
        f"wall time {time.monotonic() - t0:.0f} s)"
    )
    result: dict[str, Any] = {
        "sessions_realtime": best["sessions"] if best else 0,
        "p50_ms": best["p50_ms"] if best else NAN,
        "p95_ms": best["p95_ms"] if best else NAN,
        "baseline_p50_ms": steps[0]["p50_ms"] if steps else NAN,
        "baseline_p95_ms": steps[0]["p95_ms"] if steps else NAN,
        "first_failing": next((s["sessions"] for s in steps if not s["realtime"]), None),
        "max_sessions_tried": max_n,
        "turns_per_caller": turns,
        "history_tokens": history_tokens,
        "backend": args.backend,
        "bounds": {**bounds, "received_rate_min": RECEIVED_RATE_MIN},
        "startup_s": startup_s,
        "steps": steps,
    }
    if args.result is not None:
        args.result.write_text(dumps({k: v for k, v in result.items() if k != "steps"}) + "\n")
    finish(result)


if __name__ == "__main__":
    asyncio.run(main())
