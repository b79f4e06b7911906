"""The tool router at text level: which requests the built-in thinker's ``auto`` turns into a call, and of which tool.

``tool_calls.py`` (issue 38) asks by voice over the Realtime WebSocket; this asks the same kinds of requests as
text, straight to the torch thinker the engine builds with the default settings (SmolLM2-135M, float32, the spoken
decoding and example turns), with three tools listed (``get_weather(city)``, ``book_table(date)``,
``get_order_status(order_number)``). Two sets of 40 requests, each 20 that need one of the tools and 20 that need
none (questions, chit-chat, and a few that name a city or a day without asking for a tool):

* set **A**: the set the shipped threshold (``tool_router.ROUTER_THRESHOLD``) was fitted on;
* set **B**: other requests of the same kinds, never used to fit anything (held out).

Per set, for the baseline (the model's own ``auto``, no router) and the shipped router, decoded by the thinker
itself (each request the first message of a fresh conversation):

* ``call_precision``: right-tool calls / calls made; ``call_recall``: right-tool calls / the 20 tool requests;
* ``args_valid``: calls whose arguments validate against the tool's schema / calls;
* ``args_exact``: right-tool calls whose argument is the value spoken (lower-cased, punctuation and a leading "the"
  dropped) / right-tool calls;
* ``route_ms_p50``: ``begin_reply`` of a routed reply, the router's forward pass over the caller's message included
  (what routing adds before the first token; the scheduler thread is busy with it meanwhile).

Also printed: the router's scores fitted afresh on set A (the midpoint that maximises min(precision, recall)),
to show the shipped threshold is that fit.

    python benchmarks/tool_router.py [--quick] [--threads N]

``--quick``: 2 requests of each kind and set (a weather and an order request; two plain questions). Last stdout line: JSON with ``baseline`` and ``router`` per set,
the fitted threshold and the shipped one.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
from _common import finish, pct

from engine_bridge.config import EngineSettings
from engine_bridge.thinker.factory import spoken_decoding, spoken_examples, tool_router_threshold
from engine_bridge.thinker.tools import ToolCall, ToolChoice, ToolSpec
from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "get_weather",
        "Get the current weather in a given city.",
        {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
        },
    ),
    ToolSpec(
        "book_table",
        "Book a table at the restaurant for a given day.",
        {
            "type": "object",
            "properties": {
                "date": {
                    "type": "string",
                    "description": "The day, as the caller said it, e.g. tomorrow or December 12th",
                }
            },
            "required": ["date"],
        },
    ),
    ToolSpec(
        "get_order_status",
        "Look up the status of a customer's order by its order number.",
        {
            "type": "object",
            "properties": {"order_number": {"type": "string", "description": "The order number, e.g. 1234"}},
            "required": ["order_number"],
        },
    ),
)
_ARG = {"get_weather": "city", "book_table": "date", "get_order_status": "order_number"}


@dataclass(frozen=True, slots=True)
class Request:
    text: str
    #: The tool it needs and the value of its one argument as spoken (None: no tool).
    tool: str | None = None
    value: str | None = None


def _w(text: str, city: str) -> Request:
    return Request(text, "get_weather", city)


def _b(text: str, date: str) -> Request:
    return Request(text, "book_table", date)


def _o(text: str, number: str) -> Request:
    return Request(text, "get_order_status", number)


SET_A: list[Request] = [
    _w("What's the weather like in Paris today?", "Paris"),
    _w("Is it raining in Berlin?", "Berlin"),
    _w("How hot is it in Madrid right now?", "Madrid"),
    _w("Will I need an umbrella in London today?", "London"),
    _w("What's the temperature in Tokyo?", "Tokyo"),
    _w("Tell me the weather forecast for Rome.", "Rome"),
    _w("Is it sunny in Lisbon?", "Lisbon"),
    _b("Can you book a table for tomorrow?", "tomorrow"),
    _b("I'd like to reserve a table on December 12th.", "December 12th"),
    _b("Please book us a table for Friday.", "Friday"),
    _b("Book a table for tonight, please.", "tonight"),
    _b("Can I get a reservation for next Saturday?", "next Saturday"),
    _b("Reserve a table for May 3rd.", "May 3rd"),
    _o("Where is my order 4417?", "4417"),
    _o("What's the status of order number 1209?", "1209"),
    _o("Has my order 5531 shipped yet?", "5531"),
    _o("Can you check on order 8802 for me?", "8802"),
    _o("My package, order 3190, hasn't arrived. Where is it?", "3190"),
    _o("Track order 7645, please.", "7645"),
    _o("I want to know when order 2024 will arrive.", "2024"),
    Request("What is the capital of France?"),
    Request("Tell me a joke."),
    Request("How are you?"),
    Request("What is two plus two?"),
    Request("Who wrote Romeo and Juliet?"),
    Request("Good morning!"),
    Request("What color is the sky?"),
    Request("How many legs does a spider have?"),
    Request("Thank you so much."),
    Request("What's your name?"),
    Request("Can you recommend a good book?"),
    Request("What is the largest ocean?"),
    Request("Tell me a fun fact about cats."),
    Request("Hello there!"),
    Request("What is the boiling point of water?"),
    Request("How do I say hello in Spanish?"),
    Request("Who painted the Mona Lisa?"),
    Request("What is Paris famous for?"),
    Request("Goodbye, have a nice day."),
    Request("Why is the sky blue?"),
]
SET_B: list[Request] = [
    _w("How's the weather in New York?", "New York"),
    _w("Is it cold in Moscow today?", "Moscow"),
    _w("Do I need a jacket in Chicago?", "Chicago"),
    _w("What's it like outside in Sydney?", "Sydney"),
    _w("Is it snowing in Oslo?", "Oslo"),
    _w("Give me the weather for Amsterdam.", "Amsterdam"),
    _w("How warm is it in Athens?", "Athens"),
    _b("Could you reserve a table for Saturday?", "Saturday"),
    _b("Book a table for June 5th.", "June 5th"),
    _b("I need a table for the day after tomorrow.", "day after tomorrow"),
    _b("Please make a dinner reservation for Thursday.", "Thursday"),
    _b("Can we book a table on New Year's Eve?", "New Year's Eve"),
    _b("Get me a table for next Monday.", "next Monday"),
    _b("I want to book a table for March 21st.", "March 21st"),
    _o("Where's order 6120?", "6120"),
    _o("Check the status of my order, number 9981.", "9981"),
    _o("When will order 3347 be delivered?", "3347"),
    _o("Has order 1500 been shipped?", "1500"),
    _o("I'm waiting on order 4806, any news?", "4806"),
    _o("Look up order 2718 for me.", "2718"),
    Request("What is the capital of Italy?"),
    Request("Tell me something funny."),
    Request("How is your day going?"),
    Request("What is the opposite of hot?"),
    Request("Who was the first president of the United States?"),
    Request("Good evening!"),
    Request("What do bees make?"),
    Request("How many days are in a week?"),
    Request("Thanks for your help."),
    Request("Are you a robot?"),
    Request("What's a good name for a dog?"),
    Request("What is the largest planet?"),
    Request("What sound does a cow make?"),
    Request("Hi!"),
    Request("What is water made of?"),
    Request("How do you spell cat?"),
    Request("Who discovered gravity?"),
    Request("What causes rain?"),
    Request("See you later."),
    Request("What is Berlin famous for?"),
]
SETS = {"A": SET_A, "B": SET_B}


def _norm(value: str) -> str:
    v = re.sub(r"[^\w\s']", "", value.lower()).strip()
    return re.sub(r"^the ", "", v)


def figures(pairs: Sequence[tuple[Request, ToolCall | None]]) -> dict[str, Any]:
    calls = [(r, c) for r, c in pairs if c is not None]
    right = [(r, c) for r, c in calls if c.name == r.tool]
    valid = 0
    for _, c in calls:
        schema = next(t.parameters for t in TOOLS if t.name == c.name)
        try:
            jsonschema.validate(json.loads(c.arguments), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    exact = sum(
        1
        for r, c in right
        if _norm(str(json.loads(c.arguments).get(_ARG[c.name], ""))) == _norm(r.value or "")
    )
    needing = sum(1 for r, _ in pairs if r.tool is not None)
    return {
        "call_precision": len(right) / len(calls) if calls else None,
        "call_recall": len(right) / needing if needing else None,
        "args_valid": valid / len(calls) if calls else None,
        "args_exact": exact / len(right) if right else None,
        "calls": len(calls),
        "right_calls": len(right),
    }


@dataclass
class Trial:
    req: Request
    call: ToolCall | None
    said: str
    score: float | None
    route_ms: float | None


def ask(th: TorchThinker, sid: str, req: Request, settings: EngineSettings) -> Trial:
    """One ``auto`` reply to ``req`` as the first message of a voice session's conversation."""
    th.open(sid, None, [], examples=spoken_examples(settings), tools=TOOLS)
    try:
        th.append(sid, "user", req.text)
        t0 = time.perf_counter()
        th.begin_reply(
            sid, decoding=dataclasses.replace(spoken_decoding(settings), tool_choice=ToolChoice("auto"))
        )
        begin_ms = (time.perf_counter() - t0) * 1000
        said, out = "", None
        while out is None or not out.done:
            out = th.step([sid])[sid]
            said += out.text
        th.end_reply(sid)
        route = th.tool_route(sid)
        return Trial(
            req, out.tool_call, said, None if route is None else route.score, begin_ms if route else None
        )
    finally:
        th.close(sid)


def fit(trials: Sequence[Trial], route_tools: dict[str, str]) -> float:
    """The threshold that maximises min(precision, recall) of right-tool calls on ``trials`` (then their sum)."""
    scored = [(t, t.score) for t in trials if t.score is not None]
    values = sorted({s for _, s in scored})
    best: tuple[tuple[float, float], float] | None = None
    for lo, hi in itertools.pairwise(values):
        cut = (lo + hi) / 2
        calls = [t for t, s in scored if s > cut]
        right = sum(1 for t in calls if route_tools[t.req.text] == t.req.tool)
        p = right / len(calls) if calls else 0.0
        r = right / sum(1 for t in trials if t.req.tool)
        key = (min(p, r), p + r)
        if best is None or key > best[0]:
            best = (key, cut)
    return best[1] if best else float("nan")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 requests of each kind and set")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    sets = dict(SETS)
    if args.quick:
        sets = {k: [v[0], v[14], v[20], v[23]] for k, v in SETS.items()}
    settings = EngineSettings()
    shipped = tool_router_threshold(settings)
    assert shipped is not None, "the default settings route auto replies"
    th = TorchThinker(
        TorchThinkerConfig(
            threads=args.threads,
            decoding=spoken_decoding(settings),
            spoken_arguments=True,
            tool_router_threshold=shipped,
        )
    )
    router = th.tool_router
    assert router is not None
    results: dict[str, dict[str, Any]] = {"baseline": {}, "router": {}}
    fitted: float | None = None
    rows = []
    for name, reqs in sets.items():
        th.tool_router = None
        base = [ask(th, f"base-{name}-{i}", r, settings) for i, r in enumerate(reqs)]
        th.tool_router = router
        routed = [ask(th, f"route-{name}-{i}", r, settings) for i, r in enumerate(reqs)]
        for label, trials in (("baseline", base), ("router", routed)):
            fig = figures([(t.req, t.call) for t in trials])
            if label == "router":
                fig["route_ms_p50"] = pct([t.route_ms for t in trials if t.route_ms is not None], 50)
            results[label][name] = fig
            rows.append((label, name, fig))
        if name == "A":
            # The best tool whatever the threshold (route() returns None under it): ask with threshold -1.
            keep = router.threshold
            router.threshold = -1.0
            tools_by = {t.req.text: router.route(t.req.text, TOOLS).tool or "" for t in routed}
            router.threshold = keep
            fitted = fit(routed, tools_by)
        print(f"# set {name} done at {time.perf_counter() - t0:.0f} s", flush=True)
        for t in routed:
            got = "words" if t.call is None else f"{t.call.name}({t.call.arguments})"
            print(f"  [{name}] {t.req.text!r:58} score {t.score:+.3f} -> {got}", flush=True)
    keys = (
        "call_precision",
        "call_recall",
        "args_valid",
        "args_exact",
        "calls",
        "right_calls",
        "route_ms_p50",
    )
    print(f"{'approach':10} set " + " ".join(f"{k:>14}" for k in keys))
    for label, name, fig in rows:
        cells = " ".join(
            f"{'-' if fig.get(k) is None else (f'{fig[k]:.2f}' if isinstance(fig[k], float) else fig[k]):>14}"
            for k in keys
        )
        print(f"{label:10} {name:>3} {cells}")
    print(f"shipped threshold {shipped:.3f}; fitted on set A in this run {fitted:.3f}")
    finish(
        {
            "benchmark": "tool_router",
            "quick": args.quick,
            "threshold_shipped": shipped,
            "threshold_fitted_on_A": fitted,
            **results,
            "seconds": time.perf_counter() - t0,
        }
    )


if __name__ == "__main__":
    main()
