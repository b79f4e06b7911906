"""The engine process and its control channel, with real processes and real shared memory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from engine_bridge.control import EngineRequestError
from engine_bridge.ring import NATIVE, list_our_segments
from tests.conftest import ROOT, EngineProcess, connect_engine, spawn_engine, start_server


def _spawn_engine(**settings: object) -> tuple[subprocess.Popen[bytes], str]:
    eng = spawn_engine(**{"adapter": "loopback", "loopback_delay_ms": 0, **settings})
    return eng.proc, eng.address


async def _connect(sock: str, proc: subprocess.Popen[bytes]) -> EngineClient:
    return await connect_engine(EngineProcess(proc, sock), ready_timeout=30)


async def test_undecodable_control_message_gets_an_error_reply() -> None:
    proc, sock = _spawn_engine()
    try:
        client = await _connect(sock, proc)
        control = client._control
        assert control is not None
        # A frame that is msgpack but not a command (req_id salvageable) and one that is not msgpack at all.
        fut = asyncio.get_running_loop().create_future()
        control._pending[777] = fut
        control.send_raw(msgspec.msgpack.encode({"type": "no_such_command", "req_id": 777}))
        with pytest.raises(EngineRequestError) as e:
            await asyncio.wait_for(fut, 5)
        assert e.value.code == "bad_message"
        fut0 = asyncio.get_running_loop().create_future()
        control._pending[0] = fut0
        control.send_raw(b"\xc1\xff not msgpack")
        with pytest.raises(EngineRequestError):
            await asyncio.wait_for(fut0, 5)
        # Arrays nested 100,000 deep (msgspec raises RecursionError, not DecodeError, on those).
        fut1 = asyncio.get_running_loop().create_future()
        control._pending[0] = fut1
        control.send_raw(b"\x91" * 100_000 + b"\xc0")
        with pytest.raises(EngineRequestError) as e1:
            await asyncio.wait_for(fut1, 5)
        assert e1.value.code == "bad_message"
        # Found by fuzzing (benchmarks/fuzz_edges.py): a string that is not UTF-8 (msgspec raises
        # UnicodeDecodeError) used to drop the connection without a reply, and a 900 kB bad value used to make the
        # error reply, which quotes it, too large for a frame, after which the connection went silent.
        fut2 = asyncio.get_running_loop().create_future()
        control._pending[0] = fut2
        control.send_raw(b"\x82\xa4type\xa2\xea\x80\xa6req_id\x05")
        with pytest.raises(EngineRequestError) as e2:
            await asyncio.wait_for(fut2, 5)
        assert e2.value.code == "bad_message"
        fut3 = asyncio.get_running_loop().create_future()
        control._pending[778] = fut3
        control.send_raw(msgspec.msgpack.encode({"type": "x" * 900_000, "req_id": 778}))
        with pytest.raises(EngineRequestError) as e3:
            await asyncio.wait_for(fut3, 5)
        assert e3.value.code == "bad_message" and len(e3.value.message) < 1000
        # The engine survived all of them and still answers on the same connection.
        info = await client.ping()
        assert info.state is p.EngineState.READY
        await client.close()
    finally:
        proc.terminate()
        proc.wait(10)


async def test_admission_typed_error_and_unknown_session() -> None:
    proc, sock = _spawn_engine(max_sessions=1)
    try:
        client = await _connect(sock, proc)
        # The engine's doorbell (a FIFO next to its socket) is advertised, so writers can wake its audio thread.
        assert client.hello is not None
        bell = Path(client.hello.doorbell)
        assert bell.parent == Path(sock.removeprefix("unix:")).parent and stat.S_ISFIFO(bell.stat().st_mode)
        s1 = await client.open_session()
        with pytest.raises(EngineRequestError) as e:
            await client.open_session()
        assert e.value.code == "session_limit_reached"
        with pytest.raises(EngineRequestError) as e2:
            await client.request(p.AppendText(req_id=0, session_id="sess_nope", kind="thinking", text="x"))
        assert e2.value.code == "unknown_session"
        await s1.close()
        s2 = await client.open_session()  # the slot is free again
        await s2.close()
        await client.close()
    finally:
        proc.terminate()
        proc.wait(10)


async def test_client_vanishing_frees_its_sessions_and_segments() -> None:
    proc, sock = _spawn_engine()
    code = f"""
import asyncio, os, signal
from engine_bridge.client import EngineClient
async def main():
    c = await EngineClient.connect({sock!r})
    s = await c.open_session()
    print(s.rings.names[0], s.rings.names[1], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(main())
"""
    try:
        client = await _connect(sock, proc)
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        names = out.stdout.split()
        assert len(names) == 2, out.stderr
        for _ in range(100):
            info = await client.ping()
            if info.active_sessions == 0 and not set(names) & set(list_our_segments()):
                break
            await asyncio.sleep(0.1)
        assert info.active_sessions == 0
        assert not set(names) & set(list_our_segments()), (
            "the engine must unlink a vanished client's segments"
        )
        await client.close()
    finally:
        proc.terminate()
        proc.wait(10)


async def test_idle_session_is_reaped_after_its_ttl() -> None:
    proc, sock = _spawn_engine()
    try:
        client = await _connect(sock, proc)
        s = await client.open_session(p.SessionConfig(idle_ttl_s=1.0))
        events = []

        async def collect() -> None:
            async for ev in s.iter_events():
                events.append(ev)

        await asyncio.wait_for(collect(), 10)
        assert any(isinstance(e, p.SessionClosed) and e.reason == "idle_timeout" for e in events)
        assert (await client.ping()).active_sessions == 0
        await client.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_engine_kill9_mid_stream_errors_client_restarts_and_leaves_no_segments() -> None:
    """kill -9 of the engine while a session streams: the client gets an error and a close, the supervisor
    starts a new engine, a new session works, and /dev/shm holds none of our segments afterwards."""
    before = set(list_our_segments())
    server = start_server(adapter="loopback")
    engine_pid = server.engine_pid()
    creators = {
        server.proc.pid,
        engine_pid,
    }  # the pids whose segments this test answers for (more added below)
    try:
        code = f"""
import asyncio, json, os, signal, sys, time
import numpy as np
from engine_bridge.client import EngineClient
async def main():
    c = await EngineClient.connect({server.socket_path!r})
    s = await c.open_session()
    out = np.zeros(8000, dtype=np.int16)
    got = 0
    frame = np.full(320, 1000, dtype=np.int16)
    for i in range(400):
        s.rings.ingress.write(frame)
        s.ring_doorbell()
        while (info := s.rings.egress.read_chunk(out)) is not None:
            got += info.nsamples
        if i == 50:
            os.kill(int(sys.argv[1]), signal.SIGKILL)
        await asyncio.sleep(0.02)
        if s.closed:
            break
    evs = []
    while not s.events.empty():
        evs.append(type(s.events.get_nowait()).__name__)
    print(json.dumps({{"got": got, "events": evs, "closed": s.closed, "reason": s.close_reason, "pid": os.getpid()}}))
asyncio.run(main())
"""
        out = subprocess.run(
            [sys.executable, "-c", code, str(engine_pid)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        creators.add(result["pid"])
        assert result["got"] > 0, "audio flowed before the kill"
        assert result["closed"] and result["reason"] == "engine_lost"
        assert "SessionError" in result["events"] and "SessionClosed" in result["events"]
        # The supervisor brings up a new engine; /health goes back to 200 with a new pid.
        body = server.wait_ready(60)
        assert body["engine"]["pid"] != engine_pid and body["engine"]["restarts"] >= 1
        creators.add(body["engine"]["pid"])
        code2 = f"""
import asyncio, os
import numpy as np
from engine_bridge.client import EngineClient
async def main():
    c = await EngineClient.connect({server.socket_path!r})
    s = await c.open_session()
    out = np.zeros(8000, dtype=np.int16)
    got = 0
    for _ in range(50):
        s.rings.ingress.write(np.full(320, 5, dtype=np.int16))
        s.ring_doorbell()
        await asyncio.sleep(0.02)
        while (info := s.rings.egress.read_chunk(out)) is not None:
            got += info.nsamples
    await s.close()
    await c.close()
    print(os.getpid(), got)
asyncio.run(main())
"""
        out2 = subprocess.run(
            [sys.executable, "-c", code2], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        pid2, got2 = out2.stdout.strip().splitlines()[-1].split()
        creators.add(int(pid2))
        assert int(got2) > 0, out2.stderr
    finally:
        server.stop()

    def leaked() -> set[str]:
        # Only the segments this test's processes created: other test workers run sessions of their own meanwhile.
        return {n for n in set(list_our_segments()) - before if int(n.split("_")[1]) in creators}

    deadline = time.monotonic() + 10
    while leaked() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leaked(), f"leaked segments: {leaked()}"


def test_serve_attaches_to_a_separately_started_engine() -> None:
    sock = str(Path(tempfile.mkdtemp(prefix="lko-att-")) / "engine.sock")
    eng = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "livekit_omni.cli",
            "engine",
            "--adapter",
            "loopback",
            "--address",
            "unix:" + sock,
        ],
        cwd=ROOT,
        env={**os.environ, "LIVEKIT_OMNI_LOG_LEVEL": "WARNING"},
    )
    try:
        server = start_server(adapter="loopback", extra_args=["--engine", "unix:" + sock])
        try:
            body = server.health()[1]
            assert body["engine"]["attached"] is True
            assert body["engine"]["engine_pid"] == eng.pid
            assert body["engine"]["ring_native"] is NATIVE  # which ring path the engine runs, for operators
            # The heap trimmer is on by default (engine_bridge/heap.py), reported for operators.
            assert body["engine"]["heap"]["enabled"] is True and body["engine"]["heap"]["interval_s"] == 30.0
        finally:
            server.stop()
        assert eng.poll() is None, "stopping an attached server must not stop the engine"
    finally:
        eng.send_signal(signal.SIGTERM)
        eng.wait(10)
