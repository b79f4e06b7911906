"""The tool-call grammar, compiled with xgrammar for one tokenizer: the torch backend masks every step of a reply
with tools by it, and both backends compile it when tools are set, so a schema xgrammar cannot compile is refused
there (:class:`~engine_bridge.thinker.tools.ToolSchemaError`), never mid-reply.

Why xgrammar (benchmarks/tool_grammar.py, docs/speech-stack.md): on SmolLM2's 49,152-token vocabulary its token
mask takes ~1.4 us (median; llguidance ~13 us, outlines-core ~23 ms through its list of allowed tokens), a typical
call schema compiles in ~14 ms once and is cached after, and it is vLLM's default structured-outputs backend: the
vLLM backend's grammar is compiled by the same library from the same structural tag, so the two backends mask
the same tokens. The tokenizer info and the stop tokens are built the way vLLM builds them (the model's vocabulary
size; the reply's stop ids as the matcher's), so masks agree token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from .tools import ToolCallFormat, ToolChoice, ToolSchemaError, ToolSpec, grammar_spec

#: xgrammar's cache of compiled grammars (least recently used go first), as vLLM bounds its own.
_CACHE_LIMIT_BYTES = 64 << 20


class ToolGrammars:
    """A compiler for one tokenizer (and logits width), with xgrammar's cache of compiled grammars."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # Bounded: a forced call with spoken arguments compiles a grammar of the caller's own words each time.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=_CACHE_LIMIT_BYTES
        )

    def compile(self, spec: str, what: str = "the tools") -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_structural_tag(spec)
        except Exception as e:  # xgrammar raises several types (RuntimeError, ValueError, its own)
            raise ToolSchemaError(f"{what}: the grammar library cannot compile the schema: {e}") from e

    def check(self, fmt: ToolCallFormat, tools: Sequence[ToolSpec], choice: ToolChoice | None = None) -> None:
        """Compile the grammar of every choice the tools can be used with (raises ToolSchemaError)."""
        for tool in tools:
            spec = grammar_spec(fmt, [tool], ToolChoice("function", tool.name))
            assert spec is not None
            self.compile(spec, f"tool {tool.name!r}")
        if choice is not None:
            spec = grammar_spec(fmt, tools, choice)
            if spec is not None:
                self.compile(spec)

    def matcher(self, spec: str) -> ReplyMatcher:
        return ReplyMatcher(self, self.compile(spec))


class ReplyMatcher:
    """One reply's grammar state: masks logits before sampling and advances by the sampled token."""

    def __init__(self, grammars: ToolGrammars, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=grammars.stop_ids)
        self._bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
        self._vocab = grammars.vocab_size

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits (``[V]``, float, CPU or not) of every token the grammar forbids to -inf, in place."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        row = logits.view(1, -1)
        bitmask: Any = (
            self._bitmask.to(row.device, non_blocking=True) if row.device.type != "cpu" else self._bitmask
        )
        xgr.apply_token_bitmask_inplace(row, bitmask, vocab_size=self._vocab)

    def accept(self, token: int) -> None:
        if not self._matcher.is_terminated():
            self._matcher.accept_token(token)
