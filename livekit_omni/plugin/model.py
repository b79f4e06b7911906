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
import weakref
from typing import Any

from livekit.agents import llm

from engine_bridge.client import EngineClient
from livekit_omni.plugin.colocated import ColocatedSession
from livekit_omni.plugin.gate import OmniGate
from livekit_omni.plugin.options import OmniOptions, resolve_options
from livekit_omni.plugin.remote import RemoteSession
from livekit_omni.plugin.session import OmniSession


class OmniDuplexModel(llm.DuplexModel):
    """livekit-omni's full-duplex voice engine for ``AgentSession(llm=...)``.

    Give exactly one of ``engine_address`` (co-located) or ``base_url`` (remote); either may come from the
    environment (``LIVEKIT_OMNI_ENGINE_ADDRESS`` / ``LIVEKIT_OMNI_BASE_URL``). The agent's function tools run as
    with any LiveKit model: the engine's model calls them, LiveKit executes them, and the answer is built on their
    results (``tool_choice`` sets whether the replies the model starts on its own may or must call one). Tools the
    engine cannot use fail the agent's start with a ``RealtimeError`` naming them.
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
        tool_choice: str | None = None,
        acknowledgement_delay_ms: int | None = None,
    ) -> None:
        super().__init__(
            capabilities=llm.DuplexCapabilities(
                # The engine transcribes the caller and reports turn boundaries.
                user_transcription=True,
                # A tool's result asks for no reply by itself (the engine's tool_result append, the Live
                # response.item.create): the framework asks for the answer (_generate_reply), which lets it bound
                # tool rounds (max_tool_steps: tool_choice "none" for the last), leave a result that wants no reply
                # unanswered, and tie the answer to the tool's speech. See OmniSession's module docstring.
                auto_tool_reply_generation=False,
                # The conversation is append-only (a KV lease holds it): new items can be added but nothing can be
                # edited or removed, and the instructions cannot be replaced — only appended to. GPT-Live declares
                # the same, so a handoff that changes them opens a fresh session.
                mutable_chat_context=False,
                mutable_instructions=False,
                # Tools can be replaced on a running session (the engine rebuilds its context once; the Live
                # session's responses delegation takes them in a session.update).
                mutable_tools=True,
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
            "tool_choice": tool_choice,
            "acknowledgement_delay_ms": acknowledgement_delay_ms,
        }
        self._opts = resolve_options(given)
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
        s: OmniSession
        if self._opts.engine_address:
            # The session gets this loop's shared control connection through the getter, when it opens.
            s = ColocatedSession(self, self._opts, engine_client=self._engine_client)
        else:
            s = RemoteSession(self, self._opts)
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
