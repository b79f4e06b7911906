"""Shared fixtures: real server and engine processes on free loopback ports, and test output folders."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from livekit_omni.sessions.eventlog import dialect_log_path

if TYPE_CHECKING:
    from engine_bridge.client import EngineClient

ROOT = Path(__file__).resolve().parent.parent
#: Every server event each dialect emits during the test session is appended to that dialect's file beside this
#: path (JSON lines; livekit_omni.sessions.eventlog.dialect_log_path), and the event conformance test validates them
#: all against the openai SDK's models at the end.
EVENT_LOG = Path(os.environ.get("LIVEKIT_OMNI_TEST_EVENT_LOG", ROOT / "test-output" / "server-events.jsonl"))
DIALECTS = ("live", "realtime")
EVENT_LOGS = {d: dialect_log_path(EVENT_LOG, d) for d in DIALECTS}


def pytest_sessionstart(session: pytest.Session) -> None:
    EVENT_LOG.parent.mkdir(parents=True, exist_ok=True)
    # A run starts with empty logs (its xdist workers append to the controller's); `make test` checks them in a
    # second run after the first (LIVEKIT_OMNI_TEST_KEEP_EVENT_LOGS), which must not empty them.
    if not os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("LIVEKIT_OMNI_TEST_KEEP_EVENT_LOGS"):
        for path in EVENT_LOGS.values():
            path.write_text("")


#: The marks of the heavy tests (real models, Chromium, process drills and benchmark runs; docs/development.md).
HEAVY_MARKS = ("models", "browser", "slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with heavy tests first, then the rest; within each, modules with more tests first (pytest-xdist's
    own order, which `make test` turns off with --no-loadscope-reorder so that this one holds). By test count alone a
    one-test benchmark run of four minutes started last and ran on after the other worker had nothing left (about
    eight minutes of the suite's end on one worker); started early, its time overlaps the many quick modules. The
    order within a module is kept."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def heavy(module: list[pytest.Item]) -> bool:
        return any(item.get_closest_marker(m) is not None for item in module for m in HEAVY_MARKS)

    ordered = sorted(modules.values(), key=lambda module: (not heavy(module), -len(module)))
    items[:] = [item for module in ordered for item in module]


#: Adapters whose engine loads the real models (whisper, SmolLM2, Piper). The engine's default is the cascade.
MODEL_ADAPTERS = frozenset({"cascade"})
_running: pytest.Item | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before the item's fixtures are set up, so that require_mark also sees which test a module fixture serves.
    global _running
    _running = item


def require_mark(marker: str, what: str) -> None:
    """Fail the running test if it lacks ``marker``: `make test-fast` deselects the ``models`` and ``browser``
    marks, and an unmarked test that loads models or starts Chromium would quietly slow that tier down (and fail
    where Chromium is not installed). The marks are explicit; this catches a forgotten one (docs/development.md,
    Test tiers)."""
    item = _running
    if item is not None and item.get_closest_marker(marker) is None:
        pytest.fail(
            f"{item.nodeid} {what} but is not marked {marker!r}: add `pytestmark = pytest.mark.{marker}` to its "
            f"module or `@pytest.mark.{marker}` to the test",
            pytrace=False,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    socket_path: str

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://")

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def engine_pid(self) -> int:
        return int(self.health()[1]["engine"]["pid"])

    def wait_ready(self, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                code, body = self.health()
                last = body
                if code == 200:
                    return body
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s: {last}\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_until_healthy(
    url: str, proc: subprocess.Popen[bytes], *, timeout: float, what: str, log: Path, poll_s: float = 0.1
) -> None:
    """Poll ``url`` until it answers; fails when ``proc`` exits or ``timeout`` passes first (``what`` names it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{what} did not start; see {log}") from None
            time.sleep(poll_s)


def start_server(
    *,
    adapter: str = "cascade",
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    ready_timeout: float = 240.0,
) -> ServerProcess:
    """Start a real ``livekit-omni serve`` process on a free port and wait for /health to say ready."""
    if adapter in MODEL_ADAPTERS:
        require_mark("models", f"starts a server on the {adapter!r} adapter")
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="lko-test-"))
    sock = str(tmp / "engine.sock")
    full_env = dict(os.environ)
    full_env.update(
        {
            "LIVEKIT_OMNI_ENGINE__ADDRESS": "unix:" + sock,
            "LIVEKIT_OMNI_EVENT_LOG": str(EVENT_LOG),
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    full_env.update(env or {})
    log_path = ROOT / "test-output" / f"server-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "livekit_omni.cli",
        "serve",
        "--port",
        str(port),
        "--adapter",
        adapter,
        *(extra_args or []),
    ]
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=logf, stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, proc, log_path, sock)
    try:
        server.wait_ready(ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture
def output_dir(request: pytest.FixtureRequest) -> Path:
    """A per-test folder under test-output/ for artifacts (screenshots, audio, logs)."""
    d = ROOT / "test-output" / request.node.name.replace("/", "_").replace("[", "_").replace("]", "")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def loopback_server() -> Iterator[ServerProcess]:
    """A real server whose engine runs the loopback echo *test fixture* (no models): for data-plane tests."""
    server = start_server(adapter="loopback")
    yield server
    server.stop()


@dataclass
class EngineProcess:
    proc: subprocess.Popen[bytes]
    address: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn_engine(**settings: object) -> EngineProcess:
    """A real engine process (``python -m engine_bridge.engine``) on a fresh Unix socket."""
    adapter = str(settings.get("adapter", "cascade"))
    if adapter in MODEL_ADAPTERS:
        require_mark("models", f"starts an engine on the {adapter!r} adapter")
    sock = str(Path(tempfile.mkdtemp(prefix="lko-eng-")) / "engine.sock")
    cfg = {"address": "unix:" + sock, **settings}
    log_path = ROOT / "test-output" / f"engine-{Path(sock).parent.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_bridge.engine", "--settings-json", json.dumps(cfg, default=str)],
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    return EngineProcess(proc, "unix:" + sock)


async def connect_engine(engine: EngineProcess, *, ready_timeout: float = 240.0):
    """Connect an EngineClient once the engine listens, and wait until its models are loaded."""
    import asyncio

    from engine_bridge.client import EngineClient

    deadline = time.monotonic() + ready_timeout
    client = None
    while client is None:
        if engine.proc.poll() is not None:
            raise RuntimeError(f"engine exited with {engine.proc.returncode}")
        try:
            client = await EngineClient.connect(engine.address, timeout=1.0)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    from engine_bridge.control import RequestTimeout
    from engine_bridge.protocol import EngineState

    while True:
        try:
            info = await client.ping()
        except RequestTimeout:
            # While a model loads (vLLM's start-up above all) the engine's loop can answer late on this 2-core VM;
            # a late answer is not a failure until the deadline.
            if time.monotonic() > deadline:
                raise
            continue
        if info.state is EngineState.READY:
            return client
        if info.state is EngineState.FAILED or time.monotonic() > deadline:
            raise RuntimeError(f"engine failed to load: {info}")
        await asyncio.sleep(0.25)


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[EngineProcess]:
    """One real engine process per test module, configured by the module's ``ENGINE_SETTINGS`` dict."""
    settings = getattr(request.module, "ENGINE_SETTINGS", None)
    if settings is None:
        raise pytest.UsageError(f"{request.module.__name__} uses the engine fixture without ENGINE_SETTINGS")
    eng = spawn_engine(**settings)
    yield eng
    eng.stop()


@pytest.fixture
async def client(engine: EngineProcess) -> AsyncIterator[EngineClient]:
    """A control-channel client of the module's engine, connected once its models are loaded."""
    c = await connect_engine(engine)
    yield c
    await c.close()
