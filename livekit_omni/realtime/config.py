"""A Realtime session's configuration: defaults, sparse ``session.update``, the full echo, and the engine's view.

``session.update`` is sparse (a field left out keeps its value, ``null`` resets it to the default here), and every
``session.updated`` echoes the whole effective configuration. What the engine honours is taken from here when the
engine session opens (instructions, voice, turn-taking, function tools); what it cannot honour is accepted and
echoed (tracing, noise reduction, ...; docs/protocol.md, Realtime).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from engine_bridge import protocol as p
from livekit_omni.realtime import wire
from livekit_omni.sessions.audio import WireFormat
from livekit_omni.sessions.tools import tool_choice_spec, tool_defs

DEFAULT_VOICE: Final = "marin"
#: The dialect's default format, both ways: PCM16 mono at 24 kHz.
PCM24: Final = WireFormat("pcm16", 24_000)
#: semantic_vad uses the engine's end-of-turn model: its eagerness picks the model's threshold (the probability that
#: the sentence is finished above which a pause ends the turn) and the longest wait (ms) when it is not finished.
#: server_vad ends turns by its silence window alone.
EAGERNESS_END_OF_TURN: Final[dict[str, tuple[float, int]]] = {
    "high": (0.004, 1000),
    "medium": (0.01, 2000),
    "auto": (0.01, 2000),
    "low": (0.03, 4000),
}
#: interrupt_response false: a barge-in minimum no caller turn reaches, so the reply plays on.
NO_BARGE_IN_MS: Final = 10_000_000
MAX_INSTRUCTIONS_CHARS: Final = 65_536
#: The sampling temperatures accepted (the engine's range; 0 is greedy).
MAX_TEMPERATURE: Final = 2.0
#: ``max_output_tokens: "inf"`` on one response, over a session cap: a cap no reply reaches (the engine's own
#: reply limit applies).
NO_TOKEN_CAP: Final = 2**31 - 1
#: The server VAD defaults the dialect documents.
DEFAULT_VAD: Final = wire.TurnDetection(
    type="server_vad",
    threshold=0.5,
    prefix_padding_ms=300,
    silence_duration_ms=500,
    idle_timeout_ms=None,
    create_response=True,
    interrupt_response=True,
)


def parse_format(fmt: wire.AudioFormat, param: str) -> WireFormat:
    """A Realtime format object -> the media format. ``audio/pcm`` is 24 kHz only (the SDK types say so)."""
    if fmt.type == "audio/pcm":
        if fmt.rate not in (None, 24_000):
            raise wire.WireError("invalid_value", "audio/pcm is 24000 Hz only", param=f"{param}.rate")
        return PCM24
    if fmt.type in ("audio/pcmu", "audio/pcma"):
        return WireFormat("pcmu" if fmt.type == "audio/pcmu" else "pcma", 8000)
    raise wire.WireError(
        "invalid_value",
        f"unsupported audio format {fmt.type!r}; use audio/pcm (24000), audio/pcmu or audio/pcma",
        param=f"{param}.type",
    )


def format_wire(fmt: WireFormat) -> wire.AudioFormat:
    if fmt.encoding == "pcm16":
        return wire.AudioFormat(type="audio/pcm", rate=fmt.rate)
    return wire.AudioFormat(type="audio/pcmu" if fmt.encoding == "pcmu" else "audio/pcma")


@dataclass(slots=True)
class RealtimeConfig:
    model: str
    instructions: str = ""
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    max_output_tokens: int | str = "inf"
    #: None: the engine's spoken-reply decoding (greedy).
    temperature: float | None = None
    input_format: WireFormat = PCM24
    output_format: WireFormat = PCM24
    noise_reduction: wire.NoiseReduction | None = None
    transcription: wire.Transcription | None = None
    turn_detection: wire.TurnDetection | None = DEFAULT_VAD
    voice: str | dict[str, Any] = DEFAULT_VOICE
    speed: float = 1.0
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    #: Accepted and echoed, never acted on.
    tracing: Any = None
    truncation: Any = "auto"
    prompt: Any = None
    reasoning: Any = None
    include: Any = None

    def apply(self, s: wire.SessionConfig) -> RealtimeConfig:
        """The configuration after a sparse update (a new object; ``self`` is unchanged if it raises)."""
        if not isinstance(s.type, msgspec.UnsetType) and s.type != "realtime":
            raise wire.WireError(
                "invalid_value",
                f"session.type {s.type!r} is not served; this server serves realtime sessions only",
                param="session.type",
            )
        c = dataclasses.replace(self)
        d = RealtimeConfig(model=self.model)
        if not isinstance(s.model, msgspec.UnsetType) and s.model:
            c.model = s.model
        if not isinstance(s.instructions, msgspec.UnsetType):
            c.instructions = s.instructions or ""
            if len(c.instructions) > MAX_INSTRUCTIONS_CHARS:
                raise wire.WireError(
                    "invalid_value",
                    f"instructions are limited to {MAX_INSTRUCTIONS_CHARS} characters",
                    param="session.instructions",
                )
        if not isinstance(s.output_modalities, msgspec.UnsetType):
            mods = s.output_modalities or d.output_modalities
            if mods not in (["audio"], ["text"]) and sorted(mods) != ["audio", "text"]:
                raise wire.WireError(
                    "invalid_value",
                    'output_modalities is ["audio"] or ["text"]',
                    param="session.output_modalities",
                )
            c.output_modalities = ["text"] if mods == ["text"] else ["audio"]
        if not isinstance(s.max_output_tokens, msgspec.UnsetType):
            c.max_output_tokens = check_max_output_tokens(s.max_output_tokens, "session.max_output_tokens")
        if not isinstance(s.temperature, msgspec.UnsetType):
            t = s.temperature
            if t is not None and not 0.0 <= t <= MAX_TEMPERATURE:
                raise wire.WireError(
                    "invalid_value",
                    f"temperature is between 0 and {MAX_TEMPERATURE:g}",
                    param="session.temperature",
                )
            c.temperature = t
        if not isinstance(s.tools, msgspec.UnsetType):
            tool_defs(s.tools, "session.tools")  # refused here, before anything changes
        if not isinstance(s.tool_choice, msgspec.UnsetType):
            tool_choice_spec(s.tool_choice, "session.tool_choice")
        for name in ("tools", "tool_choice", "tracing", "truncation", "prompt", "reasoning", "include"):
            v = getattr(s, name)
            if not isinstance(v, msgspec.UnsetType):
                setattr(c, name, v if v is not None else getattr(d, name))
        audio = s.audio
        if isinstance(audio, msgspec.UnsetType) or audio is None:
            return c
        inp = audio.input
        if not isinstance(inp, msgspec.UnsetType) and inp is not None:
            if not isinstance(inp.format, msgspec.UnsetType):
                c.input_format = parse_format(inp.format, "session.audio.input.format")
            if not isinstance(inp.noise_reduction, msgspec.UnsetType):
                c.noise_reduction = inp.noise_reduction
            if not isinstance(inp.transcription, msgspec.UnsetType):
                c.transcription = inp.transcription
            if not isinstance(inp.turn_detection, msgspec.UnsetType):
                c.turn_detection = _turn_detection(inp.turn_detection)
        out = audio.output
        if not isinstance(out, msgspec.UnsetType) and out is not None:
            if not isinstance(out.format, msgspec.UnsetType):
                c.output_format = parse_format(out.format, "session.audio.output.format")
            if not isinstance(out.voice, msgspec.UnsetType):
                c.voice = out.voice if out.voice is not None else DEFAULT_VOICE
            if not isinstance(out.speed, msgspec.UnsetType):
                c.speed = out.speed if out.speed is not None else 1.0
        return c

    @property
    def tool_defs(self) -> list[p.ToolDef]:
        """The session's function tools as the engine takes them (checked by :meth:`apply`)."""
        return tool_defs(self.tools, "session.tools")

    @property
    def tool_choice_spec(self) -> p.ToolChoiceSpec:
        return tool_choice_spec(self.tool_choice, "session.tool_choice")

    @property
    def token_cap(self) -> int:
        """The session's ``max_output_tokens`` as the engine takes it (0: no cap but the engine's own)."""
        return self.max_output_tokens if isinstance(self.max_output_tokens, int) else 0

    def engine_changes(self, old: RealtimeConfig) -> dict[str, Any]:
        """What changed for the engine from ``old`` to this configuration: ``UpdateSession``'s fields."""
        changes: dict[str, Any] = {}
        if self.instructions != old.instructions:
            changes["instructions"] = self.instructions
        if self.voice_name != old.voice_name:
            changes["voice"] = self.voice_name
        if self.turn_taking() != old.turn_taking():
            changes["turn_taking"] = self.turn_taking()
        if self.temperature != old.temperature and self.temperature is not None:
            changes["temperature"] = self.temperature
        elif self.temperature is None and old.temperature is not None:
            changes["temperature"] = 0.0  # reset: the engine's spoken-reply decoding is greedy
        if self.token_cap != old.token_cap:
            changes["max_output_tokens"] = self.token_cap
        if self.tool_defs != old.tool_defs:
            changes["tools"] = self.tool_defs
        if self.tool_choice_spec != old.tool_choice_spec:
            changes["tool_choice"] = self.tool_choice_spec
        return changes

    @property
    def voice_name(self) -> str:
        v = self.voice
        return v if isinstance(v, str) else str(v.get("id", ""))

    def turn_taking(self) -> p.TurnTakingConfig:
        """The engine's turn-taking for this configuration (taken when the engine session opens)."""
        td = self.turn_detection
        if td is None:
            # Manual: the client commits and asks for replies; the caller never barges in by VAD.
            return p.TurnTakingConfig(auto_reply=False, barge_in_min_ms=NO_BARGE_IN_MS)
        barge_in = None if td.interrupt_response is not False else NO_BARGE_IN_MS
        auto_reply = td.create_response is not False
        if td.type == "semantic_vad":
            threshold, max_wait = EAGERNESS_END_OF_TURN.get(
                td.eagerness or "auto", EAGERNESS_END_OF_TURN["auto"]
            )
            return p.TurnTakingConfig(
                end_of_turn="model",
                eot_threshold=threshold,
                eot_max_wait_ms=max_wait,
                barge_in_min_ms=barge_in,
                auto_reply=auto_reply,
            )
        return p.TurnTakingConfig(
            end_of_turn="silence",
            threshold=td.threshold,
            prefix_padding_ms=td.prefix_padding_ms,
            silence_ms=td.silence_duration_ms,
            barge_in_min_ms=barge_in,
            auto_reply=auto_reply,
        )

    def echo(self, *, session_id: str, expires_at: int) -> wire.SessionConfig:
        """The full effective configuration, as ``session.created`` and every ``session.updated`` carry it."""
        return wire.SessionConfig(
            type="realtime",
            id=session_id,
            object="realtime.session",
            expires_at=expires_at,
            model=self.model,
            instructions=self.instructions,
            output_modalities=list(self.output_modalities),
            max_output_tokens=self.max_output_tokens,  # type: ignore[arg-type]
            temperature=self.temperature if self.temperature is not None else msgspec.UNSET,
            audio=wire.AudioConfig(
                input=wire.AudioInput(
                    format=format_wire(self.input_format),
                    noise_reduction=self.noise_reduction,
                    transcription=self.transcription,
                    turn_detection=self.turn_detection,
                ),
                output=wire.AudioOutput(
                    format=format_wire(self.output_format), voice=self.voice, speed=self.speed
                ),
            ),
            tools=self.tools,
            tool_choice=self.tool_choice,
            tracing=self.tracing,
            truncation=self.truncation,
            prompt=self.prompt,
            reasoning=self.reasoning,
            include=self.include,
        )


def check_max_output_tokens(v: int | str | None, param: str) -> int | str:
    """A ``max_output_tokens``: a positive int or ``"inf"`` (``null``: ``"inf"``)."""
    if v is None or v == "inf":
        return "inf"
    if not isinstance(v, int) or v < 1:
        raise wire.WireError("invalid_value", 'max_output_tokens is a positive integer or "inf"', param=param)
    return v


def _turn_detection(td: wire.TurnDetection | None) -> wire.TurnDetection | None:
    """Fill the defaults of a turn-detection object (``null`` stays null: manual turn-taking)."""
    if td is None:
        return None
    if td.type == "server_vad":
        if td.threshold is not None and not 0.0 <= td.threshold <= 1.0:
            raise wire.WireError(
                "invalid_value",
                "threshold is between 0 and 1",
                param="session.audio.input.turn_detection.threshold",
            )
        return wire.TurnDetection(
            type="server_vad",
            threshold=td.threshold if td.threshold is not None else 0.5,
            prefix_padding_ms=td.prefix_padding_ms if td.prefix_padding_ms is not None else 300,
            silence_duration_ms=td.silence_duration_ms if td.silence_duration_ms is not None else 500,
            idle_timeout_ms=td.idle_timeout_ms,
            create_response=td.create_response is not False,
            interrupt_response=td.interrupt_response is not False,
        )
    if td.type == "semantic_vad":
        if td.eagerness is not None and td.eagerness not in EAGERNESS_END_OF_TURN:
            # Refused, never echoed: the session resource must stay valid for the clients' own types.
            raise wire.WireError(
                "invalid_value",
                f"eagerness is one of {', '.join(sorted(EAGERNESS_END_OF_TURN))}",
                param="session.audio.input.turn_detection.eagerness",
            )
        return wire.TurnDetection(
            type="semantic_vad",
            eagerness=td.eagerness or "auto",
            create_response=td.create_response is not False,
            interrupt_response=td.interrupt_response is not False,
        )
    raise wire.WireError(
        "invalid_value",
        f"unknown turn_detection type {td.type!r}; use server_vad, semantic_vad or null",
        param="session.audio.input.turn_detection.type",
    )
