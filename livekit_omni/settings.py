"""One typed settings object for the whole server: defaults < config file (TOML) < environment < flags.

Environment variables use the prefix ``LIVEKIT_OMNI_`` and ``__`` for nesting, e.g.
``LIVEKIT_OMNI_PORT=9000``, ``LIVEKIT_OMNI_API_KEYS='["sk-1"]'``, ``LIVEKIT_OMNI_ENGINE__MAX_SESSIONS=8``,
``LIVEKIT_OMNI_LIMITS__SESSION_LIFETIME_S=600``, ``LIVEKIT_OMNI_DRAIN_GRACE_S=60``, ``LIVEKIT_OMNI_RESUME_GRACE_S=0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from engine_bridge.config import EngineSettings


class LimitSettings(BaseModel):
    """Every limit of the serving side. Over a limit the client gets a stable error code (see the facade)."""

    #: Largest inbound WebSocket message (a 30 s fixture is ~1.9 MB of base64).
    max_message_bytes: int = Field(8 * 1024 * 1024, ge=64 * 1024)
    #: Largest outbound message; LiveKit's client breaks above 4 MiB.
    max_outbound_bytes: int = Field(256 * 1024, ge=4 * 1024)
    #: Outbound events queued per Live WebSocket. Audio goes out every 40-100 ms, so 512 is ~20-50 s of a client
    #: not reading (TCP buffers add a little) before it is disconnected with 1013; the queue never grows past it.
    outbound_queue_events: int = Field(512, ge=16)
    #: A session older than this is closed with reason ``expired``.
    session_lifetime_s: float = Field(3600.0, gt=0)
    #: Caller audio may run ahead of real time by this much (start-up backlog, bursts) before backpressure.
    input_burst_s: float = Field(5.0, gt=0)
    #: How long input may stay over budget before the session is closed with 1013.
    input_backpressure_grace_s: float = Field(3.0, gt=0)
    #: Largest SDP offer accepted.
    max_sdp_bytes: int = Field(64 * 1024, ge=1024)
    #: A WebRTC client must complete ICE + DTLS within this after the answer; until then its session holds an
    #: engine slot (so offers that never connect cannot hold the engine for long).
    webrtc_connect_timeout_s: float = Field(30.0, gt=0)
    #: Largest fixture clip.
    max_fixture_s: float = Field(30.0, gt=0)
    #: What a detached session (its connection dropped, see ``resume_grace_s``) may hold for its client: events
    #: and bytes (encoded). Over either, the session is closed and its resume token dies. The defaults hold a
    #: 30 s grace of PCM16 24 kHz speech (750 chunks, ~2 MB) with room to spare.
    resume_buffer_events: int = Field(4096, ge=16)
    resume_buffer_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024)


class WebRTCSettings(BaseModel):
    #: ICE servers as aiortc/WebRTC dicts, e.g. [{"urls": "stun:stun.example.org:3478"}]. No public STUN by default.
    ice_servers: list[dict[str, Any]] = Field(default_factory=list)
    #: Only use 127.0.0.1 candidates (local development and tests).
    loopback_only: bool = False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LIVEKIT_OMNI_", env_nested_delimiter="__", extra="ignore")
    config_file: ClassVar[Path | None] = None

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    #: Bearer keys accepted on every endpoint but /health. Empty: open (local use), with a warning at start-up.
    api_keys: list[str] = Field(default_factory=list)
    #: Attach to an engine that is already running instead of spawning one.
    engine_address: str | None = None
    #: The model name advertised by /v1/models and echoed in sessions.
    model_name: str = "livekit-omni"
    cors_origins: list[str] = Field(default_factory=lambda: ["*"])
    log_level: str = "INFO"
    #: SIGTERM drains: no new sessions, open ones run up to this long, then close 1012 (livekit_omni.drain).
    drain_grace_s: float = Field(30.0, ge=0)
    #: A Live session whose connection drops without ``session.close`` stays open this long (engine session, KV,
    #: pending output) for a ``session.resume`` with its token (docs/protocol.md). 0: no resume, a drop ends it.
    resume_grace_s: float = Field(30.0, ge=0)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    webrtc: WebRTCSettings = Field(default_factory=WebRTCSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls.config_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls.config_file))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> Settings:
        """Resolve settings; ``overrides`` (command-line flags) win over everything else."""
        if config_file is not None and not Path(config_file).is_file():
            raise FileNotFoundError(f"config file {config_file} does not exist")
        cls.config_file = Path(config_file) if config_file else None
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        finally:
            cls.config_file = None
