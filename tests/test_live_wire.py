"""Unit tests of the Live facade's wire module: command decoding, error classification, config resolution, events.

No server: these pin the translation rules that the integration tests (test_live_ws.py etc.) exercise end to end.
"""

from __future__ import annotations

import base64
import json
import typing

import msgspec
import pytest
from openai.types.live import ServerEvent as SDKServerEvent
from openai.types.live import SessionStartedEvent
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from livekit_omni.live import wire


def _sdk_models() -> dict[str, type[BaseModel]]:
    union = typing.get_args(SDKServerEvent)[0]  # Annotated[Union[...], PropertyInfo(discriminator="type")]
    out: dict[str, type[BaseModel]] = {}
    for model in typing.get_args(union):
        (literal,) = typing.get_args(model.model_fields["type"].annotation)
        out[literal] = model
    return out


SDK_MODELS = _sdk_models()
#: The Responses streaming events a ``response.event`` nests (the SDK's discriminated union).
RESPONSES_EVENT: TypeAdapter[typing.Any] = TypeAdapter(ResponseStreamEvent)


def decode_error(raw: str | bytes) -> wire.WireError:
    with pytest.raises(wire.WireError) as e:
        wire.decode_command(raw)
    return e.value


def test_known_commands_decode_and_unknown_fields_are_ignored() -> None:
    cmd = wire.decode_command(
        json.dumps(
            {
                "type": "session.start",
                "event_id": "e1",
                "extra": 1,
                "session": {"model": "m", "unknown": {"x": 1}, "audio": {"format": {"type": "audio/pcmu"}}},
            }
        )
    )
    assert isinstance(cmd, wire.SessionStart) and cmd.event_id == "e1" and cmd.session.model == "m"
    cmd = wire.decode_command('{"type":"session.commentary.append","content":"hi","delegation_id":null}')
    assert isinstance(cmd, wire.CommentaryAppend) and cmd.delegation_id is None
    assert isinstance(wire.decode_command('{"type":"session.close"}'), wire.SessionClose)


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        ("{oops", "invalid_json", None),
        ('{"type":"session.update","session":' + "[" * 5000 + "]" * 5000 + "}", "invalid_json", None),
        ("[" * 100_000, "invalid_json", None),
        ("[1]", "invalid_json", None),
        ('"text"', "invalid_json", None),
        # Binary frames that are not UTF-8 (msgspec raises UnicodeDecodeError, not DecodeError; found by fuzzing).
        (b'{"type": "session.\xc0close", "event_id": "e"}', "invalid_json", None),
        (b"\xfe\xff", "invalid_json", None),
        (b'{"t\x80ype": "session.close", "event_id": "\xfee5"}', "invalid_json", None),  # the slow path too
        ('{"type": "session.close", "event_id": "\\ud800"}', "invalid_json", None),  # a lone surrogate escape
        ('{"event_id":"x"}', "invalid_event", "type"),
        ('{"type":5}', "invalid_event", "type"),
        ('{"type":"nope","event_id":"z"}', "unknown_event", "type"),
        ('{"type":"decision.create","event_id":"d"}', "unsupported_event", "type"),
        ('{"type":"session.thinking.append","content":"x"}', "missing_required_parameter", "delegation_id"),
        ('{"type":"session.thinking.append","content":1,"delegation_id":null}', "invalid_value", "content"),
        (
            '{"type":"session.start","session":{"model":"m","audio":{"format":{"type":"audio/pcm","rate":"x"}}}}',
            "invalid_value",
            "session.audio.format.rate",
        ),
    ],
)
def test_decode_errors_name_the_problem(raw: str | bytes, code: str, param: str | None) -> None:
    e = decode_error(raw)
    assert (e.code, e.param) == (code, param), e.message
    assert e.type == "invalid_request_error"


def test_client_event_id_is_kept_for_errors() -> None:
    assert decode_error('{"type":"nope","event_id":"abc"}').client_event_id == "abc"
    assert decode_error('{"type":"nope","event_id":7}').client_event_id is None


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (None, wire.WireFormat("pcm16", 24000)),
        ({"type": "audio/pcm", "rate": 16000}, wire.WireFormat("pcm16", 16000)),
        ({"type": "audio/pcm", "rate": 24000}, wire.WireFormat("pcm16", 24000)),
        ({"type": "audio/pcmu", "rate": 8000}, wire.WireFormat("pcmu", 8000)),
        ({"type": "audio/pcma"}, wire.WireFormat("pcma", 8000)),
    ],
)
def test_audio_formats(fmt: dict | None, expected: wire.WireFormat) -> None:
    parsed = None if fmt is None else msgspec.convert(fmt, wire.AudioFormat)
    assert wire.parse_format(parsed) == expected


@pytest.mark.parametrize(
    "fmt",
    [{"type": "audio/pcm", "rate": 48000}, {"type": "audio/pcmu", "rate": 16000}, {"type": "audio/opus"}],
)
def test_unsupported_audio_formats(fmt: dict) -> None:
    with pytest.raises(wire.WireError) as e:
        wire.parse_format(msgspec.convert(fmt, wire.AudioFormat))
    assert e.value.code == "invalid_audio_format"


def test_decode_audio_checks_base64_and_whole_samples() -> None:
    pcm = wire.WireFormat("pcm16", 24000)
    assert wire.decode_audio(base64.b64encode(b"\x01\x02").decode(), pcm) == b"\x01\x02"
    with pytest.raises(wire.WireError, match="base64"):
        wire.decode_audio("###", pcm)
    with pytest.raises(wire.WireError, match="16-bit"):
        wire.decode_audio(base64.b64encode(b"\x01\x02\x03").decode(), pcm)
    # G.711 has one byte per sample: any length is whole.
    assert wire.decode_audio(base64.b64encode(b"\x01\x02\x03").decode(), wire.WireFormat("pcmu", 8000))


def start_config(**session: object) -> wire.StartConfig:
    return msgspec.convert({"model": "m", **session}, wire.StartConfig)


def test_resolve_config_defaults_and_resource_validate_against_the_sdk() -> None:
    cfg = wire.resolve_config(
        start_config(
            input=[
                {"role": "user", "content": [{"text": "hi"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            ],
            audio={"output": {"voice": {"id": "voice_1", "extra": 2}}},
            store=True,
        )
    )
    assert cfg.history == [("user", "hi"), ("assistant", "hello")]
    assert cfg.delegation == wire.Delegation(type="client", acknowledgement_delay_ms=0)
    assert cfg.store is False and cfg.store_requested is True
    res = wire.session_resource(cfg, session_id="live_x", expires_at=123)
    ev = wire.SessionStarted(client_event_id="c", session=res)
    SessionStartedEvent.model_validate(json.loads(wire.encode(ev)), strict=True)
    assert json.loads(wire.encode(ev))["session"]["audio"]["output"]["voice"] == {"id": "voice_1"}
    assert res.input is not None and res.input[0].content[0].type == "input_text"


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        ({"delegation": {"type": "decisions"}}, "unsupported_delegation", "session.delegation.type"),
        ({"delegation": {"type": "robots"}}, "invalid_value", "session.delegation.type"),
        ({"triggers": [{"type": "decisions"}]}, "unsupported_triggers", "session.triggers"),
        (
            {"input": [{"role": "system", "content": [{"text": "x"}]}]},
            "invalid_value",
            "session.input[0].role",
        ),
        ({"input": [{"role": "user", "content": []}]}, "invalid_value", "session.input[0].content"),
        ({"input": [{"role": "user", "content": [{"text": "x"}]}] * 129}, "too_many_items", "session.input"),
        (
            {"input": [{"role": "user", "content": [{"text": "x" * 40_000}]}]},
            "input_too_large",
            "session.input",
        ),
        ({"model": " "}, "invalid_value", "session.model"),
    ],
)
def test_resolve_config_refusals(session: dict, code: str, param: str) -> None:
    with pytest.raises(wire.WireError) as e:
        wire.resolve_config(start_config(**session))
    assert (e.value.code, e.value.param) == (code, param)
    if code == "unsupported_delegation":
        assert "client" in e.value.message


def test_responses_delegation_is_accepted_and_echoed() -> None:
    """LiveKit's GPTLiveModel defaults to responses delegation: accepted, its backend settings echoed."""
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    cfg = wire.resolve_config(
        start_config(delegation={"type": "responses", "responses": {"model": "gpt-5.6-luna", "tools": tools}})
    )
    assert cfg.delegation == wire.Delegation(
        type="responses", responses={"model": "gpt-5.6-luna", "tools": tools}, acknowledgement_delay_ms=0
    )
    res = wire.session_resource(cfg, session_id="live_x", expires_at=123)
    SessionStartedEvent.model_validate(json.loads(wire.encode(wire.SessionStarted(session=res))), strict=True)
    # Updates are sparse (LiveKit sends only the new tools) and keep the type.
    new = wire.check_update(
        msgspec.convert({"delegation": {"type": "responses", "responses": {"tools": []}}}, wire.UpdateConfig),
        cfg.delegation,
    )
    assert new == wire.Delegation(
        type="responses", responses={"model": "gpt-5.6-luna", "tools": []}, acknowledgement_delay_ms=0
    )
    with pytest.raises(wire.WireError) as e:
        wire.check_update(msgspec.convert({"delegation": {"type": "client"}}, wire.UpdateConfig), new)
    assert e.value.code == "immutable_field"


def test_update_rules() -> None:
    current = wire.Delegation(type="client", acknowledgement_delay_ms=100)

    def update(**session: object) -> wire.Delegation | None:
        return wire.check_update(msgspec.convert(session, wire.UpdateConfig), current)

    assert update() is None
    assert update(triggers=[]) is None
    assert update(delegation=None) == current
    assert update(delegation={"type": "client"}) == current  # omitted settings keep their values
    assert update(delegation={"type": "client", "acknowledgement_delay_ms": 5}) == wire.Delegation(
        type="client", acknowledgement_delay_ms=5
    )
    for field in ("model", "instructions", "input", "audio", "client", "store", "safety_identifier"):
        with pytest.raises(wire.WireError) as e:
            update(**{field: None})
        assert (e.value.code, e.value.param) == ("immutable_field", f"session.{field}")


def test_events_have_unique_ids_and_echo_client_ids() -> None:
    a, b = wire.InputAudioMuted(client_event_id="c1"), wire.InputAudioMuted()
    assert a.event_id != b.event_id
    assert json.loads(wire.encode(a))["client_event_id"] == "c1" and "client_event_id" not in json.loads(
        wire.encode(b)
    )
    err = json.loads(wire.encode(wire.error_event("x", "y", param="p", client_event_id="c")))
    assert err["error"] == {
        "type": "invalid_request_error",
        "code": "x",
        "message": "y",
        "param": "p",
        "client_event_id": "c",
    }
    assert err["client_event_id"] == "c"
    # Output audio: raw bytes in the struct, base64 on the wire, no event_id and no timestamps.
    raw = wire.encode(wire.OutputAudioDelta(delta=b"\x00\x01"))
    assert json.loads(raw) == {"type": "session.output_audio.delta", "delta": "AAE="}


def _one_of_each() -> list[wire.ServerEvent]:
    cfg = wire.resolve_config(start_config())
    res = wire.session_resource(cfg, session_id="live_x", expires_at=1)
    return [
        wire.SessionStarted(session=res, client_event_id="s"),
        wire.SessionUpdated(session=res),
        wire.InputAudioMuted(),
        wire.InputAudioUnmuted(),
        wire.FixturePlaying(),
        wire.FixturePlayed(),
        wire.InstructionsAppended(start_ms=1, end_ms=1),
        wire.ThinkingAppended(start_ms=1, end_ms=2),
        wire.CommentaryAppended(start_ms=0, end_ms=0),
        wire.OutputAudioDelta(delta=b"\x01\x00" * 3),
        wire.InputTranscriptDelta(delta="hi", start_ms=0, end_ms=10),
        wire.OutputTranscriptDelta(delta="yo", start_ms=5, end_ms=9),
        wire.UsageUpdated(usage=wire.usage(1), context_window=wire.ContextWindow(usage_ratio=0.5)),
        wire.SessionClosed(reason="close_requested", session=res, usage=wire.usage(2.5)),
        wire.error_event("c", "m"),
        wire.Info(code="i", message="m"),
        wire.DelegationCreated(
            delegation=wire.DelegationInfo(
                id="del_1", target="responses", type="delegation", response_id="r"
            ),
            offset_ms=1200,
        ),
        *_backend_stream(),
    ]


def _backend_stream() -> list[wire.ServerEvent]:
    """A call's whole backend response, as ``response.event`` envelopes (one of each nested event)."""
    from engine_bridge import protocol as p
    from livekit_omni.live import delegation as dg

    r = dg.BackendResponse("resp_1", "del_1", "gpt-5.6-luna", p.ToolChoiceSpec(mode="required"))
    call = p.ToolCallItem(call_id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    done = p.ReplyDone(
        session_id="s",
        turn_id=1,
        epoch=0,
        interrupted=False,
        text="",
        total_samples=0,
        input_tokens=9,
        output_tokens=4,
    )
    nested = [r.created(), *r.call(call), r.completed(dg.usage_of(done))]
    return [wire.ResponseEvent(event=e, delegation_id="del_1") for e in nested]


def test_every_server_event_round_trips_and_validates_against_the_sdk() -> None:
    events = _one_of_each()
    # One of every member of the union.
    assert {type(e) for e in events} == set(typing.get_args(wire.ServerEvent))
    for ev in events:
        data = wire.encode(ev)
        assert wire.decode_server_event(data) == ev
        obj = json.loads(data)
        model = SDK_MODELS[obj["type"]]
        model.model_validate(obj, strict=True)
        if obj["type"] == "response.event":
            RESPONSES_EVENT.validate_python(obj["event"], strict=True)


def test_a_backend_response_stream_is_what_livekit_reads() -> None:
    """The nested events of one call, in order, numbered, with cleared snapshots and the completed call item."""
    nested = [json.loads(wire.encode(e))["event"] for e in _backend_stream()]
    assert [e["type"] for e in nested] == [
        "response.created",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in nested] == list(range(6))
    created, completed = nested[0]["response"], nested[-1]["response"]
    for snap in (created, completed):
        assert snap["output"] == [] and snap["tools"] == [] and "instructions" not in snap
        assert snap["id"] == "resp_1" and snap["model"] == "gpt-5.6-luna"
    assert created["status"] == "in_progress" and completed["status"] == "completed"
    assert completed["usage"]["input_tokens"] == 9 and completed["usage"]["total_tokens"] == 13
    item = nested[4]["item"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert (item["call_id"], item["name"], json.loads(item["arguments"])) == (
        "call_1",
        "get_weather",
        {"city": "Paris"},
    )
    assert nested[1]["item"]["id"] == item["id"] == nested[2]["item_id"] == nested[3]["item_id"]


def test_server_event_decoding_tells_unknown_from_broken() -> None:
    with pytest.raises(wire.UnknownServerEvent):
        wire.decode_server_event('{"type":"session.brand_new","event_id":"e"}')
    with pytest.raises(wire.UnknownServerEvent):
        wire.decode_server_event('{"type":"session.input_transcript.delta","event_id":"e","delta":"x"}')
    for broken in ("[1]", "nope", '"text"'):
        with pytest.raises(msgspec.DecodeError):
            wire.decode_server_event(broken)


def test_client_commands_encode_what_the_server_decodes() -> None:
    start = wire.SessionStart(
        event_id="s",
        session=wire.StartConfig(
            model="m", audio=wire.AudioConfig(format=wire.AudioFormat(type="audio/pcm", rate=24000))
        ),
    )
    data = wire.encode(start)
    # Unset optional fields are left out, not sent as null.
    assert json.loads(data) == {
        "type": "session.start",
        "event_id": "s",
        "session": {"model": "m", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}},
    }
    assert wire.decode_command(data) == start
    append = wire.CommentaryAppend(content="x", delegation_id=None)
    assert json.loads(wire.encode(append)) == {
        "type": "session.commentary.append",
        "content": "x",
        "delegation_id": None,
    }
