"""Batched decode: 4 sessions generating at once through one ``step()`` per token vs one after another.

Same backend (the torch thinker on the real SmolLM2-135M), same sessions, same token counts: every session
has a different history length (so the batched cache is really left-padded), generates ``--tokens`` tokens
with ``ignore_eos``, and is rolled back to its checkpoint afterwards so each repeat starts from the same
state. Sequential = ``step([sid])`` for one session until it is done, then the next. Batched =
``step(all sids)`` until all are done (the first step also feeds each session's assistant header, and the
group's batched cache is built inside the timed region). Both modes run in every repeat, alternating which
goes first; medians are reported. ``tokens_equal`` says whether both modes produced the same greedy tokens.

Usage: ``python benchmarks/engine_batch.py [--quick] [--dtype float32|bfloat16] [--sessions 4] [--tokens 48]``.
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rich.console import Console
from rich.table import Table

from engine_bridge.thinker.base import Checkpoint, DecodingSettings, Message
from engine_bridge.thinker.torch_backend import DEFAULT_DTYPE, TorchThinker, TorchThinkerConfig

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


def run(args: argparse.Namespace) -> dict[str, object]:
    th = TorchThinker(TorchThinkerConfig(dtype=args.dtype, threads=args.threads))
    dec = DecodingSettings(max_tokens=args.tokens, ignore_eos=True, repetition_penalty=1.15)
    sids = [f"s{i}" for i in range(args.sessions)]
    for i, sid in enumerate(sids):
        history, question = SESSIONS[i % len(SESSIONS)]
        th.open(sid, history=history)
        th.append(sid, "user", question)
    context = [len(th.log(sid)) for sid in sids]

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

    total = args.sessions * args.tokens
    seq_rates: list[float] = []
    bat_rates: list[float] = []
    equal = True
    sequential()  # warm-up (allocator, oneDNN/MKL kernels), not counted
    batched()
    for rep in range(args.repeats):
        order = (sequential, batched) if rep % 2 == 0 else (batched, sequential)
        results = {fn.__name__: fn() for fn in order}
        (t_seq, toks_seq), (t_bat, toks_bat) = results["sequential"], results["batched"]
        seq_rates.append(total / t_seq)
        bat_rates.append(total / t_bat)
        equal &= toks_seq == toks_bat
        print(f"repeat {rep + 1}: sequential {total / t_seq:.1f} tok/s, batched {total / t_bat:.1f} tok/s")

    tok_s_seq = statistics.median(seq_rates)
    tok_s_bat = statistics.median(bat_rates)
    ratio = tok_s_bat / tok_s_seq
    table = Table(
        title=f"{args.sessions} sessions x {args.tokens} tokens, SmolLM2-135M {args.dtype}, "
        f"{args.threads} thread(s), median of {args.repeats}"
    )
    for col in ("mode", "tok/s (all sessions)", "ms per token step"):
        table.add_column(col, justify="right")
    table.add_row("sequential", f"{tok_s_seq:.1f}", f"{1000 / tok_s_seq:.1f}")
    table.add_row("batched", f"{tok_s_bat:.1f}", f"{1000 * args.sessions / tok_s_bat:.1f}")
    table.add_row("ratio", f"{ratio:.2f}", "")
    Console(highlight=False, width=120).print(table)
    print(f"context tokens per session: {context}; same greedy tokens in both modes: {equal}")
    return {
        "tok_s_batched": round(tok_s_bat, 2),
        "tok_s_sequential": round(tok_s_seq, 2),
        "ratio": round(ratio, 2),
        "tokens_equal": equal,
        "context_tokens": context,
        "sessions": args.sessions,
        "tokens": args.tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "repeats": args.repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="1 repeat of 24 tokens instead of 3 of 48")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE, choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.tokens is None:
        args.tokens = 24 if args.quick else 48
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
