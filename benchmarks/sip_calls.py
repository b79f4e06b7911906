"""SIP calls at the SIP caller: how many one server process holds at real time, voice-to-voice and barge-in.

    python benchmarks/sip_calls.py                              # loopback steps 10,25,50,75,100, then the models
    python benchmarks/sip_calls.py --no-models --steps 10,50    # the loopback engine only (no model time)

Callers are :class:`testkit.sip_caller.SipCaller` (aiosipua's UAC over UDP, PCMU RTP at real time from one shared
20 ms clock, what comes back decoded with its arrival time).

1. **Calls at real time, loopback engine** (the echo fixture: no model time, so the media plane and signalling are
   what is measured). For each step N: N calls set up at once, each sending a tone; after a 2 s settle, a 10 s
   window. The step holds at real time when every call was answered, every call received at least 97 % of the
   window's 500 packets, and no call saw a gap over 100 ms between two packets. ``sip_calls_realtime_loopback`` is
   the largest step that held (the steps stop at the first that does not). Server CPU per call is reported.
2. **Calls at real time, embedded models** (VAD → whisper → SmolLM2 → Piper): the same test with steps of
   ``--model-steps`` calls, each asking one question in the window; it also requires every call to hear an answer.
   ``sip_calls_realtime_models``.
3. **Voice to voice at the SIP caller**: one call asks ``--turns`` questions; each turn from the caller's last audible
   sample sent to the first audible sample of the answer heard (benchmarks/_callers.py). The same server, the same
   run, a WebRTC caller (the Live dialect's ``/v1/live/sessions``) asks the same questions: ``v2v_p50_ms``.
4. **Barge-in at the SIP caller** (a second server, told to tell long stories): the caller asks for a story and,
   ``--barge-after`` seconds into the answer, speaks over it; ``silent`` is from its onset sent to the last audible
   10 ms window of the story heard (the duck counts: 40 dB down is under the audible floor).

The last line is JSON: ``sip_calls_realtime_loopback``, ``sip_calls_realtime_models``, ``sip_v2v_p50_ms``,
``sip_bargein_silent_p50_ms``, ``v2v_p50_ms`` (WebRTC, same run) and the details. Targets (issue 39): at least 50
calls at real time on the loopback engine; SIP voice-to-voice within 100 ms of the WebRTC path's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._callers import QUESTIONS, HeardAudio, hear_answer, marked_sample, webrtc_leg
from benchmarks._common import finish, pct
from testkit.sip_caller import RATE, SipCaller
from tests.conftest import ServerProcess, start_server
from tests.sip_peers import free_udp_port
from tests.speech_fixtures import synthesize_speech

NAN = math.nan
STORYTELLER = "You are a storyteller. Always answer at length, in many sentences."
WINDOW_S = 10.0
MIN_SHARE = 0.97
MAX_GAP_S = 0.1


def sip_server(adapter: str, max_sessions: int, **sip: str) -> tuple[ServerProcess, int]:
    port = free_udp_port()
    env = {
        "LIVEKIT_OMNI_SIP__ENABLED": "true",
        "LIVEKIT_OMNI_SIP__PORT": str(port),
        "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": str(max_sessions),
        "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
        "LIVEKIT_OMNI_EVENT_LOG": "",
        "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
        **{f"LIVEKIT_OMNI_SIP__{k.upper()}": v for k, v in sip.items()},
    }
    return start_server(adapter=adapter, env=env, ready_timeout=400), port


def tone(seconds: float, freq: float = 330.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (np.sin(2 * np.pi * freq * t) * 6000).astype(np.int16)


def _cpu(server: ServerProcess) -> float:
    try:
        return float(
            psutil.Process(server.proc.pid).cpu_times().user
            + psutil.Process(server.proc.pid).cpu_times().system
        )
    except psutil.Error:
        return NAN


async def realtime_step(server: ServerProcess, port: int, n: int, *, ask: bool) -> dict[str, Any]:
    """N calls at once for one window (see the module docstring)."""
    heard = [HeardAudio(RATE) for _ in range(n)]
    callers = [SipCaller(("127.0.0.1", port), on_audio=h.add) for h in heard]
    t0 = time.monotonic()
    results = await asyncio.gather(*(c.call(timeout=60) for c in callers), return_exceptions=True)
    refused = [r for r in results if isinstance(r, BaseException)]
    setup_s = time.monotonic() - t0
    answered: list[bool] = [False] * n
    try:
        if not ask:
            for c in callers:
                c.say(tone(WINDOW_S + 4), 0)
        await asyncio.sleep(2.0)
        for c in callers:
            c.reset_counts()
        cpu0, w0 = await asyncio.to_thread(_cpu, server), time.monotonic()
        if ask:
            clips = [synthesize_speech(QUESTIONS[i % len(QUESTIONS)], rate=RATE) for i in range(n)]
            ends = await asyncio.gather(
                *(c.say(p, marked_sample(p, RATE, "end")) for c, p in zip(callers, clips, strict=True))
            )
            await asyncio.sleep(max(0.0, w0 + WINDOW_S - time.monotonic()))
            for i, (h, end) in enumerate(zip(heard, ends, strict=True)):
                h.scan()
                answered[i] = h.first_loud_after(end) is not None
        else:
            await asyncio.sleep(WINDOW_S)
        window = time.monotonic() - w0
        cpu = (await asyncio.to_thread(_cpu, server) - cpu0) / window
        expected = window * 50
        shares = [c.received / expected for c in callers]
        gaps = [c.max_gap_s for c in callers]
    finally:
        await asyncio.gather(*(c.hangup() for c in callers))
    held = not refused and min(shares) >= MIN_SHARE and max(gaps) <= MAX_GAP_S and (not ask or all(answered))
    row = {
        "calls": n,
        "held": held,
        "refused": len(refused),
        "setup_s": round(setup_s, 2),
        "min_share": round(min(shares), 3),
        "max_gap_ms": round(max(gaps) * 1000, 1),
        "server_cpu_per_call_pct": round(cpu * 100 / n, 2),
        **({"answered": sum(answered)} if ask else {}),
    }
    print(f"  {n:4d} calls: {row}", flush=True)
    await asyncio.sleep(2.0)  # the calls' sessions close before the next step
    return row


async def realtime_steps(
    server: ServerProcess, port: int, steps: list[int], *, ask: bool
) -> tuple[int, list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    best = 0
    for n in steps:
        row = await realtime_step(server, port, n, ask=ask)
        rows.append(row)
        if not row["held"]:
            break
        best = n
    return best, rows


async def sip_turns(port: int, turns: int) -> list[float]:
    heard = HeardAudio(RATE)
    caller = SipCaller(("127.0.0.1", port), on_audio=heard.add)
    await caller.call(timeout=60)
    out: list[float] = []
    try:
        await asyncio.sleep(1.0)
        for i in range(turns):
            q = synthesize_speech(
                QUESTIONS[i % len(QUESTIONS)], rate=RATE, lead_silence_ms=200, tail_silence_ms=0
            )
            heard.scan()
            start = heard.windows_received()
            end = await caller.say(q, marked_sample(q, RATE, "end"))
            first = await hear_answer(heard, end, start, timeout=30.0, quiet_s=1.2)
            v2v = (first - end) * 1000 if first is not None else NAN
            print(f"  sip turn {i + 1}: {v2v:.0f} ms", flush=True)
            out.append(v2v)
            await asyncio.sleep(0.3)
    finally:
        await caller.hangup()
    return out


async def webrtc_turns(server: ServerProcess, turns: int) -> list[float]:
    leg = await webrtc_leg(server)
    out: list[float] = []
    try:
        await asyncio.sleep(1.0)
        for i in range(turns):
            leg.heard.scan()
            start = leg.heard.windows_received()
            end = await leg.say(QUESTIONS[i % len(QUESTIONS)])
            first = await hear_answer(leg.heard, end, start, timeout=30.0, quiet_s=1.2)
            v2v = (first - end) * 1000 if first is not None else NAN
            print(f"  webrtc turn {i + 1}: {v2v:.0f} ms", flush=True)
            out.append(v2v)
            await asyncio.sleep(0.3)
    finally:
        for close in leg.closers:
            await close()
    return out


async def barge_in(port: int, trials: int, barge_after: float) -> list[float]:
    out: list[float] = []
    story = synthesize_speech(
        "Tell me a long story about a dragon and a knight.", rate=RATE, tail_silence_ms=0
    )
    stop = synthesize_speech(
        "Stop. What is the capital of France?", rate=RATE, lead_silence_ms=0, tail_silence_ms=0
    )
    for i in range(trials):
        heard = HeardAudio(RATE, keep_levels=True)
        caller = SipCaller(("127.0.0.1", port), on_audio=heard.add)
        await caller.call(timeout=60)
        try:
            await asyncio.sleep(0.5)
            end = await caller.say(story, marked_sample(story, RATE, "end"))
            first = None
            deadline = end + 30
            while first is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                heard.scan()
                first = heard.first_loud_after(end)
            if first is None:
                print(f"  barge-in {i + 1}: no story heard", flush=True)
                out.append(NAN)
                continue
            await asyncio.sleep(max(0.0, first[1] + barge_after - time.monotonic()))
            onset = await caller.say(stop, marked_sample(stop, RATE, "onset"))
            await asyncio.sleep(1.5)
            heard.scan()
            # The last audible window of the story heard after the onset, before the caller's speech ends (the next
            # answer cannot start before that).
            upto = onset + 1.2
            loud = [t for _, t in heard.loud if onset <= t <= upto]
            silent = (max(loud) + 0.01 - onset) * 1000 if loud else 0.0
            print(f"  barge-in {i + 1}: story silent {silent:.0f} ms after the onset", flush=True)
            out.append(silent)
        finally:
            await caller.hangup()
        await asyncio.sleep(1.0)
    return out


def _p50(xs: list[float]) -> float:
    ok = [x for x in xs if not math.isnan(x)]
    return round(statistics.median(ok), 1) if ok else NAN


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "sip_calls", "cpu_count": os.cpu_count()}
    steps = [int(s) for s in args.steps.split(",") if s]
    print("== SIP calls at real time, loopback engine", flush=True)
    server, port = await asyncio.to_thread(sip_server, "loopback", max(steps) + 8)
    try:
        best, rows = await realtime_steps(server, port, steps, ask=False)
    finally:
        await asyncio.to_thread(server.stop)
    result["sip_calls_realtime_loopback"] = best
    result["loopback_steps"] = rows
    if args.no_models:
        return result
    print("== the embedded models", flush=True)
    server, port = await asyncio.to_thread(sip_server, "cascade", 16)
    try:
        sip = await sip_turns(port, args.turns)
        web = await webrtc_turns(server, args.turns)
        model_steps = [int(s) for s in args.model_steps.split(",") if s]
        best_m, rows_m = await realtime_steps(server, port, model_steps, ask=True)
    finally:
        await asyncio.to_thread(server.stop)
    result.update(
        sip_v2v_p50_ms=_p50(sip),
        sip_v2v_p90_ms=round(pct([x for x in sip if not math.isnan(x)], 90), 1) if sip else NAN,
        v2v_p50_ms=_p50(web),
        sip_v2v_ms=[round(x, 1) for x in sip],
        webrtc_v2v_ms=[round(x, 1) for x in web],
        sip_calls_realtime_models=best_m,
        model_steps=rows_m,
    )
    print("== barge-in at the SIP caller (storyteller)", flush=True)
    server, port = await asyncio.to_thread(
        sip_server, "cascade", 4, session=f'{{"instructions": "{STORYTELLER}"}}'
    )
    try:
        silent = await barge_in(port, args.barge_trials, args.barge_after)
    finally:
        await asyncio.to_thread(server.stop)
    result["sip_bargein_silent_p50_ms"] = _p50(silent)
    result["sip_bargein_silent_ms"] = [round(x, 1) for x in silent]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="10,25,50,75,100", help="loopback: concurrent calls per step")
    ap.add_argument("--model-steps", default="1,2,4", help="models: concurrent calls per step")
    ap.add_argument("--turns", type=int, default=5, help="voice-to-voice turns per path")
    ap.add_argument("--barge-trials", type=int, default=3)
    ap.add_argument("--barge-after", type=float, default=1.5, help="seconds into the story")
    ap.add_argument("--no-models", action="store_true", help="the loopback engine only")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    finish(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
