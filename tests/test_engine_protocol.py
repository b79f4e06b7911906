"""The control channel's typed replies: every command has one result struct, and a reply decodes to it by type.

No engine: these pin the schema that tests/test_engine_process.py exercises end to end.
"""

from __future__ import annotations

import asyncio
import typing
from pathlib import Path

import msgspec
import pytest

from engine_bridge import protocol as p
from engine_bridge.control import (
    Address,
    ControlClient,
    ControlServer,
    EngineRequestError,
    ServerConnection,
    UnexpectedReply,
    encode,
    result_as,
)

_decoder = msgspec.msgpack.Decoder(p.EngineMessage)


def test_every_command_has_a_result_type() -> None:
    assert set(p.RESULT_OF) == set(typing.get_args(p.Command))
    assert set(p.RESULT_OF.values()) <= set(typing.get_args(p.ReplyResult))


@pytest.mark.parametrize(
    "result",
    [
        p.Ack(),
        p.SessionOpened(session_id="s", epoch=1, idle_ttl_s=120.0),
        p.TextAppended(start_ms=10, end_ms=10),
        p.MuteSet(muted=True),
        p.Interrupted(epoch=3),
    ],
    ids=lambda r: type(r).__name__,
)
def test_a_reply_decodes_to_its_result_type(result: p.ReplyResult) -> None:
    decoded = _decoder.decode(encode(p.Reply(req_id=7, result=result))[4:])
    assert isinstance(decoded, p.Reply) and decoded.result == result


def test_health_keeps_adapter_fields_apart_and_flattens_back() -> None:
    flat = {
        "engine_pid": 1,
        "state": "ready",
        "error": None,
        "max_sessions": 4,
        "active_sessions": 1,
        "adapter": "cascade",
        "kv_bytes": 1024,
        "models": {"asr": "tiny"},
    }
    health = p.EngineHealth.from_fields(flat)
    assert health.active_sessions == 1 and health.details == {"kv_bytes": 1024, "models": {"asr": "tiny"}}
    decoded = _decoder.decode(encode(p.Reply(req_id=1, result=health))[4:])
    assert isinstance(decoded, p.Reply) and decoded.result == health
    assert {k: v for k, v in health.flat().items() if k in flat} == flat


def test_session_stats_keep_the_log_typed_and_the_adapter_counters_apart() -> None:
    stats = p.SessionStats.from_fields(
        {
            "session_id": "s",
            "state": "listening",
            "epoch": 0,
            "turn_id": 1,
            "input_seconds": 1.0,
            "output_seconds": 0.5,
            "turns": 1,
            "barge_ins": 0,
            "playout": {"epoch": 0, "turn_id": 1, "samples": 10},
            "log": [{"role": "user", "text": "hi", "epoch": 0, "turn_id": 1}],
            "turn_records": [{"turn_id": 1}],
        }
    )
    assert stats.log == [p.LogEntry(role="user", text="hi", epoch=0, turn_id=1)]
    assert stats.extra == {"turn_records": [{"turn_id": 1}]}


def test_a_result_of_the_wrong_type_is_refused() -> None:
    reply = p.Reply(req_id=1, result=p.MuteSet(muted=False))
    cmd = p.AppendText(req_id=1, session_id="s", kind="thinking")
    assert result_as(reply, p.SetMute(req_id=1, session_id="s", muted=False), p.MuteSet) == p.MuteSet(
        muted=False
    )
    with pytest.raises(UnexpectedReply, match="TextAppended"):
        result_as(reply, cmd, p.TextAppended)


async def test_engine_state_and_close_reasons_cross_the_control_channel_typed_as_plain_strings(
    tmp_path: Path,
) -> None:
    """EngineHealth.state, CloseSession.reason and SessionClosed.reason are enums on both sides and their values
    on the wire; a value outside the enum does not decode."""
    received: list[p.CloseReason] = []

    async def handle(conn: ServerConnection, cmd: p.Command) -> p.Reply | p.ErrorReply:
        match cmd:
            case p.Hello() | p.Ping():
                health = p.EngineHealth(
                    engine_pid=1, state=p.EngineState.LOADING, max_sessions=1, active_sessions=0
                )
                return p.Reply(req_id=cmd.req_id, result=health)
            case p.CloseSession():
                received.append(cmd.reason)
                conn.send(p.SessionClosed(session_id=cmd.session_id, reason=cmd.reason))
                return p.Reply(req_id=cmd.req_id)
        return p.ErrorReply(req_id=cmd.req_id, code=p.ErrorCode.INVALID_REQUEST, message="unexpected")

    server = ControlServer(Address("unix", path=str(tmp_path / "engine.sock")), handle)
    await server.start()
    events: list[p.SessionEvent | p.TextEvent] = []
    client = await ControlClient.connect(server.address, on_event=events.append)
    try:
        assert client.hello is not None and client.hello.state is p.EngineState.LOADING
        cmd = p.CloseSession(req_id=0, session_id="s", reason=p.CloseReason.IDLE_TIMEOUT)
        await client.call(cmd, p.Ack)
        assert received == [p.CloseReason.IDLE_TIMEOUT] and type(received[0]) is p.CloseReason
        assert events == [p.SessionClosed(session_id="s", reason=p.CloseReason.IDLE_TIMEOUT)]
        assert type(typing.cast(p.SessionClosed, events[0]).reason) is p.CloseReason

        # A reason outside the enum is refused by the engine side's decoder with bad_message, never handled.
        fut = asyncio.get_running_loop().create_future()
        client._pending[778] = fut
        client.send_raw(
            msgspec.msgpack.encode(
                {"type": "closesession", "req_id": 778, "session_id": "s", "reason": "bogus"}
            )
        )
        with pytest.raises(EngineRequestError) as e:
            await asyncio.wait_for(fut, 5)
        assert e.value.code == p.ErrorCode.BAD_MESSAGE and "Invalid enum value 'bogus'" in str(e.value)
        assert received == [p.CloseReason.IDLE_TIMEOUT] and server.bad_messages == 1
    finally:
        await client.close()
        await server.close()


def test_typed_states_and_reasons_are_their_string_values_on_the_wire() -> None:
    health = p.EngineHealth(engine_pid=1, state=p.EngineState.READY, max_sessions=1, active_sessions=0)
    closed = p.SessionClosed(session_id="s", reason=p.CloseReason.ENGINE_SHUTDOWN)
    stats = p.SessionStats(
        session_id="s",
        state=p.SessionState.THINKING,
        epoch=0,
        turn_id=0,
        input_seconds=0.0,
        output_seconds=0.0,
        turns=0,
        barge_ins=0,
        playout=p.PlayoutPosition(epoch=0, turn_id=0, samples=0),
    )
    raw = [msgspec.msgpack.decode(encode(m)[4:]) for m in (p.Reply(req_id=1, result=health), closed)]
    assert raw[0]["result"]["state"] == "ready" and type(raw[0]["result"]["state"]) is str
    assert raw[1]["reason"] == "engine_shutdown" and type(raw[1]["reason"]) is str
    decoded = _decoder.decode(encode(p.Reply(req_id=2, result=stats))[4:])
    assert isinstance(decoded, p.Reply) and isinstance(decoded.result, p.SessionStats)
    assert decoded.result.state is p.SessionState.THINKING
    # The serving side's decoder refuses values outside the enums as well.
    for bad in (
        {"type": "reply", "req_id": 1, "result": {**raw[0]["result"], "state": "warming"}},
        {"type": "sessionclosed", "session_id": "s", "reason": "bogus"},
    ):
        with pytest.raises(msgspec.ValidationError, match="Invalid enum value"):
            _decoder.decode(msgspec.msgpack.encode(bad))
