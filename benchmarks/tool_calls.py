"""Function tools where the caller is: spoken requests over the Realtime WebSocket, each in a fresh session on a real
``livekit-omni serve`` with the embedded default models, with three tools listed and ``tool_choice: auto``.

20 requests need one of three tools (``get_weather(city)``, ``book_table(date)``, ``get_order_status(order_number)``)
and 20 need none. Each is spoken at real time (Piper, 24 kHz PCM, 20 ms appends, silence around it like a
microphone) into a fresh session; the server's VAD ends the turn and its reply either calls a tool or answers in
words. When it calls, the benchmark returns the tool's result (``function_call_output`` + ``response.create``) and
hears the answer built on it.

Figures (every trial started counts; a trial that times out is a miss, never retried):

* ``call_precision``: calls of the right tool / all calls made (a call on a request that needs none, or of the
  wrong tool, is a false one);
* ``call_recall``: tool requests whose reply called the right tool / tool requests;
* ``args_valid``: calls whose arguments parse as JSON and validate against the tool's schema / calls;
* ``args_exact``: right-tool calls whose argument is the value spoken (city name, month and day, order digits) /
  right-tool calls;
* ``call_latency_ms_p50``: the caller's last audible sample → the function call reaches the client
  (``response.function_call_arguments.done`` received);
* ``answer_after_result_ms_p50``: ``function_call_output`` sent → the first audible sample of the answer heard;
* ``answers_with_result``: of the calls, the answers after the result that say one of its values and no markup;
* baseline in the same run: ``v2v_no_tool_ms_p50``, the requests that need no tool, caller's last audible sample →
  first audible sample of the spoken answer (what a caller waits for any answer on the same server and minute).

    python benchmarks/tool_calls.py [--quick] [--tool-choice auto|required]

``--quick``: 2 tool requests and 1 without (a smoke run). ``--tool-choice required`` makes every reply call (what the
grammar does when the model must call: arguments, latency), beside the model's own judgement under ``auto``.
Last stdout line: one JSON object with the keys above, per-trial rows and the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import numpy as np
import websockets
from _callers import QUESTIONS, HeardAudio, marked_sample
from _common import finish, pct
from rich.console import Console
from rich.table import Table

from engine_bridge.thinker.prompting import MARKUP_CHARS
from tests.conftest import ServerProcess, start_server
from tests.speech_fixtures import synthesize_speech

RATE = 24_000
CHUNK = RATE // 50
TRIAL_TIMEOUT_S = 45.0
#: The canned results the benchmark's tools return.
RESULTS = {
    "get_weather": '{"temperature_c": 18, "sky": "sunny"}',
    "book_table": '{"booked": true, "time": "7 pm"}',
    "get_order_status": '{"status": "shipped", "arrives": "Friday"}',
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
        },
    },
    {
        "type": "function",
        "name": "book_table",
        "description": "Book a table at the restaurant on a date.",
        "parameters": {
            "type": "object",
            "properties": {"date": {"type": "string", "description": "The date, e.g. December 12"}},
            "required": ["date"],
        },
    },
    {
        "type": "function",
        "name": "get_order_status",
        "description": "Look up the delivery status of an order by its number.",
        "parameters": {
            "type": "object",
            "properties": {"order_number": {"type": "string", "description": "The order number, e.g. 4417"}},
            "required": ["order_number"],
        },
    },
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
MONTHS = "january february march april may june july august september october november december".split()
ORDINALS = {
    "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8,
    "ninth": 9, "tenth": 10, "eleventh": 11, "twelfth": 12, "thirteenth": 13, "fourteenth": 14, "fifteenth": 15,
    "twentieth": 20,
}  # fmt: skip


@dataclass(frozen=True)
class Request:
    text: str
    #: The tool it needs (None: none) and the value it spoke for the tool's one argument.
    tool: str | None = None
    value: str = ""


TOOL_REQUESTS = [
    Request("What is the weather like in Paris today?", "get_weather", "paris"),
    Request("Is it raining in Berlin right now?", "get_weather", "berlin"),
    Request("How hot is it in Tokyo?", "get_weather", "tokyo"),
    Request("Tell me the weather in London.", "get_weather", "london"),
    Request("What is the temperature in Madrid?", "get_weather", "madrid"),
    Request("Will it be sunny in Rome today?", "get_weather", "rome"),
    Request("How cold is it in Chicago?", "get_weather", "chicago"),
    Request("Book a table for December twelfth.", "book_table", "december 12"),
    Request("Can you reserve a table on March third?", "book_table", "march 3"),
    Request("I want to book a table for May first.", "book_table", "may 1"),
    Request("Please book a table on July fourth.", "book_table", "july 4"),
    Request("Reserve a table for June tenth, please.", "book_table", "june 10"),
    Request("Book me a table on October second.", "book_table", "october 2"),
    Request("Where is my order 4417?", "get_order_status", "4417"),
    Request("What is the status of order 1234?", "get_order_status", "1234"),
    Request("Has order 5512 shipped yet?", "get_order_status", "5512"),
    Request("Can you check order 9087 for me?", "get_order_status", "9087"),
    Request("Track my order 3321, please.", "get_order_status", "3321"),
    Request("When will order 7702 arrive?", "get_order_status", "7702"),
    Request("Is order 2468 on its way?", "get_order_status", "2468"),
]
PLAIN_REQUESTS = [
    Request(q)
    for q in (
        *QUESTIONS,  # the other benchmarks' callers' ten questions, then ten more
        "Tell me a joke.",
        "How are you today?",
        "What is your name?",
        "Thank you very much.",
        "Who wrote Romeo and Juliet?",
        "At what temperature does water boil?",
        "How many hours are in a day?",
        "What is the capital of Japan?",
        "Good morning!",
        "What do cows eat?",
    )
]


def normalized(tool: str, args: dict[str, Any]) -> str:
    """The call's one argument as the requests write their expected values."""
    if tool == "get_weather":
        return str(args.get("city", "")).strip().lower().split(",")[0]
    if tool == "book_table":
        text = str(args.get("date", "")).lower()
        month = next((m for m in MONTHS if m in text), "")
        day = re.search(r"\b(\d{1,2})(st|nd|rd|th)?\b", text)
        num = int(day.group(1)) if day else next((n for w, n in ORDINALS.items() if w in text), 0)
        return f"{month} {num}" if month and num else text
    return "".join(ch for ch in str(args.get("order_number", "")) if ch.isdigit())


@dataclass
class Trial:
    request: Request
    called: str | None = None
    arguments: str = ""
    args_valid: bool = False
    args_exact: bool = False
    call_latency_ms: float | None = None
    answer_after_result_ms: float | None = None
    v2v_ms: float | None = None
    said: str = ""
    error: str = ""
    events: list[str] = field(default_factory=list)


class RealtimeCaller:
    """One Realtime WebSocket session: a microphone at real time and what the caller hears, with arrival times."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.heard = HeardAudio(RATE)
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._queue: asyncio.Queue[tuple[np.ndarray, int, asyncio.Future[float]]] = asyncio.Queue()
        self._mic = asyncio.create_task(self._speak())
        self._reader = asyncio.create_task(self._read())
        self._new = asyncio.Event()

    def say(self, text: str) -> asyncio.Future[float]:
        pcm = synthesize_speech(text, rate=RATE, lead_silence_ms=200, tail_silence_ms=0)
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((pcm, marked_sample(pcm, RATE, "end") // CHUNK, fut))
        return fut

    async def send(self, event: dict[str, Any]) -> float:
        await self.ws.send(json.dumps(event))
        return time.monotonic()

    async def _speak(self) -> None:
        t0, sent = time.monotonic(), 0
        silence = base64.b64encode(bytes(CHUNK * 2)).decode()
        current: tuple[np.ndarray, int, asyncio.Future[float]] | None = None
        pos = 0
        while True:
            if current is None and not self._queue.empty():
                current, pos = self._queue.get_nowait(), 0
            payload = silence
            if current is not None:
                chunk = current[0][pos * CHUNK : (pos + 1) * CHUNK]
                chunk = np.pad(chunk, (0, CHUNK - len(chunk)))
                payload = base64.b64encode(chunk.astype("<i2").tobytes()).decode()
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": payload}))
            if current is not None:
                if pos == current[1] and not current[2].done():
                    current[2].set_result(time.monotonic())
                pos += 1
                if pos * CHUNK >= len(current[0]):
                    current = None
            sent += 1
            await asyncio.sleep(max(0.0, t0 + sent * CHUNK / RATE - time.monotonic()))

    async def _read(self) -> None:
        async for raw in self.ws:
            at = time.monotonic()
            ev = json.loads(raw)
            if ev["type"] == "response.output_audio.delta":
                self.heard.add(at, np.frombuffer(base64.b64decode(ev["delta"]), dtype="<i2"))
            self.events.append((at, ev))
            self._new.set()

    async def until(self, pred: Any, timeout: float, start: int = 0) -> tuple[int, float, dict[str, Any]]:
        """The first event from index ``start`` on for which ``pred`` holds: (index, arrival, event)."""
        deadline = time.monotonic() + timeout
        i = start
        while True:
            while i < len(self.events):
                at, ev = self.events[i]
                if pred(ev):
                    return i, at, ev
                i += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._new.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), left)

    async def close(self) -> None:
        for task in (self._mic, self._reader):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.ws.close()


def first_audible_after(heard: HeardAudio, t: float) -> float | None:
    heard.scan()
    hit = heard.first_loud_after(t)
    return hit[1] if hit is not None else None


async def run_trial(server: ServerProcess, req: Request, tool_choice: str) -> Trial:
    trial = Trial(req)
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    async with websockets.connect(url, max_size=None) as ws:
        c = RealtimeCaller(ws)
        try:
            await c.send(
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "tools": TOOLS, "tool_choice": tool_choice},
                }
            )
            await c.until(lambda e: e["type"] in ("session.updated", "error"), 30)
            errors = [e for _, e in c.events if e["type"] == "error"]
            if errors:
                raise RuntimeError(f"session.update refused: {errors[0]['error']}")
            speech_end = await c.say(req.text)
            i, _, done = await c.until(lambda e: e["type"] == "response.done", TRIAL_TIMEOUT_S)
            calls = [o for o in done["response"].get("output", []) if o.get("type") == "function_call"]
            if not calls:
                trial.said = " ".join(
                    (p.get("transcript") or p.get("text") or "")
                    for o in done["response"].get("output", [])
                    for p in o.get("content") or []
                )
                heard = first_audible_after(c.heard, speech_end)
                trial.v2v_ms = (heard - speech_end) * 1000 if heard is not None else None
                return trial
            call = calls[0]
            trial.called, trial.arguments = call["name"], call["arguments"]
            _, at, _ = await c.until(
                lambda e: (
                    e["type"] == "response.function_call_arguments.done" and e["call_id"] == call["call_id"]
                ),
                5,
            )
            trial.call_latency_ms = (at - speech_end) * 1000
            try:
                args = json.loads(call["arguments"])
                jsonschema.validate(args, SCHEMAS[call["name"]])
                trial.args_valid = True
            except (ValueError, jsonschema.ValidationError, KeyError):
                args = {}
            trial.args_exact = (
                trial.args_valid and req.tool == call["name"] and normalized(call["name"], args) == req.value
            )
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "function_call_output",
                        "call_id": call["call_id"],
                        "output": RESULTS.get(call["name"], "{}"),
                    },
                }
            )
            # Under ``required`` every reply must call, the answer too: it is asked for with ``none``.
            own = {"response": {"tool_choice": "none"}} if tool_choice == "required" else {}
            sent = await c.send({"type": "response.create", **own})
            _, _, answer = await c.until(lambda e: e["type"] == "response.done", TRIAL_TIMEOUT_S, i + 1)
            heard = first_audible_after(c.heard, sent)
            trial.answer_after_result_ms = (heard - sent) * 1000 if heard is not None else None
            trial.said = " ".join(
                (p.get("transcript") or "")
                for o in answer["response"].get("output", [])
                for p in o.get("content") or []
            )
        except (TimeoutError, RuntimeError, websockets.ConnectionClosed) as e:
            trial.error = f"{type(e).__name__}: {e}"
        finally:
            trial.events = [e["type"] for _, e in c.events if not e["type"].endswith(".delta")]
            await c.close()
    return trial


def says_result(trial: Trial) -> bool:
    """The answer after the result says one of the result's values (18 or sunny, 7 pm, shipped or Friday) and no
    markup (a call imitated instead of an answer)."""
    if trial.called is None or set(trial.said) & set(MARKUP_CHARS):
        return False
    values = json.loads(RESULTS.get(trial.called, "{}")).values()
    said = trial.said.lower()
    return any(str(v).lower() in said for v in values if not isinstance(v, bool))


def figures(trials: list[Trial]) -> dict[str, Any]:
    calls = [t for t in trials if t.called is not None]
    right = [t for t in calls if t.request.tool == t.called]
    tool_requests = [t for t in trials if t.request.tool is not None]
    return {
        "call_precision": len(right) / len(calls) if calls else float("nan"),
        "call_recall": len(right) / len(tool_requests) if tool_requests else float("nan"),
        "args_valid": sum(t.args_valid for t in calls) / len(calls) if calls else float("nan"),
        "args_exact": sum(t.args_exact for t in right) / len(right) if right else float("nan"),
        "call_latency_ms_p50": pct([t.call_latency_ms for t in calls if t.call_latency_ms is not None], 50),
        "answer_after_result_ms_p50": pct(
            [t.answer_after_result_ms for t in calls if t.answer_after_result_ms is not None], 50
        ),
        "v2v_no_tool_ms_p50": pct(
            [t.v2v_ms for t in trials if t.request.tool is None and t.v2v_ms is not None], 50
        ),
        "answers_with_result": (sum(says_result(t) for t in calls) / len(calls) if calls else float("nan")),
        "calls": len(calls),
        "false_calls": len(calls) - len(right),
        "failed_trials": sum(bool(t.error) for t in trials),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 tool requests and 1 without")
    ap.add_argument("--tool-choice", default="auto", choices=("auto", "required"))
    args = ap.parse_args()
    out = Console(stderr=True)
    requests = (
        [TOOL_REQUESTS[0], TOOL_REQUESTS[13], PLAIN_REQUESTS[0]]
        if args.quick
        else [*TOOL_REQUESTS, *PLAIN_REQUESTS]
    )
    t0 = time.monotonic()
    server = await asyncio.to_thread(start_server, adapter="cascade", ready_timeout=400)
    out.print(
        f"server ready in {time.monotonic() - t0:.1f} s; {len(requests)} spoken requests, tool_choice {args.tool_choice}"
    )
    trials: list[Trial] = []
    try:
        for n, req in enumerate(requests, 1):
            trial = await run_trial(server, req, args.tool_choice)
            trials.append(trial)
            out.print(
                f"[{n}/{len(requests)}] {req.text!r}: "
                + (
                    f"called {trial.called}({trial.arguments})"
                    if trial.called
                    else f"said {trial.said[:60]!r}"
                )
                + (f" ERROR {trial.error}" if trial.error else "")
            )
    finally:
        await asyncio.to_thread(server.stop)
    table = Table(title=f"Spoken tool requests over the Realtime WebSocket (tool_choice {args.tool_choice})")
    for col in (
        "request",
        "needs",
        "called",
        "arguments",
        "valid",
        "exact",
        "call ms",
        "answer ms",
        "v2v ms",
        "said",
    ):
        table.add_column(col)
    for t in trials:
        table.add_row(
            t.request.text,
            t.request.tool or "-",
            t.called or ("ERROR" if t.error else "-"),
            t.arguments,
            "yes" if t.args_valid else ("-" if t.called is None else "NO"),
            "yes" if t.args_exact else ("-" if t.request.tool != t.called else "NO"),
            f"{t.call_latency_ms:.0f}" if t.call_latency_ms is not None else "-",
            f"{t.answer_after_result_ms:.0f}" if t.answer_after_result_ms is not None else "-",
            f"{t.v2v_ms:.0f}" if t.v2v_ms is not None else "-",
            t.said[:60],
        )
    Console().print(table)
    result = figures(trials)
    summary = Table(title="Figures (every trial counted)")
    summary.add_column("figure")
    summary.add_column("value")
    for k, v in result.items():
        summary.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(summary)
    finish(
        {
            **result,
            "tool_choice": args.tool_choice,
            "quick": args.quick,
            "trials": len(trials),
            "rows": [
                {
                    "request": t.request.text,
                    "needs": t.request.tool,
                    "called": t.called,
                    "arguments": t.arguments,
                    "args_valid": t.args_valid,
                    "args_exact": t.args_exact,
                    "call_latency_ms": t.call_latency_ms,
                    "answer_after_result_ms": t.answer_after_result_ms,
                    "v2v_ms": t.v2v_ms,
                    "said": t.said,
                    "error": t.error,
                }
                for t in trials
            ],
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
