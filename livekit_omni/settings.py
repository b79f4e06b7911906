"""One typed settings object for the whole server: defaults < config file (TOML) < environment < flags.

Environment variables use the prefix ``LIVEKIT_OMNI_`` and ``__`` for nesting, e.g.
``LIVEKIT_OMNI_PORT=9000``, ``LIVEKIT_OMNI_API_KEYS='["sk-1"]'``, ``LIVEKIT_OMNI_ENGINE__MAX_SESSIONS=8``,
``LIVEKIT_OMNI_LIMITS__SESSION_LIFETIME_S=600``, ``LIVEKIT_OMNI_DRAIN_GRACE_S=60``, ``LIVEKIT_OMNI_RESUME_GRACE_S=0``,
``LIVEKIT_OMNI_SIP__ENABLED=true LIVEKIT_OMNI_SIP__PORT=5062``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator
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


SipTransportName = Literal["udp", "tcp"]


def _both_transports() -> list[SipTransportName]:
    return ["udp", "tcp"]


class SipCredential(BaseModel):
    username: str = Field(min_length=1)
    password: str = Field(min_length=1)


class SipSettings(BaseModel):
    """The SIP endpoint (docs/sip.md): phone calls straight in, each one a Realtime session. Off by default."""

    enabled: bool = False
    #: Address the SIP transports and the calls' RTP sockets bind to. None: the server's ``host``.
    host: str | None = None
    port: int = Field(5060, ge=1, le=65535)
    transports: list[SipTransportName] = Field(default_factory=_both_transports, min_length=1)
    #: What SDP (``c=``) and Contact/Via advertise: the address callers reach this server at (a public IP behind
    #: NAT). None: ``host``, or when that is a wildcard (0.0.0.0), the address of the interface of the default route.
    public_address: str | None = None
    #: Even ports of this inclusive range carry the calls' RTP (one per call).
    rtp_port_min: int = Field(20000, ge=1024, le=65534)
    rtp_port_max: int = Field(29999, ge=1025, le=65535)
    #: A call whose caller sent no RTP for this long (not on hold) is hung up. 0: never.
    rtp_timeout_s: float = Field(30.0, ge=0)
    #: Receive jitter buffer: packets of reordering repaired (each adds 20 ms to every turn), see media/rtp.py.
    jitter_prefetch: int = Field(1, ge=0, le=8)
    #: The answer to a call over the engine's session limit: 503 with Retry-After (a proxy fails over to another
    #: node) or 486 Busy Here (final: the caller hears busy).
    limit_status: Literal[486, 503] = 503
    #: Retry-After (seconds) of a 503 (session limit, engine unavailable, draining).
    retry_after_s: int = Field(10, ge=0, le=3600)
    #: Realtime session configuration (the JSON of a ``session.update``'s ``session``) a call is accepted with when
    #: no webhook decides, e.g. ``{"instructions": "You answer the phone for ACME."}``.
    session: dict[str, Any] = Field(default_factory=dict)
    user_agent: str = "livekit-omni"
    #: Networks (CIDRs) whose requests are served; others get 403. Empty: every source (bind to a private address,
    #: or list your trunk provider's and PBX's networks, when the port is reachable from the internet).
    allowed_sources: list[str] = Field(default_factory=list)
    #: Digest credentials a new INVITE must carry (401 challenge otherwise). Empty: no authentication.
    credentials: list[SipCredential] = Field(default_factory=list)
    realm: str = "livekit-omni"
    digest_algorithm: Literal["MD5", "SHA-256"] = "MD5"
    #: Session timers (RFC 4028): the interval we ask for when the caller offers none (it is the caller's when it
    #: offers one), and the smallest we accept (422 below it). 0: no session timers.
    session_expires_s: int = Field(1800, ge=0)
    min_se_s: int = Field(90, ge=90)
    #: OpenAI's call control: each INVITE is announced to this URL (a signed ``realtime.call.incoming``), and the
    #: app accepts, rejects, transfers or hangs up the call through ``/v1/realtime/calls/{call_id}/...``. None: every
    #: call is accepted with ``session``.
    webhook_url: str | None = None
    #: The Standard Webhooks secret the webhook is signed with (``whsec_<base64>``, as OpenAI's).
    webhook_secret: str | None = None
    #: A call the app neither accepts nor rejects within this is refused (480).
    accept_timeout_s: float = Field(30.0, gt=0, le=300)

    @model_validator(mode="after")
    def _check_ports(self) -> SipSettings:
        if self.rtp_port_max - self.rtp_port_min < 1:
            raise ValueError(
                "sip.rtp_port_max must be above sip.rtp_port_min (an even port and its RTCP pair)"
            )
        return self


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
    #: Realtime sessions, whose dialect has no setting for it: after a reply that called a function tool, the caller
    #: hears a short spoken acknowledgement once this many ms pass without the call's result (-1: none, as on
    #: OpenAI's servers). The Live dialect takes its own from ``delegation.acknowledgement_delay_ms``.
    realtime_acknowledgement_delay_ms: int = Field(-1, ge=-1, le=60_000)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    webrtc: WebRTCSettings = Field(default_factory=WebRTCSettings)
    sip: SipSettings = Field(default_factory=SipSettings)

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
