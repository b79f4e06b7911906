"""Text requests on the cascade's thinker: /v1/chat/completions answered by the same weights as the voice sessions.

A text request is a short-lived thinker session (ids ``text:<request id>``, apart from the voice sessions' ids)
opened with the chat-templated messages, decoded to EOS / ``max_tokens`` / a stop string (never the voice
sessions' sentence limit), and closed as soon as it ends or is aborted, which frees its KV at once.

One budget. A text request needs a thinker session, and the thinker's admission (session limit, KV budget) is
the one the voice sessions use; on top of that a text request never takes a slot a voice session could still
claim: the engine admits ``max_sessions`` voice sessions, and text only gets what lies beyond them
(:meth:`TextCompletions._room`). The engine also caps text requests in flight (``max_text_requests``) and refuses
the rest at once, so a burst of text gets 429s instead of a queue.

Voice first. The scheduler thread steps the voice sessions first, then calls :meth:`TextCompletions.step`, which
does nothing while any voice turn is on its latency path (``voice_busy``: a caller turn being transcribed, a
reply generating, or a reply whose first audio is not out yet). So text requests are never batched into a voice
step and never prefilled ahead of one; at most one text step (tens of ms on a CPU) is in progress when a voice
turn arrives. The price is that text stalls while voice works, which a voice call's few seconds of thinking per
turn makes short. Batching text into the voice steps up to a cap was the alternative: on the torch backend every
change of the batch regroups the KV (a copy of every row), and a bigger batch makes each voice token slower, which
is exactly the delay this rule avoids. While voice audio plays (TTS of later clauses, the caller listening),
text runs at full speed.

Function tools. A request with tools opens its thinker session with them (``thinker.open(..., tools=...)``) and
decodes with its tool choice; tools the thinker cannot constrain a call to are refused (``INVALID_TOOLS``) before
anything is opened. The history's calls are written as the model writes them (``tool_format.render_call``) and
a ``tool`` message is the format's tool result. Only what the reply says goes out as TextDelta (the thinker never
puts a call's text in ``StepOutput.text``); a reply that ends in a call ends with ``TextDone(finish_reason=
"tool_calls", tool_calls=[...])``. One call per reply (the grammar stops after the first).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_bridge import protocol as p
from engine_bridge.text import TextRefused, TextRequest, TextStatus
from engine_bridge.thinker.base import (
    DecodingSettings,
    Message,
    StepOutput,
    ThinkerBackend,
    ThinkerCapacityError,
    ThinkerError,
)
from engine_bridge.thinker.tools import ToolCall, ToolCallFormat, ToolChoice, ToolSchemaError, ToolSpec

log = logging.getLogger(__name__)

#: Thinker session ids of text requests start with this (voice sessions' ids start with ``sess_``).
TEXT_SID_PREFIX = "text:"


class StopMatcher:
    """Stop strings over streamed text: hands out text only once it cannot be the start of a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit = False

    def push(self, text: str) -> str:
        """Text that is safe to emit now; sets :attr:`hit` (and drops the rest) when a stop string appears."""
        if not self.stops:
            return text
        buf = self._held + text
        first = min((i for s in self.stops if (i := buf.find(s)) >= 0), default=-1)
        if first >= 0:
            self.hit = True
            self._held = ""
            return buf[:first]
        # Keep back the longest tail that is the start of some stop string.
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


@dataclass(eq=False, slots=True)
class _Running:
    req: TextRequest
    sid: str
    prompt_tokens: int
    cached_tokens: int
    stop: StopMatcher
    #: The most tokens the completion may have, its call included (the client's ``max_tokens``, or the room left).
    max_tokens: int
    completion_tokens: int = 0
    done: p.TextDone | None = field(default=None)


def _history_message(m: p.TextMessage, fmt: ToolCallFormat) -> Message:
    if m.role == "system":
        return Message("developer", m.text)
    if m.role == "assistant" and m.tool_calls:
        # A message that made calls is what the model wrote: its words, then each call in the model's format.
        calls = "\n".join(fmt.render_call(ToolCall(c.call_id, c.name, c.arguments)) for c in m.tool_calls)
        words = m.text.strip()
        return Message("assistant", f"{words}\n{calls}" if words else calls)
    return Message(m.role, m.text)  # "tool": the thinker wraps it as the format's tool result


def to_messages(messages: list[p.TextMessage], fmt: ToolCallFormat) -> tuple[str | None, list[Message]]:
    """Chat messages → (instructions, history) of a thinker session: a leading system message becomes the
    session's system segment, later system messages become developer context (rendered as system turns); an
    assistant message's calls are written in the model's tool format ``fmt``, a tool message is the format's tool
    result."""
    instructions: str | None = None
    rest = messages
    if messages and messages[0].role in ("system", "developer"):
        instructions, rest = messages[0].text, messages[1:]
    return instructions, [_history_message(m, fmt) for m in rest]


def to_tools(req: TextRequest) -> tuple[list[ToolSpec], ToolChoice]:
    """The request's tools and tool choice as the thinker's; raises ToolSchemaError for what it cannot use (a bad
    name, a parameters schema that is not a JSON schema, a choice that names no tool or needs tools)."""
    tools = [ToolSpec(t.name, t.description, t.parameters) for t in req.tools]
    choice = ToolChoice(req.tool_choice.mode, req.tool_choice.name)
    choice.check(tools)
    return tools, choice


def reply_budget(room: int, cap: int, choice: ToolChoice | None) -> tuple[int, int]:
    """``(max_tokens, max_call_tokens)`` of a reply that may have ``room`` tokens and its client ``cap`` (at most
    ``room``): words and a call together fit in ``room`` (the thinker never trims a text request's history to
    make room), and the driver ends the completion at ``cap`` tokens in all (``_Running.max_tokens``). ``choice``
    None: no tools. ``room`` must be at least 2 with tools."""
    if choice is None:
        return cap, 1
    if choice.mode == "none":
        return min(cap, room - 1), 1
    if choice.mode in ("required", "function"):
        return 1, min(cap, room - 1)  # the reply is the call from its first token
    call = min(cap, max(1, room // 2))
    return min(cap, room - call), call


class TextCompletions:
    """The cascade adapter's text requests. ``submit`` from any thread; everything else on the scheduler thread."""

    def __init__(
        self,
        thinker: ThinkerBackend,
        *,
        voice_slots: int,
        voice_open: Callable[[], int],
        model_name: str,
        on_change: Callable[[], None],
    ) -> None:
        self.thinker = thinker
        #: Voice sessions the engine may admit (``max_sessions``): text never takes their thinker slots.
        self.voice_slots = voice_slots
        self._voice_open = voice_open
        self.model_name = model_name
        #: Called after a text session opened or closed (the adapter refreshes what /health shows).
        self._on_change = on_change
        self._inbox: queue.SimpleQueue[TextRequest] = queue.SimpleQueue()
        self._queued: list[TextRequest] = []
        self._running: dict[str, _Running] = {}
        self.completed = 0
        self.refused = 0
        self.aborted = 0

    # --- any thread ------------------------------------------------------------------------------------------
    def submit(self, req: TextRequest) -> None:
        self._inbox.put(req)

    def has_work(self) -> bool:
        return bool(self._queued or self._running or not self._inbox.empty())

    @property
    def running(self) -> int:
        return len(self._running)

    # --- scheduler thread --------------------------------------------------------------------------------------
    def step(self, *, voice_busy: bool) -> bool:
        """Aborts first, then (only when voice leaves room) admissions and one batched decode step."""
        worked = self._reap()
        while True:
            try:
                self._queued.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if voice_busy:
            return worked
        while self._queued:
            worked = True
            self._admit(self._queued.pop(0))
        if self._running:
            self._decode()
            worked = True
        return worked

    def _reap(self) -> bool:
        worked = False
        for req in [r for r in self._queued if r.abort_requested.is_set()]:
            self._queued.remove(req)
            req.refuse(p.ErrorCode.INVALID_REQUEST, "aborted before it started")
            worked = True
        for run in [r for r in self._running.values() if r.req.abort_requested.is_set()]:
            self.aborted += 1
            self._end(run, "abort")
            worked = True
        return worked

    def _room(self) -> int:
        """Thinker sessions a text request may still take: the thinker's limit (session count, and full contexts
        its KV holds when it reports a capacity) minus what is open and what voice may still claim."""
        limit = self.thinker.caps.max_sessions
        capacity = self.thinker.describe().get("kv_capacity_tokens")
        if isinstance(capacity, int) and capacity > 0:
            limit = min(limit, capacity // self.thinker.caps.max_context)
        voice_claim = max(0, self.voice_slots - self._voice_open())
        return limit - len(self.thinker.session_ids()) - voice_claim

    def _admit(self, req: TextRequest) -> None:
        if req.abort_requested.is_set():
            req.refuse(p.ErrorCode.INVALID_REQUEST, "aborted before it started")
            return
        thinker = self.thinker
        tools: list[ToolSpec] = []
        choice: ToolChoice | None = None
        if req.tools or req.tool_choice.mode != "auto":
            try:
                tools, choice = to_tools(req)
                if tools:
                    thinker.check_tools(tools, choice)  # compiles the grammar: refused here, never mid-reply
            except ToolSchemaError as e:
                self._refuse(req, p.ErrorCode.INVALID_TOOLS, str(e))
                return
        if not tools:
            choice = None  # no tools: an unconstrained reply whatever the choice ("auto" and "none" alike)
        instructions, history = to_messages(req.messages, thinker.tool_format)
        s = req.sampling
        try:
            prompt = thinker.prompt_length(instructions, history, tools)
        except ValueError as e:
            self._refuse(req, p.ErrorCode.INVALID_REQUEST, str(e))
            return
        limit = thinker.caps.max_context
        room = limit - prompt - thinker.reply_footer_length()
        if room < (2 if tools else 1):
            self._refuse(
                req,
                p.ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                f"{prompt} tokens (with the chat template). Please reduce the length of the messages.",
            )
            return
        if self._room() < 1:
            self._refuse(
                req, p.ErrorCode.CAPACITY_EXCEEDED, "the thinker is full (voice sessions keep their share)"
            )
            return
        max_tokens = min(s.max_tokens, room) if s.max_tokens is not None else room
        words, call = reply_budget(room, max_tokens, choice)
        decoding = DecodingSettings(
            max_tokens=words,
            temperature=s.temperature,
            top_p=s.top_p,
            repetition_penalty=1.0,
            max_sentences=None,  # text runs to EOS / max_tokens / a stop string, not to a sentence end
            seed=s.seed,
            tool_choice=choice,
            max_call_tokens=call,
        )
        sid = TEXT_SID_PREFIX + req.request_id
        try:
            thinker.open(sid, instructions, history, decoding=decoding, tools=tools)
            # KV reused instead of computed for the prompt: 0 on the torch backend (no cache across sessions);
            # on vLLM, its prefix-cache hits for this request.
            cached = max(0, len(thinker.log(sid)) - thinker.stats(sid).prefill_tokens_last_append)
            thinker.begin_reply(sid, decoding=decoding)
        except ThinkerCapacityError as e:
            thinker.close(sid)
            self._refuse(req, p.ErrorCode.CAPACITY_EXCEEDED, str(e))
            return
        except ToolSchemaError as e:  # checked above; open checks again
            thinker.close(sid)
            self._refuse(req, p.ErrorCode.INVALID_TOOLS, str(e))
            return
        except (ThinkerError, ValueError) as e:
            thinker.close(sid)
            self._refuse(req, p.ErrorCode.INVALID_REQUEST, str(e))
            return
        run = _Running(req, sid, prompt, cached, StopMatcher(s.stop), max_tokens)
        self._running[sid] = run
        req.status = TextStatus.RUNNING
        req.admitted.set_result(
            p.TextStarted(
                request_id=req.request_id,
                prompt_tokens=prompt,
                cached_tokens=cached,
                max_tokens=max_tokens,
                model=self.model_name,
            )
        )
        self._on_change()

    def _refuse(self, req: TextRequest, code: str, message: str) -> None:
        self.refused += 1
        req.refuse(code, message)

    def _decode(self) -> None:
        runs = list(self._running.values())
        try:
            outs = self.thinker.step([r.sid for r in runs])
        except Exception as e:
            log.exception("text step failed")
            for run in runs:
                self._end(run, "error", f"model step failed: {e}")
            return
        for run in runs:
            self._on_token(run, outs[run.sid])

    def _on_token(self, run: _Running, out: StepOutput) -> None:
        if out.token_id is not None:
            run.completion_tokens += 1
        text = run.stop.push(out.text)
        if run.stop.hit:
            self._send(run, text)
            self._end(run, "stop")
            return
        cut = not out.done and run.completion_tokens >= run.max_tokens  # words and a call, in all
        if out.done or cut:
            text += run.stop.flush()
        self._send(run, text)
        if out.tool_call is not None:
            call = out.tool_call
            item = p.ToolCallItem(call_id=call.call_id, name=call.name, arguments=call.arguments)
            self._end(run, "tool_calls", calls=[item])
        elif out.done or cut:
            self._end(run, "length" if cut or out.finish_reason == "length" else "stop")

    @staticmethod
    def _send(run: _Running, text: str) -> None:
        if text:
            run.req.emit(
                p.TextDelta(request_id=run.req.request_id, text=text, completion_tokens=run.completion_tokens)
            )

    def _end(
        self,
        run: _Running,
        reason: p.TextFinish,
        error: str = "",
        *,
        calls: list[p.ToolCallItem] | None = None,
    ) -> None:
        self._running.pop(run.sid, None)
        self.thinker.close(run.sid)  # frees the KV now (a reply in progress is dropped with it)
        self.completed += 1
        self._on_change()  # before finish(): whoever waits on the request sees the freed KV in /health
        run.req.finish(
            p.TextDone(
                request_id=run.req.request_id,
                finish_reason=reason,
                prompt_tokens=run.prompt_tokens,
                completion_tokens=run.completion_tokens,
                cached_tokens=run.cached_tokens,
                error=error,
                tool_calls=calls or [],
            )
        )

    def close_all(self, reason: str) -> None:
        """The adapter shuts down: refuse what is queued and end what runs."""
        for req in self._queued:
            req.refuse(p.ErrorCode.INTERNAL, reason)
        self._queued.clear()
        for run in list(self._running.values()):
            self._end(run, "error", reason)


__all__ = [
    "TEXT_SID_PREFIX",
    "StopMatcher",
    "TextCompletions",
    "TextRefused",
    "reply_budget",
    "to_messages",
    "to_tools",
]
