"""What the cascade reports about its turns: per-turn timing records (the session stats and the voice-to-voice
benchmark read them), the thinker's KV figures, and the periodic ``Usage`` event."""

from __future__ import annotations

import collections
from typing import Any, Final, Protocol

from engine_bridge import protocol as p
from engine_bridge.adapters.cascade.reply import Reply
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE
from engine_bridge.session import DuplexSession
from engine_bridge.thinker.base import ThinkerBackend

#: Per-turn timing records kept per session.
TURN_RECORDS: Final = 64
USAGE_EVERY_S: Final = 5.0


class TimedTurn(Protocol):
    """What a turn record needs of the caller turn a reply answered."""

    @property
    def end_ms(self) -> int: ...
    @property
    def speculated(self) -> bool: ...
    @property
    def asr_ms(self) -> float: ...
    @property
    def at_wall(self) -> float: ...
    @property
    def endpoint_wall(self) -> float | None: ...


def turn_record(r: Reply, turn: TimedTurn | None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "turn_id": r.turn_id,
        "samples": r.samples,
        "text": r.text.strip(),
        "voice": r.voice,
        "temperature": r.temperature,
        "output_tokens": r.tokens,
        "capped": r.capped,
        **r.append_stats,
    }
    if turn is not None and turn.endpoint_wall is not None and r.first_audio_wall is not None:
        first_clause = r.first_clause_wall or r.started_wall
        rec.update(
            {
                "speech_end_ms": turn.end_ms,
                "speculative": turn.speculated,
                "asr_ms": round(turn.asr_ms, 1),
                "endpoint_to_first_audio_ms": round((r.first_audio_wall - turn.endpoint_wall) * 1000, 1),
                "asr_start_to_first_clause_ms": round((first_clause - turn.at_wall) * 1000, 1),
                "reply_start_to_first_clause_ms": round((first_clause - r.started_wall) * 1000, 1),
                "tts_first_chunk_ms": round((r.first_audio_wall - first_clause) * 1000, 1),
            }
        )
    return rec


def publish_turn(
    session: DuplexSession,
    records: collections.deque[dict[str, Any]],
    rec: dict[str, Any],
    thinker: ThinkerBackend,
) -> None:
    records.append(rec)
    session.stats.extra["turn_records"] = list(records)
    ts = thinker.stats(session.id)
    session.stats.extra["thinker"] = {
        "resident_kv_tokens": ts.resident_kv_tokens,
        "log_tokens": ts.log_tokens,
        "prefill_tokens_last_append": ts.prefill_tokens_last_append,
        "cached_tokens_last_append": ts.cached_tokens_last_append,
        "ttft_ms_last_reply": ts.ttft_ms_last_reply,
        "trims": ts.trims,
        "memory_bytes": ts.memory_bytes,
    }


def emit_usage(session: DuplexSession, thinker: ThinkerBackend, context_limit: int) -> None:
    session.emit(
        p.Usage(
            session_id=session.id,
            input_seconds=session.stats.input_samples / ENGINE_INPUT_RATE,
            output_seconds=session.stats.output_samples / ENGINE_OUTPUT_RATE,
            context_tokens=thinker.stats(session.id).resident_kv_tokens,
            context_limit=context_limit,
        )
    )
