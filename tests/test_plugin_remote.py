"""Acceptance: a real ``AgentSession`` on ``OmniDuplexModel`` in remote mode (the OpenAI Live WebSocket) against a
real ``livekit-omni serve`` process whose engine runs the embedded cascade (VAD → whisper → SmolLM2 → Piper).

The caller is Piper speech fed at real time through an in-memory microphone; the agent's audio goes to an
in-memory speaker (tests/plugin_harness.py). Only LiveKit's room is replaced: it needs a LiveKit server. The
Live wire has no reply boundaries, so what the engine kept after the barge-in is read from the server's engine
directly (its control socket), by the Live session id. One server serves the whole module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from livekit_omni import OmniDuplexModel
from livekit_omni.live import wire
from livekit_omni.plugin.remote import RemoteSession
from tests.conftest import ServerProcess, start_server
from tests.plugin_harness import (
    STORY,
    ask_and_wait,
    assistant_between,
    chat,
    final_before_stop,
    start_conversation,
    words,
)

pytestmark = pytest.mark.models

INSTRUCTIONS = "You are a helpful assistant. Answer briefly."


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server(adapter="cascade")
    yield srv
    srv.stop()


async def engine_log(server: ServerProcess, session_id: str) -> list[p.LogEntry]:
    client = await EngineClient.connect("unix:" + server.socket_path)
    try:
        return (await client.session_stats(session_id)).log
    finally:
        await client.close()


def loud(frame: Any) -> bool:
    return bool(np.abs(np.frombuffer(frame.data, np.int16)).max(initial=0) > 500)


async def test_two_spoken_turns_and_a_barge_in_over_the_live_websocket(server: ServerProcess) -> None:
    model = OmniDuplexModel(base_url=server.url + "/v1")
    conv = await start_conversation(model, rate=24_000, instructions=INSTRUCTIONS)
    duplex = conv.duplex
    assert isinstance(duplex, RemoteSession)
    sent: list[str] = []
    duplex.on("omni_client_event", lambda ev: sent.append(wire.event_type(ev)))
    t0 = time.monotonic()
    try:
        first = await ask_and_wait(conv, "Hello, my name is Alice.", settle_s=2.0)
        assert words(first), conv.rec.summary()
        await ask_and_wait(conv, "What is the capital of France?", expect=frozenset({"paris"}), settle_s=2.0)
        users = conv.texts("user")
        assert len(users) == 2
        assert "alice" in words(users[0]) and {"capital", "france"} <= set(words(users[1]))
        assert final_before_stop(conv.rec)

        # A long answer, and the caller talks over it once ~1.5 s of it has played.
        story_from = len(chat(conv.rec))
        loud0 = conv.speaker.loud_seconds()
        conv.session.generate_reply(instructions=STORY)
        await conv.rec.wait_for(lambda: conv.speaker.loud_seconds() - loud0 > 1.5, 60, "the story to play")
        t_cut = await conv.say("Wait, stop. What is the capital of France?")
        await conv.rec.wait_for(lambda: len(conv.texts("user")) >= 3, 60, "the interrupting question")
        story, question = assistant_between(conv.rec, story_from)
        await conv.rec.wait_for(
            lambda: bool(words(assistant_between(conv.rec, question + 1)[0])), 60, "the next answer"
        )
        await conv.settle(quiet_s=2.0)
        following = assistant_between(conv.rec, question + 1)[0]
        # The story stopped: between the end of the caller's question and the next answer nothing played.
        next_start = min(
            t
            for t, n, ev in conv.rec.events
            if n == "agent_state_changed" and t > t_cut and ev.new_state == "speaking"
        )
        assert not [t for t, f in conv.speaker.frames if t_cut < t < next_start - 0.05 and loud(f)]
        # Its message holds only what was played.
        assert duplex.session_id is not None
        log = await engine_log(server, duplex.session_id)
        cut = [s for s in log if s.role == "assistant" and s.interrupted]
        assert cut, log
        told, kept = words(story), words(cut[-1].text)
        # The engine keeps what the caller heard at full level; the words that played under the duck reach no client
        # (the media plane holds their transcript until the verdict), so the message is that, plus at most the
        # word in flight when the duck came.
        assert kept and told[: len(kept)] == kept and len(told) - len(kept) <= 1, (story, cut[-1].text)
        assert 0 < len(told) < 30
        # And the next answer followed the caller's interrupting question.
        assert words(following), conv.rec.summary()
        assert {"capital", "france"} <= set(words(conv.texts("user")[-1]))
        # One Live session throughout; the story was asked for with a commentary append.
        assert not conv.rec.of("duplex.session_reconnected") and "session.commentary.append" in sent
        usage = conv.session.usage.model_usage
        assert usage and 0 < usage[0].session_duration <= time.monotonic() - t0 + 1
        assert not [e for e in conv.rec.of("duplex.error")], conv.rec.summary()
    finally:
        await conv.aclose()
        await model.aclose()
