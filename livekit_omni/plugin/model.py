"""``OmniDuplexModel``: livekit-omni as a LiveKit Agents ``llm.DuplexModel``, co-located or remote.

* **Co-located** (``engine_address="unix:/run/livekit-omni/engine.sock"``): the agent process talks to an engine on
  the same host. Caller audio goes straight into the session's shared-memory ingress ring, answer audio comes out
  of the egress ring paced at 20 ms; only control messages cross the socket. No WebSocket, no base64.
* **Remote** (``base_url="http://host:8080/v1"``): the OpenAI Live WebSocket of a ``livekit-omni serve`` on another
  machine, with bounded reconnects that resume the same server session after a dropped connection, or else
  re-seed a new session with the conversation so far (as GPT-Live does).

``AgentSession(llm=OmniDuplexModel(...))`` is all an agent needs. The app owns the model: ``AgentSession.aclose()``
closes only the session, so close the model too (``async with OmniDuplexModel(...) as model:``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from livekit.agents import llm

from livekit_omni.plugin.gate import OmniGate
from livekit_omni.plugin.session import OmniSession

if TYPE_CHECKING:
    from engine_bridge.client import EngineClient

#: Environment fallbacks for the two connection choices and the key.
ENV_ENGINE_ADDRESS: Final = "LIVEKIT_OMNI_ENGINE_ADDRESS"
ENV_BASE_URL: Final = "LIVEKIT_OMNI_BASE_URL"
ENV_API_KEY: Final = "LIVEKIT_OMNI_API_KEY"


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

    def __post_init__(self) -> None:
        if self.input_queue_frames < 1 or self.output_queue_frames < 1:
            raise ValueError("queue bounds must be at least 1 frame")
        if self.max_retries < 0 or self.retry_interval_s < 0 or self.connect_timeout_s <= 0:
            raise ValueError("max_retries and retry_interval_s must be >= 0, connect_timeout_s > 0")
        if self.transcript_hold_s < 0 or self.idle_ttl_s < 0:
            raise ValueError("transcript_hold_s and idle_ttl_s must be >= 0")

    @property
    def mode(self) -> str:
        return "colocated" if self.engine_address else "remote"


class OmniDuplexModel(llm.DuplexModel):
    """livekit-omni's full-duplex voice engine for ``AgentSession(llm=...)``.

    Give exactly one of ``engine_address`` (co-located) or ``base_url`` (remote); either may come from the
    environment (``LIVEKIT_OMNI_ENGINE_ADDRESS`` / ``LIVEKIT_OMNI_BASE_URL``). Tools are not supported: an agent
    with tools fails to start with a ``RealtimeError``.
    """

    def __init__(
        self,
        *,
        engine_address: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        model: str | None = None,
        voice: str | None = None,
        idle_ttl_s: float | None = None,
        input_queue_frames: int | None = None,
        output_queue_frames: int | None = None,
        max_retries: int | None = None,
        retry_interval_s: float | None = None,
        connect_timeout_s: float | None = None,
        transcript_hold_s: float | None = None,
    ) -> None:
        super().__init__(
            capabilities=llm.DuplexCapabilities(
                # The engine transcribes the caller and reports turn boundaries.
                user_transcription=True,
                # No tools ever run (see OmniSession._update_tools), so there is no tool result to continue from.
                auto_tool_reply_generation=False,
                # The conversation is append-only (a KV lease holds it): new items can be added but nothing can be
                # edited or removed, and the instructions cannot be replaced — only appended to. GPT-Live declares
                # the same, so a handoff that changes them opens a fresh session.
                mutable_chat_context=False,
                mutable_instructions=False,
                mutable_tools=False,
            )
        )
        given: dict[str, Any] = {
            "engine_address": engine_address,
            "base_url": base_url,
            "api_key": api_key,
            "model": model,
            "voice": voice,
            "idle_ttl_s": idle_ttl_s,
            "input_queue_frames": input_queue_frames,
            "output_queue_frames": output_queue_frames,
            "max_retries": max_retries,
            "retry_interval_s": retry_interval_s,
            "connect_timeout_s": connect_timeout_s,
            "transcript_hold_s": transcript_hold_s,
        }
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
        elif not opts.base_url.startswith(("http://", "https://", "ws://", "wss://")):  # type: ignore[union-attr]
            raise ValueError(f"base_url must be an http(s):// or ws(s):// URL, got {opts.base_url!r}")
        self._opts = opts
        # Co-located sessions share one control connection per event loop (a worker has one loop; tests may run
        # several in turn), opened on first use.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EngineClient] = (
            weakref.WeakKeyDictionary()
        )
        self._client_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._sessions: weakref.WeakSet[OmniSession] = weakref.WeakSet()

    @property
    def options(self) -> OmniOptions:
        return self._opts

    @property
    def mode(self) -> str:
        """``"colocated"`` or ``"remote"``."""
        return self._opts.mode

    @property
    def model(self) -> str:
        return self._opts.model

    @property
    def provider(self) -> str:
        return "livekit-omni"

    def audio_gate(self) -> llm.AudioGate:
        return OmniGate()

    def session(self) -> OmniSession:
        if self._opts.engine_address:
            from livekit_omni.plugin.colocated import ColocatedSession

            s: OmniSession = ColocatedSession(self)
        else:
            from livekit_omni.plugin.remote import RemoteSession

            s = RemoteSession(self)
        self._sessions.add(s)
        return s

    async def aclose(self) -> None:
        """Close the sessions still open on this event loop and this loop's engine connection."""
        loop = asyncio.get_running_loop()
        for s in [s for s in self._sessions if s._loop is loop]:
            with contextlib.suppress(Exception):
                await s.aclose()
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.close()

    async def _engine_client(self) -> EngineClient:
        """The shared control connection of this event loop, connected (and the engine ready) on first use."""
        from engine_bridge.client import EngineClient

        loop = asyncio.get_running_loop()
        lock = self._client_locks.setdefault(loop, asyncio.Lock())
        async with lock:
            client = self._clients.get(loop)
            if client is not None and not client.lost:
                return client
            assert self._opts.engine_address is not None
            client = await EngineClient.connect(
                self._opts.engine_address,
                timeout=self._opts.connect_timeout_s,
                client_name="livekit-omni plugin",
            )
            self._clients[loop] = client
            return client
