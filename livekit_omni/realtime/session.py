"""One OpenAI Realtime session: a projection of one engine session into the Realtime dialect.

The engine knows nothing of items, responses or the input buffer; this dialect keeps them — the conversation table
(:mod:`livekit_omni.realtime.items`), the responses (:mod:`livekit_omni.realtime.responses`) and the manual input
buffer (:mod:`livekit_omni.realtime.input_buffer`) — and drives them from the engine session's events. The session
core (:mod:`livekit_omni.sessions`) owns the rest, as for the Live dialect: lifecycle, emit (size cap, event log),
housekeeping, the end, the hub's admission and 20 ms output clock.

How the engine drives the table:

* a caller turn (VAD onset ``SpeechStarted``, endpoint ``SpeechStopped``) is a user item: ``speech_started`` at
  the onset (its true start, prefix padding included), then ``speech_stopped``, ``committed`` and the item's
  ``added``/``done`` at the endpoint; its ``InputTranscript`` fills the item and, with transcription configured,
  becomes ``...input_audio_transcription.completed``;
* a reply (``ReplyStarted``: one turn of one epoch) is a response with one assistant item. Its audio leaves with
  the frames the output clock pulls (``response.output_audio.delta``), its text with the frame that plays it;
  ``response.done`` follows the reply's last frame (or at once when it is cut), so no delta ever follows it;
* a barge-in bumps the epoch (the player drops the stale audio at its next frame) and ends the response
  ``cancelled``/``turn_detected``; the engine keeps only the words that were sent in the conversation;
* a reply that ends in a function call (``ReplyDone.tool_calls``) adds a ``function_call`` item to its response
  (``output_item.added``, the arguments' ``delta``/``done``, ``output_item.done``, ``conversation.item.done``),
  then ``response.done`` holds it. The client's ``function_call_output`` item is the tool's result in the engine's
  conversation; its ``response.create`` asks for the answer built on it. A cut reply makes no call.

The engine session opens lazily, at the first event that needs it (audio, an item, a response), so that the
client's first ``session.update`` (instructions, voice, turn detection) is what the engine session opens with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Final, Protocol

import msgspec
import numpy as np

from engine_bridge import protocol as p
from engine_bridge.client import EngineSession
from engine_bridge.control import EngineRequestError
from engine_bridge.formats import FRAME_MS
from livekit_omni.realtime import wire
from livekit_omni.realtime.config import NO_TOKEN_CAP, RealtimeConfig, check_max_output_tokens
from livekit_omni.realtime.input_buffer import COMMIT_FEED_SPEED, MIN_COMMIT_MS, InputBuffer, Write
from livekit_omni.realtime.items import (
    ConversationItems,
    ItemAppend,
    ItemRecord,
    engine_text,
    function_call_item,
    snapshot,
    stored_part,
)
from livekit_omni.realtime.responses import ResponseLog, ResponseRecord, keep_engine_text, response_wire
from livekit_omni.sessions.audio import decode_audio
from livekit_omni.sessions.base import ENGINE_REQUEST_TIMEOUT_S, DialectSession
from livekit_omni.sessions.errors import WireError
from livekit_omni.sessions.hub import SessionHub
from livekit_omni.sessions.state import SessionState
from livekit_omni.sessions.tools import engine_refusal, tool_choice_spec, tool_defs
from livekit_omni.sessions.transport import Transport
from media.egress import EgressPlayer, OutputFrame

if TYPE_CHECKING:
    from collections.abc import Callable


class TrackPeer(Protocol):
    """A call's media peer whose caller audio can be diverted (a WebRTC ``WebRTCPeer``, a SIP call's ``RtpPeer``):
    with ``input_sink`` set, decoded audio goes there instead of the ingress ring."""

    input_sink: Callable[[np.ndarray, int], None] | None


log = logging.getLogger(__name__)

#: Output audio goes out in deltas of this many 20 ms frames (a small lead for barge-in).
AUDIO_CHUNK_FRAMES: Final = 2
#: Manual mode: how long a response waits for a committed turn's transcript before answering anyway.
TRANSCRIPT_WAIT_S: Final = 10.0
#: Manual mode: a committed turn whose transcript has not come this long after its audio was fed is given up
#: (the ASR heard no words in it).
TRANSCRIPT_GIVE_UP_S: Final = 6.0


class RealtimeSession(DialectSession[wire.ClientEvent, wire.ServerEvent]):
    """One Realtime session over one transport (a WebSocket, or a WebRTC call's data channel). See the module
    docstring."""

    dialect = "realtime"
    id_prefix = "sess_"

    def __init__(self, hub: SessionHub, transport: Transport, *, model: str | None = None) -> None:
        super().__init__(hub, transport, wire.CODEC)
        self.config = RealtimeConfig(model=model or self.settings.model_name)
        self.expires_at = int(time.time() + self.settings.limits.session_lifetime_s)
        self.player: EgressPlayer | None = None
        self._opening: asyncio.Lock = asyncio.Lock()
        #: The conversation, in order.
        self.items = ConversationItems()
        self.responses = ResponseLog()
        #: The response in progress (created and not done), if any.
        self.active: ResponseRecord | None = None
        #: Engine replies of an epoch before this are stale (the client cancelled them).
        self._min_epoch = 0
        #: The user item of the caller's turn in progress (VAD modes).
        self._speaking: ItemRecord | None = None
        #: User items waiting for their transcript, oldest first.
        self._untranscribed: list[ItemRecord] = []
        #: Manual mode: the uncommitted input (appended bytes, or a WebRTC call's track audio).
        self._buffer = InputBuffer()
        self._peer: TrackPeer | None = None
        self._input_ms = 0.0  # all audio appended, on the dialect's input clock
        #: Manual mode: engine input fed so far (ms), and the lock that keeps commits in order.
        self._fed_ms = 0.0
        self._feeding = asyncio.Lock()
        self._transcribed = asyncio.Event()
        #: Whether the engine session was opened for manual turn-taking (None: not open yet).
        self._opened_manual: bool | None = None
        #: server_vad ``idle_timeout_ms``: when the caller's silence after the last response's audio triggers a
        #: response (monotonic), and where the input clock stood when that silence began.
        self._idle_deadline: float | None = None
        self._idle_from_ms = 0.0

    # --- the dialect's wire --------------------------------------------------------------------------------
    @property
    def metrics_label(self) -> str:
        return "realtime"

    def error(self, code: str, message: str, *, cid: str | None = None, param: str | None = None) -> None:
        self.emit(wire.error_event(code, message, param=param, client_event_id=cid))

    def start(self) -> None:
        """The session exists: ``session.created`` goes out first, unprompted."""
        self.emit(wire.SessionCreated(session=self._echo()))

    def _echo(self) -> wire.SessionConfig:
        return self.config.echo(session_id=self.id, expires_at=self.expires_at)

    @property
    def on_track(self) -> bool:
        """Audio travels on a media track (a WebRTC call), not in events: no ``append``, no ``output_audio.delta``;
        the track's clock pulls the output frames and ``output_audio_buffer.*`` tell where its audio stands."""
        return not self.transport.carries_audio

    @property
    def manual(self) -> bool:
        """Manual turn-taking: as the engine session was opened (its turn-taking is fixed then), else as configured."""
        if self._opened_manual is not None:
            return self._opened_manual
        return self.config.turn_detection is None

    # --- receive path -------------------------------------------------------------------------------------
    async def receive(self, ev: wire.ClientEvent) -> None:
        cid = ev.event_id
        match ev:
            case wire.InputAudioAppend():
                await self._on_append(ev)
            case wire.SessionUpdate():
                await self._on_update(ev)
            case wire.InputAudioCommit():
                await self._on_commit(cid)
            case wire.InputAudioClear():
                self._buffer.clear()
                self.emit(wire.InputCleared())
            case wire.OutputAudioClear():
                # WebRTC's "stop playing"; over the WebSocket it is a cancel of what is playing.
                if self.active is not None:
                    await self._cancel(self.active, "client_cancelled")
            case wire.ItemCreate():
                await self._on_item_create(ev)
            case wire.ItemRetrieve():
                rec = self.items.get(ev.item_id, "item_retrieve_invalid_item_id", "retrieve")
                self.emit(wire.ItemRetrieved(item=rec.item))
            case wire.ItemTruncate():
                await self._on_truncate(ev)
            case wire.ItemDelete():
                rec = self.items.get(ev.item_id, "item_delete_invalid_item_id", "delete")
                if rec.turn_id is not None and self.engine is not None:
                    # A deleted answer leaves the conversation (LiveKit deletes one that was cut before any of
                    # it played).
                    await asyncio.wait_for(
                        self.engine.truncate_reply(rec.turn_id, ""), ENGINE_REQUEST_TIMEOUT_S
                    )
                self.items.delete(ev.item_id)
                self._untranscribed = [r for r in self._untranscribed if r.id != ev.item_id]
                self.emit(wire.ItemDeleted(item_id=ev.item_id))
            case wire.ResponseCreate():
                await self._on_response_create(ev)
            case wire.ResponseCancel():
                r = self.active
                if r is None or (ev.response_id is not None and ev.response_id != r.id):
                    # Racing the server's own cancel after a barge-in is normal: a non-fatal error whose text
                    # LiveKit recognizes and ignores.
                    raise WireError(
                        "response_cancel_not_active", "Cancellation failed: no active response found"
                    )
                await self._cancel(r, "client_cancelled")

    # --- session.update -----------------------------------------------------------------------------------
    async def _on_update(self, ev: wire.SessionUpdate) -> None:
        new = self.config.apply(ev.session)
        old = self.config
        # Over WebRTC the codec was negotiated in the SDP: the formats are echoed and change nothing.
        if not self.on_track and self.player is not None and new.output_format != old.output_format:
            raise wire.WireError(
                "invalid_value",
                "the output format cannot change once audio has been sent",
                param="session.audio.output.format",
            )
        if self.engine is None and (
            new.tool_defs != old.tool_defs or new.tool_choice_spec != old.tool_choice_spec
        ):
            # Only the engine can tell whether its grammar library compiles a tool's schema: it opens now (with
            # the configuration as it stands) and takes the tools as an update, refusing them before they are
            # echoed, so the engine session never fails to open on them.
            await self.ensure_engine()
        changes = new.engine_changes(old) if self.engine is not None else {}
        if changes and self.engine is not None:
            # The engine session is open: what changed reaches it (voice, turn-taking, temperature and the token
            # cap from the next turn or reply on; instructions and tools rebuild its system prompt, keeping the
            # conversation).
            await self._engine_update(self.engine, "session.tools", **changes)
        self.config = new
        if self.bridge is not None and new.input_format != old.input_format:
            self.bridge.writer.set_format(new.input_format.encoding, new.input_format.rate)
        if "turn_taking" in changes:
            self._switch_turn_taking(manual=new.turn_detection is None)
        self.emit(wire.SessionUpdated(session=self._echo()))

    @staticmethod
    async def _engine_update(engine: EngineSession, param: str, **changes: object) -> None:
        """``UpdateSession``; tools the engine refuses become the dialect's ``invalid_value`` on ``param``."""
        try:
            await asyncio.wait_for(engine.update(**changes), ENGINE_REQUEST_TIMEOUT_S)  # type: ignore[arg-type]
        except EngineRequestError as e:
            refusal = engine_refusal(e, param)
            if refusal is None:
                raise
            raise refusal from e

    async def _append_item(self, engine: EngineSession, a: ItemAppend) -> None:
        if not a.empty:
            await asyncio.wait_for(
                engine.append_text(a.kind, a.text, call_id=a.call_id, call=a.call), ENGINE_REQUEST_TIMEOUT_S
            )

    def _switch_turn_taking(self, *, manual: bool) -> None:
        """Turn detection changed mid-session. Into manual mode: the caller's turn in progress is no user item
        (the client commits from now on). Out of it: the uncommitted buffer is dropped (the VAD hears live audio
        from now on)."""
        if self._opened_manual == manual:
            return
        self._opened_manual = manual
        if manual:
            self._speaking = None
        else:
            self._buffer.clear()
        self._route_track()

    def attach_peer(self, peer: TrackPeer) -> None:
        """A call's media peer (WebRTC or SIP): in manual mode its audio is buffered here until the client commits
        a turn."""
        self._peer = peer
        self._route_track()

    def _route_track(self) -> None:
        if self._peer is not None:
            self._peer.input_sink = self._capture_track if self.manual else None

    def _capture_track(self, pcm: np.ndarray, rate: int) -> None:
        """The track's audio while no commit has come (manual mode over WebRTC)."""
        self._buffer.capture_track(pcm, rate)

    # --- the engine session -------------------------------------------------------------------------------
    async def ensure_engine(self) -> EngineSession:
        """Open the engine session with the configuration as it stands (once)."""
        async with self._opening:
            if self.engine is not None:
                return self.engine
            if self.state.ending:
                raise WireError("session_closed", "the session is closed", type=wire.SERVER_ERROR)
            cfg = self.config
            engine = await self.open_engine(
                p.SessionConfig(
                    instructions=cfg.instructions,
                    voice=cfg.voice_name,
                    turn_taking=cfg.turn_taking(),
                    temperature=cfg.temperature,
                    max_output_tokens=cfg.token_cap,
                    tools=cfg.tool_defs,
                    tool_choice=cfg.tool_choice_spec,
                    acknowledgement_delay_ms=self.settings.realtime_acknowledgement_delay_ms,
                )
            )
            assert self.bridge is not None
            self._opened_manual = cfg.turn_detection is None
            self.bridge.writer.set_format(cfg.input_format.encoding, cfg.input_format.rate)
            self.activate()
            if not self.on_track:
                # Over WebRTC the media track's pacer pulls the frames (on_frame).
                self.hub.start_ticking(self)
            return engine

    def _open_output(self) -> None:
        """The egress player at the session's output format (WebSocket). Over WebRTC the peer opens it at the
        negotiated codec's rate when it answers the offer, which may be after the engine's first event."""
        assert self.bridge is not None
        if self.player is None and not self.on_track:
            fmt = self.config.output_format
            self.player = self.bridge.open_output(rate=fmt.rate, encoding=fmt.encoding)

    # --- input audio --------------------------------------------------------------------------------------
    async def _on_append(self, ev: wire.InputAudioAppend) -> None:
        if self.on_track:
            raise WireError(
                "invalid_value",
                "over WebRTC the caller's audio travels on the media track, not in input_audio_buffer.append",
                param="type",
            )
        fmt = self.config.input_format
        raw = decode_audio(ev.audio, fmt)
        ms = len(raw) / fmt.bytes_per_sample / fmt.rate * 1000
        # Audio the server consumes at real time (a manual buffer only fills until its commit).
        if not self.manual and not self.admit_input(ms / 1000):
            return
        self._input_ms += ms
        self.metrics.audio_in_seconds.inc(ms / 1000)
        await self.ensure_engine()
        assert self.bridge is not None
        if self.manual:
            self._buffer.append(raw, fmt)
            return
        self.bridge.writer.write(raw)

    async def _on_commit(self, cid: str | None) -> None:
        fmt = self.config.input_format
        have_ms = self._buffer.buffered_ms(on_track=self.on_track, fmt=fmt)
        if not self.manual:
            # Under server VAD the server commits at each endpoint; the buffer is what the VAD has not ended yet.
            have_ms = 0.0 if self._speaking is None else float(MIN_COMMIT_MS)
        if have_ms < MIN_COMMIT_MS:
            raise WireError(
                "input_audio_buffer_commit_empty",
                f"Error committing input audio buffer: buffer too small. Expected at least {MIN_COMMIT_MS}ms of "
                f"audio, but buffer only has {have_ms:.2f}ms of audio.",
            )
        if not self.manual:
            return  # the VAD's endpoint commits the turn in progress
        assert self.bridge is not None
        pieces, span_ms = self._buffer.commit(self.bridge.writer, on_track=self.on_track, fmt=fmt)
        rec = self._add_item(
            wire.message_item(
                wire.new_id("item"), "user", [wire.ContentPart(type="input_audio", transcript=None)]
            ),
            committed=True,
        )
        rec.start_ms, rec.end_ms = int(self._fed_ms), int(self._fed_ms + span_ms)
        self._fed_ms += span_ms
        self._untranscribed.append(rec)
        self._transcribed.clear()
        self.spawn(self._feed(pieces, rec))

    async def _feed(self, pieces: list[Write], rec: ItemRecord) -> None:
        """Manual mode: the committed audio (100 ms ``pieces`` that write it) into the engine, at a few times real
        time, in order behind earlier commits. A turn the ASR heard nothing in is given up after a while."""
        assert self.bridge is not None
        async with self._feeding:
            for write in pieces:
                if self.state.ending:
                    return
                write()
                await asyncio.sleep(0.1 / COMMIT_FEED_SPEED)
        await asyncio.sleep(TRANSCRIPT_GIVE_UP_S)
        if rec in self._untranscribed:
            self._untranscribed.remove(rec)
            self._transcribed.set()

    # --- items --------------------------------------------------------------------------------------------
    def _add_item(
        self, item: wire.Item, *, committed: bool = False, previous: str | None = None, first: bool = False
    ) -> ItemRecord:
        """Add an item after ``previous`` (default: the last item; ``first``: before all) and announce it."""
        rec = ItemRecord(item=item)
        if first:
            prev = None
        else:
            prev = previous if previous is not None else self.items.last_id()
        self.items.remember(rec)
        if committed:
            self.emit(wire.InputCommitted(item_id=rec.id, previous_item_id=prev))
        self.emit(wire.ItemAdded(item=item, previous_item_id=prev))
        self.emit(wire.ItemDone(item=item, previous_item_id=prev))
        return rec

    async def _on_item_create(self, ev: wire.ItemCreate) -> None:
        it = ev.item
        item_id = it.id or wire.new_id("item")
        if item_id in self.items:
            raise WireError(
                "item_create_duplicate_item_id",
                f"an item with id '{item_id}' already exists",
                param="item.id",
            )
        prev = ev.previous_item_id
        if prev not in (None, "root") and prev not in self.items:
            raise WireError(
                "item_create_invalid_previous_item_id",
                f"previous_item_id '{prev}' does not exist",
                param="previous_item_id",
            )
        append = engine_text(it)
        if it.type in (None, "message") and it.role not in ("user", "assistant", "system"):
            raise WireError("invalid_value", "role is user, assistant or system", param="item.role")
        engine = await self.ensure_engine()
        await self._append_item(engine, append)
        stored = wire.Item(
            id=item_id,
            type=it.type or "message",
            object="realtime.item",
            status="completed",
            role=it.role,
            content=[stored_part(c) for c in it.content] if it.content is not None else None,
            call_id=it.call_id,
            name=it.name,
            arguments=it.arguments,
            output=it.output,
        )
        if stored.type == "message" and not stored.content:
            stored.content = []
        rec = self._add_item(stored, previous=None if prev == "root" else prev, first=prev == "root")
        if prev == "root":
            # Kept first in the table (the engine's context order is the order the text arrived in).
            self.items.move_first(rec)

    async def _on_truncate(self, ev: wire.ItemTruncate) -> None:
        rec = self.items.get(ev.item_id, "item_truncate_invalid_item_id", "truncate")
        parts = rec.item.content or []
        if rec.item.role != "assistant" or not parts or parts[0].type != "output_audio":
            raise WireError(
                "unsupported_content_type",
                "Only model output audio messages can be truncated",
                param="item_id",
            )
        # Clamped to the audio sent and floored, never refused (clients keep tripping over OpenAI's refusals).
        t = max(0, min(int(ev.audio_end_ms), rec.audio_ms))
        kept = " ".join(w for w, end in rec.words if end <= t)
        rec.words = [(w, end) for w, end in rec.words if end <= t]
        rec.audio_ms = t
        parts[0].transcript = kept
        if rec.turn_id is not None and self.engine is not None:
            # The engine's conversation keeps the same words (applied once no reply runs).
            await asyncio.wait_for(self.engine.truncate_reply(rec.turn_id, kept), ENGINE_REQUEST_TIMEOUT_S)
        self.emit(wire.ItemTruncated(item_id=rec.id, content_index=ev.content_index, audio_end_ms=t))

    # --- responses ----------------------------------------------------------------------------------------
    async def _on_response_create(self, ev: wire.ResponseCreate) -> None:
        params = ev.response or wire.ResponseParams()
        if params.max_output_tokens is not None:
            check_max_output_tokens(params.max_output_tokens, "response.max_output_tokens")
        if self.active is not None:
            raise WireError(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {self.active.id}. "
                "Wait until the response is finished before creating a new one.",
            )
        # Checked before anything is created: a refused response.create leaves no response behind.
        own_choice = (
            tool_choice_spec(params.tool_choice, "response.tool_choice")
            if params.tool_choice is not None
            else None
        )
        own_tools = tool_defs(params.tools, "response.tools") if params.tools is not None else None
        inputs = [engine_text(it, f"response.input[{i}]") for i, it in enumerate(params.input or [])]
        engine = await self.ensure_engine()
        session_tools = self.config.tool_defs
        swap = own_tools is not None and own_tools != session_tools
        if swap:
            # This response's own tools: the engine lists them until the response ends, then the session's again.
            await self._engine_update(engine, "response.tools", tools=own_tools)
        r = self._new_response(params)
        if swap:
            r.restore_tools = session_tools
        self.emit(wire.ResponseCreated(response=self._response_wire(r, "in_progress")))
        extra = (params.instructions or "").strip()
        base = self.config.instructions.strip()
        if base and extra.startswith(base):
            # LiveKit sends the session instructions + "\n" + the extra ones: only the extra ones are new.
            extra = extra[len(base) :].strip()
        for append in inputs:
            await self._append_item(engine, append)
        # The extra instructions hold for this response only: the engine removes them when the reply ends.
        if self._untranscribed and self.manual:
            self.spawn(self._respond_after_transcript(engine, r, extra, self._reply_cap(params), own_choice))
        else:
            await asyncio.wait_for(
                engine.append_text(
                    "respond", extra, max_output_tokens=self._reply_cap(params), tool_choice=own_choice
                ),
                ENGINE_REQUEST_TIMEOUT_S,
            )

    @staticmethod
    def _reply_cap(params: wire.ResponseParams) -> int:
        """The response's own ``max_output_tokens`` for the engine: 0 (the session's cap) when it gives none."""
        cap = params.max_output_tokens
        if cap is None:
            return 0
        return cap if isinstance(cap, int) else NO_TOKEN_CAP

    async def _respond_after_transcript(
        self,
        engine: EngineSession,
        r: ResponseRecord,
        extra: str,
        cap: int,
        choice: p.ToolChoiceSpec | None,
    ) -> None:
        """Manual mode: the committed turn's words must be in the conversation before the reply starts."""
        deadline = time.monotonic() + TRANSCRIPT_WAIT_S
        while self._untranscribed and time.monotonic() < deadline and not r.finished:
            self._transcribed.clear()
            try:
                await asyncio.wait_for(self._transcribed.wait(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
        if not r.finished and self.state is SessionState.ACTIVE:
            await asyncio.wait_for(
                engine.append_text("respond", extra, max_output_tokens=cap, tool_choice=choice),
                ENGINE_REQUEST_TIMEOUT_S,
            )

    def _new_response(self, params: wire.ResponseParams | None = None) -> ResponseRecord:
        params = params or wire.ResponseParams()
        mods = params.output_modalities or self.config.output_modalities
        r = ResponseRecord(
            id=wire.new_id("resp"),
            modalities=["text"] if mods == ["text"] else ["audio"],
            metadata=params.metadata,
            max_output_tokens=params.max_output_tokens or self.config.max_output_tokens,
            out_of_band=params.conversation == "none",
        )
        self._idle_deadline = None
        self.responses.add(r)
        self.active = r
        return r

    def _response_wire(self, r: ResponseRecord, status: str, reason: str | None = None) -> wire.Response:
        return response_wire(
            r,
            status,
            reason,
            context_tokens=self.context[0] if self.context is not None else 0,
            conversation_id="conv_" + self.id[5:],
        )

    def _bind(self, r: ResponseRecord, epoch: int, turn_id: int) -> None:
        """The engine's reply (epoch, turn) is this response: its assistant item opens."""
        r.reply = (epoch, turn_id)
        part_type = "output_audio" if r.audio else "output_text"
        item = wire.message_item(
            wire.new_id("item"),
            "assistant",
            [
                wire.ContentPart(type=part_type, transcript="")
                if r.audio
                else wire.ContentPart(type=part_type, text="")
            ],
            status="in_progress",
        )
        prev = self.items.last_id()
        rec = ItemRecord(item=item, turn_id=turn_id)
        r.item = rec
        self.emit(wire.OutputItemAdded(response_id=r.id, item=snapshot(item, content=[])))
        if not r.out_of_band:
            self.items.remember(rec)
            self.emit(wire.ItemAdded(item=snapshot(item, content=[]), previous_item_id=prev))
        part = wire.Part(type="audio", transcript="") if r.audio else wire.Part(type="text", text="")
        self.emit(wire.ContentPartAdded(response_id=r.id, item_id=rec.id, part=part))

    async def _cancel(self, r: ResponseRecord, reason: str, *, status: str = "cancelled") -> None:
        assert self.engine is not None
        r.cancel_reason = reason
        interrupted = await asyncio.wait_for(self.engine.interrupt(), ENGINE_REQUEST_TIMEOUT_S)
        self._min_epoch = max(self._min_epoch, interrupted.epoch)
        self._finish(r, status, reason)

    def _finish(self, r: ResponseRecord, status: str, reason: str | None = None) -> None:
        """Close the response: the rest of its audio, the ``.done`` events of its parts and item, then
        ``response.done`` (always last)."""
        if r.finished:
            return
        r.finished = True
        if self.active is r:
            self.active = None
        if r.restore_tools is not None and self.engine is not None:
            self.spawn(self._engine_update(self.engine, "session.tools", tools=r.restore_tools))
        td = self.config.turn_detection
        if td is not None and td.idle_timeout_ms:
            # The idle timer runs from the end of the response's audio (it just finished playing).
            self._idle_deadline = time.monotonic() + td.idle_timeout_ms / 1000
            self._idle_from_ms = self._input_ms
        rec = r.item
        if rec is not None:
            self._flush_audio(r)
            text = " ".join(w for w, _ in rec.words) if r.audio else r.text
            item_status = "completed" if status == "completed" else "incomplete"
            part = (rec.item.content or [wire.ContentPart()])[0]
            if r.audio:
                part.transcript = text
                self.emit(wire.OutputAudioDone(response_id=r.id, item_id=rec.id))
                self.emit(wire.OutputAudioTranscriptDone(response_id=r.id, item_id=rec.id, transcript=text))
                done_part = wire.Part(type="audio", transcript=text)
            else:
                part.text = text
                self.emit(wire.OutputTextDone(response_id=r.id, item_id=rec.id, text=text))
                done_part = wire.Part(type="text", text=text)
            rec.item.status = item_status
            self.emit(wire.ContentPartDone(response_id=r.id, item_id=rec.id, part=done_part))
            self.emit(wire.OutputItemDone(response_id=r.id, item=rec.item))
            if not r.out_of_band:
                self.emit(wire.ItemDone(item=rec.item))
        self.emit(wire.ResponseDone(response=self._response_wire(r, status, reason)))
        if self.on_track and r.audio and r.first_frame_ms is not None:
            # The track plays no more of it: all of it played, or the rest was dropped (a barge-in, a cancel).
            if status == "completed":
                self.emit(wire.OutputAudioBufferStopped(response_id=r.id))
            else:
                self.emit(wire.OutputAudioBufferCleared(response_id=r.id))

    def _response_of(self, epoch: int, turn_id: int) -> ResponseRecord | None:
        r = self.active
        if r is not None and r.reply == (epoch, turn_id):
            return r
        return None

    # --- output: one 20 ms frame per tick of the hub's clock ----------------------------------------------
    def tick(self) -> None:
        player = self.player
        if player is None or self.state is not SessionState.ACTIVE:
            return
        self.on_frame(player.next_frame())

    def on_frame(self, frame: OutputFrame) -> None:
        """One 20 ms output frame left the player: from the hub's clock (WebSocket) or the media track (WebRTC)."""
        if self.state is not SessionState.ACTIVE:
            return
        if self._idle_deadline is not None and time.monotonic() >= self._idle_deadline:
            self._idle_deadline = None
            self.spawn(self._idle_timeout())
        r = self.active
        if r is None or r.reply is None:
            return
        ours = frame.speaking and (frame.epoch, frame.turn_id) == r.reply
        if ours and r.first_frame_ms is None:
            r.first_frame_ms = frame.start_ms
            if self.on_track and r.audio:
                self.emit(wire.OutputAudioBufferStarted(response_id=r.id))
        if r.first_frame_ms is not None and (ours or not r.generated):
            # From its first frame on, every frame goes out, the pauses between clauses included: the client's
            # audio of the item is then the server's timeline, so a playback position is a position in it.
            if r.audio and not self.on_track:
                r.audio_buf += frame.payload.data
                r.audio_frames += 1
            if r.item is not None:
                r.item.audio_ms = frame.start_ms + FRAME_MS - r.first_frame_ms
        if frame.transcripts:
            self._flush_audio(r)
            self._on_words(r, frame)
        elif r.audio_frames >= AUDIO_CHUNK_FRAMES:
            self._flush_audio(r)
        if (
            r.generated
            and not (frame.speaking and (frame.epoch, frame.turn_id) == r.reply)
            and not frame.transcripts
        ):
            self._finish_generated(r)

    def _finish_generated(self, r: ResponseRecord) -> None:
        """The reply is over and played: ``completed``, or ``incomplete`` when the engine stopped it at the
        client's ``max_output_tokens``."""
        if r.capped:
            self._finish(r, "incomplete", "max_output_tokens")
        else:
            self._finish(r, "completed")

    async def _idle_timeout(self) -> None:
        """server_vad ``idle_timeout_ms``: the caller stayed silent after the last answer; the model goes on."""
        if self.active is not None or self._speaking is not None or self.engine is None:
            return
        item_id = wire.new_id("item")
        self.emit(
            wire.TimeoutTriggered(
                audio_start_ms=int(self._idle_from_ms), audio_end_ms=int(self._input_ms), item_id=item_id
            )
        )
        self._add_item(
            wire.message_item(item_id, "user", [wire.ContentPart(type="input_audio", transcript="")]),
            committed=True,
        )
        td = self.config.turn_detection
        if td is not None and td.create_response is not False:
            await asyncio.wait_for(self.engine.append_text("respond", ""), ENGINE_REQUEST_TIMEOUT_S)

    def _on_words(self, r: ResponseRecord, frame: OutputFrame) -> None:
        rec = r.item
        if rec is None:
            return
        for d in frame.transcripts:
            if (d.epoch, d.turn_id) != r.reply or not d.text:
                continue
            base = r.first_frame_ms if r.first_frame_ms is not None else d.start_ms
            sep = " " if rec.words else ""
            rec.words.append((d.text.strip(), max(0, d.end_ms - base)))
            if r.audio:
                self.emit(
                    wire.OutputAudioTranscriptDelta(
                        response_id=r.id, item_id=rec.id, delta=sep + d.text.strip()
                    )
                )
            else:
                r.text += sep + d.text.strip()
                self.emit(wire.OutputTextDelta(response_id=r.id, item_id=rec.id, delta=sep + d.text.strip()))

    def _flush_audio(self, r: ResponseRecord) -> None:
        if not r.audio_buf or r.item is None:
            return
        self.emit(wire.OutputAudioDelta(response_id=r.id, item_id=r.item.id, delta=bytes(r.audio_buf)))
        self.metrics.audio_out_seconds.inc(r.audio_frames * FRAME_MS / 1000)
        r.audio_buf.clear()
        r.audio_frames = 0

    # --- engine events ------------------------------------------------------------------------------------
    def on_engine_event(self, ev: p.SessionEvent) -> None:
        match ev:
            case p.SpeechStarted():
                if not self.manual:
                    rec = ItemRecord(
                        item=wire.message_item(
                            wire.new_id("item"),
                            "user",
                            [wire.ContentPart(type="input_audio", transcript=None)],
                        ),
                        start_ms=ev.at_ms,
                    )
                    self._speaking = rec
                    self._idle_deadline = None
                    self.emit(wire.SpeechStarted(audio_start_ms=ev.at_ms, item_id=rec.id))
            case p.SpeechStopped():
                turn = self._speaking
                if turn is not None and not self.manual:
                    self._speaking = None
                    self.emit(wire.SpeechStopped(audio_end_ms=ev.at_ms, item_id=turn.id))
                    added = self._add_item(turn.item, committed=True)
                    added.start_ms = turn.start_ms
                    self._untranscribed.append(added)
            case p.BargeIn():
                r = self.active
                if r is not None and r.reply is not None and r.cancel_reason is None:
                    r.cancel_reason = "turn_detected"
            case p.InputTranscript(final=True):
                self._on_transcript(ev)
            case p.ReplyStarted():
                if ev.epoch < self._min_epoch:
                    return
                r = self.active
                if r is None or r.reply is not None:
                    if r is not None:
                        self._finish_generated(r)
                    r = self._new_response()
                    self.emit(wire.ResponseCreated(response=self._response_wire(r, "in_progress")))
                self._open_output()
                self._bind(r, ev.epoch, ev.turn_id)
            case p.ReplyDone():
                self._on_reply_done(ev)

    def _on_transcript(self, ev: p.InputTranscript) -> None:
        pending = self._untranscribed
        if not pending:
            return
        if self.manual:
            match = next(
                (
                    r
                    for r in pending
                    if r.start_ms is not None
                    and r.end_ms is not None
                    and r.start_ms <= ev.start_ms < r.end_ms
                ),
                None,
            )
            if match is None:
                return  # speech outside any committed span (cannot happen: only commits are fed)
        else:
            match = next((r for r in pending if r.start_ms == ev.start_ms), None) or pending[0]
        # Older items that got no transcript (the ASR heard nothing) are given up.
        idx = pending.index(match)
        del pending[: idx + 1]
        part = (match.item.content or [wire.ContentPart()])[0]
        part.transcript = (
            ev.text.strip() if part.transcript is None else f"{part.transcript} {ev.text.strip()}"
        )
        if self.config.transcription is not None:
            seconds = max(0.0, (ev.end_ms - ev.start_ms) / 1000)
            self.emit(
                wire.TranscriptionCompleted(
                    item_id=match.id, transcript=ev.text.strip(), usage=wire.DurationUsage(seconds=seconds)
                )
            )
        self._transcribed.set()

    def _on_reply_done(self, ev: p.ReplyDone) -> None:
        oob = self.responses.of_reply(ev.epoch, ev.turn_id, out_of_band=True)
        if oob is not None and self.engine is not None:
            # Out of band: the answer leaves the engine's conversation once it is over.
            self.spawn(self.engine.truncate_reply(ev.turn_id, ""))
        r = self._response_of(ev.epoch, ev.turn_id)
        if r is None:
            # A reply the client already cancelled: its item keeps only what the engine kept.
            old = self.responses.of_reply(ev.epoch, ev.turn_id)
            if old is not None:
                keep_engine_text(old, ev.text)
            else:
                if ev.interrupted and self.active is not None and self.active.reply is None:
                    # Cut before it was announced (a cancel that raced the reply's start).
                    self._finish(self.active, "cancelled", self.active.cancel_reason or "client_cancelled")
            return
        r.tokens = (ev.input_tokens, ev.cached_tokens, ev.output_tokens)
        r.capped = ev.capped
        if ev.interrupted:
            self._flush_audio(r)
            self._finish(r, "cancelled", r.cancel_reason or "turn_detected")
            keep_engine_text(r, ev.text)
        else:
            r.generated = True
            if r.text == "" and not r.audio:
                r.text = ev.text
            for call in ev.tool_calls:
                self._add_call(r, call)

    def _add_call(self, r: ResponseRecord, call: p.ToolCallItem) -> None:
        """A function call the reply ended in: its item in the response and the conversation, with the events
        the clients read the call from (``response.output_item.done`` is LiveKit's; the arguments' ``done`` is
        the SDK's)."""
        opened = function_call_item(call, status="in_progress", arguments="")
        item = msgspec.structs.replace(opened, status="completed", arguments=call.arguments)
        rec = ItemRecord(item=item)
        index = len(r.output())
        prev = self.items.last_id()
        r.calls.append(rec)
        self.emit(wire.OutputItemAdded(response_id=r.id, output_index=index, item=opened))
        if not r.out_of_band:
            self.items.remember(rec)
            self.emit(wire.ItemAdded(item=opened, previous_item_id=prev))
        item_id = item.id or ""
        self.emit(
            wire.FunctionCallArgumentsDelta(
                response_id=r.id,
                output_index=index,
                item_id=item_id,
                call_id=call.call_id,
                delta=call.arguments,
            )
        )
        self.emit(
            wire.FunctionCallArgumentsDone(
                response_id=r.id,
                output_index=index,
                item_id=item_id,
                call_id=call.call_id,
                name=call.name,
                arguments=call.arguments,
            )
        )
        self.emit(wire.OutputItemDone(response_id=r.id, output_index=index, item=item))
        if not r.out_of_band:
            self.emit(wire.ItemDone(item=item, previous_item_id=prev))

    # --- housekeeping and the end -------------------------------------------------------------------------
    def on_housekeeping(self, now: float) -> None:
        r = self.active
        if r is not None and r.never_started:
            # Never left without a response.done: the client could create no other response.
            self._finish(r, "failed")

    def farewell(self, *, was_active: bool, error: wire.ServerEvent | None) -> None:
        """The ``error`` if any, then the response in progress ends ``cancelled``."""
        if error is not None:
            self.emit(error)
        if self.active is not None and not self.active.finished:
            self._finish(self.active, "cancelled", "client_cancelled")
