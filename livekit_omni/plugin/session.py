"""What the co-located and the remote session share: the framework hooks, startup history, item de-duplication,
the public steering methods, function tools, error and usage reporting, and the bounded queues.

The two connections differ only in how they reach the engine (see :mod:`.colocated` and :mod:`.remote`); each
subclass implements a few verbs — send a text append, ask for a reply, set the mute, say whether the session has
started, and for tools: apply tools or a tool choice, return a call's result, ask for the answer built on results —
and the rest is here, so both behave the same towards LiveKit.

Function tools (docs/architecture.md, "Tool calls"). The model calls a tool at the end of a reply; the session emits
LiveKit's ``function_call`` and LiveKit runs the agent's tool. Its result comes back through ``_append_items`` and
goes to the engine as the call's result; then the framework asks for the answer (``_generate_reply``, because the
capabilities say ``auto_tool_reply_generation=False``), and that ask becomes a reply built on the result. A result
that arrives after the caller has taken a new turn joins the conversation but is not answered: the model has moved
on, and saying it then would talk out of turn.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from abc import abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, TypeVar

import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.agents.metrics import RealtimeModelMetrics
from livekit.agents.metrics.base import Metadata
from livekit.agents.types import NOT_GIVEN, NotGivenOr
from livekit.agents.utils import is_given

from engine_bridge import protocol as p
from livekit_omni.plugin.log import logger
from livekit_omni.plugin.options import OmniOptions
from livekit_omni.plugin.tools import choice_spec, engine_tools
from media.codecs import downmix_interleaved

T = TypeVar("T")

Role = Literal["developer", "user", "assistant"]
AppendKind = Literal["instructions", "thinking", "commentary"]

#: Item ids remembered for de-duplication. The framework re-sends the whole context on a reused handoff; a
#: conversation has a few hundred items at most, so this bound is never reached in practice but keeps memory fixed.
SEEN_IDS_LIMIT: Final = 4096
#: Conversation kept for startup history (co-located) and for re-seeding a reconnect (remote). The Live protocol
#: accepts at most 128 startup items, and the engine trims its own context, so older turns have no use.
HISTORY_LIMIT: Final = 128
#: Function calls remembered for their results (a call waits for one for as long as its tool runs; a session makes
#: a few per turn at most).
CALLS_LIMIT: Final = 256
#: The ``RealtimeError`` code of an answer the framework asked for after a result that arrived too late.
STALE_RESULT: Final = "tool_result_after_caller_turn"

OmniEventTypes = Literal["omni_reply_done", "omni_barge_in", "omni_server_event", "omni_client_event"]


@dataclass(frozen=True, slots=True)
class HistoryTurn:
    """One rendered conversation item: what the engine's startup history and a Live ``session.start`` carry."""

    role: Role
    text: str


@dataclass(frozen=True, slots=True)
class OmniReplyDone:
    """A reply ended (co-located mode): ``text`` is what the engine kept — after a barge-in, only what was played."""

    turn_id: int
    interrupted: bool
    text: str


@dataclass(frozen=True, slots=True)
class OmniBargeIn:
    """The caller talked over reply ``turn_id``; ``played_ms`` of it had been played (co-located mode)."""

    turn_id: int
    played_ms: int


@dataclass(slots=True)
class ToolCallState:
    """A function call this session knows: one the model made (``caller_turn``: how many caller turns had been
    heard when it was made), or, with ``foreign``, one the app put into the conversation."""

    name: str
    caller_turn: int
    foreign: bool = False
    answered: bool = False


def _frame_without_checks(data: bytes, rate: int, userdata: dict[str, Any] | None) -> rtc.AudioFrame:
    """``rtc.AudioFrame(data, rate, 1, len(data) // 2, userdata=userdata)`` with its attributes set directly."""
    frame = rtc.AudioFrame.__new__(rtc.AudioFrame)
    frame._data = data
    frame._sample_rate = rate
    frame._num_channels = 1
    frame._samples_per_channel = len(data) // 2
    frame._userdata = {} if userdata is None else userdata
    return frame


def _check_fast_frames() -> bool:
    """Whether frames built by :func:`mono_pcm16_frame`'s fast path read back exactly like constructed ones on the
    installed ``livekit`` (its private attributes are what the fast path sets; a release that renames them turns
    the fast path off instead of building broken frames)."""
    data, rate, userdata = bytes(range(8)), 24_000, {"k": 1}
    try:
        fast = _frame_without_checks(data, rate, userdata)
        built = rtc.AudioFrame(data, rate, 1, len(data) // 2, userdata=userdata)
        return vars(fast).keys() == vars(built).keys() and (
            bytes(fast.data.cast("B")),
            fast.sample_rate,
            fast.num_channels,
            fast.samples_per_channel,
            fast.userdata,
        ) == (
            bytes(built.data.cast("B")),
            built.sample_rate,
            built.num_channels,
            built.samples_per_channel,
            userdata,
        )
    except Exception:  # any difference means: use the constructor
        return False


#: Whether :func:`mono_pcm16_frame` skips ``rtc.AudioFrame``'s constructor (checked once, at import).
FAST_FRAMES: Final = _check_fast_frames()


def mono_pcm16_frame(data: bytes, rate: int, userdata: dict[str, Any] | None = None) -> rtc.AudioFrame:
    """An ``rtc.AudioFrame`` over ``data``, mono PCM16 that this plugin produced (whole samples, its own bytes).

    Why not the constructor: it checks the buffer's type and length with ``ctypes.sizeof`` calls, which after the
    20 ms sleep between output frames run from cold caches: ~15 µs of each co-located frame's CPU on the EPYC VM
    (benchmarks/plugin_paths.py, the modes measured in the same windows). What it checks holds by construction
    here; where the installed ``livekit`` is not the one the fast path was checked against (``FAST_FRAMES``), the
    constructor builds the frame."""
    if not FAST_FRAMES:
        return rtc.AudioFrame(data, rate, 1, len(data) // 2, userdata=userdata)
    return _frame_without_checks(data, rate, userdata)


def frame_to_mono_pcm16(frame: rtc.AudioFrame) -> np.ndarray:
    """An rtc.AudioFrame (interleaved int16, any channel count) as mono int16 at the frame's rate (a view when
    it is already mono)."""
    pcm = np.frombuffer(frame.data, dtype=np.int16)
    return pcm if frame.num_channels == 1 else downmix_interleaved(pcm, frame.num_channels)


def render_item(item: llm.ChatItem) -> tuple[Role, str] | None:
    """A context item as a role and text the engine carries (tool traffic narrated, as GPT-Live does)."""
    if isinstance(item, llm.ChatMessage):
        if not (text := item.text_content):
            return None
        if item.role in ("system", "developer"):
            return "developer", text
        return ("user" if item.role == "user" else "assistant"), text
    if isinstance(item, llm.FunctionCall):
        return "developer", f"Called tool {item.name} with {item.arguments}"
    if isinstance(item, llm.FunctionCallOutput):
        verb = "failed with" if item.is_error else "returned"
        return "developer", f"Tool {item.name or item.call_id} {verb} {item.output}"
    return None


class DropOldestQueue(Generic[T]):
    """A bounded FIFO with one consumer whose producer never waits: when full, the oldest item is dropped and
    counted. Caller audio goes through one, so a stalled consumer costs the oldest audio, never the event loop."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError("queue bound must be at least 1")
        self._items: collections.deque[T] = collections.deque()
        self._maxlen = maxlen
        self._ready = asyncio.Event()
        self._closed = False
        #: Items dropped because the queue was full.
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        if self._closed:
            return
        if len(self._items) >= self._maxlen:
            self._items.popleft()
            self.dropped += 1
        self._items.append(item)
        self._ready.set()

    def get_nowait(self) -> T | None:
        return self._items.popleft() if self._items else None

    async def get(self) -> T | None:
        """The next item; None once the queue is closed and empty."""
        while not self._items:
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def clear(self) -> int:
        n = len(self._items)
        self._items.clear()
        return n

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while (item := await self.get()) is not None:
            yield item


class OmniSession(llm.DuplexSession[OmniEventTypes]):
    """The common part of a livekit-omni duplex session. Reach it from an agent as ``agent.duplex_session``.

    Public steering (queued, never blocking): :meth:`append_instructions`, :meth:`append_thinking`,
    :meth:`append_commentary`, :meth:`speak_now`, :meth:`mute_input`, :meth:`unmute_input`.
    """

    def __init__(self, model: llm.DuplexModel, options: OmniOptions) -> None:
        # Typed as LiveKit's base model: a session reads only its label, name and provider (for metrics). What it
        # needs of the plugin's own model comes as arguments, so no session module imports the model's module.
        super().__init__(model)
        self._opts = options
        self._instructions = ""
        self._history: collections.deque[HistoryTurn] = collections.deque(maxlen=HISTORY_LIMIT)
        self._seen_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._input: DropOldestQueue[rtc.AudioFrame] = DropOldestQueue(self._opts.input_queue_frames)
        self._input_muted = False
        #: Whether the configuration (instructions, startup history) has been handed to the engine. Until then
        #: appended context only joins the history that the configuration carries; afterwards it is sent as an
        #: append. A remote session clears it between connections, so a reconnect re-sends everything as history.
        self._config_sent = False
        #: Set once an unrecoverable error was reported, so a session reports its end exactly once.
        self._failed = False
        self._loop = asyncio.get_running_loop()
        # Function tools: the agent's (LiveKit's objects, and as the engine's definitions), the framework's tool
        # choice while it sets one (None: the option's, or set_tool_choice's), the calls and their results.
        self._tool_ctx = llm.ToolContext.empty()
        self._tool_defs: list[p.ToolDef] = []
        self._default_choice = choice_spec(options.tool_choice)
        self._choice_override: p.ToolChoiceSpec | None = None
        #: Caller turns heard so far (a call made before the latest one is answered only if it still is the latest).
        self._caller_turns = 0
        self._calls: collections.OrderedDict[str, ToolCallState] = collections.OrderedDict()
        #: Results handed to the engine since the framework last asked for an answer.
        self._answered: list[str] = []
        #: Why the engine refused the agent's tools when the session opened, and whether the agent's start is
        #: waiting for that answer (it raises the refusal then).
        self._tools_refused: llm.RealtimeError | None = None
        self._start_waits = False

    # --- subclass verbs ---------------------------------------------------------------------------------------
    @abstractmethod
    def _send_append(self, kind: AppendKind, text: str) -> None:
        """Queue a text append for the engine (after start). Raises ``llm.RealtimeError`` when it cannot."""

    @abstractmethod
    def _request_reply(self, instructions: str | None) -> None:
        """Ask the model to speak now (after start, or queued until then)."""

    @abstractmethod
    def _send_mute(self, muted: bool) -> None:
        """Queue a mute change (re-applied by the subclass to any new engine session)."""

    @abstractmethod
    async def wait_ready(self) -> bool:
        """Wait until the engine session is open (True), or could not be opened / was closed first (False)."""

    @abstractmethod
    async def _apply_tools(self, tools: list[p.ToolDef], choice: p.ToolChoiceSpec) -> None:
        """Give the started session new tools (and the tool choice that goes with them). Raises
        ``llm.RealtimeError`` when the engine refuses them; the session keeps its tools then."""

    @abstractmethod
    def _send_tool_choice(self, choice: p.ToolChoiceSpec) -> None:
        """Queue a new session tool choice (after start; only while the session has tools)."""

    @abstractmethod
    def _send_tool_result(self, call_id: str, output: str) -> None:
        """Queue the result of the call ``call_id`` (no reply asked for)."""

    @abstractmethod
    def _send_tool_call(self, call: llm.FunctionCall) -> bool:
        """Queue a call the app put into the conversation as the model's own; False when the connection cannot
        carry one (it is narrated as context then)."""

    @abstractmethod
    def _request_tool_reply(self, choice: p.ToolChoiceSpec) -> None:
        """Ask the model for the answer built on the results just handed over."""

    # --- properties ---------------------------------------------------------------------------------------------
    @property
    def model(self) -> llm.DuplexModel:
        return self._duplex_model

    @property
    def tools(self) -> llm.ToolContext:
        return self._tool_ctx.copy()

    @property
    def tool_choice(self) -> p.ToolChoiceSpec:
        """The tool choice of the replies the model starts on its own, as the engine gets it."""
        return self._effective_choice(self._tool_defs)

    @property
    def input_frames_dropped(self) -> int:
        """Caller frames dropped because the input queue was full (the engine side fell behind)."""
        return self._input.dropped

    @property
    def started(self) -> bool:
        """Whether the session's configuration has been handed to the engine (later context goes as appends)."""
        return self._config_sent

    # --- audio in -----------------------------------------------------------------------------------------------
    def push_audio(self, frame: rtc.AudioFrame) -> None:
        # Called by the framework for every caller frame on the event loop: O(1), never waits.
        self._input.put(frame)

    # --- framework hooks ------------------------------------------------------------------------------------------
    async def _update_instructions(self, instructions: str) -> None:
        if not self.started:
            # Before start they are the session's own instructions (SessionConfig / session.start).
            self._instructions = instructions
            return
        if instructions == self._instructions:
            return
        # After start the engine cannot replace its instructions (its context is append-only, the KV holds them);
        # the new ones become a standing instruction appended to the conversation.
        self._instructions = instructions
        self._append_context("instructions", instructions)

    async def _update_session(
        self,
        *,
        instructions: NotGivenOr[str] = NOT_GIVEN,
        chat_ctx: NotGivenOr[llm.ChatContext] = NOT_GIVEN,
        tools: NotGivenOr[list[llm.Tool]] = NOT_GIVEN,
    ) -> None:
        first = not self._configured.is_set()
        await super()._update_session(instructions=instructions, chat_ctx=chat_ctx, tools=tools)
        if not (first and self._tool_defs) or self._closing:
            return
        # The engine checks the tools when the session opens (it compiles a grammar for each schema): wait for that,
        # so that tools it cannot use fail the agent's start with an error naming them, as the refusal of any other
        # configuration would, instead of ending the call a moment later. Bounded: an engine that is slow to answer
        # (still loading, a reconnect) lets the start go on, and a later refusal ends the session with that error.
        self._start_waits = True
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wait_ready(), 2 * self._opts.connect_timeout_s)
        finally:
            self._start_waits = False
        if self._tools_refused is not None:
            raise self._tools_refused

    async def _append_items(self, items: list[llm.ChatItem]) -> None:
        fresh = [item for item in items if self._first_sight(item.id)]
        if not self.started:
            # Startup history, handed over with the session's configuration (tool traffic narrated).
            for item in fresh:
                if (rendered := render_item(item)) is not None:
                    self._history.append(HistoryTurn(*rendered))
            return
        # As GPT-Live: a system/developer message is a standing instruction, everything else is silent context in
        # one thinking append, one "role: text" line per item. A tool's result for a call the engine knows goes
        # back as that call's result, in its place among them.
        lines: list[str] = []

        def flush() -> None:
            if lines:
                self._send_append("thinking", "\n".join(lines))
                lines.clear()

        for item in fresh:
            if (rendered := render_item(item)) is None:
                continue
            role, text = rendered
            self._history.append(HistoryTurn(role, text))
            if (
                isinstance(item, llm.FunctionCallOutput)
                and (call := self._calls.get(item.call_id)) is not None
            ):
                flush()
                self._send_tool_result(
                    item.call_id, f"error: {item.output}" if item.is_error else item.output
                )
                call.answered = True
                if not call.foreign and item.reply_required:
                    self._answered.append(item.call_id)
            elif isinstance(item, llm.FunctionCall) and item.call_id not in self._calls:
                flush()
                if self._send_tool_call(item):
                    self._remember_call(
                        item.call_id, ToolCallState(item.name, self._caller_turns, foreign=True)
                    )
                else:
                    lines.append(f"{role}: {text}")
            elif isinstance(item, llm.ChatMessage) and item.role in ("system", "developer"):
                self._send_append("instructions", text)
            else:
                lines.append(f"{role}: {text}")
        flush()

    async def _update_tools(self, tools: list[llm.Tool]) -> None:
        ctx = llm.ToolContext(tools)
        defs = engine_tools(ctx.flatten())
        if self.started and defs != self._tool_defs:
            # Replaces the engine session's tools (one rebuild of its context, like new instructions); the
            # engine refuses tools it cannot use and keeps the old ones.
            await self._apply_tools(defs, self._effective_choice(defs))
        # Before start they go out with the configuration (the engine checks them when the session opens).
        self._tool_ctx, self._tool_defs = ctx, defs

    def _update_options(self, *, tool_choice: NotGivenOr[llm.ToolChoice | None] = NOT_GIVEN) -> None:
        # The framework's session-wide choice: set for a reply it asks for (per_response_tool_choice is False for
        # every duplex model) and restored (None) afterwards.
        if not is_given(tool_choice):
            return
        before = self.tool_choice
        self._choice_override = None if tool_choice is None else choice_spec(tool_choice)
        self._choice_changed(before)

    def set_tool_choice(self, choice: llm.ToolChoice | str | None) -> None:
        """Change the tool choice of the replies the model starts on its own, for the rest of the call
        (``None``: the ``tool_choice`` option again); the framework's own choice still applies while it sets one.
        The engine checks it against the session's tools (an error event when it refuses)."""
        before = self.tool_choice
        self._default_choice = choice_spec(self._opts.tool_choice if choice is None else choice)
        self._choice_changed(before)

    def _generate_reply(
        self,
        *,
        instructions: NotGivenOr[str] = NOT_GIVEN,
        tool_choice: NotGivenOr[llm.ToolChoice] = NOT_GIVEN,
        tools: NotGivenOr[list[llm.Tool]] = NOT_GIVEN,
    ) -> None:
        if is_given(tools) and tools:
            # Never sent by the framework to a duplex model (per_response_tool_choice=False): it sets turn tools
            # session-wide with update_tools and restores them afterwards.
            raise llm.RealtimeError(
                "livekit-omni takes tools per session (update_tools), not per reply", code="invalid_tools"
            )
        if is_given(instructions) and instructions:
            self._request_reply(instructions)
            return
        if self._answered:
            self._answer_results(choice_spec(tool_choice) if is_given(tool_choice) else self.tool_choice)
            return
        self._request_reply(None)

    # --- function calls ---------------------------------------------------------------------------------------
    def _emit_function_call(
        self, call_id: str, name: str, arguments: str, item_id: str | None = None
    ) -> None:
        """The model called a tool: LiveKit runs it and hands its result back through ``_append_items``."""
        if call_id in self._calls:
            return  # already delivered (a server may repeat an item)
        call = llm.FunctionCall(call_id=call_id, name=name, arguments=arguments)
        if item_id:
            call.id = item_id
        # The framework records the call under this id; a context update carrying it back is not new.
        self._first_sight(call.id)
        self._remember_call(call_id, ToolCallState(name, self._caller_turns))
        if (rendered := render_item(call)) is not None:
            self._history.append(HistoryTurn(*rendered))
        self.emit("function_call", call)

    def _note_caller_turn(self) -> None:
        """The caller took a new turn: calls made before it are answered only as context from now on."""
        self._caller_turns += 1

    def _forget_calls(self) -> None:
        """The engine session that made the calls is gone (a new one was started): their results become context."""
        self._calls.clear()
        self._answered.clear()

    def _remember_call(self, call_id: str, state: ToolCallState) -> None:
        self._calls[call_id] = state
        while len(self._calls) > CALLS_LIMIT:
            self._calls.popitem(last=False)

    def _answer_results(self, choice: p.ToolChoiceSpec) -> None:
        """The framework asks for the answer to the results handed over since its last ask."""
        answered, self._answered = self._answered, []
        calls = [(cid, c) for cid in answered if (c := self._calls.get(cid)) is not None]
        current = [(cid, c) for cid, c in calls if c.caller_turn == self._caller_turns]
        if not current:
            names = sorted({c.name for _, c in calls})
            raise llm.RealtimeError(
                f"the caller spoke after {names} {'was' if len(names) == 1 else 'were'} called: the result joined "
                "the conversation without a spoken answer (the model's replies from now on know it)",
                code=STALE_RESULT,
            )
        waiting = [
            c.name
            for c in self._calls.values()
            if not c.answered and not c.foreign and c.caller_turn == self._caller_turns
        ]
        if waiting:
            # One answer for all the calls of a turn, once each has its result (as GPT-Live continues a response).
            self._answered = answered
            raise llm.RealtimeError(
                f"waiting for the results of {sorted(waiting)} before answering", code="tool_results_pending"
            )
        self._request_tool_reply(choice)

    def _refuse_tools(self, error: llm.RealtimeError) -> None:
        """The engine refused the session's tools when it opened: the agent's start raises this when it is waiting
        (OmniSession._update_session); otherwise the session ends with it."""
        self._tools_refused = error
        if self._start_waits:
            logger.error("%s", error)
            self._failed = True
        else:
            self._emit_error(error, recoverable=False)

    def _effective_choice(self, tools: list[p.ToolDef]) -> p.ToolChoiceSpec:
        if not tools:
            return (
                p.ToolChoiceSpec()
            )  # nothing to choose among: the engine refuses required/function without tools
        return self._choice_override or self._default_choice

    def _choice_changed(self, before: p.ToolChoiceSpec) -> None:
        after = self.tool_choice
        if after != before and self.started and self._tool_defs:
            self._send_tool_choice(after)

    # --- public steering --------------------------------------------------------------------------------------
    def append_instructions(self, text: str) -> None:
        """Add a standing instruction to the conversation."""
        self._append_context("instructions", text)

    def append_thinking(self, text: str) -> None:
        """Give the model something to know without saying it."""
        self._append_context("thinking", text)

    def append_commentary(self, text: str) -> None:
        """Give the model something to say now, in its own words."""
        self._request_reply(text)

    def speak_now(self) -> None:
        """Ask the model to speak now without waiting for the caller."""
        self._request_reply(None)

    def mute_input(self) -> None:
        """The engine hears silence instead of the caller (the timeline keeps moving); kept across reconnects."""
        self._input_muted = True
        self._send_mute(True)

    def unmute_input(self) -> None:
        self._input_muted = False
        self._send_mute(False)

    # --- helpers for subclasses ---------------------------------------------------------------------------------
    def _first_sight(self, item_id: str) -> bool:
        if item_id in self._seen_ids:
            return False
        self._seen_ids[item_id] = None
        if len(self._seen_ids) > SEEN_IDS_LIMIT:
            self._seen_ids.popitem(last=False)
        return True

    def _append_context(self, kind: Literal["instructions", "thinking"], text: str) -> None:
        if not text:
            return
        # Kept in the history either way: before start it is startup history, after start it re-seeds a reconnect.
        self._history.append(HistoryTurn("developer", text))
        if self.started:
            self._send_append(kind, text)

    def _emit_error(self, error: Exception, *, recoverable: bool) -> None:
        if self._failed or self._closing:
            return
        if not recoverable:
            self._failed = True
        logger.log(
            logging.WARNING if recoverable else logging.ERROR,
            "livekit-omni session error (%s): %s",
            "recoverable" if recoverable else "unrecoverable",
            error,
        )
        self.emit(
            "error",
            llm.RealtimeModelError(
                timestamp=time.time(), label=self._duplex_model.label, error=error, recoverable=recoverable
            ),
        )

    def _emit_usage(self, session_seconds: float, request_id: str) -> None:
        """Usage as a delta: LiveKit's collector sums every event, so a cumulative figure would be counted again
        and again."""
        if session_seconds <= 0:
            return
        self.emit(
            "metrics_collected",
            RealtimeModelMetrics(
                timestamp=time.time(),
                request_id=request_id,
                label=self._duplex_model.label,
                session_duration=session_seconds,
                input_token_details=RealtimeModelMetrics.InputTokenDetails(),
                output_token_details=RealtimeModelMetrics.OutputTokenDetails(),
                metadata=Metadata(
                    model_name=self._duplex_model.model, model_provider=self._duplex_model.provider
                ),
            ),
        )

    def _startup_history(self) -> list[HistoryTurn]:
        return list(self._history)
