"""Seeded fuzzing of every edge where outside bytes enter the server: shared by ``benchmarks/fuzz_edges.py`` (10,000
inputs per edge) and ``tests/test_fuzz_edges.py`` (a few hundred), so the two cannot drift.

Edges, each a generator of :class:`FuzzInput` (mutations of real inputs, reproducible from one seed) and a runner
that sends them to a running ``livekit-omni serve`` (loopback engine: no model time) and judges every outcome:

* ``live_json``: Live WebSocket events (deep nesting, huge numbers, wrong types, unknown types, truncated text,
  non-UTF-8, huge strings), in a started session and, now and then, as the ``session.start`` of a new one;
* ``base64_audio``: ``session.input_audio.append`` (and fixture) audio with bad padding, odd lengths, bad
  alphabets, huge payloads;
* ``sdp``: mutated real offers (aiortc's, Chromium's) posted to ``POST /v1/live/sessions``;
* ``control``: the engine's control channel, straight to its socket: msgpack frames with wrong types, unknown
  tags, deep nesting, truncated frames, bad and huge length prefixes;
* ``rtp_opus``: garbage Opus payloads inside a real WebRTC call (real SRTP from an aiortc caller, then the
  server's jitter buffer, libopus, and the ingress ring), with the caller's echo checked after every batch;
* ``realtime_json``: the same JSON mutations of real Realtime-dialect client events on ``/v1/realtime``;
* ``sip``: mutated SIP requests (INVITE with SDP, OPTIONS, BYE, CANCEL, ACK, UPDATE, REFER, REGISTER, INFO) to the
  SIP endpoint over UDP: each must be answered (not 5xx, save 503) or ignored, an INVITE that gets through is ACKed
  and hung up, and the endpoint must answer an OPTIONS probe after every batch.

What is allowed (:func:`judge_live` and friends): a typed error and the session (or connection) alive wherever the
protocol lets it live; otherwise a clean close with an error first. Anything else is counted against the edge:
``unexpected_close`` (a close without an error first, or where the session should have lived), ``untyped_error``,
``internal_error`` (a 500 or an ``internal`` reply: an exception the code did not expect), ``no_answer`` (no reply
where one is due) and ``audio_lost`` (the call no longer carries audio). The engine must never die and memory must
stay bounded; each report carries engine deaths and the RSS growth of the server and the engine.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import enum
import fractions
import itertools
import json
import random
import re
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import numpy as np
import psutil
from aiortc.mediastreams import MediaStreamTrack
from av import Packet

from livekit_omni.live import wire

#: New edges go at the end: an edge's inputs are seeded by its index (:func:`edge_seed`).
EDGES: Final = ("live_json", "base64_audio", "sdp", "control", "rtp_opus", "realtime_json", "sip")


class Outcome(enum.StrEnum):
    ACCEPTED = "accepted"  # no error; alive (the mutant was still a valid input)
    ERROR_ALIVE = "error_alive"  # a typed error; the session or connection lives on
    CLEAN_CLOSE = "clean_close"  # an error (or the requested session.closed) first, then a documented close
    REFUSED = "refused"  # HTTP: a typed 4xx/503 error body
    UNEXPECTED_CLOSE = "unexpected_close"
    UNTYPED_ERROR = "untyped_error"
    INTERNAL_ERROR = "internal_error"
    NO_ANSWER = "no_answer"
    AUDIO_LOST = "audio_lost"
    IGNORED = "ignored"  # SIP: a request not worth an answer (unparseable, or no Via to answer to)


#: Outcomes that are bugs.
BAD: Final = frozenset(
    {
        Outcome.UNEXPECTED_CLOSE,
        Outcome.UNTYPED_ERROR,
        Outcome.INTERNAL_ERROR,
        Outcome.NO_ANSWER,
        Outcome.AUDIO_LOST,
    }
)
#: Close codes a Live session may end with after an error event (docs/protocol.md, Lifecycle).
DOCUMENTED_CLOSES: Final = frozenset({1008, 1011, 1012, 1013})
ERROR_TYPES: Final = frozenset({wire.INVALID_REQUEST, wire.SERVER_ERROR})


@dataclass(frozen=True, slots=True)
class FuzzInput:
    #: The mutation's name (what the table groups by).
    mutation: str
    #: What is sent: text or bytes (a frame, a body, a payload), or a structured value the runner understands.
    data: Any
    #: The protocol lets this input end the session (a ``session.close``, a refused ``session.start``).
    may_close: bool = False


# --- the judge ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LiveObservation:
    """What one Live input caused: the events after it (until the probe answered), and whether the socket closed."""

    events: list[wire.ServerEvent]
    closed: bool
    close_code: int | None = None
    may_close: bool = False
    #: Error codes the session had already received (a backpressure close follows its earlier warning).
    earlier_errors: frozenset[str] = frozenset()
    answered: bool = True


def _typed(err: wire.Error) -> bool:
    return bool(err.error.code) and err.error.type in ERROR_TYPES and bool(err.error.message)


def judge_live(obs: LiveObservation) -> Outcome:
    """The verdict on one Live input (WebSocket or data channel)."""
    errors = [e for e in obs.events if isinstance(e, wire.Error)]
    if any(not _typed(e) for e in errors):
        return Outcome.UNTYPED_ERROR
    if any(e.error.code == "internal_error" for e in errors):
        return Outcome.INTERNAL_ERROR
    if obs.closed:
        closed = [e for e in obs.events if isinstance(e, wire.SessionClosed)]
        if obs.may_close and closed and closed[-1].reason == "close_requested" and obs.close_code == 1000:
            return Outcome.CLEAN_CLOSE  # the input was a session.close
        codes = {e.error.code for e in errors}
        if not codes and "input_backpressure" in obs.earlier_errors and obs.close_code == 1013:
            return Outcome.CLEAN_CLOSE  # input stayed too fast past the grace it was warned about
        if not errors or obs.close_code not in DOCUMENTED_CLOSES:
            return Outcome.UNEXPECTED_CLOSE
        if not obs.may_close:
            return Outcome.UNEXPECTED_CLOSE  # an error, but this input should have left the session alive
        return Outcome.CLEAN_CLOSE
    if not obs.answered:
        return Outcome.NO_ANSWER
    return Outcome.ERROR_ALIVE if errors else Outcome.ACCEPTED


def judge_http(status: int, body: bytes) -> Outcome:
    """The verdict on one WebRTC offer: a 200 answer, or a typed ``{error: {type, code, message}}``."""
    if status == 200:
        try:
            ok = json.loads(body)["transport"]["sdp"].startswith("v=0")
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        return Outcome.ACCEPTED if ok else Outcome.UNTYPED_ERROR
    try:
        err = json.loads(body)["error"]
        typed = all(isinstance(err[k], str) and err[k] for k in ("type", "code", "message"))
    except (ValueError, KeyError, TypeError):
        typed = False
    if not typed:
        return Outcome.UNTYPED_ERROR
    if status >= 500 and status != 503:
        return Outcome.INTERNAL_ERROR
    return Outcome.REFUSED


# --- reports --------------------------------------------------------------------------------------------------


@dataclass
class EdgeReport:
    edge: str
    inputs: int = 0
    outcomes: dict[str, collections.Counter[str]] = field(default_factory=dict)
    engine_deaths: int = 0
    rss_growth_mb: float = 0.0
    #: Of that, the growth over the second half of the inputs (near 0 when memory is bounded).
    rss_late_growth_mb: float = 0.0
    fd_growth: int = 0
    seconds: float = 0.0
    #: The first few bad outcomes: (mutation, outcome, what was sent, detail), to reproduce them.
    examples: list[tuple[str, str, str, str]] = field(default_factory=list)

    def add(self, inp: FuzzInput, outcome: Outcome, detail: str = "") -> None:
        self.inputs += 1
        self.outcomes.setdefault(inp.mutation, collections.Counter())[outcome] += 1
        if outcome in BAD and len(self.examples) < 10:
            self.examples.append((inp.mutation, str(outcome), _preview(inp.data), detail[:300]))

    def count(self, outcome: Outcome) -> int:
        return sum(c[outcome] for c in self.outcomes.values())

    @property
    def unexpected_closes(self) -> int:
        return self.count(Outcome.UNEXPECTED_CLOSE)

    @property
    def bad(self) -> int:
        return sum(self.count(o) for o in BAD)

    def table(self) -> str:
        cols = [o for o in Outcome if self.count(o)]
        head = f"{'mutation':<24}" + "".join(f"{o!s:>18}" for o in cols)
        lines = [f"== {self.edge}: {self.inputs} inputs in {self.seconds:.1f} s", head]
        for name in sorted(self.outcomes):
            c = self.outcomes[name]
            lines.append(f"{name:<24}" + "".join(f"{c[o]:>18}" for o in cols))
        lines.append(
            f"engine deaths {self.engine_deaths}, unexpected closes {self.unexpected_closes}, "
            f"bad outcomes {self.bad}, RSS growth {self.rss_growth_mb:+.1f} MB ({self.rss_late_growth_mb:+.1f} MB in the second half), open fds {self.fd_growth:+d}"
        )
        for ex in self.examples:
            lines.append(f"  ! {ex[0]} -> {ex[1]}: {ex[3]} | sent {ex[2]}")
        # Mutants quote lone surrogates and control characters: escape them so the table prints anywhere.
        return "\n".join(lines).encode("utf-8", "backslashreplace").decode()

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "engine_deaths": self.engine_deaths,
            "unexpected_closes": self.unexpected_closes,
            "bad_outcomes": self.bad,
            "rss_growth_mb": round(self.rss_growth_mb, 1),
            "rss_late_growth_mb": round(self.rss_late_growth_mb, 1),
            "fd_growth": self.fd_growth,
            "outcomes": {str(o): self.count(o) for o in Outcome if self.count(o)},
        }


def _preview(data: Any, n: int = 120) -> str:
    if isinstance(data, bytes | bytearray):
        return repr(bytes(data[:n])) + (f"...({len(data)} bytes)" if len(data) > n else "")
    text = data if isinstance(data, str) else repr(data)
    return text[:n] + (f"...({len(text)} chars)" if len(text) > n else "")


# --- the target: a running server ----------------------------------------------------------------------------


@dataclass
class FuzzTarget:
    """A running ``livekit-omni serve`` (its URL and process) and its engine's control socket."""

    url: str
    server_pid: int
    engine_address: str
    api_key: str | None = None
    #: The SIP endpoint's UDP port on 127.0.0.1 (the ``sip`` edge).
    sip_port: int | None = None

    def health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            return dict(json.loads(e.read() or b"{}"))

    def engine_pid(self) -> int:
        return int(self.health()["engine"]["pid"])

    def restarts(self) -> int:
        return int(self.health()["engine"]["restarts"])

    def rss_mb(self) -> float:
        total = 0
        for pid in (self.server_pid, self.engine_pid()):
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(pid).memory_info().rss
        return total / 2**20

    def open_fds(self) -> int:
        """File descriptors the server and the engine hold (sockets of peers and sessions that were not freed)."""
        total = 0
        for pid in (self.server_pid, self.engine_pid()):
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(pid).num_fds()
        return total

    async def wait_idle(self, timeout: float = 45.0) -> None:
        """Until the engine has no session open (WebRTC offers that never connect hold one until the connect
        deadline)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = await asyncio.to_thread(self.health)
            if h.get("engine", {}).get("active_sessions") == 0:
                return
            await asyncio.sleep(0.25)


# --- mutation helpers -----------------------------------------------------------------------------------------

_TONE_RATE: Final = 24_000


def tone_pcm(seconds: float, rate: int = _TONE_RATE, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (8000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


TONE_B64: Final = base64.b64encode(tone_pcm(0.1).astype("<i2").tobytes()).decode()
_WORDS: Final = [
    "",
    "a",
    "é",
    "\u0000",
    "\ud800",
    "🙂",
    "type",
    "session",
    "null",
    "\\",
    '"',
    "\n",
    "%s",
    "{",
]


def _rand_scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            -1,
            2**63,
            -(2**63) - 1,
            10**30,
            1.5,
            -0.0,
            1e308,
            "",
            "x" * rng.randint(1, 64),
            rng.choice(_WORDS),
            [],
            {},
            [1, "a", None],
            {"k": "v"},
        ]
    )


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return obj


def _nested(depth: int, kind: str) -> str:
    """JSON text nested ``depth`` deep (built as text: json.dumps itself recurses)."""
    if kind == "array":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def _dumps(obj: Any, rng: random.Random) -> str:
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5)
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate cannot travel in a text frame; as a JSON escape it can
        text = json.dumps(obj)
    return text


# --- live_json ------------------------------------------------------------------------------------------------

START_CONFIG: Final[dict[str, Any]] = {
    "model": "fuzz",
    "instructions": "You are a helpful assistant.",
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
    "audio": {"format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "marin"}},
    "delegation": {"type": "client", "acknowledgement_delay_ms": 500},
}


def live_seed_events() -> list[dict[str, Any]]:
    """Real client events of a started session (what the mutations start from)."""
    return [
        {"type": "session.update", "event_id": "e1", "session": {"delegation": {"type": "client"}}},
        {"type": "session.input_audio.append", "event_id": "e2", "audio": TONE_B64},
        {"type": "session.input_audio.mute", "event_id": "e3"},
        {"type": "session.input_audio.unmute", "event_id": "e4"},
        {
            "type": "session.instructions.append",
            "event_id": "e5",
            "content": "Be brief.",
            "delegation_id": None,
        },
        {"type": "session.thinking.append", "event_id": "e6", "content": "hmm", "delegation_id": None},
        {"type": "session.commentary.append", "event_id": "e7", "content": "ok", "delegation_id": None},
        {"type": "session.output_audio.fixture.play", "event_id": "e8", "audio": TONE_B64},
        {"type": "response.create", "event_id": "e9"},
    ]


def _mutate_json(obj: dict[str, Any], rng: random.Random) -> tuple[str, str | bytes]:
    """One mutation of a client event: (mutation name, the frame to send)."""
    kind = rng.choice(
        [
            "deep_nesting",
            "huge_number",
            "wrong_type",
            "unknown_type",
            "drop_field",
            "extra_field",
            "truncated",
            "non_utf8",
            "huge_string",
            "byte_flip",
            "not_an_object",
            "bad_literal",
            "duplicate_key",
            "unchanged",
        ]
    )
    obj = json.loads(json.dumps(obj))
    paths = _paths(obj)[1:]
    if kind == "deep_nesting":
        depth = rng.choice([64, 200, 1000, 5000, 50_000, 200_000])
        path = rng.choice(paths) if paths else ("session",)
        marker = "__NEST__"
        text = json.dumps(_set(obj, path, marker))
        return kind, text.replace(json.dumps(marker), _nested(depth, rng.choice(["array", "object"])), 1)
    if kind == "huge_number":
        path = rng.choice(paths) if paths else ("event_id",)
        marker = "__NUM__"
        num = rng.choice(
            ["1e400", "-1e400", "1" + "0" * rng.randint(20, 5000), "1e-400", "-0", "1.0e+99999999"]
        )
        return kind, json.dumps(_set(obj, path, marker)).replace(json.dumps(marker), num, 1)
    if kind == "wrong_type":
        for _ in range(rng.randint(1, 3)):
            if paths:
                path = rng.choice(paths)
                obj = _set(obj, path, _rand_scalar(rng))
                paths = _paths(obj)[1:]
        return kind, _dumps(obj, rng)
    if kind == "unknown_type":
        obj["type"] = rng.choice(
            [
                "session.nope",
                "SESSION.START",
                "session.input_audio.append ",
                "",
                "x" * 5000,
                5,
                None,
                ["session.close"],
                {"t": 1},
                "conversation.item.create",
                "input_audio_buffer.append",
                "transport.dtmf.send",
            ]
        )
        return kind, _dumps(obj, rng)
    if kind == "drop_field":
        keys = [k for k in obj if k != "event_id"]
        if keys:
            del obj[rng.choice(keys)]
        return kind, _dumps(obj, rng)
    if kind == "extra_field":
        obj[rng.choice(["extra", "type2", "session", "audio", "__proto__"])] = _rand_scalar(rng)
        return kind, _dumps(obj, rng)
    if kind == "truncated":
        text = _dumps(obj, rng)
        return kind, text[: rng.randint(0, max(0, len(text) - 1))]
    if kind == "non_utf8":
        raw = bytearray(_dumps(obj, rng).encode())
        for _ in range(rng.randint(1, 4)):
            raw.insert(rng.randint(0, len(raw)), rng.choice([0xFF, 0xC0, 0xED, 0x80, 0xFE]))
        return kind, bytes(raw)  # sent as a binary frame (a text frame cannot carry it)
    if kind == "huge_string":
        strings = [p for p in paths if isinstance(_get(obj, p), str)] or [("event_id",)]
        # Up to 9.5 MB of UTF-8: over the 8 MiB message limit (an error), under the transport's hard cap (twice it).
        char = rng.choice("aé\u0000🙂")
        per_char = len(json.dumps(char, ensure_ascii=False).encode()) - 2  # bytes on the wire
        n = rng.choice([10_000, 100_000, 1_000_000, 2_000_000, 9_500_000]) // per_char
        return kind, json.dumps(_set(obj, rng.choice(strings), char * n), ensure_ascii=False)
    if kind == "byte_flip":
        chars = list(_dumps(obj, rng))
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(chars))
            chars[i] = rng.choice('{}[]":,\\0a \t\u0000é')
        return kind, "".join(chars)
    if kind == "not_an_object":
        return kind, rng.choice(
            ["[]", "null", "1", '"session.start"', "", " ", "[" + _dumps(obj, rng) + "]", "true"]
        )
    if kind == "bad_literal":
        return kind, _dumps(obj, rng).replace(":", ": NaN,", 1) if rng.random() < 0.5 else "{'type': 'x'}"
    if kind == "duplicate_key":
        text = _dumps(obj, rng)
        return kind, text[:-1] + ', "type": "session.close"}' if rng.random() < 0.5 else text[
            :-1
        ] + ', "type": 7}'
    return kind, _dumps(obj, rng)


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def live_json_inputs(rng: random.Random, n: int) -> Iterator[FuzzInput]:
    """``n`` Live JSON inputs: mostly mutated events of a started session, some mutated ``session.start``s."""
    seeds = live_seed_events()
    start = {"type": "session.start", "event_id": "start", "session": START_CONFIG}
    for _ in range(n):
        if rng.random() < 0.05:
            name, frame = _mutate_json(start, rng)
            yield FuzzInput("start:" + name, frame, may_close=True)
            continue
        seed = rng.choice(seeds)
        name, frame = _mutate_json(seed, rng)
        # A mutant that still reads as session.close may end the session, as asked.
        yield FuzzInput(name, frame, may_close="session.close" in (frame if isinstance(frame, str) else ""))


# --- base64_audio ---------------------------------------------------------------------------------------------


def _audio_b64(rng: random.Random) -> tuple[str, str]:
    pcm = tone_pcm(rng.choice([0.02, 0.1, 0.2])).astype("<i2").tobytes()
    b64 = base64.b64encode(pcm).decode()
    kind = rng.choice(
        [
            "bad_padding",
            "odd_length",
            "bad_alphabet",
            "whitespace",
            "non_ascii",
            "empty",
            "huge",
            "truncated",
            "data_url",
            "valid",
        ]
    )
    if kind == "bad_padding":
        body = base64.b64encode(pcm[: rng.randrange(1, len(pcm))]).decode().rstrip("=")
        return kind, body + "=" * rng.choice([0, 1, 3, 4, 7])
    if kind == "odd_length":
        return kind, base64.b64encode(pcm[: rng.randrange(1, len(pcm)) | 1]).decode()
    if kind == "bad_alphabet":
        chars = list(b64)
        for _ in range(rng.randint(1, 5)):
            chars[rng.randrange(len(chars))] = rng.choice("-_.*!~%$")
        return kind, "".join(chars)
    if kind == "whitespace":
        i = rng.randrange(len(b64))
        return kind, b64[:i] + rng.choice([" ", "\n", "\r\n", "\t"]) + b64[i:]
    if kind == "non_ascii":
        i = rng.randrange(len(b64))
        return kind, b64[:i] + rng.choice(["é", "\u0000", "🙂", "\ud800", "Ａ"]) + b64[i:]
    if kind == "empty":
        return kind, rng.choice(["", "=", "==", "===="])
    if kind == "huge":
        size = rng.choice([300_000, 2_000_000, 6_000_000, 9_000_000])
        if rng.random() < 0.5:
            return kind, "A" * (size // 4 * 4)  # valid base64 of silence: over budget, or over the size limit
        return kind, "A" * size + "!"
    if kind == "truncated":
        return kind, b64[: rng.randrange(len(b64))]
    if kind == "data_url":
        return kind, "data:audio/pcm;base64," + b64
    return kind, b64


def base64_audio_inputs(rng: random.Random, n: int) -> Iterator[FuzzInput]:
    for _ in range(n):
        name, audio = _audio_b64(rng)
        event = "session.input_audio.append" if rng.random() < 0.9 else "session.output_audio.fixture.play"
        prefix = "" if event.endswith("append") else "fixture:"
        yield FuzzInput(prefix + name, json.dumps({"type": event, "event_id": "a", "audio": audio}))


# --- the Live runner (live_json and base64_audio) -------------------------------------------------------------

PROBE_TIMEOUT_S: Final = 10.0


class _LiveConn:
    """One WebSocket session of the fuzzer, with a probe that marks where one input's answer ends."""

    def __init__(self, target: FuzzTarget) -> None:
        self.target = target
        self.client: Any = None
        self.errors_seen: set[str] = set()
        self.n = 0

    async def open(self, *, start: bool = True) -> None:
        from testkit.live_client import LiveClient

        self.client = await LiveClient.connect(
            self.target.url, api_key=self.target.api_key, keep_audio=False, max_size=None
        )
        self.errors_seen = set()
        if start:
            ev = await self.client.start({**START_CONFIG})
            if not isinstance(ev, wire.SessionStarted):
                raise RuntimeError(f"the fuzzer's own session.start was refused: {ev}")

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def send(self, inp: FuzzInput) -> LiveObservation:
        from websockets.exceptions import ConnectionClosed

        from testkit.live_client import ProtocolViolation

        c = self.client
        assert c is not None
        before = len(c.events)
        self.n += 1
        probe = f"probe-{self.n}"
        answered = violation = False
        try:
            await c.ws.send(inp.data)  # str: a text frame; bytes: a binary frame
            await c.ws.send(json.dumps({"type": "fuzz.probe", "event_id": probe}))
            deadline = time.monotonic() + PROBE_TIMEOUT_S
            while not answered:
                ev = await c.next_event(wire.Error, timeout=max(0.01, deadline - time.monotonic()))
                answered = ev.error.client_event_id == probe
        except (ConnectionClosed, EOFError, TimeoutError):
            pass
        except ProtocolViolation:
            violation = True
        if not answered:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.closed.wait(), 2.0)
        events = [
            e
            for e in c.events[before:]
            if not (isinstance(e, wire.Error) and (e.error.client_event_id or "").startswith("probe-"))
        ]
        if violation or c.violations:
            events.append(wire.error_event("", f"protocol violation: {c.violations[:1]}"))
            c.violations.clear()
        obs = LiveObservation(
            events=events,
            closed=c.closed.is_set(),
            close_code=c.close_code,
            may_close=inp.may_close,
            earlier_errors=frozenset(self.errors_seen),
            answered=answered,
        )
        self.errors_seen |= {e.error.code for e in events if isinstance(e, wire.Error)}
        return obs


async def run_live(target: FuzzTarget, inputs: Iterator[FuzzInput], report: EdgeReport) -> None:
    """Send each input on a started session (``start:`` mutants on a fresh, unstarted socket) and judge it."""
    conn = _LiveConn(target)
    await conn.open()
    try:
        for inp in inputs:
            if inp.mutation.startswith("start:"):
                fresh = _LiveConn(target)
                await fresh.open(start=False)
                try:
                    obs = await fresh.send(inp)
                finally:
                    await fresh.close()
                # A start that was accepted opened a session: it ends when this socket closes.
                report.add(inp, judge_live(obs), _describe(obs))
                continue
            obs = await conn.send(inp)
            outcome = judge_live(obs)
            report.add(inp, outcome, _describe(obs))
            if obs.closed:
                await conn.close()
                await conn.open()
    finally:
        await conn.close()


def _describe(obs: LiveObservation) -> str:
    kinds = [
        wire.event_type(e) + (f"({e.error.code})" if isinstance(e, wire.Error) else "")
        for e in obs.events[:6]
    ]
    return f"events {kinds}, closed={obs.closed} code={obs.close_code} answered={obs.answered}"


# --- realtime_json --------------------------------------------------------------------------------------------


def realtime_seed_events() -> list[dict[str, Any]]:
    """Real Realtime client events (what LiveKit's RealtimeModel and the openai SDK send), mutated from."""
    return [
        {
            "type": "session.update",
            "event_id": "r1",
            "session": {
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 24000},
                        "turn_detection": {"type": "semantic_vad", "eagerness": "auto"},
                        "transcription": {"model": "gpt-4o-mini-transcribe"},
                    },
                    "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin"},
                },
                "tools": [],
                "tool_choice": "auto",
            },
        },
        {"type": "input_audio_buffer.append", "event_id": "r2", "audio": TONE_B64},
        {"type": "input_audio_buffer.clear", "event_id": "r3"},
        {"type": "input_audio_buffer.commit", "event_id": "r4"},
        {
            "type": "conversation.item.create",
            "event_id": "r5",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hello there."}],
            },
        },
        {"type": "response.create", "event_id": "r6", "response": {"instructions": "Be brief."}},
        {"type": "response.cancel", "event_id": "r7"},
        {
            "type": "conversation.item.truncate",
            "event_id": "r8",
            "item_id": "item_x",
            "content_index": 0,
            "audio_end_ms": 500,
        },
        {"type": "conversation.item.delete", "event_id": "r9", "item_id": "item_x"},
        {"type": "conversation.item.retrieve", "event_id": "r10", "item_id": "item_x"},
        {"type": "output_audio_buffer.clear", "event_id": "r11"},
    ]


def realtime_json_inputs(rng: random.Random, n: int) -> Iterator[FuzzInput]:
    """``n`` Realtime JSON inputs: mutated client events of a connected session (none may end it)."""
    seeds = realtime_seed_events()
    for _ in range(n):
        name, frame = _mutate_json(rng.choice(seeds), rng)
        yield FuzzInput(name, frame)


@dataclass(slots=True)
class RealtimeObservation:
    """What one Realtime input caused: the server events after it (JSON objects) and whether the socket closed."""

    events: list[dict[str, Any]]
    closed: bool
    close_code: int | None = None
    answered: bool = True


def judge_realtime(obs: RealtimeObservation) -> Outcome:
    """The verdict on one Realtime input: every error typed, no internal error, the session alive (no client
    event of the dialect ends a session; a close is allowed only after an error, with a documented code)."""
    errors = [e.get("error") or {} for e in obs.events if e.get("type") == "error"]
    if any(not (e.get("code") and e.get("message") and e.get("type") in ERROR_TYPES) for e in errors):
        return Outcome.UNTYPED_ERROR
    if any(e.get("code") == "internal_error" for e in errors):
        return Outcome.INTERNAL_ERROR
    if obs.closed:
        if (
            errors
            and obs.close_code in DOCUMENTED_CLOSES
            and any(e.get("code") == "input_backpressure" for e in errors)
        ):
            return Outcome.CLEAN_CLOSE
        return Outcome.UNEXPECTED_CLOSE
    if not obs.answered:
        return Outcome.NO_ANSWER
    return Outcome.ERROR_ALIVE if errors else Outcome.ACCEPTED


class _RealtimeConn:
    """One Realtime WebSocket of the fuzzer, with the same probe as the Live one: an unknown event type whose
    error (carrying the probe's ``event_id``) marks where one input's answer ends."""

    def __init__(self, target: FuzzTarget) -> None:
        self.target = target
        self.ws: Any = None
        self.n = 0

    async def open(self) -> None:
        import websockets

        url = self.target.url.replace("http://", "ws://", 1) + "/v1/realtime?model=fuzz"
        headers = {"Authorization": f"Bearer {self.target.api_key}"} if self.target.api_key else None
        self.ws = await websockets.connect(url, additional_headers=headers, max_size=None)
        first = json.loads(await asyncio.wait_for(self.ws.recv(), PROBE_TIMEOUT_S))
        if first.get("type") != "session.created":
            raise RuntimeError(f"the fuzzer's Realtime socket was refused: {first}")

    async def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
            self.ws = None

    async def send(self, inp: FuzzInput) -> RealtimeObservation:
        from websockets.exceptions import ConnectionClosed

        ws = self.ws
        assert ws is not None
        self.n += 1
        probe = f"probe-{self.n}"
        events: list[dict[str, Any]] = []
        answered = closed = False
        try:
            await ws.send(inp.data)
            await ws.send(json.dumps({"type": "fuzz.probe", "event_id": probe}))
            deadline = time.monotonic() + PROBE_TIMEOUT_S
            while not answered:
                raw = await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic()))
                ev = json.loads(raw)
                if ev.get("type") == "error" and (ev.get("error") or {}).get("event_id") == probe:
                    answered = True
                elif not isinstance(ev, dict):
                    events.append({"type": "error", "error": {"message": f"not an object: {raw[:80]!r}"}})
                else:
                    events.append(ev)
        except ConnectionClosed:
            closed = True
        except TimeoutError:
            pass
        code = ws.close_code if closed else None
        return RealtimeObservation(events=events, closed=closed, close_code=code, answered=answered)


async def run_realtime(target: FuzzTarget, inputs: Iterator[FuzzInput], report: EdgeReport) -> None:
    """Send each input on one Realtime session (a fresh one after any close) and judge it."""
    conn = _RealtimeConn(target)
    await conn.open()
    try:
        for inp in inputs:
            obs = await conn.send(inp)
            kinds = [
                str(e.get("type"))
                + (f"({(e.get('error') or {}).get('code')})" if e.get("type") == "error" else "")
                for e in obs.events[:6]
            ]
            report.add(
                inp,
                judge_realtime(obs),
                f"events {kinds}, closed={obs.closed} code={obs.close_code} answered={obs.answered}",
            )
            if obs.closed:
                await conn.close()
                await conn.open()
    finally:
        await conn.close()


# --- sdp ------------------------------------------------------------------------------------------------------

#: A real offer of aiortc 1.x (the project's own test caller), candidates moved to loopback.
AIORTC_OFFER: Final = "\r\n".join(
    [
        "v=0",
        "o=- 4005160547 4005160547 IN IP4 0.0.0.0",
        "s=-",
        "t=0 0",
        "a=group:BUNDLE 0 1",
        "a=msid-semantic:WMS *",
        "m=audio 58740 UDP/TLS/RTP/SAVPF 96 9 0 8",
        "c=IN IP4 127.0.0.1",
        "a=sendrecv",
        "a=extmap:1 urn:ietf:params:rtp-hdrext:sdes:mid",
        "a=extmap:2 urn:ietf:params:rtp-hdrext:ssrc-audio-level",
        "a=mid:0",
        "a=msid:744af8e4-b56b-4329-a7b6-8e6e6b7858ee e66ba7a9-0f6d-4a81-b944-12beaa02fcc0",
        "a=rtcp:9 IN IP4 0.0.0.0",
        "a=rtcp-mux",
        "a=ssrc:2142816243 cname:3c46ed9b-569e-4219-9d45-0b57d1e8c2eb",
        "a=rtpmap:96 opus/48000/2",
        "a=rtpmap:9 G722/8000",
        "a=rtpmap:0 PCMU/8000",
        "a=rtpmap:8 PCMA/8000",
        "a=candidate:f957a2332b1715da3b0ef8ba684454eb 1 udp 2130706431 127.0.0.1 58740 typ host",
        "a=end-of-candidates",
        "a=ice-ufrag:Lk3b",
        "a=ice-pwd:vJNmIMZzybrCrd3KoMxjKs",
        "a=fingerprint:sha-256 D1:73:30:E4:1E:F1:B3:09:05:BC:40:34:7B:6E:93:81:18:DC:49:52:8D:21:C0:1E:79:D5:0E:95"
        ":EC:FD:91:A9",
        "a=setup:actpass",
        "m=application 46447 UDP/DTLS/SCTP webrtc-datachannel",
        "c=IN IP4 127.0.0.1",
        "a=mid:1",
        "a=sctp-port:5000",
        "a=max-message-size:262144",
        "a=candidate:f957a2332b1715da3b0ef8ba684454eb 1 udp 2130706431 127.0.0.1 46447 typ host",
        "a=end-of-candidates",
        "a=ice-ufrag:Lk3b",
        "a=ice-pwd:vJNmIMZzybrCrd3KoMxjKs",
        "a=fingerprint:sha-256 D1:73:30:E4:1E:F1:B3:09:05:BC:40:34:7B:6E:93:81:18:DC:49:52:8D:21:C0:1E:79:D5:0E:95"
        ":EC:FD:91:A9",
        "a=setup:actpass",
        "",
    ]
)

#: The shape of a Chromium (Chrome 12x) offer for an audio track and the ``oai-events`` data channel.
CHROMIUM_OFFER: Final = "\r\n".join(
    [
        "v=0",
        "o=- 4611731400430051336 2 IN IP4 127.0.0.1",
        "s=-",
        "t=0 0",
        "a=group:BUNDLE 0 1",
        "a=extmap-allow-mixed",
        "a=msid-semantic: WMS 9f7d0f31-5d2e-4e2f-8d6b-3c4f2b1a0e9d",
        "m=audio 9 UDP/TLS/RTP/SAVPF 111 63 9 0 8 13 110 126",
        "c=IN IP4 0.0.0.0",
        "a=rtcp:9 IN IP4 0.0.0.0",
        "a=candidate:1467250027 1 udp 2122260223 127.0.0.1 46243 typ host generation 0 network-id 1",
        "a=candidate:2812583147 1 udp 2122194687 a1b2c3d4-1111-2222-3333-444455556666.local 51413 typ host "
        "generation 0 network-id 2",
        "a=ice-ufrag:Xq3J",
        "a=ice-pwd:GqN4ySpSp2WmJlFKMJqu9Jx7",
        "a=ice-options:trickle",
        "a=fingerprint:sha-256 5B:3C:93:6F:3B:1D:60:3E:6A:AC:6A:86:1E:2E:3F:17:46:8B:9C:76:7E:27:EA:5A:66:2D:52:A6"
        ":0C:B8:2E:E2",
        "a=setup:actpass",
        "a=mid:0",
        "a=extmap:1 urn:ietf:params:rtp-hdrext:ssrc-audio-level",
        "a=extmap:2 http://www.webrtc.org/experiments/rtp-hdrext/abs-send-time",
        "a=extmap:3 http://www.ietf.org/id/draft-holmer-rmcat-transport-wide-cc-extensions-01",
        "a=extmap:4 urn:ietf:params:rtp-hdrext:sdes:mid",
        "a=sendrecv",
        "a=msid:9f7d0f31-5d2e-4e2f-8d6b-3c4f2b1a0e9d 6a1e9c3b-0d4f-4b8e-9a7c-2f5e8d1c3b6a",
        "a=rtcp-mux",
        "a=rtpmap:111 opus/48000/2",
        "a=rtcp-fb:111 transport-cc",
        "a=fmtp:111 minptime=10;useinbandfec=1",
        "a=rtpmap:63 red/48000/2",
        "a=fmtp:63 111/111",
        "a=rtpmap:9 G722/8000",
        "a=rtpmap:0 PCMU/8000",
        "a=rtpmap:8 PCMA/8000",
        "a=rtpmap:13 CN/8000",
        "a=rtpmap:110 telephone-event/48000",
        "a=rtpmap:126 telephone-event/8000",
        "a=ssrc:3735928559 cname:Ym9ndXNjbmFtZQ==",
        "a=ssrc:3735928559 msid:9f7d0f31-5d2e-4e2f-8d6b-3c4f2b1a0e9d 6a1e9c3b-0d4f-4b8e-9a7c-2f5e8d1c3b6a",
        "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
        "c=IN IP4 0.0.0.0",
        "a=candidate:1467250027 1 udp 2122260223 127.0.0.1 38877 typ host generation 0 network-id 1",
        "a=ice-ufrag:Xq3J",
        "a=ice-pwd:GqN4ySpSp2WmJlFKMJqu9Jx7",
        "a=ice-options:trickle",
        "a=fingerprint:sha-256 5B:3C:93:6F:3B:1D:60:3E:6A:AC:6A:86:1E:2E:3F:17:46:8B:9C:76:7E:27:EA:5A:66:2D:52:A6"
        ":0C:B8:2E:E2",
        "a=setup:actpass",
        "a=mid:1",
        "a=sctp-port:5000",
        "a=max-message-size:262144",
        "",
    ]
)

_SDP_TOKENS: Final = [
    "0",
    "-1",
    "65536",
    "4294967296",
    "99999999999999999999",
    "",
    "x",
    "opus/0/2",
    "opus/48000/0",
    "opus/-48000/2",
    "opus/48000/99999",
    "PCMU/8000/2",
    "UDP/TLS/RTP/SAVP",
    "RTP/AVP",
    "active",
    "passive",
    "holdconn",
    "sha-1",
    "md5 00",
    "IN IP6 ::1",
    "IN IP4 999.1.1.1",
    "typ relay",
    "é",
    "\u0000",
]


def _mutate_sdp(rng: random.Random) -> tuple[str, str]:
    base = rng.choice([AIORTC_OFFER, CHROMIUM_OFFER])
    eol = "\r\n" if rng.random() < 0.8 else "\n"
    lines = base.split("\r\n")[:-1]
    kind = rng.choice(
        [
            "drop_line",
            "dup_line",
            "swap_lines",
            "token",
            "garbage_line",
            "truncated",
            "many_sections",
            "huge_line",
            "no_audio",
            "rtpmap",
            "candidate",
            "attributes",
            "empty",
            "unchanged",
        ]
    )
    if kind == "drop_line":
        for _ in range(rng.randint(1, 4)):
            lines.pop(rng.randrange(len(lines)))
    elif kind == "dup_line":
        i = rng.randrange(len(lines))
        lines[i:i] = [lines[i]] * rng.randint(1, 50)
    elif kind == "swap_lines":
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == "token":
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(lines))
            parts = lines[i].split(" ")
            k = rng.randrange(len(parts))
            head, sep, _ = parts[k].partition(":") if k == 0 and ":" in parts[k] else ("", "", parts[k])
            parts[k] = head + sep + rng.choice(_SDP_TOKENS)
            lines[i] = " ".join(parts)
    elif kind == "garbage_line":
        i = rng.randrange(len(lines))
        garbage = "".join(rng.choice("abc=:/ 0123456789\t\u00e9\u0000") for _ in range(rng.randint(0, 80)))
        lines.insert(i, rng.choice(["a=", "m=", "c=", "", "x="]) + garbage)
    elif kind == "truncated":
        text = eol.join(lines)
        return kind, text[: rng.randrange(len(text))]
    elif kind == "many_sections":
        at = next(i for i, line in enumerate(lines) if line.startswith("m=application"))
        audio = lines[next(i for i, line in enumerate(lines) if line.startswith("m=audio")) : at]
        lines[at:at] = audio * rng.choice([2, 8, 50])
    elif kind == "huge_line":
        lines.insert(
            rng.randrange(len(lines)), "a=x-huge:" + "A" * rng.choice([1000, 30_000, 70_000, 400_000])
        )
    elif kind == "no_audio":
        lines = [line for line in lines if not line.startswith("m=audio")]
    elif kind == "rtpmap":
        i = next(i for i, line in enumerate(lines) if line.startswith("a=rtpmap:"))
        lines[i] = (
            "a=rtpmap:" + rng.choice(["96", "111", "0", "-5", "300", "x"]) + " " + rng.choice(_SDP_TOKENS)
        )
    elif kind == "candidate":
        i = next(i for i, line in enumerate(lines) if line.startswith("a=candidate:"))
        fields = lines[i].split(" ")
        fields[rng.randrange(len(fields))] = rng.choice(_SDP_TOKENS)
        lines[i] = " ".join(fields)
    elif kind == "attributes":
        lines.insert(
            rng.randrange(4, len(lines)),
            rng.choice(
                [
                    "a=setup:",
                    "a=sctp-port:-1",
                    "a=sctp-port:99999999",
                    "a=max-message-size:-5",
                    "a=max-message-size:1e9",
                    "a=ssrc:99999999999 cname:x",
                    "a=ssrc-group:FID 1",
                    "a=fingerprint:sha-256",
                    "a=ice-ufrag:",
                    "a=rtcp:abc",
                    "a=group:BUNDLE 0 0 0",
                    "a=mid:",
                    "a=extmap:999999 urn:x",
                    "a=fmtp:111 " + "k=v;" * 500,
                    "a=rtcp-fb:* nack",
                    "b=AS:-1",
                ]
            ),
        )
    elif kind == "empty":
        return kind, rng.choice(["", "v=0", "\r\n", "m=audio"])
    return kind, eol.join(lines) + eol


def sdp_inputs(rng: random.Random, n: int) -> Iterator[FuzzInput]:
    for _ in range(n):
        name, sdp = _mutate_sdp(rng)
        body: Any = {"session": {"model": "fuzz"}, "transport": {"type": "webrtc", "sdp": sdp}}
        if rng.random() < 0.1:  # the JSON around the offer
            body_name, text = _mutate_json(body, rng)
            yield FuzzInput("body:" + body_name, text if isinstance(text, bytes) else text.encode())
            continue
        yield FuzzInput(name, json.dumps(body).encode())


#: How long one offer waits for a free engine slot (answered offers hold one until the connect deadline,
#: ``limits.webrtc_connect_timeout_s``; the benchmark and the test set it to 2 s).
SDP_SLOT_WAIT_S: Final = 45.0


async def run_sdp(target: FuzzTarget, inputs: Iterator[FuzzInput], report: EdgeReport) -> None:
    import aiohttp

    headers = {"Content-Type": "application/json"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    timeout = aiohttp.ClientTimeout(total=30)
    # A fresh connection per offer, as browsers make them (a pooled one may have hit the server's keep-alive
    # timeout while the engine went idle between phases).
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        for inp in inputs:
            deadline = time.monotonic() + SDP_SLOT_WAIT_S
            while True:
                try:
                    async with http.post(
                        target.url + "/v1/live/sessions", data=inp.data, headers=headers
                    ) as r:
                        body = await r.read()
                        status = r.status
                    outcome = judge_http(status, body)
                    detail = f"HTTP {status}: {body[:200]!r}"
                except (aiohttp.ClientError, TimeoutError) as e:
                    outcome, detail = Outcome.UNEXPECTED_CLOSE, f"{type(e).__name__}: {e}"
                    break
                # Answered offers that never connect hold an engine slot for the 30 s connect deadline, and the
                # engine session opens before the offer is answered: with every slot taken, an offer would never
                # reach aiortc. Wait for a slot and send it again, so each offer is judged on its own merits.
                if status != 503 or b"session_limit_reached" not in body or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            report.add(inp, outcome, detail)


# --- control --------------------------------------------------------------------------------------------------

_LEN: Final = struct.Struct(">I")
MAX_CONTROL_FRAME: Final = 1 << 20


def _control_seeds(rng: random.Random) -> list[dict[str, Any]]:
    sid = f"fuzz_{rng.getrandbits(32):08x}"
    return [
        {"type": "hello", "req_id": 1, "client": "fuzz", "pid": 1, "protocol": 1},
        {"type": "ping", "req_id": 2},
        {"type": "getstats", "req_id": 3, "session_id": ""},
        {"type": "getstats", "req_id": 3, "session_id": sid},
        {
            "type": "opensession",
            "req_id": 4,
            "session_id": sid,
            "ingress": "lko_1_deadbeef_in",
            "egress": "lko_1_deadbeef_out",
            "config": {"instructions": "hi", "history": [{"role": "user", "text": "x"}], "voice": "marin"},
        },
        {"type": "appendtext", "req_id": 5, "session_id": sid, "kind": "instructions", "text": "x"},
        {"type": "setmute", "req_id": 6, "session_id": sid, "muted": True},
        {"type": "interrupt", "req_id": 7, "session_id": sid},
        {"type": "touch", "req_id": 8, "session_id": sid},
        {"type": "closesession", "req_id": 9, "session_id": sid, "reason": "client"},
    ]


@dataclass(frozen=True, slots=True)
class ControlFrame:
    """Bytes to write on the control socket, and whether they frame one whole message."""

    raw: bytes
    #: One length prefix and that many bytes: the engine can answer and stay in sync.
    framed: bool
    #: The engine should hang up after answering (a length prefix over its limit).
    oversized: bool = False
    #: An ``OpenSession`` to send with real rings: the runner creates a ring pair, puts its names in (as
    #: ``rings`` says: in order, swapped, or the same ring twice), packs it, and closes the session afterwards.
    open_session: dict[str, Any] | None = None
    rings: str = "in_order"


def _frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def _session_config_mutant(rng: random.Random) -> dict[str, Any]:
    """A session config with hostile values where the engine reads them (turn taking, TTL, history, adapter)."""
    cfg: dict[str, Any] = {"instructions": "hi", "history": [{"role": "user", "text": "x"}], "voice": "marin"}
    field_name = rng.choice(["turn_taking", "idle_ttl_s", "history", "adapter", "voice", "instructions"])
    weird: Any = rng.choice(
        [-1, 0, 2**63, -(2**63), float("nan"), float("inf"), -1e308, 1e-308, 99, "x", None, [], {}]
    )
    if field_name == "turn_taking":
        key = rng.choice(
            ["vad", "aggressiveness", "threshold", "prefix_padding_ms", "silence_ms", "barge_in_min_ms"]
        )
        cfg["turn_taking"] = {key: rng.choice([weird, "silero", "webrtc", "nope"])}
    elif field_name == "idle_ttl_s":
        cfg["idle_ttl_s"] = weird
    elif field_name == "history":
        turn = {
            "role": rng.choice(["user", "assistant", "developer", "system", ""]),
            "text": "x" * rng.randint(0, 9),
        }
        cfg["history"] = [turn] * rng.choice([0, 1, 1000, 20_000])
    elif field_name == "adapter":
        cfg["adapter"] = rng.choice(["loopback", "cascade", "vllm", "nope", "", "../x", weird])
    elif field_name == "voice":
        cfg["voice"] = rng.choice(["", "nope", "x" * 10_000, "\u0000", weird])
    else:
        cfg["instructions"] = rng.choice(["", "x" * 500_000, weird])
    return cfg


def _mutate_control(rng: random.Random) -> tuple[str, ControlFrame]:
    obj = rng.choice(_control_seeds(rng))
    if rng.random() < 0.12:
        # Past the ring check: real rings, so the mutated config reaches the engine's session and adapter.
        sid = f"fuzz_{rng.getrandbits(40):010x}"
        cmd = {"type": "opensession", "req_id": 40, "session_id": sid, "config": _session_config_mutant(rng)}
        rings = rng.choices(["in_order", "swapped", "same"], weights=[8, 1, 1])[0]
        return "open_session", ControlFrame(b"", True, open_session=cmd, rings=rings)
    kind = rng.choice(
        [
            "wrong_type",
            "unknown_tag",
            "drop_field",
            "deep_nesting",
            "huge_int",
            "huge_string",
            "bin_for_str",
            "random_body",
            "empty_body",
            "truncated_frame",
            "short_length",
            "huge_length",
            "not_a_map",
            "ext_type",
            "valid",
        ]
    )
    if kind == "wrong_type":
        keys = list(obj)
        for _ in range(rng.randint(1, 2)):
            obj[rng.choice(keys)] = _rand_scalar(rng) if rng.random() < 0.8 else -(2**63)
        return kind, ControlFrame(_frame(_pack(obj)), True)
    if kind == "unknown_tag":
        obj["type"] = rng.choice(["nope", "", "Ping", "reply", "errorreply", "sessionclosed", 3, None])
        return kind, ControlFrame(_frame(_pack(obj)), True)
    if kind == "drop_field":
        obj.pop(rng.choice(list(obj)))
        return kind, ControlFrame(_frame(_pack(obj)), True)
    if kind == "deep_nesting":
        depth = rng.choice([100, 2000, 100_000, 300_000])
        # fixarray of one element, ``depth`` deep (msgpack 0x91), then nil
        key = rng.choice([k for k in obj if k != "type"])
        inner = b"\x91" * depth + b"\xc0"
        body = _pack({k: v for k, v in obj.items() if k != key})
        body = _map_with_raw(body, key, inner)
        return kind, ControlFrame(_frame(body), len(body) <= MAX_CONTROL_FRAME, len(body) > MAX_CONTROL_FRAME)
    if kind == "huge_int":
        key = rng.choice(list(obj))
        obj[key] = rng.choice([2**64 - 1, -(2**63), 2**63, float("nan"), float("inf"), -1e308])
        return kind, ControlFrame(_frame(_pack(obj)), True)
    if kind == "huge_string":
        key = rng.choice(list(obj))
        obj[key] = "x" * rng.choice([10_000, 500_000, 1_048_000, 2_000_000])
        body = _pack(obj)
        return kind, ControlFrame(_frame(body), len(body) <= MAX_CONTROL_FRAME, len(body) > MAX_CONTROL_FRAME)
    if kind == "bin_for_str":
        key = rng.choice([k for k, v in obj.items() if isinstance(v, str)])
        obj[key] = obj[key].encode() + b"\xff"
        return kind, ControlFrame(_frame(_pack(obj)), True)
    if kind == "random_body":
        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
        return kind, ControlFrame(_frame(body), True)
    if kind == "empty_body":
        return kind, ControlFrame(_frame(b""), True)
    if kind == "truncated_frame":
        body = _pack(obj)
        cut = rng.randrange(0, len(body))
        return kind, ControlFrame(_LEN.pack(len(body)) + body[:cut], False)
    if kind == "short_length":
        body = _pack(obj)
        return kind, ControlFrame(_LEN.pack(rng.randrange(0, len(body))) + body, False)
    if kind == "huge_length":
        n = rng.choice([MAX_CONTROL_FRAME + 1, 2**31, 2**32 - 1])
        return kind, ControlFrame(_LEN.pack(n) + _pack(obj), False, True)
    if kind == "not_a_map":
        body = msgspec.msgpack.encode(rng.choice([[1, 2], "ping", 7, None, [obj]]))
        return kind, ControlFrame(_frame(body), True)
    if kind == "ext_type":
        key = rng.choice(list(obj))
        obj[key] = msgspec.msgpack.Ext(rng.randint(-128, 127), b"\x00" * rng.randint(0, 20))
        return kind, ControlFrame(_frame(_pack(obj)), True)
    return kind, ControlFrame(_frame(_pack(obj)), True)


def _pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(_msgpackable(obj))


def _msgpackable(obj: Any) -> Any:
    """JSON-side values msgpack cannot carry: integers past 64 bits become its largest integer, strings with lone
    surrogates become their bytes (bin: a wrong type)."""
    if isinstance(obj, str):
        try:
            obj.encode()
        except UnicodeEncodeError:
            return obj.encode("utf-8", "surrogatepass")
        return obj
    if isinstance(obj, bool) or not isinstance(obj, int | dict | list):
        return obj
    if isinstance(obj, int):
        return obj if -(2**63) <= obj <= 2**64 - 1 else 2**64 - 1
    if isinstance(obj, dict):
        return {k: _msgpackable(v) for k, v in obj.items()}
    return [_msgpackable(v) for v in obj]


def _map_with_raw(packed_map: bytes, key: str, raw_value: bytes) -> bytes:
    """``packed_map`` (a msgpack map) with one more entry whose value is the pre-encoded ``raw_value``."""
    head = packed_map[0]
    if 0x80 <= head <= 0x8E:
        return bytes([head + 1]) + packed_map[1:] + msgspec.msgpack.encode(key) + raw_value
    raise ValueError("only small maps")


def control_inputs(rng: random.Random, n: int) -> Iterator[FuzzInput]:
    for _ in range(n):
        name, frame = _mutate_control(rng)
        yield FuzzInput(name, frame, may_close=not frame.framed or frame.oversized)


class _ControlConn:
    """A raw connection to the engine's control socket."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._probe_id = 1_000_000

    async def open(self) -> None:
        if self.address.startswith("unix:"):
            self.reader, self.writer = await asyncio.open_unix_connection(
                self.address[5:], limit=4 * MAX_CONTROL_FRAME
            )
        else:
            host, _, port = self.address.removeprefix("tcp:").rpartition(":")
            self.reader, self.writer = await asyncio.open_connection(host, int(port))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def read_message(self, timeout: float) -> dict[str, Any] | None:
        """The next message, or None once the engine hung up. Raises TimeoutError."""
        assert self.reader is not None
        try:
            head = await asyncio.wait_for(self.reader.readexactly(4), timeout)
            (n,) = _LEN.unpack(head)
            body = await asyncio.wait_for(self.reader.readexactly(n), timeout)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        msg = msgspec.msgpack.decode(body)
        return msg if isinstance(msg, dict) else {"type": "?", "raw": msg}

    async def ping(self, timeout: float = 5.0) -> str:
        """``answered`` (a Ping's reply came), ``closed`` (the engine hung up) or ``silent``; errors before it are
        returned too (see :meth:`exchange`)."""
        return (await self.exchange(b"", timeout))[0]

    async def exchange(self, raw: bytes, timeout: float) -> tuple[str, list[dict[str, Any]]]:
        """Write ``raw`` and then a Ping; collect messages until the Ping's reply. Returns (state, messages)."""
        assert self.writer is not None
        self._probe_id += 1
        probe = self._probe_id
        got: list[dict[str, Any]] = []
        try:
            self.writer.write(raw + _frame(_pack({"type": "ping", "req_id": probe})))
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            return "closed", got
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "silent", got
            try:
                msg = await self.read_message(left)
            except TimeoutError:
                return "silent", got
            if msg is None:
                return "closed", got
            if msg.get("req_id") == probe and msg.get("type") == "reply":
                return "answered", got
            got.append(msg)


def judge_control(inp: FuzzInput, state: str, got: list[dict[str, Any]]) -> Outcome:
    """One control frame: a typed reply and a live connection, or (for a frame the engine cannot resync after)
    an error reply then a hang-up, or silence the client must end (it broke the framing itself)."""
    frame: ControlFrame = inp.data
    errors = [m for m in got if m.get("type") == "errorreply"]
    if any(not (isinstance(m.get("code"), str) and m.get("code")) for m in errors):
        return Outcome.UNTYPED_ERROR
    if any(m.get("code") == "internal" for m in errors):
        return Outcome.INTERNAL_ERROR
    if state == "closed":
        if frame.framed and not frame.oversized:
            return Outcome.UNEXPECTED_CLOSE
        return Outcome.CLEAN_CLOSE if errors or not frame.framed else Outcome.UNEXPECTED_CLOSE
    if state == "silent":
        # The engine waits for the rest of a frame it was promised: only the sender's own broken framing.
        return Outcome.CLEAN_CLOSE if not frame.framed and not frame.oversized else Outcome.NO_ANSWER
    return Outcome.ERROR_ALIVE if errors else Outcome.ACCEPTED


async def _open_with_rings(conn: _ControlConn, frame: ControlFrame) -> tuple[str, list[dict[str, Any]]]:
    """Send ``frame.open_session`` with the names of a fresh ring pair; close the session and the rings after."""
    from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE
    from engine_bridge.ring import RingPair

    assert frame.open_session is not None
    pair = RingPair.create(input_rate=ENGINE_INPUT_RATE, output_rate=ENGINE_OUTPUT_RATE)
    try:
        ing, eg = pair.names
        names = {"in_order": (ing, eg), "swapped": (eg, ing), "same": (ing, ing)}[frame.rings]
        cmd = {**frame.open_session, "ingress": names[0], "egress": names[1]}
        state, got = await conn.exchange(_frame(_pack(cmd)), timeout=10.0)
        if state == "answered":
            close = {
                "type": "closesession",
                "req_id": 41,
                "session_id": cmd["session_id"],
                "reason": "client",
            }
            state, more = await conn.exchange(_frame(_pack(close)), timeout=15.0)
            # An opened session's own events (state changes, closed) come along; keep only replies.
            got += [m for m in more if m.get("type") in ("reply", "errorreply") and m.get("req_id") != 41]
        got = [m for m in got if m.get("type") in ("reply", "errorreply")]
        return state, got
    finally:
        pair.close()


async def run_control(target: FuzzTarget, inputs: Iterator[FuzzInput], report: EdgeReport) -> None:
    conn = _ControlConn(target.engine_address)
    await conn.open()
    try:
        for inp in inputs:
            frame: ControlFrame = inp.data
            if frame.open_session is not None:
                state, got = await _open_with_rings(conn, frame)
            else:
                state, got = await conn.exchange(frame.raw, timeout=5.0 if frame.framed else 0.5)
            outcome = judge_control(inp, state, got)
            report.add(inp, outcome, f"{state}: {[(m.get('type'), m.get('code')) for m in got][:4]}")
            if state != "answered":
                await conn.close()
                # The engine must still answer a new connection at once.
                await conn.open()
                if await conn.ping() != "answered":
                    report.add(
                        FuzzInput(inp.mutation, b""), Outcome.NO_ANSWER, "engine silent after a hang-up"
                    )
    finally:
        await conn.close()


# --- rtp_opus -------------------------------------------------------------------------------------------------

OPUS_FRAME: Final = 960


def _opus_packets(seconds: float, freq: float) -> list[bytes]:
    from media.codecs import OpusEncoder

    return OpusEncoder().encode(tone_pcm(seconds, rate=48_000, freq=freq))


def _mutate_opus(rng: random.Random, real: list[bytes]) -> tuple[str, bytes]:
    pkt = rng.choice(real)
    kind = rng.choice(
        ["random", "empty", "truncated", "bit_flip", "toc", "huge", "zeros", "ones", "repeat_frames", "valid"]
    )
    if kind == "random":
        return kind, bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 400)))
    if kind == "empty":
        return kind, b""
    if kind == "truncated":
        return kind, pkt[: rng.randrange(1, max(2, len(pkt)))]
    if kind == "bit_flip":
        b = bytearray(pkt)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return kind, bytes(b)
    if kind == "toc":
        # TOC byte: config, stereo, frame-count code; code 3 adds a frame-count byte (VBR, padding, up to 48 frames)
        toc = rng.getrandbits(8)
        extra = bytes([rng.getrandbits(8)]) if toc & 3 == 3 else b""
        return kind, bytes([toc]) + extra + pkt[1:]
    if kind == "huge":
        # 1,275 bytes is Opus's largest packet; much more does not fit the caller's SRTP buffer (pylibsrtp).
        return kind, bytes(rng.getrandbits(8) for _ in range(rng.choice([1000, 1200, 1275])))
    if kind == "zeros":
        return kind, bytes(rng.randint(1, 200))
    if kind == "ones":
        return kind, b"\xff" * rng.randint(1, 200)
    if kind == "repeat_frames":
        return kind, bytes([pkt[0] | 3, 0x80 | rng.randint(1, 48)]) + pkt[1:] * rng.randint(1, 6)
    return kind, pkt


def rtp_opus_inputs(rng: random.Random, n: int) -> Iterator[FuzzInput]:
    real = _opus_packets(1.0, 300.0)
    for _ in range(n):
        name, payload = _mutate_opus(rng, real)
        yield FuzzInput(name, payload)


class PayloadTrack(MediaStreamTrack):
    """The caller's audio track: Opus payloads from a queue, handed to aiortc as pre-encoded packets (aiortc sends
    each as one RTP packet over SRTP), faster than real time; when the queue is empty, real packets (a tone while
    ``playing_tone`` counts down, else silence) every 20 ms."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.queue: collections.deque[bytes] = collections.deque()
        #: Set whenever the queue has been sent out.
        self.drained = asyncio.Event()
        self.tone = _opus_packets(2.0, 440.0)
        self.silence = _opus_packets(0.02, 0.0)[0]
        self.playing_tone = 0
        self.sent = 0
        self._time_base = fractions.Fraction(1, 48_000)
        self._next = time.monotonic()

    async def recv(self) -> Packet:
        if self.queue:
            data = self.queue.popleft()
            await asyncio.sleep(0.002)
        else:
            self.drained.set()
            self._next = max(self._next + 0.02, time.monotonic() - 0.02)
            await asyncio.sleep(max(0.0, self._next - time.monotonic()))
            if self.playing_tone:
                data = self.tone[(len(self.tone) - self.playing_tone) % len(self.tone)]
                self.playing_tone -= 1
            else:
                data = self.silence
        pkt = Packet(data)
        pkt.pts = self.sent * OPUS_FRAME
        pkt.time_base = self._time_base
        self.sent += 1
        return pkt


RTP_BATCH: Final = 250


async def run_rtp(target: FuzzTarget, inputs: Iterator[FuzzInput], report: EdgeReport) -> None:
    """One WebRTC call; garbage payloads go out in batches, and after each batch the caller sends 0.6 s of a tone
    and must hear the loopback engine echo it, and the data channel must still answer."""
    caller, track = await _open_call(target)
    try:
        batch: list[FuzzInput] = []
        for inp in inputs:
            batch.append(inp)
            if len(batch) >= RTP_BATCH:
                caller, track = await _rtp_batch(target, caller, track, batch, report)
                batch = []
        if batch:
            caller, track = await _rtp_batch(target, caller, track, batch, report)
    finally:
        await caller.close()


async def _open_call(target: FuzzTarget) -> tuple[Any, Any]:
    import aiohttp

    from media.webrtc import enable_loopback_ice
    from testkit.webrtc_caller import WebRTCCaller

    enable_loopback_ice()  # the server under test gathers loopback candidates only (webrtc.loopback_only)
    caller = WebRTCCaller(codecs=["audio/opus"], record_seconds=10.0)
    track = PayloadTrack()
    caller.transceiver.sender.replaceTrack(track)
    body = {"session": {"model": "fuzz"}, "transport": {"type": "webrtc", "sdp": await caller.offer()}}
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(target.url + "/v1/live/sessions", json=body, headers=headers) as r:
            answer = await r.json()
            if r.status != 200:
                await caller.close()
                raise RuntimeError(f"the fuzzer's own WebRTC call was refused: {answer}")
    await caller.accept(answer["transport"]["sdp"])
    await asyncio.wait_for(caller.opened.wait(), 20)
    return caller, track


async def _call_alive(caller: Any, track: Any) -> tuple[bool, str]:
    """The tone comes back (the echo) and the data channel answers a probe."""
    caller.chunks.clear()
    await asyncio.sleep(0.3)  # let garbage already in flight drain
    caller.chunks.clear()
    track.playing_tone = 30
    heard = False
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        audio = caller.received_audio()
        if audio.size and np.abs(audio).max() > 2000:
            heard = True
            break
    n = len(caller.messages)
    caller.send(json.dumps({"type": "fuzz.probe", "event_id": "rtp-probe"}))
    answered = False
    for _ in range(50):
        await asyncio.sleep(0.05)
        if any("rtp-probe" in (m if isinstance(m, str) else "") for m in list(caller.messages)[n:]):
            answered = True
            break
    closed = caller.pc.connectionState in ("failed", "closed")
    return (
        heard and answered and not closed,
        f"heard={heard} answered={answered} state={caller.pc.connectionState}",
    )


async def _send_payloads(track: PayloadTrack, payloads: list[bytes]) -> None:
    track.drained.clear()
    track.queue.extend(payloads)
    await asyncio.wait_for(track.drained.wait(), 10 + 0.01 * len(payloads))


async def _rtp_batch(
    target: FuzzTarget, caller: Any, track: Any, batch: list[FuzzInput], report: EdgeReport
) -> tuple[Any, Any]:
    await _send_payloads(track, [inp.data for inp in batch])
    alive, detail = await _call_alive(caller, track)
    if alive:
        for inp in batch:
            report.add(inp, Outcome.ACCEPTED)
        return caller, track
    # Find the culprit: the call is replaced, then the batch replayed one payload at a time.
    await caller.close()
    caller, track = await _open_call(target)
    culprits = 0
    for inp in batch:
        await _send_payloads(track, [inp.data])
        if culprits < 3:
            ok, why = await _call_alive(caller, track)
        else:
            ok, why = True, "not checked (enough culprits found in this batch)"
        if ok:
            report.add(inp, Outcome.ACCEPTED)
            continue
        culprits += 1
        report.add(inp, Outcome.AUDIO_LOST, f"after this payload: {why} (batch: {detail})")
        await caller.close()
        caller, track = await _open_call(target)
    return caller, track


# --- sip --------------------------------------------------------------------------------------------------------

_SIP_SDP: Final = (
    "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio 4000 RTP/AVP 0 8 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\na=sendrecv\r\n"
)
#: Placeholders the runner fills in: the sender's port and a per-input token (fresh branch and Call-ID).
SIP_PORT_MARK: Final = b"{PORT}"
SIP_ID_MARK: Final = b"{ID}"
#: SIP inputs sent before their answers are collected, and how long the last one's answer may take.
SIP_BATCH: Final = 40
_SIP_TOKENS: Final = itertools.count(int(time.time() * 1000) % 10**9)
SIP_ANSWER_WAIT_S: Final = 0.6


def sip_seeds() -> list[bytes]:
    """Real requests of every method the endpoint meets (placeholders for the port and a per-input id)."""

    def req(method: str, body: str = "", extra: str = "", to_tag: bool = False) -> bytes:
        head = (
            f"{method} sip:omni@127.0.0.1:5060 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{{PORT}};branch=z9hG4bK{{ID}};rport\r\n"
            f'Max-Forwards: 70\r\nFrom: "F" <sip:f@127.0.0.1>;tag=t{{ID}}\r\n'
            f"To: <sip:omni@127.0.0.1>{';tag=x' if to_tag else ''}\r\nCall-ID: {{ID}}@127.0.0.1\r\n"
            f"CSeq: 1 {method}\r\nContact: <sip:f@127.0.0.1:{{PORT}}>\r\n{extra}"
        )
        if body:
            head += f"Content-Type: application/sdp\r\nContent-Length: {len(body)}\r\n"
        else:
            head += "Content-Length: 0\r\n"
        return (head + "\r\n" + body).encode()

    return [
        req("INVITE", _SIP_SDP),
        req("INVITE", _SIP_SDP, "Supported: timer\r\nSession-Expires: 120;refresher=uac\r\n"),
        req("OPTIONS"),
        req("BYE", to_tag=True),
        req("CANCEL"),
        req("ACK", to_tag=True),
        req("UPDATE", _SIP_SDP, to_tag=True),
        req("REFER", extra="Refer-To: <sip:x@127.0.0.1>\r\n", to_tag=True),
        req("REGISTER"),
        req("INFO", to_tag=True),
    ]


def sip_mutate(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    """One mutation of a SIP request (its name, the bytes)."""
    b = bytearray(raw)
    kind = rng.choice(
        [
            "bytes",
            "truncate",
            "shuffle",
            "drop_line",
            "inject",
            "numbers",
            "dup_line",
            "line_ends",
            "sdp",
            "valid",
        ]
    )
    if kind == "bytes":
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == "truncate":
        b = b[: rng.randrange(len(b))]
    elif kind == "shuffle":
        lines = bytes(b).split(b"\r\n")
        rng.shuffle(lines)
        b = bytearray(b"\r\n".join(lines))
    elif kind == "drop_line":
        lines = bytes(b).split(b"\r\n")
        del lines[rng.randrange(len(lines))]
        b = bytearray(b"\r\n".join(lines))
    elif kind == "inject":
        i = rng.randrange(len(b))
        b[i:i] = rng.choice(
            [
                b"\x00",
                b"\r\n",
                b":",
                b";",
                b"<",
                b">",
                b'"',
                b"%",
                b"=" * 300,
                b"\xff\xfe",
                b" " * 2000,
                b",,,",
            ]
        )
    elif kind == "numbers":
        old = rng.choice(
            [b"CSeq: ", b"Content-Length: ", b"branch=", b"tag=", b"m=audio ", b"SIP/2.0", b"Expires: "]
        )
        new = rng.choice([b"", b"-1 ", b"99999999999 ", b"x", b"\t", b"SIP/3.0", b"0 "])
        b = bytearray(bytes(b).replace(old, old + new, 1))
    elif kind == "dup_line":
        lines = bytes(b).split(b"\r\n")
        i = rng.randrange(1, max(2, len(lines)))
        lines.insert(i, lines[rng.randrange(len(lines))])
        b = bytearray(b"\r\n".join(lines))
    elif kind == "line_ends":
        b = bytearray(bytes(b).replace(b"\r\n", rng.choice([b"\n", b"\r", b"\r\n "]), rng.randint(1, 4)))
    elif kind == "sdp":
        head, sep, body = bytes(b).partition(b"\r\n\r\n")
        if body:
            lines = body.split(b"\r\n")
            j = rng.randrange(len(lines))
            lines[j] = rng.choice(
                [
                    b"",
                    b"m=audio 0 RTP/AVP 0",
                    b"m=audio 4000 RTP/SAVP 0",
                    b"c=IN IP4 0.0.0.0",
                    b"a=sendonly",
                    b"m=audio x RTP/AVP",
                    b"a=rtpmap:0 ",
                    b"m=video 4000 RTP/AVP 96",
                    b"c=IN IP6 ::1",
                    b"\xff" * 40,
                ]
            )
            body = b"\r\n".join(lines)
            head = head.replace(b"Content-Length: ", b"X-Old-Length: ")
            b = bytearray(head + b"\r\nContent-Length: " + str(len(body)).encode() + sep + body)
    return kind, bytes(b)


def sip_inputs(rng: random.Random, n: int) -> Iterator[FuzzInput]:
    seeds = sip_seeds()
    for _ in range(n):
        name, data = sip_mutate(rng, rng.choice(seeds))
        yield FuzzInput(name, data)


class _SipClient(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received.put_nowait(data)


_SIP_STATUS: Final = re.compile(rb"^SIP/2\.0 (\d{3})")
_SIP_CALL_ID: Final = re.compile(rb"(?im)^(?:Call-ID|i)\s*:\s*(\S+)")


async def run_sip(target: FuzzTarget, inputs: Iterator[FuzzInput], report: EdgeReport) -> None:
    """Send the inputs in batches over UDP; judge each by the final answer to its Call-ID (or none); after every
    batch the endpoint must answer an OPTIONS probe."""
    assert target.sip_port is not None, "the sip edge needs a server with its SIP endpoint on"
    server = ("127.0.0.1", target.sip_port)
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(_SipClient, local_addr=("127.0.0.1", 0))
    port = str(transport.get_extra_info("sockname")[1]).encode()
    # Tokens (branches, Call-IDs) never repeat within a process: the endpoint answers a repeated branch as a
    # retransmission of the earlier request, for 32 s.
    counter = _SIP_TOKENS
    try:
        while True:
            batch = list(itertools.islice(inputs, SIP_BATCH))
            if not batch:
                return
            sent: dict[bytes, FuzzInput] = {}
            for inp in batch:
                token = b"fz%d" % next(counter)
                sent[token] = inp
                transport.sendto(inp.data.replace(SIP_PORT_MARK, port).replace(SIP_ID_MARK, token), server)
                await asyncio.sleep(0)
            finals: dict[bytes, int] = {}
            deadline = loop.time() + SIP_ANSWER_WAIT_S
            while loop.time() < deadline:
                try:
                    data = await asyncio.wait_for(proto.received.get(), deadline - loop.time())
                except TimeoutError:
                    break
                m, c = _SIP_STATUS.match(data), _SIP_CALL_ID.search(data)
                if m is None or c is None:
                    continue
                token = c.group(1).split(b"@")[0]
                status = int(m.group(1))
                if status >= 200 and token in sent:
                    finals.setdefault(token, status)
                    if 200 <= status < 300 and b"INVITE" in data.split(b"\r\n\r\n")[0]:
                        _sip_hang_up(transport, server, data, port)
            for token, inp in sent.items():
                final = finals.get(token)
                if final is None:
                    report.add(inp, Outcome.IGNORED)
                elif final >= 500 and final != 503:
                    report.add(inp, Outcome.INTERNAL_ERROR, f"answered {final}")
                elif final >= 300:
                    report.add(inp, Outcome.REFUSED)
                else:
                    report.add(inp, Outcome.ACCEPTED)
            if not await _sip_probe(transport, proto, server, port, next(counter)):
                for inp in batch:
                    report.add(inp, Outcome.NO_ANSWER, "the endpoint did not answer OPTIONS after this batch")
                return
    finally:
        transport.close()


def _sip_hang_up(
    transport: asyncio.DatagramTransport, server: tuple[str, int], ok: bytes, port: bytes
) -> None:
    """ACK and BYE an INVITE the endpoint answered 200 (so the engine session ends now)."""
    head = ok.split(b"\r\n\r\n")[0].split(b"\r\n")
    keep = [h for h in head[1:] if h.split(b":")[0].strip().lower() in (b"from", b"to", b"call-id")]
    for method, cseq in ((b"ACK", b"1"), (b"BYE", b"2")):
        msg = [
            method + b" sip:omni@127.0.0.1 SIP/2.0",
            b"Via: SIP/2.0/UDP 127.0.0.1:"
            + port
            + b";branch=z9hG4bK"
            + method
            + str(random.random()).encode()[2:],
            *keep,
            b"CSeq: " + cseq + b" " + method,
            b"Max-Forwards: 70",
            b"Content-Length: 0",
        ]
        transport.sendto(b"\r\n".join(msg) + b"\r\n\r\n", server)


async def _sip_probe(
    transport: asyncio.DatagramTransport, proto: _SipClient, server: tuple[str, int], port: bytes, n: int
) -> bool:
    probe = sip_seeds()[2].replace(SIP_PORT_MARK, port).replace(SIP_ID_MARK, b"probe%d" % n)
    for _ in range(3):
        transport.sendto(probe, server)
        deadline = asyncio.get_running_loop().time() + 2.0
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                data = await asyncio.wait_for(proto.received.get(), remaining)
            except TimeoutError:
                break
            if data.startswith(b"SIP/2.0 200") and b"probe%d@" % n in data:
                return True
    return False


# --- one edge, measured ---------------------------------------------------------------------------------------

InputsFn = Callable[[random.Random, int], Iterator[FuzzInput]]
RunnerFn = Callable[[FuzzTarget, Iterator[FuzzInput], EdgeReport], Any]

GENERATORS: Final[dict[str, InputsFn]] = {
    "live_json": live_json_inputs,
    "base64_audio": base64_audio_inputs,
    "sdp": sdp_inputs,
    "control": control_inputs,
    "rtp_opus": rtp_opus_inputs,
    "realtime_json": realtime_json_inputs,
    "sip": sip_inputs,
}
RUNNERS: Final[dict[str, RunnerFn]] = {
    "live_json": run_live,
    "base64_audio": run_live,
    "sdp": run_sdp,
    "control": run_control,
    "rtp_opus": run_rtp,
    "realtime_json": run_realtime,
    "sip": run_sip,
}


def edge_seed(seed: int, edge: str) -> int:
    """Each edge's own stream: picking fewer edges (or another order) does not change an edge's inputs."""
    return seed * 1_000_003 + EDGES.index(edge)


async def fuzz_edge(target: FuzzTarget, edge: str, *, seed: int, inputs: int) -> EdgeReport:
    """Run ``inputs`` inputs of ``edge``; the engine's restarts, the RSS growth and the open file descriptors are
    measured around it (after a warm-up of a tenth of the inputs, and again once the engine is idle); the RSS also
    halfway, so a leak (growth in the second half as in the first) tells itself from a high-water mark."""
    report = EdgeReport(edge)
    rng = random.Random(edge_seed(seed, edge))
    gen = GENERATORS[edge](rng, inputs)
    runner = RUNNERS[edge]
    restarts0 = await asyncio.to_thread(target.restarts)
    pid0 = await asyncio.to_thread(target.engine_pid)
    t0 = time.monotonic()
    warm = max(1, inputs // 10)
    warm_inputs = [next(gen) for _ in range(min(warm, inputs))]
    await runner(target, iter(warm_inputs), report)
    await target.wait_idle()
    rss0 = await asyncio.to_thread(target.rss_mb)
    fds0 = await asyncio.to_thread(target.open_fds)
    rest = inputs - len(warm_inputs)
    await runner(target, itertools.islice(gen, rest // 2), report)
    await target.wait_idle()
    rss_mid = await asyncio.to_thread(target.rss_mb)
    await runner(target, gen, report)
    report.seconds = time.monotonic() - t0
    await target.wait_idle()
    health = await asyncio.to_thread(target.health)
    report.engine_deaths = (
        int(health["engine"]["restarts"])
        - restarts0
        + (1 if health["engine"]["pid"] != pid0 and int(health["engine"]["restarts"]) == restarts0 else 0)
    )
    rss_end = await asyncio.to_thread(target.rss_mb)
    report.rss_growth_mb = rss_end - rss0
    report.rss_late_growth_mb = rss_end - rss_mid
    report.fd_growth = await asyncio.to_thread(target.open_fds) - fds0
    return report
