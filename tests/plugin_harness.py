"""In-memory audio I/O and an event recorder for running a real ``AgentSession`` without a LiveKit room
(docs/development.md, No LiveKit room): the one thing these tests cannot run here is a LiveKit server, so the room's
microphone and speaker are replaced by :class:`Mic` (caller audio fed at real time) and :class:`Speaker` (counts
what the agent plays). Everything between them — AgentSession, the duplex adapter, the plugin, the engine — is real.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from livekit import rtc
from livekit.agents import AgentSession, llm
from livekit.agents.voice import io


class Mic(io.AudioInput):
    """Caller audio at real time: queued clips, digital silence between them (a live microphone never stops)."""

    def __init__(self, rate: int = 48_000, *, frame_ms: int = 20, channels: int = 1) -> None:
        super().__init__(label="test-mic")
        self.rate = rate
        self.channels = channels
        self.samples = rate * frame_ms // 1000
        self.frame_s = frame_ms / 1000
        self._clips: collections.deque[tuple[np.ndarray, asyncio.Future[float]]] = collections.deque()
        self._pos = 0
        self._t0: float | None = None
        self._k = 0
        self.frames = 0

    def say(self, pcm: np.ndarray) -> asyncio.Future[float]:
        """Queue ``pcm`` (int16 mono at :attr:`rate`); the future resolves (with the wall time) once its last
        frame has been delivered."""
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._clips.append((pcm.astype(np.int16), fut))
        return fut

    async def __anext__(self) -> rtc.AudioFrame:
        loop = asyncio.get_running_loop()
        if self._t0 is None:
            self._t0 = loop.time()
        deadline = self._t0 + self._k * self.frame_s
        if (delay := deadline - loop.time()) > 0:
            await asyncio.sleep(delay)
        elif -delay > 0.2:
            # The loop stalled: restart the clock rather than deliver a burst.
            self._t0, self._k = loop.time(), 0
        self._k += 1
        out = np.zeros(self.samples, dtype=np.int16)
        filled = 0
        while filled < self.samples and self._clips:
            clip, fut = self._clips[0]
            take = min(self.samples - filled, clip.shape[0] - self._pos)
            out[filled : filled + take] = clip[self._pos : self._pos + take]
            filled += take
            self._pos += take
            if self._pos >= clip.shape[0]:
                self._clips.popleft()
                self._pos = 0
                if not fut.done():
                    fut.set_result(time.monotonic())
        self.frames += 1
        data = np.repeat(out, self.channels) if self.channels > 1 else out
        return rtc.AudioFrame(data.tobytes(), self.rate, self.channels, self.samples)


class Speaker(io.AudioOutput):
    """The agent's audio sink: records every frame it is given, with its wall time; playback is instant."""

    def __init__(self) -> None:
        super().__init__(label="test-speaker", capabilities=io.AudioOutputCapabilities(pause=False))
        self.frames: list[tuple[float, rtc.AudioFrame]] = []
        self.pushed = 0.0
        self.played = 0.0
        self.segments = 0
        self._segment_open = False

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        if not self._segment_open:
            # A real sink reports when a segment starts playing; the agent turns "speaking" on it.
            self._segment_open = True
            self.on_playback_started(created_at=time.time())
        await super().capture_frame(frame)
        self.frames.append((time.monotonic(), frame))
        self.pushed += frame.duration

    def flush(self) -> None:
        super().flush()
        self._finish(interrupted=False)

    def clear_buffer(self) -> None:
        self._finish(interrupted=True)

    def _finish(self, *, interrupted: bool) -> None:
        # Exactly one playback_finished per captured segment: playback is instant, so a segment is over as soon as
        # it is flushed (or cleared while it was still being captured).
        if not self._segment_open:
            return
        self._segment_open = False
        d, self.pushed = self.pushed, 0.0
        self.played += d
        self.segments += 1
        asyncio.get_running_loop().call_soon(
            lambda: self.on_playback_finished(playback_position=d, interrupted=interrupted)
        )

    def loud_seconds(self, threshold: int = 500) -> float:
        return sum(
            f.duration
            for _, f in self.frames
            if np.abs(np.frombuffer(f.data, np.int16)).max(initial=0) > threshold
        )


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


@dataclass
class Recorder:
    """Everything an AgentSession reports, with wall times, plus the duplex session's own events."""

    session: AgentSession
    events: list[tuple[float, str, Any]] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    close_event: Any = None

    def __post_init__(self) -> None:
        s = self.session
        for name in (
            "conversation_item_added",
            "agent_state_changed",
            "user_state_changed",
            "user_input_transcribed",
            "error",
            "session_usage_updated",
        ):
            s.on(name, lambda ev, n=name: self.events.append((time.monotonic(), n, ev)))
        s.on("close", self._on_close)

    def _on_close(self, ev: Any) -> None:
        self.close_event = ev
        self.events.append((time.monotonic(), "close", ev))
        self.closed.set()

    def watch_duplex(self, duplex: llm.DuplexSession) -> None:
        for name in (
            "input_speech_started",
            "input_speech_stopped",
            "input_audio_transcription_completed",
            "transcript_delta",
            "error",
            "omni_reply_done",
            "omni_barge_in",
            "session_reconnected",
            "metrics_collected",
        ):
            duplex.on(name, lambda ev, n=name: self.events.append((time.monotonic(), "duplex." + n, ev)))

    def of(self, name: str) -> list[Any]:
        return [ev for _, n, ev in self.events if n == name]

    def messages(self, role: str | None = None) -> list[llm.ChatMessage]:
        items = [ev.item for ev in self.of("conversation_item_added")]
        return [m for m in items if isinstance(m, llm.ChatMessage) and (role is None or m.role == role)]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.closed.is_set():
                raise AssertionError(f"session closed while waiting for {what}: {self.close_event}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout} s waiting for {what}; events: {self.summary()}"
                )
            await asyncio.sleep(0.05)

    def agent_state(self) -> str:
        states = self.of("agent_state_changed")
        return states[-1].new_state if states else "initializing"

    def summary(self) -> list[str]:
        out = []
        t0 = self.events[0][0] if self.events else 0.0
        for t, n, ev in self.events:
            if n in ("duplex.transcript_delta", "duplex.metrics_collected", "session_usage_updated"):
                continue
            detail = ""
            if n == "conversation_item_added" and isinstance(ev.item, llm.ChatMessage):
                detail = f"{ev.item.role}: {ev.item.text_content!r}"
            elif n in ("agent_state_changed", "user_state_changed"):
                detail = f"{ev.old_state}->{ev.new_state}"
            elif n in ("user_input_transcribed",):
                detail = f"{ev.transcript!r} final={ev.is_final}"
            elif n == "duplex.omni_reply_done":
                detail = f"turn {ev.turn_id} interrupted={ev.interrupted} {ev.text!r}"
            elif n in ("error", "duplex.error"):
                detail = repr(getattr(ev, "error", ev))
            out.append(f"{t - t0:6.2f} {n} {detail}")
        return out


STORY = (
    "Tell the caller this whole story: the old lighthouse keeper climbed the stairs every evening, lit the great "
    "lamp, watched the ships pass through the storm, and wrote their names in his book until dawn."
)


@dataclass
class Conversation:
    """A started AgentSession on a duplex model with an in-memory caller (see :func:`start_conversation`)."""

    session: AgentSession
    mic: Mic
    speaker: Speaker
    rec: Recorder
    duplex: llm.DuplexSession
    started_at: float = field(default_factory=time.monotonic)

    async def say(self, text: str) -> float:
        """Speak ``text`` (Piper speech at the microphone's rate) and wait until it has been fed."""
        from tests.speech_fixtures import synthesize_speech

        return await self.mic.say(
            synthesize_speech(text, rate=self.mic.rate, lead_silence_ms=300, tail_silence_ms=0)
        )

    def texts(self, role: str) -> list[str]:
        return [m.text_content or "" for m in self.rec.messages(role)]

    async def settle(self, quiet_s: float = 1.5, timeout: float = 60) -> None:
        """Wait until the agent has been listening for ``quiet_s`` (a reply may come in several bursts)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.rec.of("agent_state_changed")
            last_change = next(
                (t for t, n, _ in reversed(self.rec.events) if n == "agent_state_changed"), 0.0
            )
            if states and states[-1].new_state == "listening" and time.monotonic() - last_change >= quiet_s:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the agent did not settle; events: {self.rec.summary()}")
            await asyncio.sleep(0.05)

    async def aclose(self) -> None:
        await self.session.aclose()


async def start_conversation(model: llm.DuplexModel, *, rate: int, instructions: str) -> Conversation:
    from livekit.agents import Agent

    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(rate), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    rec = Recorder(session)
    await session.start(Agent(instructions=instructions))
    duplex = session.current_agent.duplex_session
    rec.watch_duplex(duplex)
    ready = getattr(duplex, "wait_ready", None)
    if ready is not None:
        assert await asyncio.wait_for(ready(), 30), "the duplex session did not open"
    return Conversation(session, mic, speaker, rec, duplex)


def final_before_stop(rec: Recorder) -> bool:
    """LiveKit wants each turn's final transcript before its input_speech_stopped."""
    pending = False
    seen_stop = 0
    for _, n, ev in rec.events:
        if n == "duplex.input_audio_transcription_completed" and ev.is_final:
            pending = True
        elif n == "duplex.input_speech_stopped":
            if not pending:
                return False
            pending = False
            seen_stop += 1
    return seen_stop > 0


def chat(rec: Recorder) -> list[llm.ChatMessage]:
    """The caller's and the agent's messages, in the order they were added."""
    return [m for m in rec.messages() if m.role in ("user", "assistant")]


def assistant_between(rec: Recorder, start: int) -> tuple[str, int]:
    """The agent's words in the messages from index ``start`` of :func:`chat` up to the next caller message
    (joined: one reply may arrive in several bursts), and that caller message's index (or the message count)."""
    msgs = chat(rec)
    text = ""
    for i in range(start, len(msgs)):
        if msgs[i].role == "user":
            return text, i
        text += msgs[i].text_content or ""
    return text, len(msgs)


async def ask_and_wait(
    conv: Conversation,
    text: str,
    *,
    expect: frozenset[str] = frozenset(),
    settle_s: float,
    timeout: float = 60,
) -> str:
    """Say ``text``; wait until the agent's reply to it holds words (all of ``expect``) and the agent has been
    listening for ``settle_s``. Returns the reply."""
    start = len(chat(conv.rec))

    def reply() -> str:
        msgs = chat(conv.rec)
        user = next((i for i in range(start, len(msgs)) if msgs[i].role == "user"), None)
        return "" if user is None else assistant_between(conv.rec, user + 1)[0]

    await conv.say(text)
    await conv.rec.wait_for(
        lambda: bool(words(reply())) and expect <= set(words(reply())), timeout, f"the reply to {text!r}"
    )
    await conv.settle(quiet_s=settle_s)
    return reply()


def history_messages(session: AgentSession, role: str) -> list[str]:
    """The text of every message of ``role`` in the AgentSession's history, in order."""
    return [
        (item.text_content or "")
        for item in session.history.items
        if item.type == "message" and item.role == role
    ]


async def wait_until(cond: Callable[[], object], timeout: float, what: str = "the condition") -> None:
    """Poll ``cond`` every 100 ms until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
