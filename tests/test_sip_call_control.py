"""OpenAI's call control for SIP calls, driven by the openai SDK against a real ``livekit-omni serve`` (loopback echo
engine) whose SIP endpoint announces each INVITE to a webhook served by this test.

The test's webhook endpoint checks every event with the SDK's ``client.webhooks.unwrap()`` (Standard Webhooks
signature, ``whsec_`` secret), then the SDK's ``client.realtime.calls.accept/reject/refer/hangup`` steer the call,
and ``client.realtime.connect(call_id=...)`` attaches a sideband that receives the call's events, DTMF included.
Callers are SIPp (``tests/sip/*.xml``) and baresip (which also takes the REFER: it calls the transfer target, a SIPp
UAS).
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from openai import AsyncOpenAI, InvalidWebhookSignatureError

from tests.conftest import ServerProcess, free_port, start_server
from tests.sip_peers import Baresip, free_udp_port, require, run_sipp, sip_env
from tests.speech_fixtures import silence, synthesize_speech, write_wav

pytestmark = pytest.mark.slow

API_KEY = "sk-test"
SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


class WebhookApp:
    """The app's webhook endpoint: every event must pass the SDK's signature check."""

    def __init__(self, client: AsyncOpenAI) -> None:
        self.client = client
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.bad = 0
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            event = self.client.webhooks.unwrap(body, dict(request.headers), secret=SECRET)
        except InvalidWebhookSignatureError:
            self.bad += 1
            return web.Response(status=400)
        await self.events.put(event)
        return web.Response(status=200)

    async def start(self, port: int) -> None:
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def next_call(self, timeout: float = 20.0) -> Any:
        event = await asyncio.wait_for(self.events.get(), timeout)
        assert event.type == "realtime.call.incoming"
        return event


@pytest.fixture(scope="module")
def hook_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def controlled_server(hook_port: int) -> Iterator[tuple[ServerProcess, int]]:
    require("sipp")
    port = free_udp_port()
    env = {
        **sip_env(
            port,
            webhook_url=f"http://127.0.0.1:{hook_port}/hook",
            webhook_secret=SECRET,
            accept_timeout_s="3",
        ),
        "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
    }
    s = start_server(adapter="loopback", env=env)
    yield s, port
    s.stop()


@pytest.fixture
async def app(controlled_server: tuple[ServerProcess, int], hook_port: int) -> AsyncIterator[WebhookApp]:
    server, _ = controlled_server
    client = AsyncOpenAI(api_key=API_KEY, base_url=server.url + "/v1", webhook_secret=SECRET)
    hook = WebhookApp(client)
    await hook.start(hook_port)
    yield hook
    await hook.stop()
    await client.close()
    assert hook.bad == 0


def sipp_in_thread(*args: Any, **kwargs: Any) -> asyncio.Future[Any]:
    return asyncio.ensure_future(asyncio.to_thread(run_sipp, *args, **kwargs))


async def idle(server: ServerProcess, timeout: float = 5.0) -> None:
    """Until the engine holds no session (fails after ``timeout``)."""

    def wait() -> None:
        deadline = time.monotonic() + timeout
        while server.health()[1]["engine"]["active_sessions"]:
            assert time.monotonic() < deadline, "the engine still holds a session"
            time.sleep(0.1)

    await asyncio.to_thread(wait)


def start_target(port: int, cwd: Path) -> subprocess.Popen[bytes]:
    """SIPp's built-in UAS on ``port``: the transfer target (INVITE, 180, 200, ACK, then the caller's BYE)."""
    return subprocess.Popen(
        [
            *(require("sipp"), "-sn", "uas", "-i", "127.0.0.1", "-p", str(port), "-m", "1"),
            *("-nostdin", "-timeout", "40s", "-timeout_error", "-trace_msg"),
        ],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def header(event: Any, name: str) -> str | None:
    for h in event.data.sip_headers:
        if h.name.lower() == name.lower():
            return str(h.value)
    return None


async def test_webhook_then_accept(app: WebhookApp, controlled_server: tuple[ServerProcess, int]) -> None:
    _, port = controlled_server
    caller = sipp_in_thread("uac_call", f"127.0.0.1:{port}", pause_ms=500)
    event = await app.next_call()
    call_id = event.data.call_id
    assert call_id.startswith("sess_")
    assert header(event, "Subject") == "livekit-omni SIP test"
    assert header(event, "Call-ID") and header(event, "From")
    await app.client.realtime.calls.accept(call_id, type="realtime", instructions="You answer the phone.")
    r = await caller
    assert r.ok, r.out


async def test_reject(app: WebhookApp, controlled_server: tuple[ServerProcess, int]) -> None:
    _, port = controlled_server
    caller = sipp_in_thread("uac_refused_486", f"127.0.0.1:{port}")
    event = await app.next_call()
    await app.client.realtime.calls.reject(event.data.call_id, status_code=486)
    r = await caller
    assert r.ok, r.out
    # A call no longer waiting cannot be accepted (409), nor one this server does not hold (404).
    with pytest.raises(Exception) as e:
        await app.client.realtime.calls.accept(event.data.call_id, type="realtime")
    assert getattr(e.value, "status_code", None) == 404


async def test_not_accepted_in_time_is_480(
    app: WebhookApp, controlled_server: tuple[ServerProcess, int]
) -> None:
    _, port = controlled_server
    caller = sipp_in_thread("uac_refused_480", f"127.0.0.1:{port}")
    await app.next_call()
    r = await caller
    assert r.ok, r.out


async def test_hangup_sends_bye(app: WebhookApp, controlled_server: tuple[ServerProcess, int]) -> None:
    server, port = controlled_server
    caller = sipp_in_thread("uac_server_bye", f"127.0.0.1:{port}", timeout=30)
    event = await app.next_call()
    call_id = event.data.call_id
    await app.client.realtime.calls.accept(call_id, type="realtime")
    await asyncio.sleep(0.5)
    await app.client.realtime.calls.hangup(call_id)
    r = await caller
    assert r.ok, r.out
    await idle(server)


async def test_hangup_while_ringing_declines(
    app: WebhookApp, controlled_server: tuple[ServerProcess, int]
) -> None:
    _, port = controlled_server
    caller = sipp_in_thread("uac_refused_603", f"127.0.0.1:{port}")
    event = await app.next_call()
    await app.client.realtime.calls.hangup(event.data.call_id)
    r = await caller
    assert r.ok, r.out


async def test_cancel_while_the_app_decides(
    app: WebhookApp, controlled_server: tuple[ServerProcess, int]
) -> None:
    """The caller gives up while the app decides: CANCEL gets 200 and 487, and the app's late accept finds no call."""
    _, port = controlled_server
    caller = sipp_in_thread("uac_cancel", f"127.0.0.1:{port}")
    event = await app.next_call()
    r = await caller
    assert r.ok, r.out
    with pytest.raises(Exception) as e:
        await app.client.realtime.calls.accept(event.data.call_id, type="realtime")
    assert getattr(e.value, "status_code", None) in (404, 409), e.value


def caller_wav(path: Path, seconds: float) -> Path:
    pcm = np.concatenate([synthesize_speech("Hello, I would like to talk to someone.", rate=8000)])
    pcm = np.concatenate([pcm, silence(int(seconds * 1000), 8000)])
    write_wav(path, pcm, 8000)
    return path


async def test_dtmf_reaches_the_sideband(
    app: WebhookApp, controlled_server: tuple[ServerProcess, int], output_dir: Path
) -> None:
    """baresip presses keys (RFC 4733); the sideband attached with ``?call_id=`` gets one
    ``input_audio_buffer.dtmf_event_received`` per key, in order."""
    require("baresip")
    _, port = controlled_server
    phone = Baresip(caller_wav(output_dir / "caller.wav", 8.0))
    phone.start(f"sip:omni@127.0.0.1:{port}")
    try:
        event = await app.next_call()
        call_id = event.data.call_id
        await app.client.realtime.calls.accept(call_id, type="realtime")
        keys: list[str] = []
        async with app.client.realtime.connect(call_id=call_id) as conn:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(phone.command, "sndcode", "12#")
            async with asyncio.timeout(10):
                async for ev in conn:
                    if ev.type == "input_audio_buffer.dtmf_event_received":
                        keys.append(ev.event)
                        assert abs(ev.received_at - time.time()) < 5
                        if len(keys) == 3:
                            break
        assert keys == ["1", "2", "#"], keys
        await app.client.realtime.calls.hangup(call_id)
        await asyncio.to_thread(phone.wait_call_end, 10)
    finally:
        phone.stop()


async def test_refer_transfers_the_caller(
    app: WebhookApp, controlled_server: tuple[ServerProcess, int], output_dir: Path
) -> None:
    """``calls.refer`` sends the caller (baresip) a REFER; it calls the target, a SIPp UAS, and our leg ends."""
    require("baresip")
    server, port = controlled_server
    target_port = free_udp_port()
    target = await asyncio.to_thread(start_target, target_port, output_dir)
    phone = Baresip(caller_wav(output_dir / "caller.wav", 4.0))
    phone.start(f"sip:omni@127.0.0.1:{port}")
    try:
        event = await app.next_call()
        call_id = event.data.call_id
        await app.client.realtime.calls.accept(call_id, type="realtime")
        await asyncio.sleep(0.5)
        await app.client.realtime.calls.refer(call_id, target_uri=f"sip:agent@127.0.0.1:{target_port}")
        # The target got the transferred call (SIPp's uas scenario: INVITE, 180, 200, ACK, then the caller's BYE).
        rc = await asyncio.to_thread(target.wait, 45)
        messages = "\n".join(p.read_text(errors="replace") for p in output_dir.glob("*_messages.log"))
        assert rc == 0, messages[-3000:]
        assert "Referred-By" in messages or "INVITE sip:agent@" in messages, messages[-3000:]
        await idle(server)  # our leg ended
    finally:
        phone.stop()
        if target.poll() is None:
            target.kill()


async def test_manual_turn_taking_on_a_sip_call(
    app: WebhookApp, controlled_server: tuple[ServerProcess, int]
) -> None:
    """Accepted with ``turn_detection: null``: the caller's RTP audio waits in the session's input buffer until the
    sideband commits it (``input_audio_buffer.committed``, then the user item), as a WebRTC call's track audio does."""
    from testkit.sip_caller import RATE, SipCaller

    _, port = controlled_server
    caller = SipCaller(("127.0.0.1", port))
    dialing = asyncio.ensure_future(caller.call(timeout=20))
    try:
        event = await app.next_call()
        call_id = event.data.call_id
        await app.client.realtime.calls.accept(
            call_id, type="realtime", audio={"input": {"turn_detection": None}}
        )
        await dialing
        async with app.client.realtime.connect(call_id=call_id) as conn:
            t = np.arange(RATE) / RATE
            await caller.say((np.sin(2 * np.pi * 300 * t) * 8000).astype(np.int16), RATE - 1)
            await asyncio.sleep(0.3)
            await conn.send({"type": "input_audio_buffer.commit"})
            seen: list[str] = []
            async with asyncio.timeout(10):
                async for ev in conn:
                    seen.append(ev.type)
                    assert ev.type != "error", ev
                    if ev.type == "conversation.item.added":
                        break
            assert "input_audio_buffer.committed" in seen, seen
            assert "input_audio_buffer.speech_started" not in seen, "no VAD turns in manual mode"
    finally:
        await caller.hangup()
        if not dialing.done():
            dialing.cancel()


async def test_function_tools_reach_the_engine_from_a_sip_accept(
    app: WebhookApp, controlled_server: tuple[ServerProcess, int]
) -> None:
    """Tools in the accept go where any way in sends them: a tool the dialect refuses (a bad name) is refused 400
    before anything moves (the call still rings and can be accepted); valid tools reach the engine, which decides. The
    loopback engine runs no tools, so it refuses them: 400 ``invalid_tools`` to the app (no retry), a final answer
    to the caller. (On the cascade, the same accept opens the session with them: tests/test_realtime_tools.py.)"""
    from testkit.sip_caller import SipCaller

    _, port = controlled_server
    tool = {
        "type": "function",
        "name": "order_status",
        "description": "The status of an order.",
        "parameters": {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]},
    }
    caller = SipCaller(("127.0.0.1", port))
    dialing = asyncio.ensure_future(caller.call(timeout=20))
    try:
        event = await app.next_call()
        call_id = event.data.call_id
        bad = {**tool, "name": "order status!"}  # not a function name
        with pytest.raises(Exception) as e:
            await app.client.realtime.calls.accept(call_id, type="realtime", tools=[bad])  # type: ignore[list-item]
        assert getattr(e.value, "status_code", None) == 400, e.value
        assert not dialing.done(), "a refused accept leaves the call ringing"
        with pytest.raises(Exception) as e:
            await app.client.realtime.calls.accept(call_id, type="realtime", tools=[tool])  # type: ignore[list-item]
        assert getattr(e.value, "status_code", None) == 400, e.value
        assert getattr(e.value, "code", None) == "invalid_tools", e.value
        with pytest.raises(RuntimeError, match="500"):
            await dialing
    finally:
        await caller.hangup()
