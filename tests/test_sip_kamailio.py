"""More calls than one node holds, with an existing SIP proxy: Debian's Kamailio, running the dispatcher
configuration of ``deploy/kamailio/kamailio.cfg`` (docs/deployment.md, SIP), in front of two real
``livekit-omni serve`` nodes (loopback echo engine) on loopback.

Calls from SIPp through Kamailio spread over both nodes (round robin); one node is killed (the server and its
engine, SIGKILL: no drain, no goodbye); new calls then all go to the other one: the first INVITE to the dead node
times out and fails over (and marks it down), the dispatcher's OPTIONS probes keep it out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, ServerProcess, start_server
from tests.sip_peers import free_udp_port, require, run_sipp, sip_env

pytestmark = pytest.mark.slow

KAMAILIO_CFG = ROOT / "deploy" / "kamailio" / "kamailio.cfg"


def answered(server: ServerProcess) -> int:
    """Calls this node answered so far (its log's lines)."""
    return server.log_path.read_text(errors="replace").count(": answered, ")


@contextlib.contextmanager
def kamailio(port: int, nodes: list[int], workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    exe = require("kamailio")
    ds = workdir / "dispatcher.list"
    ds.write_text("".join(f"1 sip:127.0.0.1:{p}\n" for p in nodes))
    log = (workdir / "kamailio.log").open("wb")
    proc = subprocess.Popen(
        [
            exe,
            "-DD",
            "-E",
            "-f",
            str(KAMAILIO_CFG),
            "-A",
            f"LISTEN=udp:127.0.0.1:{port}",
            "-A",
            f'DISPATCHER_LIST="{ds}"',
            "-A",
            "PING_INTERVAL=1",
            "-m",
            "64",
            "-M",
            "8",
            "-w",
            str(workdir),
            "-Y",
            str(workdir),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kamailio exited: {(workdir / 'kamailio.log').read_text()[-3000:]}")
            if run_sipp("uac_options", f"127.0.0.1:{port}", timeout=3).ok:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"kamailio not up: {(workdir / 'kamailio.log').read_text()[-3000:]}")
            time.sleep(0.3)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_dispatcher_spreads_calls_and_fails_over() -> None:
    require("sipp")
    ports = [free_udp_port(), free_udp_port()]
    nodes = [start_server(adapter="loopback", env=sip_env(p)) for p in ports]
    workdir = Path(tempfile.mkdtemp(prefix="lko-kamailio-"))
    try:
        proxy = free_udp_port()
        with kamailio(proxy, ports, workdir):
            # 1. Calls spread over both nodes.
            before = [answered(n) for n in nodes]
            r = run_sipp("uac_call", f"127.0.0.1:{proxy}", calls=8, concurrent=2, pause_ms=300, timeout=60)
            assert r.ok, r.out
            spread = [answered(n) - b for n, b in zip(nodes, before, strict=True)]
            assert sum(spread) == 8 and min(spread) >= 2, spread
            # 2. One node dies (the server and its engine, no drain).
            dead = nodes[0]
            engine_pid = dead.engine_pid()
            dead.proc.kill()
            dead.proc.wait()
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_pid, signal.SIGKILL)
            # 3. New calls all go to the other node.
            before_live = answered(nodes[1])
            r = run_sipp("uac_call", f"127.0.0.1:{proxy}", calls=6, concurrent=1, pause_ms=200, timeout=90)
            assert r.ok, r.out + (workdir / "kamailio.log").read_text(errors="replace")[-3000:]
            assert answered(nodes[1]) - before_live == 6
            # Every call ended with its BYE; the engine closes a session just after its call ends, so give it a moment.
            deadline = time.monotonic() + 5
            while (held := nodes[1].health()[1]["engine"]["active_sessions"]) != 0:
                assert time.monotonic() < deadline, (
                    f"the engine still holds {held} sessions after every call ended"
                )
                time.sleep(0.05)
    finally:
        for n in nodes:
            n.stop()
