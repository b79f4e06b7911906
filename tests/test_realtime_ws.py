"""The Realtime dialect's protocol edges over the WebSocket, against a real ``livekit-omni serve``.

The loopback echo engine is enough here: these tests are about the handshake, auth, the session configuration,
the item table's refusals and the limits, none of which needs speech (the spoken behaviour is in
tests/test_realtime_spoken.py, with the real models). One server for the module (API key ``sk-test``, one engine
session at most, so the session limit is quick to reach). Every server event received is validated against the
openai SDK's ``RealtimeServerEvent`` union in strict mode.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import websockets

from engine_bridge.client import EngineClient
from livekit_omni.realtime.config import EAGERNESS_END_OF_TURN, NO_BARGE_IN_MS
from media.codecs import ulaw_decode, ulaw_encode
from tests.conftest import ServerProcess, start_server
from tests.realtime_checks import ServerEventLog

API_KEY = "sk-test"

#: LiveKit's RealtimeModel start-up update with its defaults, serialized as it sends it (explicit nulls included).
LIVEKIT_UPDATE: dict[str, Any] = {
    "type": "session.update",
    "event_id": "session_update_1a2b3c",
    "session": {
        "type": "realtime",
        "model": "gpt-realtime",
        "output_modalities": ["audio"],
        "max_output_tokens": "inf",
        "tool_choice": "auto",
        "tracing": None,
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "noise_reduction": None,
                "transcription": {"model": "gpt-4o-mini-transcribe"},
                "turn_detection": {
                    "type": "semantic_vad",
                    "create_response": True,
                    "eagerness": "medium",
                    "interrupt_response": True,
                },
            },
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "speed": 1.0, "voice": "marin"},
        },
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server(
        adapter="loopback",
        env={
            "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
            "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": "1",
            "LIVEKIT_OMNI_LIMITS__INPUT_BURST_S": "1.0",
            "LIVEKIT_OMNI_LIMITS__INPUT_BACKPRESSURE_GRACE_S": "1.0",
        },
    )
    yield s
    s.stop()


class Client:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.log = ServerEventLog()

    async def send(self, ev: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(ev))

    async def next(self, timeout: float = 5.0) -> dict[str, Any]:
        return self.log.add(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(self, etype: str, timeout: float = 5.0) -> dict[str, Any]:
        while True:
            ev = await self.next(timeout)
            if ev["type"] == etype:
                return ev

    async def item_event(self, etype: str, item_id: str, timeout: float = 5.0) -> dict[str, Any]:
        while True:
            ev = await self.until(etype, timeout)
            if ev["item"]["id"] == item_id:
                return ev

    async def error(self, code: str) -> dict[str, Any]:
        ev = await self.until("error")
        assert ev["error"]["code"] == code, ev
        return ev

    async def closed(self, timeout: float = 5.0) -> int:
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                self.log.add(await asyncio.wait_for(self.ws.recv(), timeout))
        assert self.ws.close_code is not None
        return int(self.ws.close_code)


@contextlib.asynccontextmanager
async def connect(
    server: ServerProcess,
    path: str = "/v1/realtime?model=gpt-realtime",
    *,
    key: str | None = API_KEY,
    subprotocols: list[str] | None = None,
) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    url = server.url.replace("http://", "ws://") + path
    async with websockets.connect(
        url,
        additional_headers=headers,
        subprotocols=subprotocols,  # type: ignore[arg-type]
        max_size=None,
    ) as ws:
        c = Client(ws)
        yield c
    c.log.validate()


async def test_session_created_first_and_full_echo_of_livekit_defaults(server: ServerProcess) -> None:
    async with connect(server) as c:
        created = await c.next()
        assert created["type"] == "session.created"
        s = created["session"]
        assert s["type"] == "realtime" and s["object"] == "realtime.session" and s["model"] == "gpt-realtime"
        assert s["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        await c.send(LIVEKIT_UPDATE)
        updated = (await c.next())["session"]
        assert (
            updated["audio"]["input"]["turn_detection"]
            == LIVEKIT_UPDATE["session"]["audio"]["input"]["turn_detection"]
        )
        assert updated["audio"]["input"]["transcription"] == {"model": "gpt-4o-mini-transcribe"}
        assert updated["audio"]["input"]["noise_reduction"] is None and updated["tracing"] is None
        # Sparse: a later update changes only what it names.
        await c.send({"type": "session.update", "session": {"type": "realtime", "instructions": "be brief"}})
        again = (await c.next())["session"]
        assert again["instructions"] == "be brief" and again["tools"] == []
        assert again["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
        assert not c.log.of("error")
        # Tools need a model that calls them: this server's loopback adapter refuses them, and nothing changes.
        tools = [
            {"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"}}
        ]
        await c.send({"type": "session.update", "session": {"type": "realtime", "tools": tools}})
        err = await c.until("error")
        assert err["error"]["param"] == "session.tools", err
        assert "does not run function tools" in err["error"]["message"], err


@pytest.mark.parametrize("path", ["/v1/realtime", "/realtime?model=x&foo=1", "/api/v1/realtime?model=m"])
async def test_paths_ending_in_realtime_are_served(server: ServerProcess, path: str) -> None:
    async with connect(server, path) as c:
        assert (await c.next())["type"] == "session.created"


async def test_model_comes_from_the_query(server: ServerProcess) -> None:
    async with connect(server, "/v1/realtime?model=my-model") as c:
        assert (await c.next())["session"]["model"] == "my-model"


async def test_browser_subprotocol_key_is_accepted_and_realtime_selected(server: ServerProcess) -> None:
    protos = ["realtime", f"openai-insecure-api-key.{API_KEY}", "openai-agents-sdk.0.1"]
    async with connect(server, key=None, subprotocols=protos) as c:
        assert c.ws.subprotocol == "realtime"
        assert (await c.next())["type"] == "session.created"


@pytest.mark.parametrize("how", ["bearer", "subprotocol", "none"])
async def test_bad_key_gets_invalid_api_key_and_1008(server: ServerProcess, how: str) -> None:
    kw: dict[str, Any] = {"key": None}
    if how == "bearer":
        kw = {"key": "sk-wrong"}
    elif how == "subprotocol":
        kw = {"key": None, "subprotocols": ["realtime", "openai-insecure-api-key.sk-wrong"]}
    async with connect(server, **kw) as c:
        ev = await c.error("invalid_api_key")
        assert ev["error"]["type"] == "invalid_request_error"
        assert await c.closed() == 1008
        assert not c.log.of("session.created")


@pytest.mark.parametrize(
    ("session", "param"),
    [
        (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "session.audio.input.format.rate",
        ),
        ({"audio": {"output": {"format": {"type": "audio/opus"}}}}, "session.audio.output.format.type"),
        ({"type": "transcription"}, "session.type"),
        ({"temperature": 2.5}, "session.temperature"),
        ({"max_output_tokens": 0}, "session.max_output_tokens"),
        (
            {"audio": {"input": {"turn_detection": {"type": "push_to_talk"}}}},
            "session.audio.input.turn_detection.type",
        ),
        (
            # Once echoed as given (the fuzzer's emoji), which broke the SDK's own session type.
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}},
            "session.audio.input.turn_detection.eagerness",
        ),
    ],
)
async def test_refused_updates_keep_the_old_config(
    server: ServerProcess, session: dict[str, Any], param: str
) -> None:
    async with connect(server) as c:
        before = (await c.next())["session"]
        await c.send({"type": "session.update", "event_id": "u1", "session": {"type": "realtime", **session}})
        ev = await c.error("invalid_value")
        assert ev["error"]["param"] == param and ev["error"]["event_id"] == "u1"
        await c.send({"type": "session.update", "session": {"type": "realtime"}})
        after = (await c.next())["session"]
        assert after["audio"] == before["audio"]


async def _engine_config(server: ServerProcess, session_id: str) -> dict[str, Any]:
    """The settings the engine session holds (its stats), as the client last set them."""
    client = await EngineClient.connect("unix:" + server.socket_path)
    try:
        return dict((await client.session_stats(session_id)).extra["config"])
    finally:
        await client.close()


async def test_session_update_mid_session_reaches_the_engine(server: ServerProcess) -> None:
    """After the engine session opened, every setting the engine honours is sent to it (the cascade's effect of
    each is tests/test_turn_machine.py's and tests/test_realtime_spoken.py's): instructions, voice, temperature,
    the token cap, and turn detection in each mode (server_vad's parameters, semantic_vad's eagerness as the
    end-of-turn model's threshold and longest wait, null as manual: no auto reply, no VAD barge-in)."""
    async with connect(server) as c:
        sid = (await c.next())["session"]["id"]
        await c.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
            }
        )
        await c.until("conversation.item.done")
        before = await _engine_config(server, sid)
        assert before["instructions"] == "" and before["max_output_tokens"] == 0
        await c.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "instructions": "Answer like a pirate.",
                    "temperature": 0.8,
                    "max_output_tokens": 5,
                    "audio": {
                        "output": {"voice": "en-us"},
                        "input": {
                            "turn_detection": {
                                "type": "server_vad",
                                "threshold": 0.7,
                                "prefix_padding_ms": 200,
                                "silence_duration_ms": 900,
                                "create_response": False,
                                "interrupt_response": False,
                            }
                        },
                    },
                },
            }
        )
        echo = (await c.until("session.updated"))["session"]
        assert echo["temperature"] == 0.8 and echo["max_output_tokens"] == 5
        cfg = await _engine_config(server, sid)
        assert cfg["instructions"] == "Answer like a pirate." and cfg["voice"] == "en-us"
        assert cfg["temperature"] == 0.8 and cfg["max_output_tokens"] == 5
        tt = cfg["turn_taking"]
        assert (tt["threshold"], tt["prefix_padding_ms"], tt["silence_ms"]) == (0.7, 200, 900)
        assert tt["auto_reply"] is False and tt["barge_in_min_ms"] == NO_BARGE_IN_MS
        td = {"type": "semantic_vad", "eagerness": "high"}
        await c.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": td}}},
            }
        )
        await c.until("session.updated")
        tt = (await _engine_config(server, sid))["turn_taking"]
        assert tt["end_of_turn"] == "model" and tt.get("auto_reply") is not False
        assert (tt["eot_threshold"], tt["eot_max_wait_ms"]) == EAGERNESS_END_OF_TURN["high"]
        assert tt.get("barge_in_min_ms") is None  # interrupt_response: the engine's barge-in
        null: dict[str, Any] = {"turn_detection": None}
        await c.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": null}, "max_output_tokens": "inf"},
            }
        )
        await c.until("session.updated")
        cfg = await _engine_config(server, sid)
        assert (
            cfg["turn_taking"]["auto_reply"] is False
            and cfg["turn_taking"]["barge_in_min_ms"] == NO_BARGE_IN_MS
        )
        assert cfg["max_output_tokens"] == 0
        # Manual now: the buffer is the client's to commit (under server VAD this commit is refused as empty).
        pcm = np.zeros(24000 // 5, "<i2").tobytes()  # 200 ms
        await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        await c.send({"type": "input_audio_buffer.commit", "event_id": "c1"})
        await c.until("input_audio_buffer.committed")


async def test_unknown_event_and_bad_json_are_not_fatal(server: ServerProcess) -> None:
    async with connect(server) as c:
        await c.next()
        await c.send({"type": "session.frobnicate", "event_id": "x1"})
        ev = await c.error("invalid_value")
        assert ev["error"]["param"] == "type" and ev["error"]["event_id"] == "x1"
        await c.ws.send("{nope")
        await c.error("invalid_json")
        # Valid JSON structure with bytes that are not UTF-8 in a binary frame (found by fuzz_edges.py: the
        # session closed with 1000 and no error event).
        await c.ws.send(b'{"type": "input_audio_buffer.cl\x80ear", "event_id": "r3"}')
        await c.error("invalid_json")
        await c.send({"type": "input_audio_buffer.append", "audio": "!!!"})
        await c.error("invalid_audio")
        await c.send({"type": "session.update", "session": {"type": "realtime"}})
        assert (await c.next())["type"] == "session.updated"


async def test_item_refusals_use_the_dialects_codes(server: ServerProcess) -> None:
    async with connect(server) as c:
        await c.next()
        for etype, code in (
            ("conversation.item.retrieve", "item_retrieve_invalid_item_id"),
            ("conversation.item.delete", "item_delete_invalid_item_id"),
            ("conversation.item.truncate", "item_truncate_invalid_item_id"),
        ):
            await c.send({"type": etype, "item_id": "nope", "content_index": 0, "audio_end_ms": 10})
            await c.error(code)
        await c.send({"type": "response.cancel", "event_id": "c1"})
        ev = await c.error("response_cancel_not_active")
        assert ev["error"]["message"].startswith("Cancellation failed")
        await c.send({"type": "input_audio_buffer.commit"})
        await c.error("input_audio_buffer_commit_empty")


async def test_items_create_root_duplicate_and_truncate_of_a_user_item(server: ServerProcess) -> None:
    async with connect(server) as c:
        await c.next()
        await c.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "id": "u1",
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
            }
        )
        # (The loopback fixture's echo is a response that opens with the engine session, so its assistant item
        # may come first.)
        added = await c.item_event("conversation.item.added", "u1")
        assert added["item"]["content"] == [{"type": "input_text", "text": "hi"}]
        await c.item_event("conversation.item.done", "u1")
        await c.send(
            {
                "type": "conversation.item.create",
                "previous_item_id": "root",
                "item": {
                    "id": "s1",
                    "type": "message",
                    "role": "system",
                    "content": [{"type": "input_text", "text": "be kind"}],
                },
            }
        )
        root = await c.item_event("conversation.item.added", "s1")
        assert root.get("previous_item_id") is None  # "root": first in the conversation
        # An image part is accepted (the image itself is dropped).
        image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
        await c.send(
            {
                "type": "conversation.item.create",
                "item": {"id": "img", "type": "message", "role": "user", "content": [image]},
            }
        )
        await c.item_event("conversation.item.done", "img")
        await c.send(
            {
                "type": "conversation.item.create",
                "item": {"id": "u1", "type": "message", "role": "user", "content": []},
            }
        )
        await c.error("item_create_duplicate_item_id")
        await c.send(
            {"type": "conversation.item.truncate", "item_id": "u1", "content_index": 0, "audio_end_ms": 0}
        )
        await c.error("unsupported_content_type")
        await c.send({"type": "conversation.item.retrieve", "item_id": "u1"})
        got = await c.until("conversation.item.retrieved")
        assert got["item"]["content"] == [{"type": "input_text", "text": "hi"}]


async def test_the_conversation_table_is_bounded_oldest_items_leave_first(server: ServerProcess) -> None:
    """A session fed items for hours does not grow without end: past MAX_ITEMS items (or MAX_ITEM_CHARS of their
    text) the oldest leave the table; the newest stay retrievable. (The fuzzer found the growth: 10,000 events on
    one session grew the server by 60 MB.)"""
    from livekit_omni.realtime.items import MAX_ITEM_CHARS, MAX_ITEMS

    def item(i: int, text: str = "") -> dict[str, Any]:
        content = [{"type": "input_text", "text": text}] if text else []
        return {"id": f"i{i}", "type": "message", "role": "user", "content": content}

    async with connect(server) as c:
        await c.next()
        n = MAX_ITEMS + 3
        for i in range(n):
            await c.send({"type": "conversation.item.create", "item": item(i)})
            if i % 100 == 99 or i == n - 1:  # read as a client does (one that stops reading is dropped)
                await c.item_event("conversation.item.done", f"i{i}", timeout=30)
        for i in (0, 2):
            await c.send({"type": "conversation.item.retrieve", "item_id": f"i{i}", "event_id": f"r{i}"})
            await c.error("item_retrieve_invalid_item_id")
        for i in (10, n - 1):  # (the loopback fixture's echo response holds an item too: i3 may have left)
            await c.send({"type": "conversation.item.retrieve", "item_id": f"i{i}"})
            assert (await c.until("conversation.item.retrieved"))["item"]["id"] == f"i{i}"
        # The text bound: six items of a fifth of it each (each echo under the default outbound cap); the first of
        # them leaves when the sixth comes.
        big = "x" * (MAX_ITEM_CHARS // 5)
        for i in range(n, n + 6):
            await c.send({"type": "conversation.item.create", "item": item(i, big)})
            await c.item_event("conversation.item.done", f"i{i}", timeout=30)
        await c.send({"type": "conversation.item.retrieve", "item_id": f"i{n}"})
        await c.error("item_retrieve_invalid_item_id")
        for i in range(n + 1, n + 6):
            await c.send({"type": "conversation.item.retrieve", "item_id": f"i{i}"})
            assert (await c.until("conversation.item.retrieved", timeout=30))["item"]["id"] == f"i{i}"


async def test_session_limit_gets_an_error_and_1013(server: ServerProcess) -> None:
    silence = base64.b64encode(bytes(4800)).decode()
    async with connect(server) as first:
        await first.next()
        await first.send({"type": "input_audio_buffer.append", "audio": silence})  # opens the engine session
        await first.until("response.created")  # (the loopback fixture's echo is one long response)
        async with connect(server) as second:
            await second.next()
            await second.send({"type": "input_audio_buffer.append", "audio": silence})
            ev = await second.error("session_limit_reached")
            assert ev["error"]["type"] == "server_error"
            assert await second.closed() == 1013


async def test_g711_in_and_out(server: ServerProcess) -> None:
    """``audio/pcmu`` both ways: a µ-law tone in comes back (the loopback echo) as µ-law at 8 kHz, in response
    audio deltas."""
    t = np.arange(8000) / 8000
    tone = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    fmt = {"type": "audio/pcmu"}
    async with connect(server) as c:
        await c.next()
        await c.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {"input": {"format": fmt}, "output": {"format": fmt}},
                },
            }
        )
        echo = (await c.next())["session"]["audio"]
        assert echo["input"]["format"] == fmt and echo["output"]["format"] == fmt
        got = bytearray()
        for i in range(0, 8000, 800):
            await c.send(
                {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(ulaw_encode(tone[i : i + 800]).tobytes()).decode(),
                }
            )
            await asyncio.sleep(0.1)
        with contextlib.suppress(TimeoutError):
            while len(got) < 8000:
                ev = await c.next(2.0)
                if ev["type"] == "response.output_audio.delta":
                    got += base64.b64decode(ev["delta"])
    pcm = ulaw_decode(bytes(got))
    spec = np.abs(np.fft.rfft(pcm.astype(np.float64) * np.hanning(len(pcm))))
    assert abs(float(np.fft.rfftfreq(len(pcm), 1 / 8000)[int(np.argmax(spec))]) - 440) < 20


async def test_input_faster_than_real_time_is_dropped_then_closed(server: ServerProcess) -> None:
    second = base64.b64encode(bytes(48000)).decode()  # 1 s of PCM16 24 kHz silence
    async with connect(server) as c:
        await c.next()
        for _ in range(3):
            await c.send({"type": "input_audio_buffer.append", "audio": second})
        await c.error("input_backpressure")
        deadline = asyncio.get_running_loop().time() + 3.0
        with contextlib.suppress(websockets.ConnectionClosed):
            while asyncio.get_running_loop().time() < deadline:
                await c.send({"type": "input_audio_buffer.append", "audio": second})
                await asyncio.sleep(0.2)
        assert await c.closed() == 1013
