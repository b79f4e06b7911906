"""Real SIP peers for the SIP tests: baresip (a softphone: it plays a WAV into the call and records what it hears)
and SIPp (scripted SIP scenarios, ``tests/sip/*.xml``), both from Debian's packages (``make system-deps``).

Nothing here imitates a peer: the helpers only write the peers' configuration, start them, and read back what
they wrote (baresip's recordings, SIPp's exit status and message trace).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, free_port
from tests.speech_fixtures import read_wav

SCENARIOS = ROOT / "tests" / "sip"
BARESIP_MODULES = Path("/usr/lib/baresip/modules")


def require(tool: str) -> str:
    """The path of ``tool``; fails the test (it is installed by ``make system-deps``) when it is missing."""
    path = shutil.which(tool)
    if path is None:
        pytest.fail(
            f"{tool} is not installed: run `make system-deps` (as root) or apt-get install it", pytrace=False
        )
    return path


def free_udp_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (SIP listens on both)."""
    for _ in range(50):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def sip_env(port: int, **more: str) -> dict[str, str]:
    """The environment of a server whose SIP endpoint listens on ``port`` (UDP and TCP, loopback)."""
    env = {"LIVEKIT_OMNI_SIP__ENABLED": "true", "LIVEKIT_OMNI_SIP__PORT": str(port)}
    env.update({f"LIVEKIT_OMNI_SIP__{k.upper()}": v for k, v in more.items()})
    return env


# --- SIPp ----------------------------------------------------------------------------------------------------------


@dataclass
class SippResult:
    returncode: int
    out: str
    messages: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_sipp(
    scenario: str,
    target: str,
    *,
    calls: int = 1,
    concurrent: int = 1,
    rate: float | None = None,
    pause_ms: int = 1000,
    keys: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    transport: str = "u1",
    timeout: float = 60.0,
    workdir: Path | None = None,
) -> SippResult:
    """Run ``tests/sip/<scenario>.xml`` against ``target`` (host:port) until ``calls`` calls are done (``pause_ms``:
    how long a scenario's ``<pause/>`` holds the call; ``keys``: its ``[key]`` values)."""
    sipp = require("sipp")
    wd = workdir or Path(tempfile.mkdtemp(prefix="lko-sipp-"))
    wd.mkdir(parents=True, exist_ok=True)
    media_port = free_udp_port()
    cmd = [
        sipp,
        target,
        "-sf",
        str(SCENARIOS / f"{scenario}.xml"),
        "-m",
        str(calls),
        "-l",
        str(concurrent),
        "-i",
        "127.0.0.1",
        "-p",
        str(free_udp_port()),
        "-t",
        transport,
        "-s",
        "omni",
        "-nostdin",
        "-trace_msg",
        "-trace_err",
        "-timeout",
        f"{int(timeout)}s",
        "-timeout_error",
        "-max_recv_loops",
        "100",
        "-mp",
        str(media_port),
        "-d",
        str(pause_ms),
    ]
    if rate is not None:
        cmd += ["-r", str(rate)]
    cmd += extra_args or []
    keys = {"rtpport": str(media_port), **(keys or {})}
    for k, v in keys.items():
        cmd += ["-key", k, v]
    proc = subprocess.run(cmd, cwd=wd, capture_output=True, text=True, timeout=timeout + 30)
    messages = "\n".join(p.read_text(errors="replace") for p in sorted(wd.glob("*_messages.log")))
    errors = "\n".join(p.read_text(errors="replace") for p in sorted(wd.glob("*_errors.log")))
    return SippResult(proc.returncode, proc.stdout[-4000:] + proc.stderr[-2000:] + errors[-4000:], messages)


# --- baresip -------------------------------------------------------------------------------------------------------

BARESIP_CONFIG = """\
poll_method		epoll
sip_listen		127.0.0.1:{sip_port}
call_local_timeout	120
call_max_calls		4
audio_player		alsa,null
audio_source		aufile,{wav}
audio_alert		alsa,null
audio_level		no
ausrc_format		s16
auplay_format		s16
auenc_format		s16
audec_format		s16
rtp_ports		{rtp_lo}-{rtp_hi}
jitter_buffer_delay	1-4
module_path		{modules}
module			g711.so
module			aufile.so
module			alsa.so
module			sndfile.so
snd_path		{rec}
module_tmp		account.so
module_app		menu.so
module_app		ctrl_tcp.so
ctrl_tcp_listen		127.0.0.1:{ctrl_port}
"""


@dataclass
class Baresip:
    """A headless baresip: it dials ``uri``, plays ``wav`` (8 kHz PCM16 mono) into the call and records what it
    hears; when the WAV ends, baresip hangs up (its aufile source reports the end of the file)."""

    wav: Path
    codec: str = "PCMU"
    home: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lko-baresip-")))
    proc: subprocess.Popen[bytes] | None = None
    ctrl_port: int = 0
    started_at: float = 0.0

    def start(self, uri: str) -> None:
        exe = require("baresip")
        self.ctrl_port = free_port()
        rtp_lo = 30000 + (free_port() % 2000) * 2
        (self.home / "rec").mkdir(parents=True, exist_ok=True)
        (self.home / "config").write_text(
            BARESIP_CONFIG.format(
                sip_port=free_udp_port(),
                wav=self.wav,
                rtp_lo=rtp_lo,
                rtp_hi=rtp_lo + 20,
                modules=BARESIP_MODULES,
                rec=self.home / "rec",
                ctrl_port=self.ctrl_port,
            )
        )
        (self.home / "accounts").write_text(f"<sip:caller@127.0.0.1>;regint=0;audio_codecs={self.codec}\n")
        log = (self.home / "baresip.log").open("wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [exe, "-f", str(self.home), "-e", f"/dial {uri}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def command(self, command: str, params: str = "") -> None:
        """A command over ctrl_tcp (a netstring of JSON), e.g. ``hangup``."""
        body = json.dumps({"command": command, "params": params, "token": "t"}).encode()
        with socket.create_connection(("127.0.0.1", self.ctrl_port), timeout=5) as s:
            s.sendall(str(len(body)).encode() + b":" + body + b",")
            with contextlib.suppress(OSError):
                s.settimeout(2)
                s.recv(4096)

    def wait_call_end(self, timeout: float) -> float:
        """Seconds until baresip says the call ended (it stays up afterwards; :meth:`stop` ends it)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log()
            if " terminated (duration" in log or "Call failed" in log or "session closed" in log:
                return time.monotonic() - self.started_at
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"baresip exited ({self.proc.returncode}) during the call:\n{log[-3000:]}"
                )
            time.sleep(0.1)
        raise AssertionError(f"the call did not end within {timeout} s; baresip's log:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.command("quit")
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        path = self.home / "baresip.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def recording(self) -> tuple[np.ndarray, int]:
        """What baresip heard (its sndfile module's decoded audio)."""
        files = sorted((self.home / "rec").glob("*-dec.wav"))
        if not files:
            raise AssertionError(f"baresip recorded nothing; its log:\n{self.log()[-3000:]}")
        return read_wav(files[-1])

    def sent(self) -> tuple[np.ndarray, int]:
        """What baresip sent (its sndfile module's encoder input)."""
        files = sorted((self.home / "rec").glob("*-enc.wav"))
        if not files:
            raise AssertionError(f"baresip recorded nothing; its log:\n{self.log()[-3000:]}")
        return read_wav(files[-1])


def frame_levels(pcm: np.ndarray, rate: int) -> np.ndarray:
    """RMS of each 20 ms frame."""
    n = rate // 50
    frames = pcm[: pcm.shape[0] // n * n].astype(np.float64).reshape(-1, n)
    return np.sqrt((frames**2).mean(axis=1))


def wait_for(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(pred) and pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
