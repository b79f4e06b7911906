"""Chat-template rendering for incremental (KV-lease) prompting, the default system prompt, and decoding
settings tuned for short spoken replies.

Incremental rendering. A session never re-renders its history: each new message is rendered as its own
template *delta* (``<|im_start|>user\\n{text}<|im_end|>\\n`` for ChatML) and only those tokens are prefilled.
:class:`ChatFormat` learns the per-role wrappers once, by rendering probe conversations through the
tokenizer's own chat template and diffing them, so any prefix-stable template works (ChatML, Llama-3, ...).
For SmolLM2 the concatenated deltas are token-identical to rendering the whole conversation at once
(docs/speech-stack.md, Thinker; checked in tests/test_thinker_smollm.py). Message *content* is tokenized with special
tokens split, so a user who says "<|im_end|>" cannot close their own turn.

The template injects "You are a helpful AI assistant named SmolLM..." when the first message is not a system
message; sessions always start with our own system segment, so that never happens.

What to expect from SmolLM2-135M-Instruct (measured with :data:`DEFAULT_SYSTEM_PROMPT` and
:data:`SPOKEN_DECODING`, greedy, fp32; bf16 gave the same answers to the questions tried):

* Simple facts come out right and short: "What is the capital of France?" -> "The capital of France is
  Paris." (8 tokens); spider -> "A spider has 8 legs."; Germany -> Berlin; Italy -> Rome; "What color is the
  sky on a clear day?" -> blue; "How are you doing today?" -> "I'm doing great! How about you?".
* It is very sensitive to the system prompt's wording: small changes flipped "capital of Germany" into a
  German sentence without the answer. Re-check a handful of questions after touching the prompt
  (tests/test_thinker_smollm.py does).
* Anything needing reasoning or arithmetic is wrong while sounding confident ("Two plus two is a classic
  math problem that has been debated for centuries."); "tell me a joke" gets a non-joke; the tallest
  mountain comes with invented numbers.
* Without a repetition penalty and a length cap it loops ("It's a miracle. It's not just ...") and rambles;
  ``repetition_penalty=1.15``, ``max_sentences=2`` and ``brief_max_tokens=48`` keep replies to one or two
  sentences (typically 8-25 tokens). A request for length ("Tell me a long story about ...", "describe ...")
  lifts that to six sentences and ``max_tokens=160`` (:func:`asks_for_length`).
* It does not reliably recall a fact from two turns back (a name, a number). The engine's tests check the
  KV-lease *mechanics* (stats, token logs), never this model's memory.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from .base import DecodingSettings, Message, Role

#: Our own system prompt. Short and concrete: a 135M model follows little more than "be brief", and it is
#: very sensitive to the wording. Of the variants tried, this one answered the most factual questions right:
#: adding "No lists, no markdown." or "plain spoken English" made "What is the capital of Germany?" drift
#: into German and "two plus two" ramble to the token cap.
DEFAULT_SYSTEM_PROMPT = "You are a helpful voice assistant. Answer in one short English sentence."

#: Example turns every voice session opens with (``engine.thinker.spoken_examples``; pinned in the tail of the
#: system segment by ``turns.opening_log``): short factual answers in the "X is Y." form, and one name exchange
#: showing that a name said earlier is recalled.
#: Measured with benchmarks/answer_quality.py's questions on SmolLM2-135M (text level, greedy, fp32), without
#: -> with these turns: accuracy 0.80 -> 0.95, name recall 0.40 -> 1.00, reply length 16.9 -> 9.7 tokens;
#: on 20 other questions and 5 other names: accuracy 0.65 -> 0.65, name recall 0.60 -> 0.80, 15.5 -> 8.6
#: tokens. So they fix the format (short answers, "Your name is ...") and recall, not the model's knowledge.
#: Written into the system prompt as text instead of as turns they did not help accuracy (0.75). Costs ~90
#: prompt tokens, prefilled once when a session opens. The example's name leaks: asked as text, 12 of 20 openings
#: in which the caller gives no name came back addressed to Tom ("Good morning!" -> "Good morning, Tom."). Other
#: example turns against it cost more than they fixed (a greeting and a "You have not told me your name yet."
#: turn first: 1 leak in 20, but a storyteller's instructions got five-word stories; the facts first: 3 leaks,
#: but the developer context's bakery was lost), so the turns stay and the name is banned from replies instead
#: (SPOKEN_EXAMPLE_NAMES): 1 leak in 20, every other figure unchanged (benchmarks/answer_text.py, docs/benchmarks.md).
SPOKEN_EXAMPLES: tuple[Message, ...] = (
    Message("user", "What is the capital of Spain?"),
    Message("assistant", "The capital of Spain is Madrid."),
    Message("user", "What is the smallest planet?"),
    Message("assistant", "The smallest planet is Mercury."),
    Message("user", "What animal barks?"),
    Message("assistant", "A dog barks."),
    Message("user", "My name is Tom, how many wheels does a bicycle have?"),
    Message("assistant", "Nice to meet you, Tom. A bicycle has two wheels."),
    Message("user", "What is my name?"),
    Message("assistant", "Your name is Tom."),
)
#: The names SPOKEN_EXAMPLES introduce. Sessions that open with the example turns decode with these as
#: ``DecodingSettings.unprompted_words``: a reply cannot say "Tom" until the caller (or the instructions) has.
#: Each must be one token of the model's vocabulary, with and without a leading space (a test checks SmolLM2's).
SPOKEN_EXAMPLE_NAMES: tuple[str, ...] = ("Tom",)

#: Decoding for spoken replies: greedy (reproducible, and sampling makes a 135M model worse), a mild
#: repetition penalty against loops, at most two sentences and 48 tokens (~10 s of speech even when the model
#: never stops), except for a reply to a request for length (:func:`asks_for_length`: "Tell me a long story
#: about a dragon ..."), which may run to six sentences and 160 tokens (~35 s). Measured under the default
#: instructions (benchmarks/answer_text.py, docs/benchmarks.md): with the two-sentence rule for every reply the
#: dragon story stopped mid-sentence at the token cap (45 words); with the lift, 104-138 words for three of five
#: story prompts, while the other two and every short question end on their own (EOS) as before.
SPOKEN_DECODING = DecodingSettings(
    max_tokens=160,
    temperature=0.0,
    repetition_penalty=1.15,
    max_sentences=2,
    brief_max_tokens=48,
    long_max_sentences=6,
)

#: Words of a message that asks for a long answer: a story or a tale, a description, an explanation, "in
#: detail", "at length", "tell me more / about".
_ASKS_FOR_LENGTH = re.compile(
    r"\b(stor(y|ies)|tales?|fairy ?tales?|poems?|describe|explain|in (more )?detail|at length|a long|"
    r"long (answer|reply|one)|tell me (more|about|everything))\b",
    re.IGNORECASE,
)


def asks_for_length(text: str) -> bool:
    """True when ``text`` asks for a long answer (a story, a description, "in detail", "tell me about ..."): the
    reply to it may run past the two-sentence rule (``DecodingSettings.long_max_sentences``)."""
    return bool(_ASKS_FOR_LENGTH.search(text))


#: Roles as the template should see them. Engine context ("developer") is rendered as a system turn,
#: the only instruction role ChatML models are trained on.
TEMPLATE_ROLES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "developer": "system",
    "assistant": "assistant",
}

_SENTENCE_END = (".", "!", "?", "…")
#: Closing quotes and brackets after a full stop still belong to the sentence.
_CLOSERS = "\"')]»”’"
#: What markup is written with (``ChatFormat.markup_tokens``): brackets, braces, angle brackets, backticks.
MARKUP_CHARS = "<>[]{}`"

_CHATML = {
    "prefix": "<|im_start|>{role}\n",
    "suffix": "<|im_end|>\n",
    "header": "<|im_start|>assistant\n",
}


def ends_sentence(text: str) -> bool:
    """True when ``text`` ends with a sentence terminator (closing quotes/brackets allowed after it)."""
    stripped = text.rstrip().rstrip(_CLOSERS)
    return stripped.endswith(_SENTENCE_END)


@dataclass(frozen=True, slots=True)
class EncodedMessage:
    prefix: list[int]
    content: list[int]
    suffix: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prefix + self.content + self.suffix


class ChatFormat:
    """Per-role template wrappers of a tokenizer's chat template, for rendering one message at a time."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        wrappers: dict[str, tuple[str, str]],
        reply_header: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.wrappers = wrappers
        self.reply_header_text = reply_header
        self._template_cache: dict[str, list[int]] = {}
        self._word_start_cache: dict[str, frozenset[int]] = {}
        self.reply_header: list[int] = self._template_tokens(reply_header)
        self.reply_footer: list[int] = self._template_tokens(wrappers["assistant"][1])
        self.stop_token_ids: frozenset[int] = self._stop_ids()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
        """Probe the tokenizer's chat template (ChatML strings when it has none)."""
        if not getattr(tokenizer, "chat_template", None):
            wrappers = {
                role: (_CHATML["prefix"].format(role=TEMPLATE_ROLES[role]), _CHATML["suffix"])
                for role in TEMPLATE_ROLES
            }
            return cls(tokenizer, wrappers, _CHATML["header"])
        return cls(tokenizer, *_probe_template(tokenizer))

    def _stop_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        # The first footer token (<|im_end|>) ends a reply; a header token (<|im_start|>) means the model is
        # starting a new turn on its own, which must end the reply too.
        for tok in (self.reply_footer[:1], self.reply_header[:1]):
            if tok and (tok[0] in special or tok[0] == eos):
                ids.add(tok[0])
        return frozenset(ids)

    @functools.cached_property
    def markup_tokens(self) -> frozenset[int]:
        """The ordinary tokens that hold a bracket, a brace or a backtick: what markup (a call's ``<tool_call>[``,
        JSON) is written with, and what no sentence said aloud needs. Special tokens (the stop tokens) are not
        among them."""
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return frozenset(
            i
            for i, piece in enumerate(pieces)
            if i not in special and piece is not None and any(c in piece for c in MARKUP_CHARS)
        )

    # ---------------------------------------------------------------- encoding
    def _template_tokens(self, text: str) -> list[int]:
        """Template text may contain special tokens (<|im_start|>), which must become their single ids."""
        cached = self._template_cache.get(text)
        if cached is None:
            cached = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            self._template_cache[text] = cached
        return list(cached)

    def encode_content(self, text: str) -> list[int]:
        """Content with special-token strings kept as plain text (no prompt injection of turn markers)."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def word_start_tokens(self, word: str) -> frozenset[int]:
        """The tokens ``word`` can begin with in a reply: its first token at the start of a text and after a
        space ("Tom," / " Tom")."""
        cached = self._word_start_cache.get(word)
        if cached is None:
            cached = frozenset(
                ids[0] for ids in (self.encode_content(word), self.encode_content(" " + word)) if ids
            )
            self._word_start_cache[word] = cached
        return cached

    def encode_message(self, role: Role, text: str) -> EncodedMessage:
        prefix, suffix = self.wrappers[role]
        return EncodedMessage(
            self._template_tokens(prefix), self.encode_content(text), self._template_tokens(suffix)
        )

    def decode(self, tokens: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def render_messages(self, messages: Sequence[tuple[Role, str]]) -> str:
        """The whole conversation as the tokenizer's template would render it (for tests and debugging)."""
        text = self.tokenizer.apply_chat_template(
            [{"role": TEMPLATE_ROLES[r], "content": t} for r, t in messages], tokenize=False
        )
        assert isinstance(text, str)  # tokenize=False renders one string
        return text


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, gen: bool = False) -> str:
    out: Any = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    return str(out)


def _split(delta: str, sentinel: str, what: str) -> tuple[str, str]:
    if delta.count(sentinel) != 1:
        raise ValueError(f"chat template: cannot find the {what} content in {delta!r}")
    before, after = delta.split(sentinel)
    return before, after


def _probe_template(tokenizer: PreTrainedTokenizerBase) -> tuple[dict[str, tuple[str, str]], str]:
    """Learn (prefix, suffix) per role by diffing renders of probe conversations.

    Requires a prefix-stable template (rendering one more message only appends text), which is what makes
    a per-session KV cache valid in the first place; anything else is rejected here, at load time.
    """
    s0, s1, s2 = "\x1dSYS\x1d", "\x1dUSR\x1d", "\x1dNEW\x1d"
    system_only = _render(tokenizer, [{"role": "system", "content": s0}])
    sys_prefix, sys_suffix = _split(system_only, s0, "system")
    base = [{"role": "system", "content": s0}, {"role": "user", "content": s1}]
    base_text = _render(tokenizer, base)
    wrappers: dict[str, tuple[str, str]] = {"system": (sys_prefix, sys_suffix)}
    for role in ("user", "developer", "assistant"):
        full = _render(tokenizer, [*base, {"role": TEMPLATE_ROLES[role], "content": s2}])
        if not full.startswith(base_text):
            raise ValueError(
                f"chat template is not prefix-stable for role {role!r}; it cannot be used with a KV lease"
            )
        wrappers[role] = _split(full[len(base_text) :], s2, role)
    with_header = _render(tokenizer, base, gen=True)
    if not with_header.startswith(base_text):
        raise ValueError("chat template's generation prompt is not prefix-stable")
    return wrappers, with_header[len(base_text) :]
