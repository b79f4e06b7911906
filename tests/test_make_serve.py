"""`make serve`, the README's command for running the server, starts it and prints the URL, and the server
answers /health (issue 2). `make test` has already installed everything by the time this runs, so `make serve`
goes straight to running; on a fresh clone the same target installs first (the Makefile's `install` step)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

# `make serve` runs the default adapter: the cascade and its models.
pytestmark = pytest.mark.models


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 while the engine loads is still an answer
        return e.code, json.loads(e.read())


def test_make_serve_prints_the_url_and_answers_health(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "make-serve.log"
    env = {
        **os.environ,
        "LIVEKIT_OMNI_PORT": str(port),
        # A private engine socket, so a server someone runs on this machine is not disturbed.
        "LIVEKIT_OMNI_ENGINE__ADDRESS": "unix:" + str(tmp_path / "engine.sock"),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["make", "--no-print-directory", "serve"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # make, the server and its engine share one process group, stopped below
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        status, body = 0, {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"make serve exited with {proc.returncode}:\n{log.read_text()}"
            try:
                status, body = _get(f"{url}/health")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
                continue
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200, (status, body, log.read_text()[-2000:])
        assert body["engine"]["state"] == "ready"
        # The embedded CPU default, as /health describes it: the torch thinker on SmolLM2, on the CPU.
        thinker = body["engine"]["thinker"]
        assert thinker["backend"] == "torch" and thinker["device"] == "cpu", thinker
        assert thinker["model"] == "smollm2-135m-instruct" and body["engine"]["device"] == "cpu", body
        printed = log.read_text()
        assert "serving at http://" in printed and f":{port}" in printed, printed
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
