"""Answer quality of the spoken default: factual questions and name recall, over the Live WebSocket.

It uses the product as a new user would: a real ``livekit-omni serve`` (cascade engine: VAD → whisper → thinker →
Piper) on a free port, and a Live WebSocket client that speaks Piper-synthesised questions in real time (20 ms
PCM appends at 24 kHz, silence in between, like a microphone) and listens to the continuous output.

* 20 short factual questions, each in a fresh session. A question is answered correctly when the reply's output
  transcript (the ``session.output_transcript.delta`` events, i.e. the words the reply audio speaks) contains
  one of its acceptable keywords (case-insensitive, whole words).
* 5 two-turn exchanges, each in a fresh session: "My name is <Name>. <question>" and, once that reply is over,
  "What is my name?". Name recall = the second reply's transcript contains the name.

Latency of a turn = from the end of the caller's last audible sample (the wall time the 20 ms append holding the
last 10 ms window above -45 dBFS was sent) to when the first 10 ms window above -45 dBFS after it is heard (the
arrival of its output delta plus its offset in the delta; benchmarks/_callers.py, shared with voice_to_voice.py).
Both are measured on the client, so the figure includes the network hops and the server's output pacing. The p50 is over every turn that got a reply (questions and both exchange turns).

A reply is over when 1.2 s of output has been quiet after its last loud window and no transcript has arrived for
1 s, or ``--turn-timeout`` seconds after the question ended.

Server settings: ``--backend`` and ``--model`` go into ``engine.thinker.backend`` / ``engine.thinker.model``.
``--system-prompt`` sets the server's default system prompt, ``--instructions`` sends session
instructions (what a client such as LiveKit's ``GPTLiveModel`` does), and ``--env NAME=VALUE`` passes any other
``LIVEKIT_OMNI_…`` setting. ``--examples on|off`` sets ``engine.thinker.spoken_examples`` (the example turns
every voice session opens with; ``auto``, the default, is on for the built-in SmolLM2).

The machine's other load shows in the latency (on the shared 2-core box, compare runs made back to back).

    python benchmarks/answer_quality.py [--quick] [--backend torch|vllm] [--model PATH] [--instructions TEXT]

Last stdout line: one JSON object with ``accuracy``, ``name_recall``, ``latency_p50_ms`` (and the backend, model,
per-turn rows, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from _callers import LiveOutput, Microphone
from _common import finish, pct

from livekit_omni.live import wire
from testkit.live_client import LiveClient
from tests.conftest import ServerProcess, start_server

RATE = 24_000
WINDOW = RATE // 100  # 10 ms loudness windows
QUIET_AFTER_REPLY_S = 1.2
TRANSCRIPT_QUIET_S = 1.0

#: (question, acceptable keywords). Number answers accept digits and words.
QUESTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("paris",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("How many days are in a week?", ("seven", "7")),
    ("What is the capital of Italy?", ("rome",)),
    ("What do bees make?", ("honey",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What animal says moo?", ("cow", "cows")),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is frozen water called?", ("ice",)),
    ("Which planet is known as the red planet?", ("mars",)),
    ("How many hours are in a day?", ("24", "twenty-four", "twenty four")),
    ("What is the capital of Germany?", ("berlin",)),
    ("What gas do people need to breathe?", ("oxygen",)),
    ("Which animal carries its baby in a pouch?", ("kangaroo", "kangaroos")),
    ("Which planet is farthest from the sun?", ("neptune",)),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("How many months are in a year?", ("twelve", "12")),
    ("At what temperature in Celsius does water boil?", ("100", "hundred")),
]

#: (name, first-turn question, its keywords). The second turn is always "What is my name?".
EXCHANGES: list[tuple[str, str, tuple[str, ...]]] = [
    ("Alice", "What is the capital of France?", ("paris",)),
    ("David", "What color is the sky on a clear day?", ("blue",)),
    ("Emma", "What do bees make?", ("honey",)),
    ("James", "What is the capital of Italy?", ("rome",)),
    ("Olivia", "How many days are in a week?", ("seven", "7")),
]
NAME_QUESTION = "What is my name?"
#: Phrases that make an answer wrong although it holds a keyword ("ice cream" is not frozen water).
WRONG: dict[str, tuple[str, ...]] = {"What is frozen water called?": ("ice cream",)}


def correct(question: str, answer: str, keywords: tuple[str, ...]) -> bool:
    return mentions(answer, keywords) and not mentions(answer, WRONG.get(question, ()))


def mentions(text: str, keywords: tuple[str, ...]) -> bool:
    """Whole-word, case-insensitive match of any keyword ("8" does not match "18", "ice" not "nice")."""
    t = text.lower()
    return any(re.search(rf"(?<![\w-]){re.escape(k.lower())}(?![\w-])", t) for k in keywords)


@dataclass
class Turn:
    question: str
    heard: str  # the server's input transcript of the question
    answer: str
    latency_ms: float
    kind: str  # "question" | "exchange-1" | "exchange-2"
    ok: bool | None = None
    error: str | None = None


async def run_turn(
    client: LiveClient, mic: Microphone, scan: LiveOutput, text: str, kind: str, timeout: float
) -> Turn:
    first_event = len(client.events)
    spoken_end = await mic.say(text)
    scan.scan()
    start_window = scan.windows_received()  # windows that arrive from now on belong to this turn
    first_loud: float | None = None
    last_loud_window = -1
    last_transcript = time.monotonic()
    deadline = spoken_end + timeout
    n_transcripts = 0
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        scan.scan()
        mine = [(w, t) for w, t in scan.loud if w >= start_window]
        if mine:
            if first_loud is None:
                first_loud = mine[0][1]
            last_loud_window = mine[-1][0]
        outs = [e for e in client.events[first_event:] if isinstance(e, wire.OutputTranscriptDelta)]
        if len(outs) != n_transcripts:
            n_transcripts, last_transcript = len(outs), time.monotonic()
        quiet_windows = scan.windows_received() - 1 - last_loud_window
        if (
            first_loud is not None
            and quiet_windows * WINDOW >= QUIET_AFTER_REPLY_S * RATE
            and time.monotonic() - last_transcript >= TRANSCRIPT_QUIET_S
        ):
            break
        if client.closed.is_set():
            break
    events = client.events[first_event:]
    heard = " ".join(e.delta for e in events if isinstance(e, wire.InputTranscriptDelta))
    answer = "".join(e.delta for e in events if isinstance(e, wire.OutputTranscriptDelta))
    errors = [e for e in events if isinstance(e, wire.Error)]
    latency = (first_loud - spoken_end) * 1000 if first_loud is not None else float("nan")
    return Turn(
        text,
        heard.strip(),
        answer.strip(),
        latency,
        kind,
        error=msgspec.json.encode(errors[0].error).decode() if errors else None,
    )


async def conversation(
    server: ServerProcess,
    texts: list[tuple[str, str]],
    *,
    instructions: str | None,
    timeout: float,
) -> list[Turn]:
    """One fresh session: speak each (text, kind) once the previous reply is over, then close."""
    client = await LiveClient.connect(server.url, api_key=None)
    turns: list[Turn] = []
    mic: Microphone | None = None
    try:
        session: dict[str, Any] = {
            "model": "gpt-live-1",
            "audio": {"format": {"type": "audio/pcm", "rate": RATE}},
        }
        if instructions:
            session["instructions"] = instructions
        started = await client.start(session)
        if not isinstance(started, wire.SessionStarted):
            raise RuntimeError(f"session.start refused: {started}")
        mic = Microphone(client, RATE)
        scan = LiveOutput(client, RATE)
        await asyncio.sleep(0.3)  # a caller takes a moment before speaking
        for text, kind in texts:
            turns.append(await run_turn(client, mic, scan, text, kind, timeout))
        await mic.stop()
        mic = None
        await client.send({"type": "session.close"})
        try:
            await client.next_event(wire.SessionClosed, timeout=5)
        except (TimeoutError, EOFError):
            pass
    finally:
        if mic is not None:
            await mic.stop()
        await client.close()
    return turns


# ------------------------------------------------------------------------------------------------ settings
def server_env(backend: str, model: str | None, extra: list[str]) -> tuple[dict[str, str], str]:
    """Environment for the server's thinker choice (``engine.thinker.backend`` / ``engine.thinker.model``)."""
    env: dict[str, str] = {"LIVEKIT_OMNI_ENGINE__THINKER__BACKEND": backend}
    if model:
        env["LIVEKIT_OMNI_ENGINE__THINKER__MODEL"] = model
    for item in extra:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("LIVEKIT_OMNI_"):
            raise SystemExit(f"--env wants LIVEKIT_OMNI_NAME=VALUE, got {item!r}")
        env[name] = value
    return env, "engine.thinker.backend/model"


# ------------------------------------------------------------------------------------------------ report
def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def print_table(turns: list[Turn]) -> None:
    print(
        f"{'#':>2}  {'kind':10}  {'question (as heard by the server)':44}  {'answer':58}  {'ok':3}  {'ms':>6}"
    )
    for i, t in enumerate(turns, 1):
        ok = "-" if t.ok is None else ("yes" if t.ok else "NO")
        lat = "-" if t.latency_ms != t.latency_ms else f"{t.latency_ms:6.0f}"
        heard = t.heard or f"({t.question})"
        print(
            f"{i:2}  {t.kind:10}  {_short(heard, 44):44}  {_short(t.answer or '-', 58):58}  {ok:3}  {lat:>6}"
        )
        if t.error:
            print(f"    error: {t.error}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 questions and 1 exchange (smoke test)")
    ap.add_argument("--backend", choices=("torch", "vllm"), default="torch")
    ap.add_argument("--model", default=None, help="thinker model: a built-in name or a local HF folder")
    ap.add_argument("--instructions", default=None, help="session instructions sent in session.start")
    ap.add_argument("--system-prompt", default=None, help="the server's default system prompt")
    ap.add_argument(
        "--examples",
        choices=("auto", "on", "off"),
        default="auto",
        help="engine.thinker.spoken_examples: the example turns voice sessions open with",
    )
    ap.add_argument("--env", action="append", default=[], metavar="LIVEKIT_OMNI_NAME=VALUE")
    ap.add_argument("--turn-timeout", type=float, default=25.0, help="seconds a reply may take to end")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    args = ap.parse_args()

    questions = QUESTIONS[:2] if args.quick else QUESTIONS
    exchanges = EXCHANGES[:1] if args.quick else EXCHANGES
    env, settings_note = server_env(args.backend, args.model, args.env)
    env["LIVEKIT_OMNI_ENGINE__THINKER__SPOKEN_EXAMPLES"] = args.examples
    if args.system_prompt is not None:
        env["LIVEKIT_OMNI_ENGINE__THINKER__SYSTEM_PROMPT"] = args.system_prompt

    t0 = time.monotonic()
    server = await asyncio.to_thread(
        start_server, adapter="cascade", env=env, ready_timeout=args.ready_timeout
    )
    ready_s = time.monotonic() - t0
    try:
        health = server.health()[1].get("engine", {})
        turns: list[Turn] = []
        for q, keywords in questions:
            (turn,) = await conversation(
                server,
                [(q, "question")],
                instructions=args.instructions,
                timeout=args.turn_timeout,
            )
            turn.ok = correct(q, turn.answer, keywords)
            turns.append(turn)
            print(
                f"[question] {q!r} -> {turn.answer!r} ({turn.latency_ms:.0f} ms)", file=sys.stderr, flush=True
            )
        recalls: list[bool] = []
        for name, q, keywords in exchanges:
            first, second = await conversation(
                server,
                [(f"My name is {name}. {q}", "exchange-1"), (NAME_QUESTION, "exchange-2")],
                instructions=args.instructions,
                timeout=args.turn_timeout,
            )
            first.ok = correct(q, first.answer, keywords)
            second.ok = mentions(second.answer, (name,))
            recalls.append(second.ok)
            turns += [first, second]
            print(f"[exchange] {name}: {first.answer!r} / {second.answer!r}", file=sys.stderr, flush=True)
    finally:
        await asyncio.to_thread(server.stop)

    plain = [t for t in turns if t.kind == "question"]
    latencies = [t.latency_ms for t in turns if t.latency_ms == t.latency_ms]
    accuracy = sum(bool(t.ok) for t in plain) / len(plain)
    name_recall = sum(recalls) / len(recalls)
    print()
    print_table(turns)
    print(
        f"\naccuracy {accuracy:.2f} ({sum(bool(t.ok) for t in plain)}/{len(plain)}), name recall "
        f"{name_recall:.2f} ({sum(recalls)}/{len(recalls)}), latency p50 {pct(latencies, 50):.0f} ms "
        f"p95 {pct(latencies, 95):.0f} ms over {len(latencies)} replies; server ready in {ready_s:.0f} s, "
        f"wall {time.monotonic() - t0:.0f} s"
    )
    finish(
        {
            "accuracy": accuracy,
            "name_recall": name_recall,
            "latency_p50_ms": pct(latencies, 50),
            "latency_p95_ms": pct(latencies, 95),
            "first_turn_accuracy": sum(bool(t.ok) for t in turns if t.kind == "exchange-1") / len(exchanges),
            "replies": len(latencies),
            "turns": len(turns),
            "no_reply": sum(1 for t in turns if t.latency_ms != t.latency_ms),
            "errors": sum(1 for t in turns if t.error),
            "backend": health.get("backend", args.backend),
            "model": health.get("model", args.model or "default"),
            "settings": settings_note,
            "instructions": args.instructions,
            "system_prompt": args.system_prompt,
            "examples": args.examples,
            "quick": args.quick,
            "server_ready_s": ready_s,
            "rows": [
                {
                    "kind": t.kind,
                    "question": t.question,
                    "heard": t.heard,
                    "answer": t.answer,
                    "ok": t.ok,
                    "latency_ms": t.latency_ms,
                }
                for t in turns
            ],
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
