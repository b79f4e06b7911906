"""The caller's side of the spoken benchmarks: a microphone that speaks over the Live WebSocket at real time, and
what the caller hears (received audio with arrival times, scanned for audible 10 ms windows).

Every spoken benchmark measures a turn the same way, where the caller is:

* **speech end** = the wall time the caller sent the frame that holds its last audible sample (the last 10 ms
  window above :data:`~tests.speech_fixtures.AUDIBLE_DBFS`, -45 dBFS, of the clip it speaks);
* **heard** = the arrival time of the received chunk that holds the first audible window of the answer, plus the
  window's offset inside that chunk: when a player that starts each chunk on arrival plays that sample.

:class:`HeardAudio` does the second part for any transport (engine egress frames, Live WebSocket deltas, WebRTC
frames after the jitter buffer); :class:`LiveOutput` feeds it from a :class:`LiveClient`.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import ROOT  # noqa: F401  (puts the repository root on sys.path)

from livekit_omni.live import wire
from testkit.live_client import LiveClient
from tests.conftest import ServerProcess
from tests.speech_fixtures import AUDIBLE_DBFS, loud_windows, speech_bounds_ms, synthesize_speech

#: The spoken questions of the benchmarks' callers (short factual questions SmolLM2 answers in a sentence).
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
#: The rates the callers use: PCM16 at 24 kHz over the Live WebSocket; Opus's 48 kHz over WebRTC.
WS_RATE = 24_000
WEBRTC_RATE = 48_000


class HeardAudio:
    """Received audio as the caller hears it: chunks with arrival times, scanned in whole 10 ms windows.

    :attr:`loud` lists (window index, time heard) for every window above ``floor_db``; a window is heard at its
    chunk's arrival time plus its offset into the chunk (a window that straddles two chunks counts in the first).
    """

    def __init__(self, rate: int, floor_db: float = AUDIBLE_DBFS, *, keep_levels: bool = False) -> None:
        if rate % 100:
            raise ValueError("the rate must hold whole 10 ms windows")
        self.rate = rate
        self.window = rate // 100
        self.floor_db = floor_db
        self.loud: list[tuple[int, float]] = []
        #: With ``keep_levels``: (dBFS, time heard) of every scanned window, loud or not.
        self.levels: list[tuple[float, float]] | None = [] if keep_levels else None
        self._samples = 0  # samples received
        self._starts: list[int] = []  # first sample of each chunk
        self._arrivals: list[float] = []
        self._tail = np.zeros(0, dtype=np.int16)  # received samples not yet in a scanned window
        self._scanned = 0  # windows scanned
        self._chunk = 0  # chunk holding the first unscanned window (the scan only moves forward)

    def add(self, arrival: float, pcm: npt.NDArray[np.int16]) -> None:
        if not len(pcm):
            return
        self._starts.append(self._samples)
        self._arrivals.append(arrival)
        self._samples += len(pcm)
        self._tail = np.concatenate([self._tail, pcm.astype(np.int16, copy=False)])

    def scan(self) -> None:
        """Examine the windows completed since the last scan."""
        n = len(self._tail) // self.window
        if not n:
            return
        hits = loud_windows(self._tail[: n * self.window], self.rate, self.floor_db)
        if self.levels is not None:
            # heard_at() only moves forward: every window's time once, in order, then the loud ones from those.
            x = self._tail[: n * self.window].astype(np.float64).reshape(n, self.window)
            db = 20 * np.log10(np.maximum(np.sqrt((x * x).mean(axis=1)), 1e-3) / 32768)
            times = [self.heard_at((self._scanned + i) * self.window) for i in range(n)]
            self.levels.extend(zip(db.tolist(), times, strict=True))
            self.loud.extend((self._scanned + int(i), times[int(i)]) for i in hits)
        else:
            for i in hits:
                w = self._scanned + int(i)
                self.loud.append((w, self.heard_at(w * self.window)))
        self._tail = self._tail[n * self.window :]
        self._scanned += n

    def heard_at(self, sample: int) -> float:
        """When ``sample`` (index into everything received) plays, given each chunk starts on arrival."""
        while self._chunk + 1 < len(self._starts) and self._starts[self._chunk + 1] <= sample:
            self._chunk += 1
        return self._arrivals[self._chunk] + (sample - self._starts[self._chunk]) / self.rate

    def windows_received(self) -> int:
        return self._samples // self.window

    def first_loud_after(self, t: float, from_window: int = 0) -> tuple[int, float] | None:
        """The first audible window at or after ``from_window`` heard at or after ``t``."""
        # The windows are in order: skip those before from_window without looking at them (a long call).
        start = bisect.bisect_left(self.loud, (from_window, -math.inf))
        return next((self.loud[i] for i in range(start, len(self.loud)) if self.loud[i][1] >= t), None)


class LiveOutput(HeardAudio):
    """:class:`HeardAudio` of a Live WebSocket client's output (its ``session.output_audio.delta`` bytes).

    ``trim=True`` removes what was scanned from the client's buffers (a long call: the soak), so only the
    windows' timing stays."""

    def __init__(
        self, client: LiveClient, rate: int, floor_db: float = AUDIBLE_DBFS, *, trim: bool = False
    ) -> None:
        super().__init__(rate, floor_db)
        self.client = client
        self.trim = trim
        self._delta = 0
        self._offset = 0

    def scan(self) -> None:
        deltas = self.client.deltas
        while self._delta < len(deltas):
            at, n = deltas[self._delta]
            raw = bytes(self.client.audio[self._offset : self._offset + n])
            self.add(at, np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<i2"))
            self._delta += 1
            self._offset += n
        if self.trim:
            del self.client.audio[: self._offset]
            del deltas[: self._delta]
            self._offset = self._delta = 0
        super().scan()


@dataclass
class _Utterance:
    pcm: npt.NDArray[np.int16]
    last_loud_chunk: int
    sent_end: asyncio.Future[float]


def marked_sample(pcm: npt.NDArray[np.int16], rate: int, mark: str) -> int:
    """The clip's last audible sample (``mark="end"``: where voice-to-voice starts) or its first (``"onset"``:
    where a barge-in starts)."""
    start_ms, end_ms = speech_bounds_ms(pcm, rate)
    if mark == "onset":
        return start_ms * rate // 1000
    if mark == "end":
        return end_ms * rate // 1000 - 1
    raise ValueError(f"mark is 'end' or 'onset', not {mark!r}")


class Microphone:
    """Streams 20 ms PCM appends over the Live WebSocket at real time for the whole session: queued utterances,
    silence otherwise (what a browser's microphone does)."""

    def __init__(self, client: LiveClient, rate: int) -> None:
        self.client = client
        self.rate = rate
        self.chunk = rate // 50
        self._queue: asyncio.Queue[_Utterance] = asyncio.Queue()
        self._silence = base64.b64encode(bytes(self.chunk * 2)).decode()
        self._task = asyncio.create_task(self._run())

    def say(self, text: str, lead_silence_ms: int = 200, mark: str = "end") -> asyncio.Future[float]:
        """Queue ``text`` (Piper); the future resolves to the wall time its last audible sample was sent (its first
        with ``mark="onset"``)."""
        pcm = synthesize_speech(text, rate=self.rate, lead_silence_ms=lead_silence_ms, tail_silence_ms=0)
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Utterance(pcm, marked_sample(pcm, self.rate, mark) // self.chunk, fut))
        return fut

    async def _run(self) -> None:
        t0 = time.monotonic()
        sent = 0
        current: _Utterance | None = None
        pos = 0
        while True:
            if current is None and not self._queue.empty():
                current, pos = self._queue.get_nowait(), 0
            if current is None:
                payload = self._silence
            else:
                chunk = current.pcm[pos * self.chunk : (pos + 1) * self.chunk]
                chunk = np.pad(chunk, (0, self.chunk - len(chunk)))
                payload = base64.b64encode(chunk.astype("<i2").tobytes()).decode()
            await self.client.send({"type": "session.input_audio.append", "audio": payload})
            if current is not None:
                if pos == current.last_loud_chunk and not current.sent_end.done():
                    current.sent_end.set_result(time.monotonic())
                pos += 1
                if pos * self.chunk >= len(current.pcm):
                    current = None
            sent += 1
            await asyncio.sleep(max(0.0, t0 + sent * self.chunk / self.rate - time.monotonic()))

    async def stop(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # a closed socket ends the stream too
            pass


async def hear_answer(
    heard: HeardAudio, speech_end: float, from_window: int, *, timeout: float, quiet_s: float = 1.2
) -> float | None:
    """The time the first audible window of an answer is heard: the first one at or after ``from_window`` heard
    at or after ``speech_end`` (the caller's last audible sample), or None within ``timeout``. Returns once the
    answer has played out (``quiet_s`` of received output quiet after its last audible window), so the next
    question is not a barge-in."""
    first: tuple[int, float] | None = None
    deadline = speech_end + timeout
    quiet_windows = round(quiet_s * 100)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        heard.scan()
        if first is None:
            first = heard.first_loud_after(speech_end, from_window)
        if first is not None and heard.windows_received() - 1 - heard.loud[-1][0] >= quiet_windows:
            break
    return first[1] if first is not None else None


# --- callers of a running server ------------------------------------------------------------------------------
@dataclass
class CallerLeg:
    """One caller of the server: how it speaks a question (→ the time its last audible sample was sent), what it
    hears, and the transcript events it has received so far as (type, text)."""

    path: str
    #: ``say(text, mark="end")`` → the time the marked sample was sent (see :func:`marked_sample`).
    say: Callable[..., Awaitable[float]]
    heard: HeardAudio
    transcripts: Callable[[], list[tuple[str, str]]]
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    #: Send one Live command (a dict) to the server.
    send: Callable[[dict[str, Any]], Awaitable[None]] | None = None
    #: ``say_pcm(pcm, mark="end")``: speak a clip at the leg's rate (not Piper's) → the time the marked sample was sent.
    say_pcm: Callable[..., Awaitable[float]] | None = None


async def ws_leg(server: ServerProcess) -> CallerLeg:
    client = await LiveClient.connect(server.url, api_key=None)
    started = await client.start(
        {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": WS_RATE}}}
    )
    if not isinstance(started, wire.SessionStarted):
        raise RuntimeError(f"session.start refused: {started}")
    mic = Microphone(client, WS_RATE)

    def transcripts() -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for e in client.events:
            if isinstance(e, wire.InputTranscriptDelta):
                out.append(("input", e.delta + " "))
            elif isinstance(e, wire.OutputTranscriptDelta):
                out.append(("output", e.delta))
        return out

    async def close() -> None:
        await mic.stop()
        with contextlib.suppress(Exception):
            await client.send({"type": "session.close"})
            await client.next_event(wire.SessionClosed, timeout=5)
        await client.close()

    return CallerLeg(
        "ws",
        lambda q, mark="end": mic.say(q, mark=mark),
        LiveOutput(client, WS_RATE),
        transcripts,
        [close],
        client.send,
    )


async def webrtc_leg(
    server: ServerProcess, *, keep_levels: bool = False, instructions: str | None = None
) -> CallerLeg:
    import aiohttp

    from media.webrtc import enable_loopback_ice
    from testkit.webrtc_caller import WebRTCCaller

    enable_loopback_ice()  # the server runs with webrtc.loopback_only; this side gathers 127.0.0.1 too
    heard = HeardAudio(WEBRTC_RATE, keep_levels=keep_levels)
    caller = WebRTCCaller(loop=False, on_audio=heard.add, record_audio=False)
    session: dict[str, Any] = {"model": "gpt-live-1"}
    if instructions:
        session["instructions"] = instructions
    body = {"session": session, "transport": {"type": "webrtc", "sdp": await caller.offer()}}
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.url + "/v1/live/sessions", json=body) as r,
    ):
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"WebRTC session refused: {r.status} {answer}")
    await caller.accept(answer["transport"]["sdp"])
    await asyncio.wait_for(caller.opened.wait(), 15)
    events: list[tuple[str, str]] = []

    def transcripts() -> list[tuple[str, str]]:
        while caller.messages:
            ev = json.loads(caller.messages.popleft())
            if ev["type"] == "session.input_transcript.delta":
                events.append(("input", ev["delta"] + " "))
            elif ev["type"] == "session.output_transcript.delta":
                events.append(("output", ev["delta"]))
        return events

    async def say_pcm(pcm: npt.NDArray[np.int16], mark: str = "end") -> float:
        return await caller.say(pcm, marked_sample(pcm, WEBRTC_RATE, mark))

    async def say(q: str, mark: str = "end") -> float:
        return await say_pcm(
            synthesize_speech(q, rate=WEBRTC_RATE, lead_silence_ms=200, tail_silence_ms=0), mark
        )

    async def send(cmd: dict[str, Any]) -> None:
        caller.send(json.dumps(cmd))

    async def close() -> None:
        with contextlib.suppress(Exception):
            caller.send(json.dumps({"type": "session.close", "event_id": "bye"}))
            await asyncio.sleep(0.3)
        await caller.close()

    return CallerLeg("webrtc", say, heard, transcripts, [close], send, say_pcm)
