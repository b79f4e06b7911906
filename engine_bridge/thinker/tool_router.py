"""The tool router: under ``tool_choice="auto"``, which tool a reply calls, for a model that cannot decide itself.

SmolLM2-135M was not trained on tools. With the tools listed in its system segment and ``auto`` decoding it never
opens a call (0 of 80 requests in docs/speech-stack.md, Tool calls), and its own probability of opening one does not
tell a request a tool serves from small talk. Its hidden states do. Each text (the caller's message, a tool's
``name: description``, and a few everyday sentences, :data:`EVERYDAY`) is embedded as the mean of the model's middle
layer over its tokens (the first token left out: it carries the model's large "attention sink" activations), less
the everyday sentences' mean embedding (what every sentence shares does not count), at unit length. A message's
score is its cosine to the closest tool less its cosine to the closest everyday sentence: a request is routed to a
tool when it is nearer to that tool than to everyday talk, by more than :attr:`ToolRouter.threshold`.
Measured on 2 x 40 text requests (benchmarks/tool_router.py; docs/speech-stack.md): the threshold fitted on the
first set gave precision 0.90 / recall 0.90 there and 0.80 / 0.80 on the held-out set, where the model's own
first-token probability of a call gave about 0.2 / 0.25 and ``auto`` on its own no call at all.

The router decides a reply before its first token: the likeliest tool above :attr:`ToolRouter.threshold` is called
(``tool_choice`` becomes that function, and the model writes its arguments under the grammar), else the reply is
words (``none``). Right after a tool's result the reply is words. It runs on the thinker's own weights (the torch
backend's model; the vLLM backend loads a transformers copy, 135M parameters for the built-in model), one forward
pass over the caller's message per routed reply (~10-30 ms on this CPU) and one per new tool description (cached).

On by default for the built-in ``smollm2`` only (``engine.thinker.tool_router``): a model trained on tools keeps its
own judgement under ``auto``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .tools import ToolSpec

#: The built-in SmolLM2-135M-Instruct's threshold on the score (fitted on set A of benchmarks/tool_router.py).
SMOLLM2_ROUTER_THRESHOLD = 0.026

#: Everyday sentences whose mean embedding is taken away from every embedding (none of them asks for a tool).
EVERYDAY: tuple[str, ...] = (
    "Hello, how are you?",
    "Tell me something interesting.",
    "What does this word mean?",
    "Thanks, goodbye.",
    "Who invented the telephone?",
    "Can you help me understand this?",
    "I like walking in the park.",
    "The meeting is at noon.",
    "Could you say that again?",
    "My favourite colour is green.",
    "We went to the beach last summer.",
    "Please speak more slowly.",
)
#: Tool descriptions kept embedded (least recently used go first).
_CACHE_LIMIT = 256


@dataclass(frozen=True, slots=True)
class Route:
    """A routed reply: the tool to call (None: answer in words) and the message's score (the closest tool's cosine
    less the closest everyday sentence's)."""

    tool: str | None
    score: float


class ToolRouter:
    """Embeds messages and tool descriptions with ``model``'s middle layer and picks the closest tool."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        threshold: float = SMOLLM2_ROUTER_THRESHOLD,
    ) -> None:
        if not -2.0 <= threshold <= 2.0:
            raise ValueError(
                f"tool router threshold must be a difference of cosines in [-2, 2], not {threshold}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.threshold = threshold
        self._lock = threading.Lock()
        self._tools: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        raw = torch.stack([self._raw(s) for s in EVERYDAY])
        self._everyday = raw.mean(0)
        centred = raw - self._everyday
        self._everyday_units = centred / centred.norm(dim=1, keepdim=True).clamp_min(1e-6)

    def _raw(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        ids = ids.to(self.model.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        states = out.hidden_states
        layer = states[len(states) // 2][0].float()
        return (layer[1:] if layer.shape[0] > 1 else layer).mean(0)

    def embed(self, text: str) -> torch.Tensor:
        """``text``'s unit-length embedding, with the everyday sentences' mean taken away first."""
        v = self._raw(text.strip() or ".") - self._everyday
        return v / v.norm().clamp_min(1e-6)

    def _tool_vector(self, tool: ToolSpec) -> torch.Tensor:
        text = f"{tool.name.replace('_', ' ')}: {tool.description}"
        v = self._tools.get(text)
        if v is None:
            v = self._tools[text] = self.embed(text)
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
            m = self.embed(message)
            cosines = {t.name: float(m @ self._tool_vector(t)) for t in tools}
            everyday = float((self._everyday_units @ m).max())
        best = max(cosines, key=lambda name: cosines[name])
        score = cosines[best] - everyday
        return Route(best if score > self.threshold else None, score)
