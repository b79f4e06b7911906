"""The bridge against vLLM-Omni's own server code: the 0.30.0 wheel's duplex WebSocket handler, run on CPU.

``tests/omni_real_server.py`` runs in its own virtualenv (``make omni-env`` makes ``.venv-omni``: the vllm-omni 0.30.0
wheel and the vLLM 0.30 it pins, docs/omni-models.md "Against vLLM-Omni's own server code"). The handler, the
client-event parsing and validation, the session handle, the per-session engine state with its lease, the real
model plugins' capabilities and session checks, and the event projection onto the wire are the wheel's code; only
the engine below them is scripted (a tone for a voice, an energy gate or the commit for turns). A TCP relay in front
of it cuts the sockets for the resume step.

For every preset of this project (``engine.omni_bridge.presets``) a real engine process runs the bridge adapter
against it, with a media-plane stand-in playing the egress ring at real time (tests/engine_driver.py), through one
session: open, audio appends in the preset's wire format and unit, a reply played and acked, a barge-in (or the
``response.cancel`` of a model without barge-in), heartbeats, a dropped socket resumed with the wheel's resume
token and journal, and close. Anything the wheel's handler refuses comes back as an ``error`` event, which the
bridge reports as a ``SessionError``; the test fails on any.

``make test`` and ``make test-fast`` make ``.venv-omni`` (``make omni-env``) first and run this file with the rest.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engine_bridge import protocol as p
from engine_bridge.config import OmniBridgeSettings
from tests.conftest import ROOT, connect_engine, free_port, spawn_engine, wait_until_healthy
from tests.engine_driver import SessionDriver, dominant_hz, silence, speech, turn_played_ms

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): vLLM-Omni's handler in its own environment, ~8 s a preset.
pytestmark = pytest.mark.slow

OMNI_PYTHON = ROOT / ".venv-omni" / "bin" / "python"
REPLY_MS = 1200
TONE_HZ = 660.0
#: preset -> the model name its sidecar serves (docs/omni-models.md, "The serve command per model family").
MODELS = {
    "minicpmo_4_5": "openbmb/MiniCPM-o-4_5",
    "qwen3_omni": "Qwen/Qwen3-Omni-30B-A3B-Instruct",
    "personaplex": "nvidia/personaplex-7b-v1",
    "nemotron_voicechat": "nvidia/NVIDIA-NemotronLabs-VoiceChat-11B",
}

if not OMNI_PYTHON.exists():
    # Never skipped: `make test` and `make test-fast` make the environment first, and a run without it checks nothing.
    raise RuntimeError(f"{OMNI_PYTHON} is missing: run `make omni-env` (make test and make test-fast do)")


class RealServer:
    """``tests/omni_real_server.py`` under ``.venv-omni``: the wheel's handler behind a relay on ``port``."""

    def __init__(self) -> None:
        self.port = free_port()
        while True:  # the server itself takes port + 1
            try:
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", self.port + 1))
                break
            except OSError:
                self.port = free_port()
        self.log = ROOT / "test-output" / f"omni-real-server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> RealServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        args = [str(OMNI_PYTHON), "-W", "ignore", str(ROOT / "tests" / "omni_real_server.py")]
        args += [
            "--port",
            str(self.port),
            "--reply-ms",
            str(REPLY_MS),
            "--tone-hz",
            str(TONE_HZ),
            "--grace-s",
            "30",
        ]
        env = {**os.environ, "PYTHONPATH": ""}
        with self.log.open("ab") as logf:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env)
        # Importing vLLM + the wheel takes ~30 s on two cores.
        wait_until_healthy(
            f"http://127.0.0.1:{self.port}/health",
            self.proc,
            timeout=180,
            what="vLLM-Omni's server",
            log=self.log,
            poll_s=0.25,
        )
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def state(self) -> dict[str, Any]:
        return json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{self.port + 1}/fake/state", timeout=5).read()
        )

    def post(self, path: str) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port + 1}{path}", method="POST")
        return json.loads(urllib.request.urlopen(req, timeout=5).read())

    def session(self, sid: str) -> dict[str, Any]:
        return next(s for s in self.state()["sessions"] if s["id"] == sid)


@pytest.fixture(scope="module")
def real_server() -> Iterator[RealServer]:
    s = RealServer().start()
    yield s
    s.stop()


def test_every_preset_has_its_model_here() -> None:
    assert set(OmniBridgeSettings().presets) == set(MODELS)


@pytest.mark.parametrize("preset", sorted(MODELS))
async def test_a_bridged_session_against_vllm_omnis_own_handler(real_server: RealServer, preset: str) -> None:
    pr = OmniBridgeSettings().presets[preset]
    model = MODELS[preset]
    settings = {
        "url": real_server.url,
        "model": model,
        "preset": preset,
        "resume_window_s": 5.0,
        "ack_interval_ms": 50,
        "heartbeat_s": 0.3,
    }
    eng = spawn_engine(adapter="omni_bridge", omni_bridge=settings)
    client = None
    try:
        client = await connect_engine(eng, ready_timeout=60)
        s = await client.open_session(p.SessionConfig())
        d = SessionDriver(s)
        # Open: the wheel's session.created announced the session id and the plugin's capabilities.
        sessions = real_server.state()["sessions"]
        mine = [x for x in sessions if x["model"] == model and not x["closed"]]
        assert len(mine) == 1, sessions
        sid = mine[0]["id"]

        # 1. The caller speaks; the model answers (its own turn-taking, or our commit), the reply plays in full.
        ask = np.concatenate([speech(600), silence(1400)])
        await d.run(ask, until=lambda x: x.reply_done(1), seconds=0.3)
        assert abs(turn_played_ms(d, 1) - REPLY_MS) <= 40 * (24_000 / pr.output_rate)
        assert abs(dominant_hz(d.audio_of_turn(1), 24_000) - TONE_HZ) < 5
        done = d.of(p.ReplyDone)[0]
        assert not done.interrupted and done.text.split() == [f"w{i}" for i in range(15)]
        st = real_server.session(sid)
        # The appends as the wheel decoded them (it converts every input format to float32, at the declared rate):
        # the bytes the bridge sent are in the format and rate it declared, one preset unit each, with consistent
        # timing hints.
        assert st["formats"] == ["pcm_f32le"] and st["rates"] == [pr.input_rate]
        assert st["appends"] >= 1 and st["received_ms"] == st["appends"] * pr.input_unit_ms
        assert st["durations"] == [pr.input_unit_ms]
        assert st["last_audio_end_ms"] == st["appends"] * pr.input_unit_ms
        assert st["commits"] == (0 if pr.owns_turn_taking else 1)
        # The playout went back as playback.ack, up to the whole reply (the last ack travels to the server over its
        # own socket while ReplyDone travels to us: wait for it a moment).
        for _ in range(60):  # 3 s
            played = [a["played_ms"] for a in real_server.session(sid)["acks"]]
            if played and abs(played[-1] - REPLY_MS) <= 1:
                break
            await asyncio.sleep(0.05)
        assert played == sorted(played) and abs(played[-1] - REPLY_MS) <= 1

        # 2. Barge-in: our interrupt acks the played position, then barge_in (response.cancel without barge-in).
        await d.run(ask, until=lambda x: turn_played_ms(x, 2) >= 400)
        interrupted = await s.interrupt()
        assert interrupted.epoch == 1
        await d.run(seconds=0.5)
        st = real_server.session(sid)
        (cut,) = st["barge_ins"]
        assert cut["reason"] == ("barge_in" if pr.barge_in else "client_cancelled")
        assert abs(cut["committed_ms"] - turn_played_ms(d, 2)) <= 60
        assert st["epoch"] == 1 and st["cancels"] == (0 if pr.barge_in else 1)
        assert [r.interrupted for r in d.of(p.ReplyDone)] == [False, True]

        # 3. Heartbeats: the wheel's session.heartbeat -> the lease touched, session.heartbeat_ack.
        assert st["heartbeats"] >= 3

        # 4. A dropped socket mid-reply: the bridge resumes with the wheel's token; the journal replays the rest.
        await d.run(ask, until=lambda x: turn_played_ms(x, 3) >= 300)
        assert real_server.post("/fake/drop")["dropped"] >= 1
        await d.run(until=lambda x: x.reply_done(3), seconds=0.5)
        st = real_server.session(sid)
        assert st["resumes"] == 1 and st["detaches"] == 1 and st["lease_generation"] == 1
        third = [r for r in d.of(p.ReplyDone) if r.turn_id == 3]
        assert third and not third[0].interrupted and third[0].total_samples == REPLY_MS * 24
        assert (await client.ping()).flat()["omni"]["resumes"] == 1

        # The wheel refused nothing the bridge sent, and the bridge reported no error.
        assert not d.of(p.SessionError), d.of(p.SessionError)
        assert real_server.state()["errors"] == []

        # 5. Close: session.close ends the wheel's session (session.closed, lease terminal).
        await s.close()
        for _ in range(300):  # 15 s: under a loaded suite the wheel's own process took over 5 s (CI-like run)
            if real_server.session(sid)["closed"]:
                break
            await asyncio.sleep(0.05)
        st = real_server.session(sid)
        assert st["closed"] and st["close_reason"] == "client_close"
    finally:
        if client is not None:
            await client.close()
        eng.stop()


# --- the stand-in refuses what the wheel's handler refuses ------------------------------------------------------

#: Bad client events after a good handshake: the wheel's answer must be the stand-in's.
BAD_EVENTS: list[object] = [
    "not json",
    {"no": "type"},
    ["a", "list"],
    {"type": "nope"},
    {"type": "input_audio_buffer.append"},
    {"type": "input_audio_buffer.append", "audio": "AAAA", "format": "mp9"},
    {
        "type": "input_audio_buffer.append",
        "audio": "!!!notbase64",
        "format": "pcm16",
        "sample_rate_hz": 16000,
    },
    {"type": "session.event_ack"},
    {"type": "session.event_ack", "server_event_seq": -1},
    {"type": "playback.ack"},
    {"type": "playback.ack", "played_ms": "x"},
    {"type": "session.resume", "session_id": "x", "resume_token": "y"},
]
#: Bad first messages (no session yet).
BAD_FIRST: list[object] = [
    "garbage",
    {"type": "session.resume", "session_id": "x"},
    {
        "type": "session.resume",
        "session_id": "nope",
        "resume_token": "t",
        "last_received_server_event_seq": 0,
    },
    {
        "type": "session.resume",
        "session_id": "nope",
        "resume_token": "t",
        "last_received_server_event_seq": -1,
    },
]


async def _answer(url: str, first: object, then: object | None = None) -> dict[str, Any]:
    """Send ``first`` (and ``then``, once the session is open); the first ``error`` event's keys that matter."""
    import aiohttp

    async def send(ws: aiohttp.ClientWebSocketResponse, m: object) -> None:
        await ws.send_str(m if isinstance(m, str) else json.dumps(m))

    query = "?duplex=1&model=openbmb/MiniCPM-o-4_5&autostart=0"
    async with aiohttp.ClientSession() as http, http.ws_connect(url + "/v1/realtime" + query) as ws:
        await send(ws, first)
        async with asyncio.timeout(5):
            async for msg in ws:
                ev = json.loads(msg.data)
                if ev["type"] == "session.updated" and then is not None:
                    await send(ws, then)
                elif ev["type"] == "error":
                    return {"type": ev["type"], **ev["error"], "journaled": "server_event_seq" in ev}
    raise AssertionError(f"no error for {first!r} / {then!r}")


async def test_the_stand_in_refuses_what_vllm_omnis_handler_refuses(real_server: RealServer) -> None:
    from tests.test_omni_bridge import Standin

    standin = Standin().start()
    try:
        opening = {"type": "session.update", "session": {"model": "openbmb/MiniCPM-o-4_5"}}
        for bad in BAD_EVENTS:
            real = await _answer(real_server.url, opening, bad)
            assert await _answer(standin.url, opening, bad) == real, bad
        for bad in BAD_FIRST:
            real = await _answer(real_server.url, bad)
            assert await _answer(standin.url, bad) == real, bad
        assert real_server.state()["errors"] == []  # all refused by the handler, none reached the engine
    finally:
        standin.stop()
