"""The thinker contract: an LLM backend whose unit is a *conversation* holding a KV lease.

Every backend (the transformers reference backend here, a vLLM streaming-input backend later) is defined by
its effect on one engine-agnostic, authoritative **token log** per session (docs/architecture.md, Thinker
backends). The KV cache is only a cache of a prefix of that log, so any backend can rebuild its state from the log
and the contract suite (tests/test_thinker_contract.py) can compare backends token for token.

Threading: every method of a backend is called from one engine worker thread. Backends keep no locks; the
engine serialises calls.

Life of a session::

    open(sid, instructions, history)          # prefills system prompt + history
    append(sid, "user", "What is ...?")       # prefills only the new message's template delta
    ckpt = begin_reply(sid)                   # checkpoint = log length before the reply
    while not done: out = step([sid, ...])    # one batched forward, one token per generating session
    end_reply(sid, None)                      # keep everything generated
    end_reply(sid, "What was played")         # barge-in: keep only what the caller actually heard
    rollback(sid, ckpt)                       # truncate log and KV to a checkpoint
    close(sid)                                # frees the KV; idempotent
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

# The errors live in their own module so that tools.py (which raises them) need not import this one.
from .errors import ThinkerCapacityError as ThinkerCapacityError
from .errors import ThinkerError as ThinkerError
from .errors import ThinkerStateError as ThinkerStateError
from .errors import UnknownSessionError as UnknownSessionError

if TYPE_CHECKING:
    from .tools import ToolCall, ToolCallFormat, ToolChoice, ToolSpec

#: Roles a segment of the log can have. "system" is the instructions segment that opens every session;
#: "developer" is engine-supplied context mid-conversation (rendered as a system turn by ChatML models); "tool" is
#: a tool's result, rendered as the session's tool format wraps one (tools.ToolCallFormat).
Role = Literal["system", "user", "developer", "assistant", "tool"]
#: Roles the caller may pass to ``append``.
APPEND_ROLES: frozenset[str] = frozenset({"user", "developer", "assistant", "tool"})

#: ``tool_call``: the reply ended with a finished call (``StepOutput.tool_call``).
FinishReason = Literal["stop", "length", "sentence", "tool_call"]


# ------------------------------------------------------------------------------------------- data types
@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    text: str


@dataclass(frozen=True, slots=True)
class ThinkerCaps:
    """What a backend can promise. The engine picks barge-in and parking strategies from these."""

    #: KV stays resident between turns (appends prefill only the new tokens).
    resident_kv: bool
    #: ``rollback`` is exact (the next output equals a fresh session on the truncated log).
    exact_rollback: bool
    #: ``step`` runs all given sessions in one batched forward pass.
    batched_step: bool
    #: Longest log a session keeps; older turns are trimmed beyond it.
    max_context: int
    max_sessions: int
    #: KV bytes one token of one session costs (0 when unknown).
    kv_bytes_per_token: int
    #: After a context trim the next output equals a fresh session's on the trimmed log (False: the kept turns'
    #: KV is reused as computed, moved to its new positions; the torch backend's ``shift`` trim).
    exact_trim: bool = True


@dataclass(frozen=True, slots=True)
class Segment:
    """One message in the token log.

    ``[start, content_start)`` are the template tokens before the content (``<|im_start|>user\\n``),
    ``[content_start, content_end)`` the content, ``[content_end, end)`` the template tokens after it
    (``<|im_end|>\\n``). ``complete`` is False for a reply still being generated or a segment cut by a rollback.
    """

    role: Role
    text: str
    start: int
    content_start: int
    content_end: int
    end: int
    epoch: int | None = None
    complete: bool = True

    def shifted(self, delta: int) -> Segment:
        return dataclasses.replace(
            self,
            start=self.start + delta,
            content_start=self.content_start + delta,
            content_end=self.content_end + delta,
            end=self.end + delta,
        )


@dataclass(frozen=True, slots=True)
class LogSnapshot:
    """An immutable copy of a session's token log; ``open(..., log=snapshot)`` restores a session from it."""

    tokens: tuple[int, ...]
    segments: tuple[Segment, ...]

    def __len__(self) -> int:
        return len(self.tokens)


class TokenLog:
    """The authoritative record of a conversation: token ids plus one :class:`Segment` per message.

    Invariant: segments are contiguous, in order, and the last one ends at ``len(tokens)``.
    """

    def __init__(self, tokens: Sequence[int] = (), segments: Sequence[Segment] = ()) -> None:
        self.tokens: list[int] = list(tokens)
        self.segments: list[Segment] = list(segments)
        self._check()

    @classmethod
    def from_snapshot(cls, snap: LogSnapshot) -> TokenLog:
        return cls(snap.tokens, snap.segments)

    def snapshot(self) -> LogSnapshot:
        return LogSnapshot(tuple(self.tokens), tuple(self.segments))

    def __len__(self) -> int:
        return len(self.tokens)

    def _check(self) -> None:
        pos = 0
        for seg in self.segments:
            if not (seg.start == pos and seg.start <= seg.content_start <= seg.content_end <= seg.end):
                raise ValueError(f"token log segments are not contiguous at {seg}")
            pos = seg.end
        if pos != len(self.tokens):
            raise ValueError(f"segments cover {pos} tokens, log has {len(self.tokens)}")

    def add_message(
        self,
        role: Role,
        text: str,
        prefix: Sequence[int],
        content: Sequence[int],
        suffix: Sequence[int],
        *,
        epoch: int | None = None,
        complete: bool = True,
    ) -> Segment:
        start = len(self.tokens)
        self.tokens.extend(prefix)
        content_start = len(self.tokens)
        self.tokens.extend(content)
        content_end = len(self.tokens)
        self.tokens.extend(suffix)
        seg = Segment(role, text, start, content_start, content_end, len(self.tokens), epoch, complete)
        self.segments.append(seg)
        return seg

    def extend_open_content(self, tokens: Sequence[int]) -> None:
        """Append content tokens to the last segment, which must be an open (incomplete) one."""
        seg = self._last_open()
        self.tokens.extend(tokens)
        n = len(self.tokens)
        self.segments[-1] = dataclasses.replace(seg, content_end=n, end=n)

    def close_open_segment(self, text: str, suffix: Sequence[int]) -> Segment:
        """Finish the open last segment: set its text and append the template's end-of-message tokens."""
        seg = self._last_open()
        self.tokens.extend(suffix)
        done = dataclasses.replace(seg, text=text, end=len(self.tokens), complete=True)
        self.segments[-1] = done
        return done

    def _last_open(self) -> Segment:
        if (
            not self.segments
            or self.segments[-1].complete
            or self.segments[-1].content_end != len(self.tokens)
        ):
            raise ThinkerStateError("the token log has no open segment to extend")
        return self.segments[-1]

    def truncate(self, k: int, decode: Callable[[Sequence[int]], str]) -> None:
        """Keep ``tokens[:k]``. A segment cut in the middle keeps its decoded content and becomes incomplete."""
        if not 0 <= k <= len(self.tokens):
            raise ValueError(f"cannot truncate a log of {len(self.tokens)} tokens to {k}")
        del self.tokens[k:]
        kept: list[Segment] = []
        for seg in self.segments:
            if seg.end <= k:
                kept.append(seg)
            elif seg.start < k:
                content_start = min(seg.content_start, k)
                content_end = min(seg.content_end, k)
                text = decode(self.tokens[content_start:content_end])
                kept.append(
                    dataclasses.replace(
                        seg,
                        text=text,
                        content_start=content_start,
                        content_end=content_end,
                        end=k,
                        complete=False,
                    )
                )
        self.segments = kept

    def without_segments(self, drop: set[int]) -> TokenLog:
        """A new log without the segments at the given indexes (context trimming). Token ids are kept as they
        are: each segment starts with its own template prefix, so spans are self-contained."""
        tokens: list[int] = []
        segments: list[Segment] = []
        for i, seg in enumerate(self.segments):
            if i in drop:
                continue
            segments.append(seg.shifted(len(tokens) - seg.start))
            tokens.extend(self.tokens[seg.start : seg.end])
        return TokenLog(tokens, segments)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A point in a session's log: its length before a reply (and the reply's epoch, when the engine gave one)."""

    log_len: int
    epoch: int | None = None


@dataclass(frozen=True, slots=True)
class AppendResult:
    #: Tokens this call added to the log.
    new_tokens: int
    #: Tokens this message costs to compute: the new ones (plus any earlier deferred ones), or after a trim
    #: the whole rebuilt log. Computed by this call, or by the session's next forward pass when deferred.
    prefill_tokens: int
    #: Tokens whose KV was reused instead of recomputed.
    cached_tokens: int
    log_len: int
    #: True when this append trimmed old turns (the cache is rebuilt once from the trimmed log).
    trimmed: bool = False
    #: True when the prefill was left to the next forward pass (``append(..., prefill=False)``).
    deferred: bool = False


@dataclass(frozen=True, slots=True)
class StepOutput:
    #: The sampled token, or None when the step ended the reply without keeping a token (sentence limit).
    token_id: int | None
    #: Text that is safe to emit now: complete UTF-8 characters only, never the end-of-turn marker.
    text: str
    done: bool
    finish_reason: FinishReason | None = None
    #: On the last step of a reply that called a tool: the call (its text was never in ``text``).
    tool_call: ToolCall | None = None


@dataclass(frozen=True, slots=True)
class ThinkerStats:
    resident_kv_tokens: int
    log_tokens: int
    prefill_tokens_last_append: int
    cached_tokens_last_append: int
    prefill_ms_last_append: float
    ttft_ms_last_reply: float | None
    prefill_tokens_total: int
    generated_tokens_total: int
    trims: int
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class DecodingSettings:
    """How a reply is decoded. The defaults for spoken replies live in ``prompting.SPOKEN_DECODING``."""

    max_tokens: int = 48
    #: 0 means greedy.
    temperature: float = 0.0
    top_p: float = 1.0
    #: HF-style penalty (divide positive logits, multiply negative ones) over the tokens of the current reply.
    repetition_penalty: float = 1.0
    #: Stop once this many sentences are complete (None: no limit).
    max_sentences: int | None = None
    #: Replies not asked for length stop at this many tokens (with ``max_tokens`` the tighter; finish reason
    #: ``sentence``: the spoken-length rule, not the hard cap); None: ``max_tokens`` alone. With
    #: ``long_max_sentences``, ``max_tokens`` is the cap of a reply asked for length.
    brief_max_tokens: int | None = None
    #: A reply to a message that asks for length (a story, a description: ``prompting.asks_for_length``, read
    #: from the latest message before the reply that is not the assistant's) stops after this many sentences
    #: instead of ``max_sentences``, and only ``max_tokens`` caps it (not ``brief_max_tokens``). None: no lift.
    long_max_sentences: int | None = None
    #: Keep generating through end-of-turn tokens (benchmarks that need a fixed token count).
    ignore_eos: bool = False
    seed: int | None = None
    #: Words a reply may not say until a message of the conversation's own (a user turn, the instructions, engine
    #: context) has said them: the example turns' names (``prompting.SPOKEN_EXAMPLE_NAMES``), so that a caller
    #: who gave no name is not called by the example's. Whole words, case-insensitive; the ban is on the word's
    #: first token, with and without a leading space, so a name should be one token of the model's vocabulary.
    #: Only the log counts: once the turn that said the word is trimmed from the context, the ban is back.
    unprompted_words: tuple[str, ...] = ()
    #: Whether a reply of a session with tools may, may not or must call one (None: ``auto``). Without tools:
    #: ignored. The call's arguments are grammar-constrained to the tool's schema (tools.py).
    tool_choice: ToolChoice | None = None
    #: Tokens a call may take beyond the words before it (a reply with tools may be ``max_tokens`` of words and
    #: then a call of at most this many tokens).
    max_call_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_call_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if (self.brief_max_tokens is not None and self.brief_max_tokens < 1) or (
            self.long_max_sentences is not None and self.long_max_sentences < 1
        ):
            raise ValueError(f"brief_max_tokens and long_max_sentences must be >= 1: {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.repetition_penalty <= 0:
            raise ValueError(f"invalid decoding settings: {self}")
        for word in self.unprompted_words:
            if not word or not word.isalpha():
                raise ValueError(f"unprompted_words must be single words of letters, not {word!r}")


# ------------------------------------------------------------------------------------------- interface
class ThinkerBackend(ABC):
    """A conversation-level LLM backend. See the module docstring for the call sequence.

    The interface is synchronous on purpose: the engine runs one worker thread per backend, and a vLLM
    streaming-input backend (docs/architecture.md, Thinker backends) maps onto it as follows: ``open``/``append`` = a
    ``StreamingInput`` chunk with ``max_tokens=1`` (a deferred ``append`` rides in the generation chunk);
    ``begin_reply`` + ``step`` = a generation chunk read one token per step; ``end_reply(committed)`` and
    ``rollback`` = abort + re-open from the log (prefix-cache hit), with ``caps.exact_rollback`` False.
    """

    caps: ThinkerCaps

    @abstractmethod
    def open(
        self,
        sid: str,
        instructions: str | None = None,
        history: Sequence[Message] | None = None,
        *,
        log: LogSnapshot | None = None,
        decoding: DecodingSettings | None = None,
        examples: Sequence[Message] = (),
        tools: Sequence[ToolSpec] = (),
    ) -> None:
        """Open a session and prefill its prompt.

        ``instructions`` becomes the system segment (None or "" -> the backend's default system prompt).
        ``history`` messages follow it; ``examples`` are example turns pinned with the system segment
        (:func:`~engine_bridge.thinker.turns.opening_log`). ``log`` restores a session from a snapshot instead (then
        ``instructions`` and ``history`` must be None). Raises :class:`ThinkerCapacityError` before any compute
        when the session limit or KV budget is reached, and :class:`ThinkerStateError` if ``sid`` is open.
        ``tools`` are listed in the system segment as the model's tool format does (with ``log``: the tools the
        snapshot's system segment lists); a schema the grammar cannot compile raises ``tools.ToolSchemaError``
        before anything is opened.
        """

    @abstractmethod
    def check_tools(self, tools: Sequence[ToolSpec], choice: ToolChoice | None = None) -> None:
        """Raise ``tools.ToolSchemaError`` when a reply could not be constrained to these tools (and choice)."""

    @abstractmethod
    def session_tools(self, sid: str) -> tuple[ToolSpec, ...]:
        """The tools the session was opened with."""

    @property
    @abstractmethod
    def tool_format(self) -> ToolCallFormat:
        """The model's tool format: how its system segment lists tools, how it writes a call (a history message
        that made a call is ``tool_format.render_call(call)``) and how a tool's result is wrapped."""

    def tool_call_text(self, call: ToolCall) -> str:
        """A call as the model's tool format writes it: the text an assistant message that made the call ends
        with, when it is appended to a conversation (history, or a conversation rebuilt after a change)."""
        return self.tool_format.render_call(call)

    @abstractmethod
    def append(
        self, sid: str, role: Role, text: str, *, epoch: int | None = None, prefill: bool = True
    ) -> AppendResult:
        """Add one message (user, developer context, a whole assistant message, or a tool's result: role
        ``tool``, its text the result) and prefill only its tokens.

        ``prefill=False`` leaves the computation to the session's next forward pass: when a reply follows
        at once, its first ``step`` computes the message and the assistant header in one pass, which saves
        one pass from the time to first token. Near ``caps.max_context`` the oldest turns are dropped (the
        system segment stays) and the cache is rebuilt once; this never raises for a long conversation.
        """

    @abstractmethod
    def begin_reply(
        self, sid: str, *, epoch: int | None = None, decoding: DecodingSettings | None = None
    ) -> Checkpoint:
        """Start an assistant reply: returns the checkpoint (log length before the reply) and appends the
        assistant header. Tokens then come from :meth:`step`."""

    @abstractmethod
    def step(self, sids: Sequence[str]) -> dict[str, StepOutput]:
        """One forward pass producing one token for each given session.

        Every given session must be generating and not yet done (a done session waits for ``end_reply``).
        Pass all generating sessions on every tick: a batching backend keeps its batched state while the set
        is unchanged, and regroups (copies the sessions' KV once) when it changes. The first step of a reply
        also feeds the assistant header (and any deferred message) in the same pass.
        """

    @abstractmethod
    def end_reply(self, sid: str, committed_text: str | None = None) -> None:
        """Finish the current reply.

        ``None`` keeps everything generated. A string (barge-in) keeps only that text, which must be what the
        caller actually played: the log and cache go back to the checkpoint and only the committed text plus
        the end-of-turn marker are appended. An empty string removes the reply altogether.
        """

    @abstractmethod
    def rollback(self, sid: str, ckpt: Checkpoint | int) -> None:
        """Truncate the log (and the KV) to a checkpoint or a log length; aborts a reply in progress."""

    @abstractmethod
    def close(self, sid: str) -> None:
        """Free the session's KV. Closing an unknown or closed session is a no-op."""

    @abstractmethod
    def stats(self, sid: str) -> ThinkerStats: ...

    @abstractmethod
    def log(self, sid: str) -> LogSnapshot:
        """A snapshot of the authoritative token log."""

    @abstractmethod
    def session_ids(self) -> list[str]: ...

    @abstractmethod
    def session_decoding(self, sid: str) -> DecodingSettings:
        """The decoding a reply of ``sid`` uses when ``begin_reply`` is given none (set at ``open``)."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of KV held by all sessions (the counter of guarantee 4, Release, in docs/architecture.md)."""

    @abstractmethod
    def decode(self, tokens: Sequence[int]) -> str:
        """Text of token ids (special tokens skipped)."""

    @abstractmethod
    def is_generating(self, sid: str) -> bool:
        """True between ``begin_reply`` and ``end_reply``/``rollback`` (also after the reply reported done)."""

    @abstractmethod
    def describe(self) -> dict[str, object]:
        """What /health shows: backend, model, device, dtype, and the KV capacity and free tokens."""

    # Text requests (chat completions) size a session before opening it, to refuse a prompt that does not fit
    # instead of letting ``open`` trim it.
    @abstractmethod
    def prompt_length(
        self, instructions: str | None, history: Sequence[Message], tools: Sequence[ToolSpec] = ()
    ) -> int:
        """Tokens ``open(sid, instructions, history, tools=tools)`` + ``begin_reply`` put before the first reply
        token."""

    @abstractmethod
    def reply_footer_length(self) -> int:
        """Tokens the template appends after a reply's content (the reserve next to ``max_tokens``)."""
