"""Turn-N time to first token: the KV lease vs re-prefilling the whole history.

Same model (the real SmolLM2-135M), same conversation, both modes measured turn by turn in the same run so
they see the same CPU noise, on one thinker backend or (``--backend vllm``) on vLLM and the torch backend:

* lease: the session's cache holds the history; TTFT_N = ``append(user_N)`` + ``begin_reply`` + first
  ``step`` (prefills only user_N and the assistant header);
* re-prefill: a fresh session restored from the same token log (history + user_N) computes everything
  again; TTFT_N = ``open(log=...)`` + ``begin_reply`` + first ``step`` (on vLLM each fresh session has its
  own cache namespace, so nothing comes from the prefix cache);
* deferred (extra column): the lease with ``append(..., prefill=False)``, so the first ``step`` computes
  user_N, the header and the first token in one pass.

Lease and re-prefill make the same number of forward passes (one prefill, one first decode step), so the ratio is
the cost of the history itself. The assistant turns are scripted (committed through ``end_reply(text)``, the
barge-in path) so that every repeat sees the same conversation: users ~20-30 tokens, assistants ~30-60.
The first token of all modes must be identical (correctness gate, ``first_token_equal``). On vLLM the scripted
answers are the barge-in path (abort + re-open from the log): ``prefix_cache_hit_share_on_rollback`` is the
share of re-opened tokens found in vLLM's prefix cache.

Usage: ``python benchmarks/engine_turns.py [--quick] [--repeats N] [--backend torch|vllm]``.
The last line of stdout is one JSON object (with ``--backend vllm``: ``vllm_ratio_at_8``, ``torch_ratio_at_8``,
``vllm_ttft_ms_at_8``, ``torch_ttft_ms_at_8``, ``prefix_cache_hit_share_on_rollback``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import finish, make_thinker_backend
from rich.console import Console
from rich.table import Table

from engine_bridge.thinker.base import DecodingSettings, LogSnapshot

TURNS: list[tuple[str, str]] = [
    (
        "Hi! I'm planning a two week trip through central Europe next spring and I could use some help.",
        "Of course, that sounds like a wonderful trip. Spring is a great time to travel there, with mild "
        "weather and fewer crowds than summer. Which cities are you thinking about so far?",
    ),
    (
        "I'd like to start in Munich, then go to Vienna and Prague, and maybe finish in Budapest.",
        "That is a classic route, and the trains between those cities are fast and comfortable. Munich to "
        "Vienna takes about four hours, and Vienna to Prague a little longer. Budapest is an easy last stop.",
    ),
    (
        "How many days should I spend in each city if I want to see the main sights without rushing?",
        "I would give Munich three days, Vienna four, Prague four and Budapest three. That leaves time for "
        "museums and long walks, plus one spare day in case a train is late or you love a place.",
    ),
    (
        "That sounds good. What is one thing in Vienna that I really should not miss on my first visit?",
        "Visit the Schönbrunn Palace early in the morning before the tour groups arrive, then walk up through "
        "the gardens to the Gloriette. The view back over the palace and the city is beautiful.",
    ),
    (
        "And in Prague, is it worth paying for a guided tour of the old town, or can I explore alone?",
        "You can explore the old town alone quite easily, since it is compact and well signposted. A guided "
        "walk is worth it mostly for the stories behind the buildings, so book one if you enjoy history.",
    ),
    (
        "I'm a bit worried about my budget. Roughly how much should I plan per day for food and transport?",
        "In these cities a careful traveller can eat well for about forty euros a day, a little more in "
        "Munich and Vienna. Local transport passes cost around eight to ten euros a day in each city.",
    ),
    (
        "Is it better to book the trains between the cities now, or can I buy the tickets at the station?",
        "Book the longer routes a few weeks ahead, because early fares are much cheaper and seats on busy "
        "trains can sell out. Short regional trips are fine to buy at the station on the same day.",
    ),
    (
        "Last question: what should I pack for the weather there in April and early May, roughly?",
        "Pack layers: a light waterproof jacket, a warm sweater for the evenings, comfortable walking shoes "
        "and an umbrella. Days can be warm and sunny, but mornings are cool and showers are common.",
    ),
]


def run(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    # The first token is all that is measured; a short cap keeps the (untimed) rest of each call cheap.
    th = make_thinker_backend(backend, threads=args.threads, decoding=DecodingSettings(max_tokens=8))
    turns = TURNS[: args.turns]
    lease: list[list[float]] = [[] for _ in turns]
    deferred: list[list[float]] = [[] for _ in turns]
    reprefill: list[list[float]] = [[] for _ in turns]
    context: list[int] = [0] * len(turns)
    prefill_lease: list[int] = [0] * len(turns)
    user_tokens: list[int] = [0] * len(turns)
    reply_tokens: list[int] = [0] * len(turns)
    first_equal = True

    for rep in range(args.repeats + 1):  # repeat 0 warms up allocators and caches, and is not counted
        th.open("lease")
        th.open("deferred")
        for n, (user, assistant) in enumerate(turns):
            t0 = time.perf_counter()
            res = th.append("lease", "user", user)
            th.begin_reply("lease")
            first = th.step(["lease"])["lease"]
            t_lease = time.perf_counter() - t0
            snap = th.log("lease")
            # The history as the re-prefill mode sees it: everything up to and including user_N + header.
            history = snap.segments[-1].start
            th.end_reply("lease", assistant)  # scripted answer: same conversation on every repeat

            # The same turn with append(prefill=False): message + header + first token in one pass.
            t0 = time.perf_counter()
            th.append("deferred", "user", user, prefill=False)
            th.begin_reply("deferred")
            lazy = th.step(["deferred"])["deferred"]
            t_deferred = time.perf_counter() - t0
            th.end_reply("deferred", assistant)

            t0 = time.perf_counter()
            fresh = f"re-{rep}-{n}"
            th.open(fresh, log=_prefix(snap, history))
            th.begin_reply(fresh)
            again = th.step([fresh])[fresh]
            t_re = time.perf_counter() - t0
            th.close(fresh)

            first_equal &= first.token_id == again.token_id == lazy.token_id
            if rep > 0:
                lease[n].append(t_lease * 1000)
                deferred[n].append(t_deferred * 1000)
                reprefill[n].append(t_re * 1000)
            context[n] = history
            prefill_lease[n] = res.prefill_tokens
            user_tokens[n] = res.new_tokens
            seg = th.log("lease").segments[-1]
            reply_tokens[n] = seg.end - seg.start
        share = getattr(th, "prefix_cache_hit_share", None)
        hit_share = share("lease") if share is not None else None
        th.close("lease")
        th.close("deferred")
    shutdown = getattr(th, "shutdown", None)
    if shutdown is not None:
        shutdown()

    med_lease = [round(statistics.median(v), 1) for v in lease]
    med_re = [round(statistics.median(v), 1) for v in reprefill]
    med_deferred = [round(statistics.median(v), 1) for v in deferred]
    ratios = [round(r / max(a, 1e-9), 2) for a, r in zip(med_lease, med_re, strict=True)]

    table = Table(title=f"turn-N TTFT, {backend} backend, SmolLM2-135M float32, median of {args.repeats}")
    cols = (
        "N",
        "context tok",
        "user tok",
        "lease prefill tok",
        "lease ms",
        "deferred ms",
        "re-prefill ms",
        "ratio",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for n in range(len(turns)):
        table.add_row(
            str(n + 1),
            str(context[n]),
            str(user_tokens[n]),
            str(prefill_lease[n]),
            f"{med_lease[n]:.1f}",
            f"{med_deferred[n]:.1f}",
            f"{med_re[n]:.1f}",
            f"{ratios[n]:.2f}",
        )
    Console(highlight=False, width=120).print(table)
    print(f"assistant turn sizes (tokens incl. template): {reply_tokens}")
    print("context tok = tokens before the reply (history + user N); ratio = re-prefill / lease")
    return {
        "backend": backend,
        "prefix_cache_hit_share_on_rollback": hit_share,
        "ttft_ms_lease": med_lease,
        "ttft_ms_reprefill": med_re,
        "ratio_at_8": ratios[-1] if len(turns) == 8 else None,
        "ratio_by_n": ratios,
        "ttft_ms_lease_deferred": med_deferred,
        "history_tokens": context,
        "prefill_tokens_lease": prefill_lease,
        "first_token_equal": first_equal,
        "threads": args.threads,
        "repeats": args.repeats,
    }


def _prefix(snap: LogSnapshot, k: int) -> LogSnapshot:
    """The snapshot cut before the assistant header: the re-prefill session adds its own header."""
    return LogSnapshot(snap.tokens[:k], tuple(s for s in snap.segments if s.end <= k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="2 repeats instead of 5")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--turns", type=int, default=8, choices=range(1, len(TURNS) + 1))
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.backend == "torch":
        finish(run(args, "torch"))
        return
    torch_r = run(args, "torch")
    vllm_r = run(args, "vllm")
    last = args.turns - 1
    result = {
        "vllm_ratio_at_8": vllm_r["ratio_at_8"],
        "torch_ratio_at_8": torch_r["ratio_at_8"],
        "vllm_ttft_ms_at_8": vllm_r["ttft_ms_lease"][last] if args.turns == 8 else None,
        "torch_ttft_ms_at_8": torch_r["ttft_ms_lease"][last] if args.turns == 8 else None,
        "vllm_ttft_no_worse_than_torch": vllm_r["ttft_ms_lease"][last] <= torch_r["ttft_ms_lease"][last],
        "prefix_cache_hit_share_on_rollback": vllm_r["prefix_cache_hit_share_on_rollback"],
        "first_token_equal": torch_r["first_token_equal"] and vllm_r["first_token_equal"],
        "vllm": vllm_r,
        "torch": torch_r,
    }
    print(
        f"turn {args.turns} TTFT with the lease: vllm {result['vllm_ttft_ms_at_8']} ms, torch "
        f"{result['torch_ttft_ms_at_8']} ms; prefix-cache hit share on re-open "
        f"{result['prefix_cache_hit_share_on_rollback']}"
    )
    finish(result)


if __name__ == "__main__":
    main()
