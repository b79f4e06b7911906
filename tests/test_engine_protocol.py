"""The control channel's typed replies: every command has one result struct, and a reply decodes to it by type.

No engine: these pin the schema that tests/test_engine_process.py exercises end to end.
"""

from __future__ import annotations

import typing

import msgspec
import pytest

from engine_bridge import protocol as p
from engine_bridge.control import UnexpectedReply, encode, result_as

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
