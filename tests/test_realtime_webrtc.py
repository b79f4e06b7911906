"""The Realtime dialect over WebRTC: ``POST /v1/realtime/calls`` with an SDP offer (raw or multipart), events on the
``oai-events`` data channel, audio on the Opus track. The caller is an aiortc client
(testkit.webrtc_caller.WebRTCCaller) on 127.0.0.1; every event it receives on the channel validates
strictly against the openai SDK's ``RealtimeServerEvent`` union (tests/realtime_checks.py).

Signalling, auth, ephemeral keys and limits run against the loopback engine (a test fixture with no models: none of
those need a turn or a reply). The spoken exchange and the barge-in need the embedded models (VAD → ASR → SmolLM2 →
Piper), so they run against the cascade engine; the caller's speech is Piper-synthesized. So do the browser tests:
headless Chromium runs frontend/realtime.html (the standard browser pattern) with a fake microphone playing a Piper
WAV (tests/browser.py), with ``?aec=0`` (browser audio processing mangles a fake-file mic).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from openai import AsyncOpenAI
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By

from media.webrtc import enable_loopback_ice
from testkit.webrtc_caller import WebRTCCaller
from tests.browser import launch_chromium, wait_until, write_fake_mic
from tests.conftest import ServerProcess, start_server
from tests.realtime_checks import ServerEventLog
from tests.speech_fixtures import synthesize_speech

API_KEY = "sk-test"
#: The spoken question of every call here, and the word its answer's transcript must contain.
QUESTION = "What is the capital of France?"
ANSWER = "paris"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
STORYTELLER = "You are a storyteller. Always answer at length, in many sentences."
WEBRTC_ENV = {"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]), "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true"}


@pytest.fixture(scope="module")
def loopback_calls_server() -> Iterator[ServerProcess]:
    enable_loopback_ice()  # the caller in this process gathers 127.0.0.1 only
    s = start_server(adapter="loopback", env={**WEBRTC_ENV, "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": "1"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cascade_calls_server() -> Iterator[ServerProcess]:
    enable_loopback_ice()
    s = start_server(adapter="cascade", env=WEBRTC_ENV)
    yield s
    s.stop()


async def post_offer(
    server: ServerProcess,
    sdp: str,
    *,
    key: str = API_KEY,
    session: dict[str, Any] | None = None,
    path: str = "/v1/realtime/calls",
) -> tuple[int, dict[str, str], str]:
    """POST the offer (raw ``application/sdp``, or multipart with a ``session`` part); status, headers, body."""
    headers = {"Authorization": f"Bearer {key}"}
    data: Any
    if session is None:
        data = sdp
        headers["Content-Type"] = "application/sdp"
    else:
        data = aiohttp.FormData()
        data.add_field("sdp", sdp)
        data.add_field("session", json.dumps(session), content_type="application/json")
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + path, data=data, headers=headers) as r:
            return r.status, dict(r.headers), await r.text()


class CallerEvents:
    """The caller's data-channel events, in order, in a log that validates each one strictly."""

    def __init__(self, caller: WebRTCCaller) -> None:
        self.caller = caller
        self.log = ServerEventLog()

    def send(self, event: dict[str, Any]) -> None:
        self.caller.send(json.dumps(event))

    def _drain(self) -> None:
        while self.caller.messages:
            self.log.add(self.caller.messages.popleft())

    async def logged(self, pred: Any, timeout: float = 30.0) -> dict[str, Any]:
        """The first event (received already or still to come) for which ``pred`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            seen = next((e for e in self.log.events if pred(e)), None)
            if seen is not None:
                return seen
            if time.monotonic() > deadline:
                raise TimeoutError(f"no such event on oai-events; got {self.log.types()}")
            await asyncio.sleep(0.02)

    async def of_type(self, etype: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        return await self.logged(
            lambda e: e["type"] == etype and all(e.get(k) == v for k, v in match.items()), timeout
        )


@contextlib.asynccontextmanager
async def call(
    server: ServerProcess, *, session: dict[str, Any] | None = None, key: str = API_KEY
) -> AsyncIterator[tuple[WebRTCCaller, CallerEvents, dict[str, str]]]:
    """An answered, connected call with its data channel open; every event it got is validated at the end."""
    caller = WebRTCCaller(None, loop=False, record_seconds=120.0)
    events = CallerEvents(caller)
    try:
        status, headers, body = await post_offer(server, await caller.offer(), key=key, session=session)
        assert status == 201, (status, body)
        await caller.accept(body)
        await asyncio.wait_for(caller.connected.wait(), 15)
        await asyncio.wait_for(caller.opened.wait(), 15)
        yield caller, events, headers
    finally:
        await caller.close()
    events.log.validate()


def loud_seconds(pcm: np.ndarray, rate: int) -> float:
    """How much of ``pcm`` is not silence (20 ms frames above -40 dBFS)."""
    n = rate // 50
    if pcm.shape[0] < n:
        return 0.0
    frames = pcm[: pcm.shape[0] // n * n].astype(np.float64).reshape(-1, n)
    return float((np.sqrt((frames**2).mean(axis=1)) > 327).sum()) * 0.02


def caller_speech(text: str) -> np.ndarray:
    return synthesize_speech(text, rate=48000)


# --- signalling, auth, limits (loopback engine) -----------------------------------------------------------------


async def test_raw_sdp_offer_answers_201_with_location_and_events_on_oai_events(
    loopback_calls_server: ServerProcess,
) -> None:
    async with call(loopback_calls_server) as (caller, events, headers):
        assert headers["Content-Type"].startswith("application/sdp")
        created = await events.of_type("session.created", 10)
        sid = created["session"]["id"]
        assert headers["Location"] == f"/v1/realtime/calls/{sid}"
        # agents-js's first move on the open channel: a session.update, then it waits for session.updated.
        events.send({"type": "session.update", "session": {"type": "realtime", "instructions": INSTRUCTIONS}})
        updated = await events.of_type("session.updated", 10)
        assert updated["session"]["instructions"] == INSTRUCTIONS
        # No audio in events over WebRTC: an append is refused, non-fatally.
        events.send({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "ap"})
        err = await events.of_type("error", 10)
        assert err["error"]["code"] == "invalid_value" and err["error"]["event_id"] == "ap"
        # The session goes on.
        events.send({"type": "conversation.item.retrieve", "item_id": "nope", "event_id": "r1"})
        err = await events.logged(lambda e: e["type"] == "error" and e["error"]["event_id"] == "r1", 10)
        assert err["error"]["code"] == "item_retrieve_invalid_item_id"
        assert caller.pc.connectionState == "connected"


async def test_a_sideband_socket_watches_and_steers_the_call_and_hangup_ends_it(
    loopback_calls_server: ServerProcess,
) -> None:
    """The openai SDK's ``client.realtime.connect(call_id=...)`` (stock, defaults) joins an answered call: both the
    data channel and the sideband get the events of an update sent on the sideband; the sideband closing leaves the
    call up; ``POST .../calls/{id}/hangup`` ends the call (its peer connection closes)."""
    sdk = AsyncOpenAI(base_url=loopback_calls_server.url + "/v1", api_key=API_KEY)
    async with call(loopback_calls_server) as (caller, events, headers):
        created = await events.of_type("session.created", 10)
        call_id = headers["Location"].rsplit("/", 1)[1]
        assert call_id == created["session"]["id"]
        async with sdk.realtime.connect(call_id=call_id) as sideband:
            await sideband.session.update(session={"type": "realtime", "instructions": STORYTELLER})
            seen = await asyncio.wait_for(sideband.recv(), 10)
            assert seen.type == "session.updated" and seen.session.instructions == STORYTELLER  # type: ignore[union-attr]
            on_channel = await events.of_type("session.updated", 10)
            assert on_channel["session"]["instructions"] == STORYTELLER
            # What the browser sends is seen by the sideband too.
            events.send({"type": "conversation.item.retrieve", "item_id": "nope", "event_id": "from-browser"})
            err = await asyncio.wait_for(sideband.recv(), 10)
            assert err.type == "error" and err.error.event_id == "from-browser"  # type: ignore[union-attr]
        await asyncio.sleep(0.5)
        assert caller.pc.connectionState == "connected", "a sideband that leaves does not end the call"
        async with aiohttp.ClientSession() as http:
            hangup = f"{loopback_calls_server.url}/v1/realtime/calls/{call_id}/hangup"
            async with http.post(hangup) as r:
                assert r.status == 401  # an API key, like every other route
            async with http.post(hangup, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                assert r.status == 200, await r.text()
            await wait_for_state(caller, "closed", 10)
            async with http.post(hangup, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                body = await r.json()
                assert r.status == 404 and body["error"]["code"] == "call_not_found", body
    async with sdk.realtime.connect(call_id="rtc_unknown") as late:
        err = await asyncio.wait_for(late.recv(), 10)
        assert err.type == "error" and err.error.code == "call_not_found"  # type: ignore[union-attr]


async def wait_for_state(caller: WebRTCCaller, state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while caller.pc.connectionState != state:
        assert time.monotonic() < deadline, caller.pc.connectionState
        await asyncio.sleep(0.05)


async def test_multipart_offer_with_session_part_configures_the_call(
    loopback_calls_server: ServerProcess,
) -> None:
    session = {"type": "realtime", "instructions": INSTRUCTIONS, "audio": {"output": {"voice": "marin"}}}
    async with call(loopback_calls_server, session=session) as (_, events, _headers):
        created = await events.of_type("session.created", 10)
        assert created["session"]["instructions"] == INSTRUCTIONS
        assert created["session"]["audio"]["output"]["voice"] == "marin"


async def test_bad_key_is_refused_401_and_an_ephemeral_key_works_once(
    loopback_calls_server: ServerProcess,
) -> None:
    caller = WebRTCCaller(None, loop=False)
    try:
        sdp = await caller.offer()
        status, _, body = await post_offer(loopback_calls_server, sdp, key="sk-wrong")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body
        status, _, body = await post_offer(loopback_calls_server, sdp, key="ek_made_up")
        assert status == 401, body
    finally:
        await caller.close()
    # The app's backend mints a key with the session it wants; the page spends it.
    async with aiohttp.ClientSession() as http:
        async with http.post(
            loopback_calls_server.url + "/v1/realtime/client_secrets",
            json={
                "expires_after": {"anchor": "created_at", "seconds": 60},
                "session": {"instructions": "Be brief."},
            },
            headers={"Authorization": f"Bearer {API_KEY}"},
        ) as r:
            assert r.status == 200, await r.text()
            secret = await r.json()
        async with http.post(loopback_calls_server.url + "/v1/realtime/client_secrets", json={}) as r:
            assert r.status == 401  # minting needs the real key
    assert secret["value"].startswith("ek_") and secret["expires_at"] > time.time() + 50
    assert secret["session"]["instructions"] == "Be brief."
    async with call(loopback_calls_server, key=secret["value"]) as (_, events, _headers):
        created = await events.of_type("session.created", 10)
        assert created["session"]["instructions"] == "Be brief."
    # Spent.
    caller = WebRTCCaller(None, loop=False)
    try:
        status, _, body = await post_offer(loopback_calls_server, await caller.offer(), key=secret["value"])
        assert status == 401, body
    finally:
        await caller.close()


async def test_a_full_engine_answers_429_with_an_openai_error(loopback_calls_server: ServerProcess) -> None:
    async with call(loopback_calls_server) as (_, events, _headers):
        await events.of_type("session.created", 10)
        other = WebRTCCaller(None, loop=False)
        try:
            status, _, body = await post_offer(loopback_calls_server, await other.offer())
        finally:
            await other.close()
    assert status == 429, (status, body)
    err = json.loads(body)["error"]
    assert err["code"] == "session_limit_reached" and err["message"], err


async def test_a_bad_offer_is_400(loopback_calls_server: ServerProcess) -> None:
    status, _, body = await post_offer(loopback_calls_server, "v=0\r\nnot an offer\r\n")
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_sdp", body


# --- spoken (embedded models) -----------------------------------------------------------------------------------


@pytest.mark.models
async def test_manual_mode_holds_the_track_until_commit_then_response_create_answers(
    cascade_calls_server: ServerProcess,
) -> None:
    """``turn_detection: null`` from the multipart ``session``: a question spoken on the track raises no VAD events
    and no response; a commit before any audio is refused (empty), ``clear`` drops what was held; after the
    question again, the commit makes it a user item with its transcript, and ``response.create`` answers on the
    track."""
    manual = {
        "type": "realtime",
        "audio": {"input": {"turn_detection": None, "transcription": {"model": "w"}}},
    }
    async with call(cascade_calls_server, session=manual) as (caller, events, _headers):
        await events.of_type("session.created", 10)
        events.send({"type": "input_audio_buffer.commit", "event_id": "early"})
        err = await events.logged(lambda e: e["type"] == "error" and e["error"]["event_id"] == "early", 10)
        assert err["error"]["code"] == "input_audio_buffer_commit_empty"
        # Held, then dropped by clear: a commit after it has (almost) nothing again.
        caller.play(caller_speech("Never mind this one."))
        await asyncio.sleep(2.5)
        events.send({"type": "input_audio_buffer.clear"})
        await events.of_type("input_audio_buffer.cleared", 10)
        caller.play(caller_speech(QUESTION))
        await asyncio.sleep(4.0)  # the question and a second of silence: no VAD turn, no answer
        assert not events.log.of("input_audio_buffer.speech_started")
        assert not events.log.of("response.created")
        events.send({"type": "input_audio_buffer.commit"})
        committed = await events.of_type("input_audio_buffer.committed", 10)
        heard = await events.of_type(
            "conversation.item.input_audio_transcription.completed", 30, item_id=committed["item_id"]
        )
        assert "capital" in heard["transcript"].lower() and "never" not in heard["transcript"].lower(), heard
        heard_before = caller.received_audio().shape[0]
        events.send({"type": "response.create"})
        done = await events.of_type("response.done", 90)
        await events.of_type("output_audio_buffer.stopped", 10, response_id=done["response"]["id"])
    answer = done["response"]["output"][0]["content"][0]["transcript"]
    assert ANSWER in answer.lower(), answer
    assert loud_seconds(caller.received_audio()[heard_before:], caller.rate) > 0.5


@pytest.mark.models
async def test_spoken_question_is_answered_on_the_track(cascade_calls_server: ServerProcess) -> None:
    """A question spoken on the track is heard (VAD events), answered in audio on the track (with
    ``output_audio_buffer.started`` … ``response.done`` … ``output_audio_buffer.stopped``) and transcribed in
    ``response.output_audio_transcript.*``; no audio travels in events."""
    async with call(cascade_calls_server) as (caller, events, _headers):
        await events.of_type("session.created", 10)
        events.send({"type": "session.update", "session": {"type": "realtime", "instructions": INSTRUCTIONS}})
        await events.of_type("session.updated", 10)
        heard_before = caller.received_audio().shape[0]
        caller.play(caller_speech(QUESTION))
        started = await events.of_type("input_audio_buffer.speech_started", 20)
        await events.of_type("input_audio_buffer.committed", 20, item_id=started["item_id"])
        done = await events.of_type("response.done", 90)
        rid = done["response"]["id"]
        stopped = await events.of_type("output_audio_buffer.stopped", 10, response_id=rid)
        types = events.log.types()
    resp = done["response"]
    assert resp["status"] == "completed", resp
    answer = resp["output"][0]["content"][0]["transcript"]
    assert ANSWER in answer.lower(), answer
    assert (
        types.index("output_audio_buffer.started")
        < types.index("response.done")
        < types.index(stopped["type"])
    )
    assert "response.output_audio.delta" not in types
    answer_pcm = caller.received_audio()[heard_before:]
    assert loud_seconds(answer_pcm, caller.rate) > 0.5, "the answer was not heard on the track"


@pytest.mark.models
async def test_barge_in_stops_the_answer_on_the_track(cascade_calls_server: ServerProcess) -> None:
    """Speaking over a long answer cuts it: ``response.done`` cancelled/``turn_detected``, then
    ``output_audio_buffer.cleared``; the track goes quiet, and the item keeps only words that were played."""
    async with call(cascade_calls_server) as (caller, events, _headers):
        await events.of_type("session.created", 10)
        events.send({"type": "session.update", "session": {"type": "realtime", "instructions": STORYTELLER}})
        await events.of_type("session.updated", 10)
        caller.play(caller_speech("Tell me a long story about a dragon and a knight."))
        first = await events.of_type("output_audio_buffer.started", 90)
        rid = first["response_id"]
        await asyncio.sleep(3.0)  # let it speak a while
        assert not any(
            e["type"] == "response.done" and e["response"]["id"] == rid for e in events.log.events
        ), "the answer ended too soon"
        caller.play(caller_speech("Stop. What is the capital of France?"))
        done = await events.logged(lambda e: e["type"] == "response.done" and e["response"]["id"] == rid, 30)
        cut_at = len(caller.chunks)
        await events.of_type("output_audio_buffer.cleared", 10, response_id=rid)
        # The cut answer's audio stops at once: the next ~0.6 s on the track (before any next answer) is quiet.
        await asyncio.sleep(0.8)
        after = list(caller.chunks)[cut_at + 10 : cut_at + 40]  # skip 200 ms in flight
        sent = " ".join(
            e["delta"]
            for e in events.log.of("response.output_audio_transcript.delta")
            if e["response_id"] == rid
        )
    assert done["response"]["status"] == "cancelled", done
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    kept = done["response"]["output"][0]["content"][0]["transcript"]
    assert set(kept.split()) <= set(sent.split()), (kept, sent)
    quiet = loud_seconds(np.concatenate(after), caller.rate) if after else 0.0
    assert quiet <= 0.2, f"{quiet:.2f} s of the cut answer still played after the barge-in"


# --- the browser page (headless Chromium, embedded models) ------------------------------------------------------


def _open_realtime_page(driver: WebDriver, server: ServerProcess) -> None:
    driver.get(f"{server.url}/static/realtime.html?key={API_KEY}&aec=0")
    wait_until(
        driver, lambda d: d.execute_script("return !!window.realtimeDemo"), timeout=20, what="the page"
    )
    driver.find_element(By.ID, "connect").click()
    wait_until(
        driver,
        lambda d: (
            d.execute_script("return window.realtimeDemo.status() === 'connected'")
            or d.execute_script("return window.realtimeDemo.errors().length > 0")
        ),
        timeout=30,
        what="the call to connect",
    )
    assert driver.execute_script("return window.realtimeDemo.errors()") == []


def _page_events(driver: WebDriver) -> list[tuple[float, dict[str, Any]]]:
    # One script: events arrive between two calls.
    ats, evs = driver.execute_script("return [window.realtimeDemo.arrivals(), window.realtimeDemo.events()]")
    return list(zip(ats, evs, strict=True))


def _page_event(driver: WebDriver, pred: Any, timeout: float, what: str) -> tuple[float, dict[str, Any]]:
    """The first page event (its arrival on the page clock, ms, and the event) for which ``pred`` holds."""
    found = wait_until(
        driver, lambda d: next((x for x in _page_events(d) if pred(x[1])), None), timeout=timeout, what=what
    )
    assert found is not None  # wait_until returns only a truthy value
    return found


def _loud_s(levels: list[list[float]], t_from: float, t_to: float, db: float = -50.0) -> float:
    """Seconds of remote audio above ``db`` between two page times (ms), from the page's 20 ms meter."""
    return sum(0.02 for t, level in levels if t_from <= t < t_to and level > db)


@pytest.mark.models
@pytest.mark.browser
def test_browser_page_hears_an_answer(cascade_calls_server: ServerProcess, output_dir: Path) -> None:
    """The page's standard pattern (client secret, getUserMedia, RTCPeerConnection, SDP to /v1/realtime/calls,
    oai-events) with a fake microphone asking a question: the answer arrives as events and is heard."""
    wav = output_dir / "fake-mic.wav"
    write_fake_mic(wav, QUESTION)
    with launch_chromium(output_dir, fake_mic_wav=wav) as driver:
        _open_realtime_page(driver, cascade_calls_server)
        _, done = _page_event(driver, lambda e: e["type"] == "response.done", 90, "the answer")
        rid = done["response"]["id"]
        started_at, _ = _page_event(
            driver,
            lambda e: e["type"] == "output_audio_buffer.started" and e["response_id"] == rid,
            5,
            "started",
        )
        stopped_at, _ = _page_event(
            driver,
            lambda e: e["type"] == "output_audio_buffer.stopped" and e["response_id"] == rid,
            30,
            "stopped",
        )
        time.sleep(0.5)
        levels = driver.execute_script("return window.realtimeDemo.levels()")
        events = [e for _, e in _page_events(driver)]
        driver.save_screenshot(str(output_dir / "realtime-page.png"))
        driver.execute_script("window.realtimeDemo.hangUp()")
    (output_dir / "page-events.json").write_text(json.dumps(events, indent=1))
    log = ServerEventLog()
    for e in events:
        log.add(e)
    log.validate()
    assert done["response"]["status"] == "completed", done
    assert ANSWER in done["response"]["output"][0]["content"][0]["transcript"].lower(), done
    heard = _loud_s(levels, started_at - 500, stopped_at + 500)
    assert heard > 0.5, f"the page heard {heard:.2f} s of the answer"


@pytest.mark.models
@pytest.mark.browser
def test_browser_page_barge_in_stops_the_answer(
    cascade_calls_server: ServerProcess, output_dir: Path
) -> None:
    """Talking over a long answer (the fake mic re-opened with the interruption): the answer is cancelled
    (``turn_detected``), ``output_audio_buffer.cleared`` follows, and the page hears no more of it."""
    wav = output_dir / "fake-mic.wav"
    write_fake_mic(wav, "Tell me a long story about a dragon and a knight.")
    with launch_chromium(output_dir, fake_mic_wav=wav) as driver:
        _open_realtime_page(driver, cascade_calls_server)
        _, first = _page_event(driver, lambda e: e["type"] == "output_audio_buffer.started", 90, "the answer")
        rid = first["response_id"]
        time.sleep(3.0)
        assert not any(e["type"] == "response.done" for _, e in _page_events(driver)), (
            "the answer ended too soon"
        )
        write_fake_mic(wav, "Hold on, what is the capital of Italy?", 300)
        driver.execute_script("return window.realtimeDemo.reopenMicrophone()")
        _, done = _page_event(
            driver, lambda e: e["type"] == "response.done" and e["response"]["id"] == rid, 30, "the cut"
        )
        cleared_at, _ = _page_event(
            driver,
            lambda e: e["type"] == "output_audio_buffer.cleared" and e["response_id"] == rid,
            10,
            "cleared",
        )
        time.sleep(1.5)
        levels = driver.execute_script("return window.realtimeDemo.levels()")
        later = [
            t
            for t, e in _page_events(driver)
            if e["type"] == "output_audio_buffer.started" and e["response_id"] != rid
        ]
        driver.execute_script("window.realtimeDemo.hangUp()")
    assert done["response"]["status"] == "cancelled", done
    assert done["response"]["status_details"]["reason"] == "turn_detected", done
    # From 300 ms after the cut (audio in flight and the jitter buffer) until the next answer starts, or 1 s.
    quiet_to = min([cleared_at + 1300, *later])
    still = _loud_s(levels, cleared_at + 300, quiet_to)
    assert still <= 0.1, f"{still:.2f} s of the cut answer played after the barge-in"
