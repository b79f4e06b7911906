"""What every thinker backend does with a conversation's turns, whatever computes the tokens.

A backend samples token ids (torch in-process, or vLLM's scheduler); everything around that is the same and
lives here, so both backends build logs, trim, stop, detokenize, count sentences and honour a barge-in
identically:

* :func:`opening_log` and :func:`fit_message` turn instructions, history and messages into log entries.
* :func:`trim_plan` chooses the old turns to drop near the context limit.

* :class:`ReplyProgress` is one reply's state: checkpoint, generated ids, the text handed out so far.
* :class:`ReplyPolicy.accept` decides what one sampled token means (kept, end of turn, sentence limit,
  length limit) and returns the :class:`StepOutput` the engine sees.
* The incremental detokenizer (the TGI/vLLM offsets scheme) hands out text only once it is whole UTF-8.
* :meth:`ReplyPolicy.committed_prefix` maps the text a caller actually heard back onto the generated ids.
"""

from __future__ import annotations

import logging
import re
import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Generic, TypeVar

from .base import (
    APPEND_ROLES,
    AppendResult,
    Checkpoint,
    DecodingSettings,
    FinishReason,
    LogSnapshot,
    Message,
    Role,
    Segment,
    StepOutput,
    ThinkerBackend,
    ThinkerStateError,
    ThinkerStats,
    TokenLog,
    UnknownSessionError,
)
from .prompting import ChatFormat, EncodedMessage, asks_for_length, ends_sentence
from .tools import (
    ToolCallFormat,
    ToolChoice,
    ToolReplyState,
    ToolSchemaError,
    ToolSpec,
    grammar_spec,
    tool_format,
)

if TYPE_CHECKING:
    from .tool_grammar import ToolGrammars
    from .tool_router import Route, ToolRouter

log = logging.getLogger(__name__)


def opening_log(
    fmt: ChatFormat,
    instructions: str | None,
    history: Sequence[Message] | None,
    *,
    system_prompt: str,
    limit: int,
    reply_reserve: int,
    examples: Sequence[Message] = (),
    tools_text: str = "",
) -> TokenLog:
    """The log of a new session: the system segment (``instructions`` or the default prompt) and history.

    ``examples`` are example turns rendered right after the system message and pinned with it: their tokens
    are the tail of the system segment (after its end-of-message marker), so trimming never drops them, a
    rollback never reaches them, and the log's messages are still exactly the conversation's own. ``tools_text``
    (the tool format's list of the session's tools) ends the system message's content, where templates put it.
    """
    out = TokenLog()
    system = fmt.encode_message("system", ((instructions or "").strip() or system_prompt) + tools_text)
    prefix, content, suffix = system.prefix, system.content, list(system.suffix)
    for msg in examples:
        if msg.role not in ("user", "assistant"):
            raise ValueError("example turns must be user or assistant messages")
        suffix += fmt.encode_message(msg.role, msg.text.strip()).tokens
    pinned = len(prefix) + len(content) + len(suffix)
    if pinned > limit // 2:
        raise ValueError(f"instructions (and example turns) take {pinned} tokens, more than half of {limit}")
    if pinned + reply_reserve > limit:
        raise ValueError(f"instructions plus one reply (max_tokens) do not fit in {limit} tokens")
    out.add_message("system", fmt.decode(system.content), prefix, content, suffix)
    for msg in history or ():
        if msg.role not in APPEND_ROLES:
            raise ValueError(f"history message role must be one of {sorted(APPEND_ROLES)}")
        enc = fmt.encode_message(msg.role, msg.text.strip())
        out.add_message(msg.role, msg.text.strip(), *_parts(enc))
    return out


def reinstruct(
    thinker: ThinkerBackend,
    sid: str,
    instructions: str | None,
    conversation: Sequence[Message],
    *,
    previous: str | None,
    examples: Sequence[Message] = (),
    tools: Sequence[ToolSpec] | None = None,
) -> str:
    """Give open session ``sid`` other instructions, keeping its conversation: the session is re-opened with the
    new system segment (and ``examples``) and ``conversation`` as its history, so the whole log is prefilled in one
    pass (one KV rebuild) and is token for token the log of a session opened that way. The session's decoding
    stays, and so do its tools unless ``tools`` gives others (changing the tools is re-instructing: they are listed
    in the system segment). Instructions the thinker cannot take (too long for its context) leave ``previous`` in
    place. Returns "" when applied, else why not. The thinker may trim the oldest turns to fit, as any ``open``
    does. Check new tools with ``thinker.check_tools`` first: tools it refuses leave the session closed."""
    dec = thinker.session_decoding(sid)
    old_tools = thinker.session_tools(sid)
    new_tools = old_tools if tools is None else tuple(tools)
    thinker.close(sid)
    try:
        thinker.open(
            sid, instructions or None, conversation, examples=examples, decoding=dec, tools=new_tools
        )
    except ValueError as e:
        thinker.open(sid, previous or None, conversation, examples=examples, decoding=dec, tools=old_tools)
        return str(e)
    return ""


def fit_message(
    fmt: ChatFormat, enc: EncodedMessage, text: str, room: int, sid: str
) -> tuple[EncodedMessage, str]:
    """A message whose content is longer than ``room`` tokens keeps its end, the part said last. Returns the
    encoding and the text that goes into the log."""
    if len(enc.content) <= room:
        return enc, text
    content = enc.content[len(enc.content) - max(room, 0) :]
    log.warning("session %s: a %d-token message was cut to its last %d tokens", sid, len(enc.content), room)
    return EncodedMessage(enc.prefix, content, enc.suffix), fmt.decode(content)


def _latest(segments: Sequence[Segment], *roles: str) -> Segment | None:
    """The latest segment before the open reply whose role is one of ``roles`` (any but the assistant's when none
    is named)."""
    for seg in reversed(segments):
        if (seg.role in roles) if roles else seg.role != "assistant":
            return seg
    return None


def _latest_request(segments: Sequence[Segment]) -> str:
    """The text of the latest message before the open reply that is not the assistant's (the caller's words,
    engine context or a commentary to speak), or "" when there is none."""
    seg = _latest(segments)
    return "" if seg is None else seg.text


def _latest_user_words(segments: Sequence[Segment]) -> str:
    """The text of the caller's latest message (the latest user segment), or "" when there is none."""
    seg = _latest(segments, "user")
    return "" if seg is None else seg.text


def _parts(enc: EncodedMessage) -> tuple[list[int], list[int], list[int]]:
    return enc.prefix, enc.content, enc.suffix


@dataclass(slots=True)
class ReplyProgress:
    ckpt: Checkpoint
    #: Log index of the first generated token (just after the assistant header).
    start: int
    decoding: DecodingSettings
    t_begin: float
    generated: list[int] = field(default_factory=list)
    #: Text already handed out in StepOutput.text.
    text: str = ""
    # Incremental detokenizer offsets: decode generated[prefix:] and emit what lies past
    # generated[prefix:read], but only once it no longer ends in an incomplete UTF-8 sequence.
    prefix_offset: int = 0
    read_offset: int = 0
    sentences: int = 0
    #: Length of ``text.rstrip()`` at the last counted sentence end (one terminator counts once).
    sentence_mark: int = 0
    first_token_seen: bool = False
    done: bool = False
    finish_reason: FinishReason | None = None
    #: Token ids this reply may not sample (``DecodingSettings.unprompted_words`` not yet said; see
    #: ``LogBackedThinker._banned_tokens``).
    banned: tuple[int, ...] = ()
    #: The reply's tool state when its session has tools (what is said aloud, whether a call is open).
    tool: ToolReplyState | None = None
    #: Whether the message it answers asks for length (``prompting.asks_for_length``); read from the log at the
    #: first token when the decoding has a ``long_max_sentences``.
    asked_length: bool | None = None

    @property
    def repetition_penalty(self) -> float:
        """The penalty this reply decodes with: none for a call whose free strings are the caller's words. Its JSON
        repeats quotes and colons by its grammar, and SmolLM2-135M, penalised for them, wrote "," or ");" for a
        city; a call with free strings of its own keeps the penalty, which stops a greedy model repeating itself
        inside a string until the call's budget runs out."""
        tool = self.tool
        if tool is not None and tool.arguments_from_words and tool.choice.mode in ("required", "function"):
            return 1.0
        return self.decoding.repetition_penalty


class ReplyPolicy:
    """Token acceptance and detokenization for one model's chat format (one instance per backend)."""

    def __init__(self, fmt: ChatFormat) -> None:
        self.fmt = fmt
        self.stop_ids = fmt.stop_token_ids
        self._space_start: dict[int, bool] = {}

    def accept(self, log: TokenLog, reply: ReplyProgress, tok: int) -> StepOutput:
        """Apply one sampled token: extend the log with it when it is kept, and say whether the reply ended."""
        dec = reply.decoding
        if tok in self.stop_ids and not dec.ignore_eos:
            # The end-of-turn token is not kept: end_reply() appends the template's whole footer.
            return self.finish(reply, tok, "stop")
        tool = reply.tool
        in_call = tool is not None and tool.in_call
        if reply.asked_length is None:
            reply.asked_length = dec.long_max_sentences is not None and asks_for_length(
                _latest_request(log.segments)
            )
        max_sentences = dec.long_max_sentences if reply.asked_length else dec.max_sentences
        if (
            max_sentences is not None
            and not in_call
            and self._starts_with_space(tok)
            and ends_sentence(reply.text)
        ):
            mark = len(reply.text.rstrip())
            if mark > reply.sentence_mark:
                reply.sentences += 1
                reply.sentence_mark = mark
                if reply.sentences >= max_sentences:
                    # This token would open the next sentence; it is not kept.
                    return self.finish(reply, None, "sentence")
        reply.generated.append(tok)
        log.extend_open_content([tok])
        text = self.next_text(reply)
        limit = dec.max_tokens
        calling = False
        if tool is not None:
            # The call's text is never said: only what comes before the trigger (tools.ToolReplyState).
            text = tool.speakable(reply.text, len(reply.generated))
            if tool.call_token_start is not None:
                limit = tool.call_token_start + dec.max_call_tokens
                calling = True
        if len(reply.generated) >= limit:
            return self.finish(reply, tok, "length", text)
        if (
            not reply.asked_length
            and not calling  # a call has its own budget (max_call_tokens), not the spoken-length rule
            and dec.brief_max_tokens is not None
            and len(reply.generated) >= dec.brief_max_tokens
        ):
            # The spoken-length rule of a reply nobody asked to be long, below the hard cap.
            return self.finish(reply, tok, "sentence", text)
        return StepOutput(tok, text, False)

    def finish(
        self, reply: ReplyProgress, tok: int | None, reason: FinishReason, text: str = ""
    ) -> StepOutput:
        reply.done = True
        rest = self.flush_text(reply)
        call = None
        if reply.tool is not None:
            rest = reply.tool.speakable(reply.text, len(reply.generated), final=True)
            call = reply.tool.call(reply.text)
            if call is not None:
                reason = "tool_call"
        reply.finish_reason = reason
        return StepOutput(tok, text + rest, True, reason, tool_call=call)

    def _starts_with_space(self, tok: int) -> bool:
        hit = self._space_start.get(tok)
        if hit is None:
            piece = self.fmt.tokenizer.decode([tok])
            hit = bool(piece) and piece[0].isspace()
            self._space_start[tok] = hit
        return hit

    def next_text(self, reply: ReplyProgress) -> str:
        gen = reply.generated
        before = self.fmt.decode(gen[reply.prefix_offset : reply.read_offset])
        now = self.fmt.decode(gen[reply.prefix_offset :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            delta = now[len(before) :]
            reply.prefix_offset, reply.read_offset = reply.read_offset, len(gen)
            reply.text += delta
            return delta
        return ""

    def flush_text(self, reply: ReplyProgress) -> str:
        """Whatever is still held back (an incomplete character at the end of a reply is dropped)."""
        gen = reply.generated
        before = self.fmt.decode(gen[reply.prefix_offset : reply.read_offset])
        now = self.fmt.decode(gen[reply.prefix_offset :])
        delta = now[len(before) :].rstrip("\ufffd") if len(now) > len(before) else ""
        reply.prefix_offset = reply.read_offset = len(gen)
        reply.text += delta
        return delta

    def committed_prefix(self, reply: ReplyProgress, committed: str) -> tuple[int, list[int], str]:
        """Barge-in: ``(keep, rest_tokens, committed)`` where the first ``keep`` generated ids are kept as they
        are (their text is a prefix of what was heard), ``rest_tokens`` encode the rest of the heard text, and
        ``committed`` is the heard text as it goes into the log."""
        self.flush_text(reply)
        said = reply.text
        if not said.startswith(committed) and said.lstrip().startswith(committed.lstrip()):
            # TTS front-ends strip the reply's leading space; put it back so the model's tokens still match.
            committed = said[: len(said) - len(said.lstrip())] + committed.lstrip()
        keep, kept_text = 0, ""
        for j in range(1, len(reply.generated) + 1):
            piece = self.fmt.decode(reply.generated[:j])
            if committed.startswith(piece):
                keep, kept_text = j, piece
            elif not piece.endswith("\ufffd"):
                break
        rest = committed[len(kept_text) :]
        return keep, (self.fmt.encode_content(rest) if rest else []), committed


def trim_plan(log: TokenLog, limit: int, need: int, fraction: float) -> set[int] | None:
    """Which segments to drop so that ``need`` more tokens fit in ``limit`` (None: nothing to drop).

    Drops the oldest turns (never the system segment) down to ``fraction`` of the limit, so that the next
    rebuild is several turns away, and never leaves an answer whose question was dropped at the front.
    """
    if len(log) + need <= limit:
        return None
    target = int(limit * fraction) - need
    segs = log.segments
    first = 1 if segs and segs[0].role == "system" else 0
    length = len(log)
    drop: set[int] = set()
    i = first
    while i < len(segs) and length > target:
        drop.add(i)
        length -= segs[i].end - segs[i].start
        i += 1
    while i < len(segs) and segs[i].role == "assistant":
        drop.add(i)
        length -= segs[i].end - segs[i].start
        i += 1
    return drop


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ------------------------------------------------------------------------------------ the shared backend half
@dataclass(slots=True)
class SessionRecord:
    """The backend-independent part of a session: its log, decoding defaults and the reported counters."""

    sid: str
    log: TokenLog
    decoding: DecodingSettings
    prefill_tokens_last_append: int = 0
    cached_tokens_last_append: int = 0
    prefill_ms_last_append: float = 0.0
    ttft_ms_last_reply: float | None = None
    prefill_tokens_total: int = 0
    generated_tokens_total: int = 0
    trims: int = 0
    #: The tools the session's system segment lists (``open(..., tools=...)``).
    tools: tuple[ToolSpec, ...] = ()
    #: The tool router's decision for the session's latest routed reply (None: none yet).
    tool_route: Route | None = None


S = TypeVar("S", bound=SessionRecord)


class LogBackedThinker(ThinkerBackend, Generic[S]):
    """The half of the contract that is about the token log, shared by the torch and vLLM backends: the session
    table, message encoding, trimming, checkpoint bounds and stats. A backend adds what computes KV."""

    fmt: ChatFormat
    policy: ReplyPolicy
    #: Longest log a session keeps, and how far a trim cuts (fraction of it).
    max_context_tokens: int
    trim_to_fraction: float
    #: The system segment of a session opened without instructions.
    system_prompt: str
    _sessions: dict[str, S]

    def _get(self, sid: str) -> S:
        try:
            return self._sessions[sid]
        except KeyError:
            raise UnknownSessionError(sid) from None

    def _reply_reserve(self, dec: DecodingSettings) -> int:
        return len(self.fmt.reply_header) + dec.max_tokens + len(self.fmt.reply_footer)

    @abstractmethod
    def _admit(self) -> None:
        """Raise :class:`ThinkerCapacityError` if one more session does not fit (before any compute)."""

    def _opening_log(
        self,
        sid: str,
        instructions: str | None,
        history: Sequence[Message] | None,
        *,
        log: LogSnapshot | None,
        examples: Sequence[Message],
        decoding: DecodingSettings,
        tools: Sequence[ToolSpec] = (),
    ) -> TokenLog:
        """``open``'s log half: refuse an id that is open, check the tools (a schema the grammar cannot compile is
        refused here), admit the session (guarantee 6, Admission, in docs/architecture.md: before any compute), and
        build its log from the snapshot or from the instructions, tools, history and example turns."""
        if sid in self._sessions:
            raise ThinkerStateError(f"session {sid!r} is already open")
        if tools:
            self.check_tools(tools, decoding.tool_choice)
        self._admit()
        if log is not None:
            if instructions or history or examples:
                raise ValueError(
                    "open(): pass either a log snapshot or instructions/history/examples, not both"
                )
            return TokenLog.from_snapshot(log)
        return opening_log(
            self.fmt,
            instructions,
            [self._as_model_reads(m) for m in history or ()],
            system_prompt=self.system_prompt,
            limit=self.max_context_tokens,
            reply_reserve=self._reply_reserve(decoding),
            examples=examples,
            tools_text=self.tool_format.render_tools(tools),
        )

    # ------------------------------------------------------------------ tools
    #: ``auto`` (from the chat template) or a name of ``tools.TOOL_FORMATS``.
    tool_format_name: str = "auto"
    #: A forced call's free strings (``required`` or a named function) are runs of the caller's latest words
    #: (``tools.spoken_schema``): for a small model that, made to call, writes values nobody said.
    spoken_arguments: bool = False
    #: Decides ``auto`` replies before their first token from the thinker's own embeddings (``tool_router.py``);
    #: None: the model decides as it decodes.
    tool_router: ToolRouter | None = None

    def _as_model_reads(self, msg: Message) -> Message:
        """``msg`` as it goes into the log: a tool's result is written as the tool format reads it (one place, so
        ``open``, ``append`` and ``prompt_length`` agree)."""
        if msg.role != "tool":
            return msg
        return Message("tool", self.tool_format.result_text(msg.text))

    @cached_property
    def tool_format(self) -> ToolCallFormat:
        """The model's tool format; also teaches the chat format the ``tool`` role (a tool result's message)."""
        found = tool_format(self.tool_format_name, getattr(self.fmt.tokenizer, "chat_template", None))
        before, after = self.fmt.wrappers[found.result_role]
        self.fmt.wrappers["tool"] = (before + found.result_prefix, found.result_suffix + after)
        return found

    def _logits_width(self) -> int:
        """Columns of the model's logits (the grammar's token masks are this wide)."""
        return len(self.fmt.tokenizer)

    @cached_property
    def tool_grammars(self) -> ToolGrammars:
        from .tool_grammar import ToolGrammars  # xgrammar loads with the first session that has tools

        return ToolGrammars(self.fmt.tokenizer, self._logits_width(), sorted(self.policy.stop_ids))

    def check_tools(self, tools: Sequence[ToolSpec], choice: ToolChoice | None = None) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ToolSchemaError(f"tool names must be unique: {names}")
        self.tool_grammars.check(self.tool_format, tools, choice)

    def session_tools(self, sid: str) -> tuple[ToolSpec, ...]:
        return self._get(sid).tools

    def _reply_tools(self, sess: S, dec: DecodingSettings) -> tuple[ToolReplyState | None, str | None]:
        """A reply's tool state and grammar (an xgrammar structural tag), or (None, None) without tools."""
        if not sess.tools:
            return None, None
        choice = dec.tool_choice or ToolChoice()
        if self.tool_router is not None and choice.mode == "auto":
            choice = self._route(sess)
        spoken = None
        if self.spoken_arguments and choice.mode in ("required", "function"):
            spoken = _latest_user_words(sess.log.segments)
        spec = grammar_spec(self.tool_format, sess.tools, choice, spoken=spoken)
        state = ToolReplyState(self.tool_format, choice, arguments_from_words=bool(spoken and spoken.strip()))
        return state, spec

    def _route(self, sess: S) -> ToolChoice:
        """The tool router's choice for an ``auto`` reply: the tool the caller's latest words ask for, or words. Right
        after a tool's result the reply is words (the result is what it speaks about)."""
        assert self.tool_router is not None
        latest = _latest(sess.log.segments)
        if latest is not None and latest.role == "tool":
            return ToolChoice("none")
        route = sess.tool_route = self.tool_router.route(_latest_user_words(sess.log.segments), sess.tools)
        log.debug("session %s: tool router %.3f -> %s", sess.sid, route.score, route.tool)
        return ToolChoice("none") if route.tool is None else ToolChoice("function", route.tool)

    def tool_route(self, sid: str) -> Route | None:
        """The tool router's decision for the session's latest routed reply (None: none yet)."""
        return self._get(sid).tool_route

    def _reply_need(self, sess: S, dec: DecodingSettings) -> int:
        """Tokens a reply may add to the log: header, words, a call when the session has tools, footer."""
        call = dec.max_call_tokens if sess.tools else 0
        return len(self.fmt.reply_header) + dec.max_tokens + call + len(self.fmt.reply_footer)

    def _close_reply(self, sess: S, reply: ReplyProgress, committed_text: str | None) -> None:
        """``end_reply``'s log half: keep the whole reply (``committed_text`` None), none of it (a blank text: as
        if it had never started), or exactly the played text (a barge-in). The generated tokens whose text is a
        prefix of the played text are kept as they are, the rest of that text is tokenized and appended."""
        if committed_text is None:
            self.policy.flush_text(reply)
            sess.log.close_open_segment(reply.text, self.fmt.reply_footer)
        elif not committed_text.strip():
            self._truncate(sess, reply.ckpt.log_len)
        else:
            keep, rest, committed = self.policy.committed_prefix(reply, committed_text)
            self._truncate(sess, reply.start + keep)
            if rest:
                sess.log.extend_open_content(rest)
            sess.log.close_open_segment(committed, self.fmt.reply_footer)

    def _truncate(self, sess: S, k: int) -> None:
        """Cut the log to ``k`` tokens (a backend whose KV outlives the cut crops it too)."""
        sess.log.truncate(k, self.fmt.decode)

    def _add_message(
        self, sess: S, role: Role, text: str, epoch: int | None, *, generating: bool
    ) -> tuple[EncodedMessage, bool]:
        """``append``'s log half: check, make room (trimming old turns), fit and add the message. Returns the
        encoding as added and whether old turns were trimmed."""
        if generating:
            raise ThinkerStateError(f"session {sess.sid!r} is generating a reply; end_reply() first")
        if role not in APPEND_ROLES:
            raise ValueError(f"append() role must be one of {sorted(APPEND_ROLES)}, not {role!r}")
        text = self._as_model_reads(Message(role, text)).text.strip()
        enc = self.fmt.encode_message(role, text)
        reserve = self._reply_reserve(sess.decoding)
        trimmed = self._trim(sess, len(enc.tokens) + reserve)
        room = self.max_context_tokens - reserve - len(sess.log) - len(enc.prefix) - len(enc.suffix)
        enc, text = fit_message(self.fmt, enc, text, room, sess.sid)
        sess.log.add_message(role, text, enc.prefix, enc.content, enc.suffix, epoch=epoch)
        return enc, trimmed

    def _record_append(
        self,
        sess: S,
        enc: EncodedMessage,
        *,
        computed: int,
        cached: int,
        trimmed: bool,
        deferred: bool,
        t0: float,
    ) -> AppendResult:
        """Remember what an ``append`` cost (``stats``) and say it (the result)."""
        sess.prefill_tokens_last_append = computed
        sess.cached_tokens_last_append = cached
        sess.prefill_ms_last_append = (time.perf_counter() - t0) * 1000
        return AppendResult(
            new_tokens=len(enc.tokens),
            prefill_tokens=computed,
            cached_tokens=cached,
            log_len=len(sess.log),
            trimmed=trimmed,
            deferred=deferred,
        )

    def _banned_tokens(
        self, sess: S, dec: DecodingSettings, tool: ToolReplyState | None = None
    ) -> tuple[int, ...]:
        """The first tokens of the ``unprompted_words`` that no message of the conversation's own (any role but
        the assistant's) has said yet. The example turns are not messages of the log (they are the tail of the
        system segment's template tokens, not its text), so an example's name counts as said only once the
        caller, the instructions or engine context say it.

        With the tool router (the built-in model), a reply of a tools session that is to be words has no markup
        tokens either: after a tool's result SmolLM2-135M imitated the call format instead of saying the result
        (``<tool_call-1>[{"name": "booked", ...`` for a booking, ``<too_cabl>[...`` for an order's status)."""
        banned: set[int] = set()
        if self.tool_router is not None and tool is not None and tool.choice.mode == "none":
            banned |= self.fmt.markup_tokens
        for word in dec.unprompted_words:
            said = re.compile(rf"\b{re.escape(word)}\b", re.IGNORECASE)
            if not any(said.search(seg.text) for seg in sess.log.segments if seg.role != "assistant"):
                banned |= self.fmt.word_start_tokens(word)
        return tuple(sorted(banned))

    def _rollback_target(self, sess: S, ckpt: Checkpoint | int) -> int:
        k = ckpt.log_len if isinstance(ckpt, Checkpoint) else int(ckpt)
        system_end = sess.log.segments[0].end if sess.log.segments else 0
        if not system_end <= k <= len(sess.log):
            raise ValueError(f"rollback to {k}: must lie within [{system_end}, {len(sess.log)}]")
        return k

    def _trim(self, sess: S, need: int) -> bool:
        """Make room for ``need`` more tokens by dropping old turns (:func:`trim_plan`); the backend's
        :meth:`_kv_after_trim` then fits the session's KV to the trimmed log."""
        limit = self.max_context_tokens
        drop = trim_plan(sess.log, limit, need, self.trim_to_fraction)
        if drop is None:
            return False
        before = len(sess.log)
        kept = [(seg.start, seg.end) for i, seg in enumerate(sess.log.segments) if i not in drop]
        sess.log = sess.log.without_segments(drop)
        how = self._kv_after_trim(sess, kept)
        log.info(
            "session %s: context %d + %d > %d tokens; dropped %d old segment(s), %d tokens kept (KV %s)",
            sess.sid,
            before,
            need,
            limit,
            len(drop),
            len(sess.log),
            how,
        )
        sess.trims += 1
        return True

    def _kv_after_trim(self, sess: S, kept: list[tuple[int, int]]) -> str:
        """The log was rewritten to the old log's ``kept`` token spans, in order. By default the session's KV is
        dropped and its next sync rebuilds it once from the trimmed log (exact). Returns what was done, for
        the log line."""
        self._forget_kv(sess)
        return "rebuilt from the log"

    @abstractmethod
    def _forget_kv(self, sess: S) -> None:
        """The log was rewritten: whatever KV the session holds no longer matches it."""

    def _stats(self, sess: S, *, resident: int, memory: int) -> ThinkerStats:
        return ThinkerStats(
            resident_kv_tokens=resident,
            log_tokens=len(sess.log),
            prefill_tokens_last_append=sess.prefill_tokens_last_append,
            cached_tokens_last_append=sess.cached_tokens_last_append,
            prefill_ms_last_append=sess.prefill_ms_last_append,
            ttft_ms_last_reply=sess.ttft_ms_last_reply,
            prefill_tokens_total=sess.prefill_tokens_total,
            generated_tokens_total=sess.generated_tokens_total,
            trims=sess.trims,
            memory_bytes=memory,
        )

    def prompt_length(
        self, instructions: str | None, history: Sequence[Message], tools: Sequence[ToolSpec] = ()
    ) -> int:
        # As opening_log builds it; the tool format is read first, since it teaches the chat format the tool role.
        tools_text = self.tool_format.render_tools(tools)
        system = ((instructions or "").strip() or self.system_prompt) + tools_text
        n = len(self.fmt.encode_message("system", system).tokens)
        for msg in map(self._as_model_reads, history):
            n += len(self.fmt.encode_message(msg.role, msg.text.strip()).tokens)
        return n + len(self.fmt.reply_header)

    def reply_footer_length(self) -> int:
        return len(self.fmt.reply_footer)

    def log(self, sid: str) -> LogSnapshot:
        return self._get(sid).log.snapshot()

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def session_decoding(self, sid: str) -> DecodingSettings:
        return self._get(sid).decoding

    def decode(self, tokens: Sequence[int]) -> str:
        return self.fmt.decode(tokens)
