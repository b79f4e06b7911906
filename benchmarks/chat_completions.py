"""Text on the voice engine: /v1/chat/completions throughput, and what text load does to a live call's latency.

One real ``livekit-omni serve`` (cascade, the configured thinker backend, ``max_text_requests`` 8), in one run:

1. **Text throughput**: N = 1, 4, 8 concurrent streamed completions (openai SDK wire format over HTTP, a fixed
   ``max_tokens`` and a prompt that keeps the model talking); tokens/s = completion tokens of all streams (their
   ``usage``) / wall time from the first request sent to the last stream's end.
2. **Voice alone / with chat**: a spoken Live WebSocket conversation (Piper questions at real time, PCM 24 kHz);
   per turn, voice-to-voice = the caller's last audible sample (wall time the 20 ms append holding it was sent)
   → the first audible reply sample heard by the client (benchmarks/_callers.py, as in voice_to_voice.py). Each question is asked twice in a row: alone, then while 4
   text streams run back to back (started 1 s before the question, cut when the reply has played). Interleaving
   the modes keeps the comparison fair on a machine whose speed varies from minute to minute.

The thinker's scheduler runs voice first (engine_bridge/adapters/cascade/text.py): text waits while a voice turn
is on its latency path, so ``voice_p50_ratio_with_chat`` should stay near 1; the target is <= 1.25. On this 2-core
box the text streams still compete with ASR/TTS threads for the CPU between their steps.

The last stdout line is one JSON object with ``chat_tok_s_at_1/4/8``, ``voice_p50_ms_alone``,
``voice_p50_ms_with_chat``, ``voice_p50_ratio_with_chat`` and the per-turn rows.

    python benchmarks/chat_completions.py [--turns 6] [--backend torch|vllm] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._callers import LiveOutput, Microphone, hear_answer
from benchmarks._common import finish, pct
from livekit_omni.live import wire
from testkit.live_client import LiveClient
from tests.conftest import ServerProcess, start_server

API_KEY = "sk-bench"
RATE = 24_000
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What color is the sky?",
    "What is the capital of Italy?",
    "What do bees make?",
    "What animal says moo?",
    "What is the largest planet?",
    "How many days are in a week?",
]
STORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a long story about a dragon who learns to cook."},
]


# --- text streams ------------------------------------------------------------------------------------------------


async def one_stream(http: Any, url: str, max_tokens: int, seed: int) -> int:
    """One streamed completion; returns its completion tokens (from the final usage chunk)."""
    body = {
        "model": "bench",
        "messages": STORY,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat stream refused: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    return tokens


async def throughput(server: ServerProcess, n: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    url = server.url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=300) as http:
        await one_stream(http, url, 8, 0)  # warm the path
        t0 = time.monotonic()
        counts = await asyncio.gather(*(one_stream(http, url, max_tokens, 100 + i) for i in range(n)))
        wall = time.monotonic() - t0
    total = sum(counts)
    return {"streams": n, "tokens": total, "wall_s": wall, "tok_s": total / wall if wall else float("nan")}


async def background_streams(
    server: ServerProcess, n: int, max_tokens: int, stop: asyncio.Event
) -> dict[str, int]:
    """``n`` text streams back to back until ``stop``; returns how many completed and their tokens."""
    import httpx

    url = server.url + "/v1/chat/completions"
    done = {"streams": 0, "tokens": 0, "errors": 0}  # filled while it runs (it is cancelled to stop)

    async def loop(k: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                done["tokens"] += await one_stream(http, url, max_tokens, 1000 * k + i)
                done["streams"] += 1
            except RuntimeError:
                done["errors"] += 1
                await asyncio.sleep(0.2)
            i += 1

    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(loop(k) for k in range(n)))
    return done


# --- the spoken call ---------------------------------------------------------------------------------------------


class Call:
    """A Live WebSocket session that speaks questions at real time and times the replies (benchmarks/_callers.py:
    the caller's last audible sample → the first audible answer sample heard, as in voice_to_voice.py)."""

    def __init__(self, live: LiveClient) -> None:
        self.mic = Microphone(live, RATE)
        self.heard = LiveOutput(live, RATE)

    async def turn(self, question: str) -> float:
        self.heard.scan()
        start_window = self.heard.windows_received()  # whatever played before this question does not count
        speech_end = await self.mic.say(question, lead_silence_ms=300)
        first = await hear_answer(self.heard, speech_end, start_window, timeout=30)
        return (first - speech_end) * 1000 if first is not None else float("nan")


async def wait_text_idle(server: ServerProcess, timeout: float = 30.0) -> None:
    """Until the engine reports no text request in flight (the aborted streams are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, body = await asyncio.to_thread(server.health)
        if code == 200 and body["engine"].get("text_requests_active") == 0:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("text requests still running")


async def conversation(
    server: ServerProcess, turns: int, max_tokens: int
) -> tuple[list[dict[str, Any]], dict]:
    """One spoken call; each question is asked twice in a row, alone and then with 4 text streams running,
    so that both modes see the same questions and the same (shared, noisy) machine at nearly the same time."""
    live = await LiveClient.connect(server.url, api_key=API_KEY)
    rows: list[dict[str, Any]] = []
    try:
        ev = await live.start({"model": "bench", "audio": {"format": {"type": "audio/pcm", "rate": RATE}}})
        if not isinstance(ev, wire.SessionStarted):
            raise RuntimeError(f"session refused: {ev}")
        call = Call(live)
        await asyncio.sleep(1.0)  # settle (the microphone streams silence)
        for i in range(turns):
            q = QUESTIONS[i % len(QUESTIONS)]
            for mode in ("alone", "with_chat"):
                load: asyncio.Task[dict[str, int]] | None = None
                stop = asyncio.Event()
                if mode == "with_chat":
                    load = asyncio.create_task(background_streams(server, 4, max_tokens, stop))
                    await asyncio.sleep(1.0)  # the streams are decoding when the caller speaks
                v2v = await call.turn(q)
                if load is not None:
                    stop.set()
                    load.cancel()  # closes the streams mid-way: the server aborts them
                    with contextlib.suppress(asyncio.CancelledError):
                        await load
                    await wait_text_idle(server)
                rows.append({"mode": mode, "question": q, "v2v_ms": v2v})
                print(f"[{mode}] turn {i + 1}: {v2v:7.0f} ms  {q!r}", file=sys.stderr, flush=True)
        await call.mic.stop()
        with contextlib.suppress(Exception):
            await live.send({"type": "session.close"})
    finally:
        await live.close()
    return rows


def p50(rows: list[dict[str, Any]]) -> float:
    return pct([r["v2v_ms"] for r in rows if r["v2v_ms"] == r["v2v_ms"]], 50)


async def main_async(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    server = await asyncio.to_thread(
        start_server,
        adapter="cascade",
        env={
            "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
            "LIVEKIT_OMNI_ENGINE__THINKER__BACKEND": args.backend,
            "LIVEKIT_OMNI_ENGINE__THINKER__MAX_TEXT_REQUESTS": "8",
            "LIVEKIT_OMNI_EVENT_LOG": "",
            "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
        },
        ready_timeout=400,
    )
    try:
        rates = []
        for n in (1, 4, 8):
            row = await throughput(server, n, args.max_tokens)
            rates.append(row)
            print(f"text: {n} stream(s): {row['tok_s']:.1f} tok/s ({row['tokens']} tokens)", file=sys.stderr)
        rows = await conversation(server, args.turns, args.max_tokens)
        alone = [r for r in rows if r["mode"] == "alone"]
        with_chat = [r for r in rows if r["mode"] == "with_chat"]
    finally:
        await asyncio.to_thread(server.stop)
    a, b = p50(alone), p50(with_chat)
    by_n = {r["streams"]: r["tok_s"] for r in rates}
    print()
    print(f"{'text streams':>14} {'tok/s':>8}")
    for r in rates:
        print(f"{r['streams']:>14} {r['tok_s']:>8.1f}")
    print(
        f"voice-to-voice p50: alone {a:.0f} ms, with 4 text streams {b:.0f} ms (ratio {b / a:.2f}; target <= 1.25)"
    )
    print(
        f"(backend {args.backend}; {args.turns} turns per mode, interleaved; wall {time.monotonic() - t0:.0f} s)"
    )
    finish(
        {
            "chat_tok_s_at_1": by_n[1],
            "chat_tok_s_at_4": by_n[4],
            "chat_tok_s_at_8": by_n[8],
            "voice_p50_ms_alone": a,
            "voice_p50_ms_with_chat": b,
            "voice_p50_ratio_with_chat": b / a if a else float("nan"),
            "voice_p95_ms_alone": pct([r["v2v_ms"] for r in alone], 95),
            "voice_p95_ms_with_chat": pct([r["v2v_ms"] for r in with_chat], 95),
            "backend": args.backend,
            "turns": args.turns,
            "rows": rows,
            "throughput": rates,
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    ap.add_argument("--max-tokens", type=int, default=96)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
