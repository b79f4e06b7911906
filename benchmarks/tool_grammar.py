"""Which grammar library constrains the torch backend's tool calls: xgrammar, llguidance or outlines-core, measured
on SmolLM2's 49,152-token vocabulary (docs/speech-stack.md, Thinker: tool calls).

For each library: the time to compile the grammar of one call of a typical tool (``{"name": "get_weather",
"arguments": <schema>}``, three typed parameters, an enum, a required list), cold (a fresh compiler) and warm (the
library's cache, where it has one); the time of one token mask, over every token of a valid call; and two checks of
correctness: the mask allows every token of the valid call, and it refuses a token that breaks the schema (a
number where the schema wants a string). Prints one line per library, then a JSON summary as the last line.

    python benchmarks/tool_grammar.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from engine_bridge.thinker.model_store import load_tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": SCHEMA},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
VALID = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}'
#: The same call with a number where "city" must be a string: its first wrong token must be refused.
INVALID_PREFIX = '{"name": "get_weather", "arguments": {"city": '
INVALID_NEXT = "4"


def _allowed(mask_row: torch.Tensor, tok: int) -> bool:
    return bool((int(mask_row[tok // 32]) >> (tok % 32)) & 1)


def bench_xgrammar(tok: Any, vocab: int, valid: list[int], bad: tuple[list[int], int]) -> dict[str, Any]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled = compiler.compile_json_schema(json.dumps(CALL_SCHEMA), any_whitespace=False)
    cold = time.perf_counter() - t0
    cached = xgr.GrammarCompiler(info)
    cached.compile_json_schema(json.dumps(CALL_SCHEMA), any_whitespace=False)
    t0 = time.perf_counter()
    cached.compile_json_schema(json.dumps(CALL_SCHEMA), any_whitespace=False)
    warm = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def run(tokens: list[int]) -> tuple[list[float], bool, Any]:
        m = xgr.GrammarMatcher(compiled)
        times, ok = [], True
        for t in tokens:
            s = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - s)
            ok &= _allowed(bitmask[0], t)
            m.accept_token(t)
        return times, ok, m

    times, ok, _ = run(valid)
    prefix, nxt = bad
    _, _, m = run(prefix)
    m.fill_next_token_bitmask(bitmask)
    return _summary("xgrammar", cold, warm, times, ok, not _allowed(bitmask[0], nxt))


def bench_llguidance(tok: Any, vocab: int, valid: list[int], bad: tuple[list[int], int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        CALL_SCHEMA, defaults={"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    )
    t0 = time.perf_counter()
    llguidance.LLMatcher(lltok, grammar)
    cold = time.perf_counter() - t0
    bitmask = lt.allocate_token_bitmask(1, vocab)

    def run(tokens: list[int]) -> tuple[list[float], bool, Any]:
        m = llguidance.LLMatcher(lltok, grammar)
        times, ok = [], True
        for t in tokens:
            s = time.perf_counter()
            lt.fill_next_token_bitmask(m, bitmask, 0)
            times.append(time.perf_counter() - s)
            ok &= _allowed(bitmask[0], t)
            m.consume_token(t)
        return times, ok, m

    times, ok, _ = run(valid)
    prefix, nxt = bad
    _, _, m = run(prefix)
    lt.fill_next_token_bitmask(m, bitmask, 0)
    out = _summary("llguidance", cold, cold, times, ok, not _allowed(bitmask[0], nxt))
    out["tokenizer_s"] = round(tok_s, 3)
    return out


def bench_outlines(tok: Any, vocab: int, valid: list[int], bad: tuple[list[int], int]) -> dict[str, Any]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    # Vocabulary.from_pretrained reads the hub; offline, the byte-level BPE pieces are decoded to bytes here.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    eos = tok.eos_token_id
    special = set(tok.all_special_ids)
    pieces: dict[bytes, list[int]] = {}
    for piece, i in tok.get_vocab().items():
        if i not in special and all(c in byte_of for c in piece):
            pieces.setdefault(bytes(byte_of[c] for c in piece), []).append(i)
    vocabulary = Vocabulary(eos, pieces)
    tok_s = time.perf_counter() - t0
    regex = build_regex_from_schema(json.dumps(CALL_SCHEMA), r" ?")
    t0 = time.perf_counter()
    index = Index(regex, vocabulary)
    cold = time.perf_counter() - t0

    def run(tokens: list[int]) -> tuple[list[float], bool, Any]:
        g = Guide(index)
        times, ok = [], True
        for t in tokens:
            s = time.perf_counter()
            allowed = g.get_tokens()
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[allowed] = True
            times.append(time.perf_counter() - s)
            ok &= bool(mask[t])
            if not g.is_finished():
                g.advance(t)
        return times, ok, g

    times, ok, _ = run(valid)
    prefix, nxt = bad
    _, _, g = run(prefix)
    refused = nxt not in set(g.get_tokens())
    out = _summary("outlines-core", cold, cold, times, ok, refused)
    out["tokenizer_s"] = round(tok_s, 3)
    return out


def _summary(
    name: str, cold: float, warm: float, times: list[float], ok: bool, refused: bool
) -> dict[str, Any]:
    us = sorted(t * 1e6 for t in times)
    return {
        "library": name,
        "compile_cold_ms": round(cold * 1000, 2),
        "compile_warm_ms": round(warm * 1000, 3),
        "mask_us_median": round(statistics.median(us), 1),
        "mask_us_p90": round(us[int(len(us) * 0.9)], 1),
        "mask_us_max": round(us[-1], 1),
        "tokens": len(us),
        "valid_call_allowed": ok,
        "invalid_token_refused": refused,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=["xgrammar", "llguidance", "outlines-core"], default=None)
    args = ap.parse_args()
    tok = load_tokenizer()
    vocab = len(tok)
    valid = tok(VALID, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prefix = tok(INVALID_PREFIX, add_special_tokens=False)["input_ids"]
    nxt = tok(INVALID_NEXT, add_special_tokens=False)["input_ids"][0]
    benches: dict[str, Callable[..., dict[str, Any]]] = {
        "xgrammar": bench_xgrammar,
        "llguidance": bench_llguidance,
        "outlines-core": bench_outlines,
    }
    results = []
    for name, fn in benches.items():
        if args.only and name != args.only:
            continue
        runs = [fn(tok, vocab, valid, (prefix, nxt)) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["mask_us_median"])
        best["compile_cold_ms"] = min(r["compile_cold_ms"] for r in runs)
        results.append(best)
        print(best, flush=True)
    print(json.dumps({"vocab": vocab, "results": results}))


if __name__ == "__main__":
    main()
