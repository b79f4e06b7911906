"""What new session instructions cost mid-session: the thinker's system segment rebuilt, the conversation kept.

A Realtime ``session.update`` with new ``instructions`` after the engine session opened replaces the system
prompt: the engine re-opens the thinker session with the new system segment and the conversation as its history
(``engine_bridge.thinker.turns.reinstruct``), so the whole log is prefilled in one pass. This measures that on the
real SmolLM2-135M (torch backend, float32, one thread) for conversations of several lengths, against two
baselines measured in the same run:

* ``reappend``: the same rebuild done message by message (re-open, then one ``append`` per message, each its own
  prefill), what re-extending a log after a rollback does;
* ``note``: appending the instructions as one developer message instead (what the server did before: cheap,
  but the old system prompt stays and the new text is only a later message).

Each figure is the median of ``--repeats`` runs, alternating two instruction texts so no run is a no-op.

    python benchmarks/instructions_rebuild.py [--quick] [--repeats N]

Last stdout line: one JSON object with ``rebuild_ms_p50``, ``reappend_ms_p50``, ``note_ms_p50`` and
``log_tokens``, each keyed by the conversation's message count.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from _common import finish, make_thinker_backend, pct

from engine_bridge.thinker.base import Message, ThinkerBackend
from engine_bridge.thinker.prompting import SPOKEN_DECODING, SPOKEN_EXAMPLES
from engine_bridge.thinker.turns import reinstruct

INSTRUCTIONS = (
    "You are a helpful voice assistant. Answer in one short English sentence.",
    "You are a cheerful tour guide in Paris. Answer in one short English sentence and mention a landmark.",
)
TURNS = (
    ("user", "What is the capital of France?"),
    ("assistant", "The capital of France is Paris."),
    ("user", "And how many people live there?"),
    ("assistant", "About two million people live in Paris itself."),
)


def conversation(n: int) -> list[Message]:
    return [Message(TURNS[i % len(TURNS)][0], TURNS[i % len(TURNS)][1]) for i in range(n)]  # type: ignore[arg-type]


def timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return pct(times, 50)


def measure(th: ThinkerBackend, n: int, repeats: int) -> dict[str, float]:
    sid = f"bench-{n}"
    history = conversation(n)
    th.open(sid, INSTRUCTIONS[0], history, examples=SPOKEN_EXAMPLES)
    turn = [0]

    def next_instructions() -> str:
        turn[0] += 1
        return INSTRUCTIONS[turn[0] % 2]

    def rebuild(instructions: str | None = None) -> None:
        text = instructions or next_instructions()
        problem = reinstruct(th, sid, text, history, previous=INSTRUCTIONS[0], examples=SPOKEN_EXAMPLES)
        assert not problem, problem

    def reappend(instructions: str | None = None) -> None:
        th.close(sid)
        th.open(sid, instructions or next_instructions(), examples=SPOKEN_EXAMPLES)
        for msg in history:
            th.append(sid, msg.role, msg.text)

    rebuild_ms = timed(rebuild, repeats)
    reappend_ms = timed(reappend, repeats)
    # Both give the same log, token for token.
    rebuild(INSTRUCTIONS[0])
    tokens = th.log(sid).tokens
    reappend(INSTRUCTIONS[0])
    assert th.log(sid).tokens == tokens, "the two rebuilds differ"
    mark = len(tokens)

    def note() -> None:
        th.append(sid, "developer", next_instructions())
        th.rollback(sid, mark)  # the next run appends to the same log

    note_ms = timed(note, repeats)
    th.close(sid)
    return {"rebuild": rebuild_ms, "reappend": reappend_ms, "note": note_ms, "tokens": float(mark)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one short conversation, 2 repeats (smoke test)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sizes = (4,) if args.quick else (4, 16, 48)
    repeats = 2 if args.quick else args.repeats
    th = make_thinker_backend("torch", decoding=SPOKEN_DECODING)
    rows = {n: measure(th, n, repeats) for n in sizes}
    print(f"{'messages':>8} {'log tokens':>10} {'rebuild ms':>11} {'reappend ms':>12} {'note ms':>8}")
    for n, r in rows.items():
        print(f"{n:>8} {int(r['tokens']):>10} {r['rebuild']:>11.1f} {r['reappend']:>12.1f} {r['note']:>8.1f}")
    finish(
        {
            "rebuild_ms_p50": {str(n): r["rebuild"] for n, r in rows.items()},
            "reappend_ms_p50": {str(n): r["reappend"] for n, r in rows.items()},
            "note_ms_p50": {str(n): r["note"] for n, r in rows.items()},
            "log_tokens": {str(n): int(r["tokens"]) for n, r in rows.items()},
            "repeats": repeats,
            "quick": args.quick,
        }
    )


if __name__ == "__main__":
    main()
