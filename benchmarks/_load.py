"""Load of spoken conversations for benchmarks/capacity.py and benchmarks/soak.py: scripted callers over the Live
WebSocket, and what the server process and its engine report (CPU, RSS, /metrics, /health).

A :class:`ScriptedCaller` is one conversation: a Live WebSocket session (PCM 24 kHz) with a microphone that streams
at real time for the whole call (benchmarks/_callers.py). It asks questions (Piper speech), measures each answer
the way every spoken benchmark does (the caller's last audible sample → the answer's first audible sample where the
caller hears it) and waits for the answer to play out; every ``barge_every``-th turn it does not wait: half a second
into the answer it asks the next question over it (a barge-in), so that question's answer follows a cut reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _callers import QUESTIONS, LiveOutput, Microphone, hear_answer
from _common import ROOT  # noqa: F401  (puts the repository root on sys.path)
from prometheus_client.parser import text_string_to_metric_families

from livekit_omni.live import wire
from testkit.live_client import LiveClient

RATE = 24_000
#: An answer is over once this much received output has been quiet after its last audible window.
QUIET_AFTER_REPLY_S = 1.2
#: How far into an answer the caller barges in.
BARGE_AFTER_S = 0.5
TURN_TIMEOUT_S = 25.0
NAN = float("nan")
#: What the model answers the callers' questions, for a history that stands for minutes of conversation.
ANSWERS = [
    "The capital of France is Paris, a city famous for the Eiffel Tower and its museums.",
    "A spider has eight legs, which makes it an arachnid and not an insect.",
    "The sky is blue on a clear day, because air scatters blue sunlight the most.",
    "Two plus two is four, one of the first sums most children learn.",
    "The largest planet is Jupiter, a gas giant more than eleven times as wide as Earth.",
    "There are seven days in a week, from Monday to Sunday.",
    "The capital of Italy is Rome, which is nearly three thousand years old.",
    "Bees make honey from the nectar of flowers, and they store it in wax combs.",
    "The opposite of hot is cold, like ice compared with a cup of tea.",
    "A cow says moo, and it usually lives on a farm with other cattle.",
]


def earlier_turns(tokens: int) -> list[dict[str, Any]]:
    """``session.start`` input items: the callers' own questions and answers, repeated until they hold about
    ``tokens`` tokens (SmolLM2's chat template: ~4 characters a token plus ~5 tokens a message). A conversation
    that starts with them is one that has been talking for minutes: its context is as long as a soak's."""
    items: list[dict[str, Any]] = []
    total = 0
    i = 0
    while total < tokens:
        q, a = QUESTIONS[i % len(QUESTIONS)], ANSWERS[i % len(ANSWERS)]
        items.append({"role": "user", "content": [{"type": "input_text", "text": q}]})
        items.append({"role": "assistant", "content": [{"type": "output_text", "text": a}]})
        total += (len(q) + len(a)) // 4 + 10
        i += 1
    return items


@dataclass
class Turn:
    caller: int
    turn: int
    question: str
    #: This question was asked over the previous answer.
    barge_in: bool
    #: Wall time (monotonic) the question's last audible sample was sent.
    speech_end: float
    #: Caller's last audible sample → first audible sample of the answer; NaN when no answer came.
    v2v_ms: float


class ScriptedCaller:
    def __init__(self, index: int, client: LiveClient) -> None:
        self.index = index
        self.client = client
        self.mic = Microphone(client, RATE)
        self.out = LiveOutput(client, RATE, trim=True)
        self.turns: list[Turn] = []

    @classmethod
    async def open(
        cls, url: str, index: int, api_key: str | None = None, *, history_tokens: int = 0
    ) -> ScriptedCaller:
        """A session, started with about ``history_tokens`` of earlier turns (:func:`earlier_turns`)."""
        client = await LiveClient.connect(url, api_key=api_key)
        config: dict[str, Any] = {
            "model": "gpt-live-1",
            "audio": {"format": {"type": "audio/pcm", "rate": RATE}},
        }
        if history_tokens:
            config["input"] = earlier_turns(history_tokens)
        started = await client.start(config, timeout=60.0)
        if not isinstance(started, wire.SessionStarted):
            await client.close()
            raise RuntimeError(f"session.start refused: {started}")
        return cls(index, client)

    @property
    def alive(self) -> bool:
        return not self.client.closed.is_set()

    def received_s(self) -> float:
        """Seconds of output audio received so far (the server sends silence between answers too)."""
        return self.client.audio_bytes / 2 / RATE

    async def converse(
        self,
        *,
        turns: int | None = None,
        until: float | None = None,
        barge_every: int = 3,
        on_turn: Callable[[Turn], None] | None = None,
    ) -> None:
        """Ask questions until ``turns`` are done or the wall time ``until`` has passed (the turn under way is
        finished), or the session has ended."""
        barge_in = False
        t = 0
        while (turns is None or t < turns) and (until is None or time.monotonic() < until) and self.alive:
            q = QUESTIONS[(self.index * 3 + t) % len(QUESTIONS)]
            self.out.scan()
            start_window = self.out.windows_received()  # what arrives from now on belongs to this turn
            speech_end = await self.mic.say(q)
            more = (turns is None or t + 1 < turns) and (until is None or time.monotonic() < until)
            barge_next = more and barge_every > 0 and (self.index + t) % barge_every == barge_every - 1
            # quiet_s=0: return at the answer's first audible sample (it is then interrupted).
            first = await hear_answer(
                self.out,
                speech_end,
                start_window,
                timeout=TURN_TIMEOUT_S,
                quiet_s=0.0 if barge_next else QUIET_AFTER_REPLY_S,
            )
            turn = Turn(
                self.index, t + 1, q, barge_in, speech_end, (first - speech_end) * 1000 if first else NAN
            )
            self.turns.append(turn)
            if on_turn is not None:
                on_turn(turn)
            barge_in = barge_next and first is not None
            await asyncio.sleep(BARGE_AFTER_S if barge_in else 0.3)
            t += 1

    async def close(self) -> None:
        await self.mic.stop()
        with contextlib.suppress(Exception):
            await self.client.send({"type": "session.close"})
            await self.client.next_event(wire.SessionClosed, timeout=5)
        await self.client.close()


# ------------------------------------------------------------------------------------------------ server probes
def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The server's /metrics as ``{(sample name, sorted labels): value}`` (prometheus_client's parser)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def losses(url: str) -> dict[str, float]:
    """The media plane's loss counters (see livekit_omni/metrics.py) and the engine's audio tick overruns."""
    m = scrape(url)

    def v(name: str, **labels: str) -> float:
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    dropped = sum(val for (name, _), val in m.items() if name == "livekit_omni_dropped_events_total")
    return {
        "ingress_overruns": v("livekit_omni_ring_overruns_total", ring="ingress"),
        "egress_overruns": v("livekit_omni_ring_overruns_total", ring="egress"),
        "egress_underruns": v("livekit_omni_egress_underruns_total"),
        "dropped_events": dropped,
    }


def health(url: str) -> dict[str, Any]:
    """/health's body, whatever its status (a restarting engine answers 503)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            body: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
    return body


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (psutil when installed, else /proc/PID/status)."""
    try:
        import psutil
    except ImportError:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0
    return int(psutil.Process(pid).memory_info().rss)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (psutil when installed, else /proc/PID/stat)."""
    try:
        import psutil
    except ImportError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)
