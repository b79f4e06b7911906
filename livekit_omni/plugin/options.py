"""The plugin's options: every one typed, optional, with its default in one place (:class:`OmniOptions`), and the
rule that fills in what a caller left out (:func:`resolve_options`: the defaults, then the environment for the
connection and the key).

A module of its own because the model, its sessions and the occupancy probe all read the options, and the model
imports the sessions: the sessions take their options from here, never from the model's module.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

#: Environment fallbacks for the two connection choices and the key.
ENV_ENGINE_ADDRESS: Final = "LIVEKIT_OMNI_ENGINE_ADDRESS"
ENV_BASE_URL: Final = "LIVEKIT_OMNI_BASE_URL"
ENV_API_KEY: Final = "LIVEKIT_OMNI_API_KEY"
#: The tool choices that are not a function's name.
TOOL_CHOICE_MODES: Final = ("auto", "none", "required")
#: A function tool's name (OpenAI's rule, which the engine applies too).
_TOOL_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class OmniOptions:
    """Every option of the plugin with its default, in one place. Constructor arguments left ``None`` take
    the value here (or, for the connection and the key, the environment)."""

    #: Co-located: the engine's control address (``unix:/path`` or ``tcp:HOST:PORT``); env LIVEKIT_OMNI_ENGINE_ADDRESS.
    engine_address: str | None = None
    #: Remote: the HTTP base URL of a ``livekit-omni serve`` (``http://host:8080/v1``); env LIVEKIT_OMNI_BASE_URL.
    base_url: str | None = None
    #: Remote: bearer key (needed when the server has API keys configured); env LIVEKIT_OMNI_API_KEY.
    api_key: str | None = None
    #: Model name sent in ``session.start`` and reported in metrics.
    model: str = "livekit-omni"
    #: Output voice; empty keeps the engine's default.
    voice: str = ""
    #: Co-located: the engine reaps a session nobody touches for this long (0: the engine's default).
    idle_ttl_s: float = 0.0
    #: Caller frames held while the engine side catches up (or before the session opens); the oldest go first.
    input_queue_frames: int = 200
    #: Remote: model frames held for the framework; it reads them as they come, so this only bounds a stall.
    output_queue_frames: int = 500
    #: Remote: reconnect attempts after a connection fails or the server ends the session.
    max_retries: int = 3
    #: Remote: the first retry waits 0.1 s, then this, doubling per attempt (capped at 10 s).
    retry_interval_s: float = 1.0
    #: Connecting (and, co-located, waiting for an engine that is still loading its models).
    connect_timeout_s: float = 10.0
    #: Co-located: how long ``input_speech_stopped`` waits for the caller's final transcript, which LiveKit wants
    #: first. The engine transcribes at (or just before) the endpoint, so the final follows the stop by up to the
    #: ASR time: ~0.5-3 s for whisper on a small, busy CPU. Only a turn nothing was recognised in waits it out.
    transcript_hold_s: float = 5.0
    #: Whether the replies the model starts on its own (the caller's turns, ``speak_now``) may call the agent's
    #: function tools: ``"auto"``, ``"none"``, ``"required"`` (every such reply calls one), or the name of one of
    #: them (every such reply calls that one). The framework's own choice overrides it while the framework sets
    #: one (``generate_reply(tool_choice=...)``, the answer to a tool's result); ``set_tool_choice()`` on the
    #: session changes it for the rest of the call.
    tool_choice: str = "auto"
    #: After a reply that ended in a tool call, a short spoken acknowledgement ("One moment, please.") once this
    #: many ms pass without the result; -1: none. Remote: the Live delegation's ``acknowledgement_delay_ms``
    #: (-1: not sent, the server's default).
    acknowledgement_delay_ms: int = -1

    def __post_init__(self) -> None:
        if self.input_queue_frames < 1 or self.output_queue_frames < 1:
            raise ValueError("queue bounds must be at least 1 frame")
        if self.max_retries < 0 or self.retry_interval_s < 0 or self.connect_timeout_s <= 0:
            raise ValueError("max_retries and retry_interval_s must be >= 0, connect_timeout_s > 0")
        if self.transcript_hold_s < 0 or self.idle_ttl_s < 0:
            raise ValueError("transcript_hold_s and idle_ttl_s must be >= 0")
        if self.tool_choice not in TOOL_CHOICE_MODES and not _TOOL_NAME.match(self.tool_choice):
            raise ValueError(
                f"tool_choice is auto, none, required or a function tool's name, not {self.tool_choice!r}"
            )
        if self.acknowledgement_delay_ms < -1:
            raise ValueError("acknowledgement_delay_ms is -1 (none) or a delay in ms")

    @property
    def mode(self) -> str:
        """``"colocated"`` or ``"remote"``."""
        return "colocated" if self.engine_address else "remote"


def resolve_options(given: Mapping[str, Any]) -> OmniOptions:
    """The options for ``OmniDuplexModel(**given)``: each ``None`` takes its default, the connection and the key
    fall back to the environment, and exactly one connection must result. Raises ``ValueError`` on a bad value,
    at construction rather than at the first call."""
    opts = replace(OmniOptions(), **{k: v for k, v in given.items() if v is not None})
    if opts.engine_address is None and opts.base_url is None:
        opts = replace(
            opts,
            engine_address=os.environ.get(ENV_ENGINE_ADDRESS) or None,
            base_url=os.environ.get(ENV_BASE_URL) or None,
        )
    if opts.api_key is None and os.environ.get(ENV_API_KEY):
        opts = replace(opts, api_key=os.environ[ENV_API_KEY])
    if bool(opts.engine_address) == bool(opts.base_url):
        raise ValueError(
            "OmniDuplexModel needs exactly one of engine_address (co-located engine, e.g. "
            "'unix:/run/livekit-omni/engine.sock') or base_url (remote server, e.g. 'http://host:8080/v1'); "
            f"or set {ENV_ENGINE_ADDRESS} or {ENV_BASE_URL}"
        )
    if opts.engine_address:
        # Validate early: a typo should fail at construction, not in the first call.
        from engine_bridge.control import Address

        Address.parse(opts.engine_address)
    elif not opts.base_url or not opts.base_url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ValueError(f"base_url must be an http(s):// or ws(s):// URL, got {opts.base_url!r}")
    return opts
