"""Headless Debian Chromium under selenium, set up as docs/development.md (Loopback WebRTC) describes.

* ``--use-fake-device-for-media-stream`` + ``--use-file-for-fake-audio-capture=<wav>%noloop``: the microphone is a
  WAV file, played once from getUserMedia on (then silence). Give it lead-in silence: it starts before ICE connects.
  Every new capture (another getUserMedia) reads the file again from the start, so a test can rewrite the file and
  have the page re-open the microphone to make the caller say something else at a moment it chooses (checked on
  Chromium 156: a rewritten file's content, level and timing came out of the second capture).
* ``--use-fake-ui-for-media-stream`` grants the microphone without a prompt (``grant_mic=False`` denies it instead,
  for the permission-denied path). Media permission is also what makes Chromium gather raw host candidates.
* ``--allow-loopback-in-peer-connection``: without it Chromium never offers 127.0.0.1, and a loopback-only server
  cannot be reached.
* ``Service(executable_path=/usr/bin/chromedriver)``: selenium then skips Selenium Manager, so nothing is downloaded.

If Chromium or chromedriver is missing and we are root, they are installed with apt-get (the same as ``make
system-deps``). Otherwise :class:`BrowserUnavailable` says what to install: browser tests fail, they never skip.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver

from tests.conftest import require_mark
from tests.speech_fixtures import synthesize_speech, write_wav

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER_PATHS = ("/usr/bin/chromedriver",)
#: Base64 characters pulled through one execute_script call: well under chromedriver's message limits.
CAPTURE_CHUNK_SAMPLES = 480_000

T = TypeVar("T")


class BrowserUnavailable(RuntimeError):
    """Chromium or chromedriver is missing and could not be installed."""


#: Silence before the first words of a fake-mic file. Chromium's fake capture device starts playing the file at
#: getUserMedia, before the call is connected; what plays before the server receives audio is lost. 1.5 s was
#: enough on a quiet machine, but under load the connection took longer: the server heard "But as the capital of
#: France" (startMs 0); in CI, most likely the same loss cost more words, and the answer had no "Paris".
MIC_LEAD_MS = 4000
#: Chromium's fake capture device takes a 48 kHz WAV as it is.
FAKE_MIC_RATE = 48_000


def write_fake_mic(path: Path, text: str, lead_ms: int = MIC_LEAD_MS, tail_ms: int = 10_000) -> None:
    """Write a fake microphone's file: ``text`` spoken by Piper after ``lead_ms`` of silence, then ``tail_ms`` of
    silence (the device plays it once: ``%noloop``, unless launched with ``loop_mic``)."""
    clip = synthesize_speech(text, rate=FAKE_MIC_RATE, lead_silence_ms=lead_ms, tail_silence_ms=tail_ms)
    write_wav(path, clip, FAKE_MIC_RATE)


def _first_existing(paths: tuple[str, ...]) -> str | None:
    return next((p for p in paths if os.access(p, os.X_OK)), None)


def _apt_install() -> None:
    # Parallel test workers may all find the browser missing; one installs, the others wait on the lock.
    lock_path = Path(tempfile.gettempdir()) / "livekit-omni-apt-chromium.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _first_existing(CHROMIUM_PATHS) and _first_existing(CHROMEDRIVER_PATHS):
            return
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"],
        ):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                raise BrowserUnavailable(
                    f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()[-800:]}"
                )


def find_chromium() -> tuple[str, str]:
    """(chromium, chromedriver) paths, installing the Debian packages first when missing and possible."""
    chromium, driver = _first_existing(CHROMIUM_PATHS), _first_existing(CHROMEDRIVER_PATHS)
    if chromium and driver:
        return chromium, driver
    if os.geteuid() == 0 and shutil.which("apt-get"):
        _apt_install()
        chromium, driver = _first_existing(CHROMIUM_PATHS), _first_existing(CHROMEDRIVER_PATHS)
        if chromium and driver:
            return chromium, driver
    missing = [name for name, path in (("chromium", chromium), ("chromium-driver", driver)) if not path]
    raise BrowserUnavailable(
        f"the browser tests need {' and '.join(missing)} ({', '.join(CHROMIUM_PATHS + CHROMEDRIVER_PATHS)}); "
        "run `make system-deps` as root or `apt-get install chromium chromium-driver`"
    )


def chromium_args(
    user_data_dir: str,
    *,
    fake_mic_wav: Path | None,
    grant_mic: bool,
    window: tuple[int, int],
    loop_mic: bool = False,
) -> list[str]:
    args = [
        "--headless=new",
        "--no-sandbox",  # root in a container: the sandbox cannot start
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-extensions",
        # Keep timers and audio running at full rate in a page the headless browser considers hidden.
        "--disable-background-timer-throttling",
        "--disable-renderer-backgrounding",
        "--disable-backgrounding-occluded-windows",
        f"--user-data-dir={user_data_dir}",
        f"--window-size={window[0]},{window[1]}",
        "--allow-loopback-in-peer-connection",
        "--autoplay-policy=no-user-gesture-required",
        "--use-fake-device-for-media-stream",
    ]
    if grant_mic:
        args.append("--use-fake-ui-for-media-stream")
    else:
        args.append("--deny-permission-prompts")
    if fake_mic_wav is not None:
        once = "" if loop_mic else "%noloop"
        args.append(f"--use-file-for-fake-audio-capture={Path(fake_mic_wav).resolve()}{once}")
    return args


@contextlib.contextmanager
def launch_chromium(
    log_dir: Path,
    *,
    fake_mic_wav: Path | None = None,
    grant_mic: bool = True,
    window: tuple[int, int] = (1280, 900),
    loop_mic: bool = False,
) -> Iterator[WebDriver]:
    """A fresh headless Chromium (its own profile) driven by selenium; always quit, its profile removed.
    ``loop_mic``: the fake microphone plays its file over and over instead of once.

    The chromedriver log and the page's console go to ``log_dir`` when it ends."""
    require_mark("browser", "starts Chromium")
    chromium, chromedriver = find_chromium()
    log_dir.mkdir(parents=True, exist_ok=True)
    user_data_dir = tempfile.mkdtemp(prefix="lko-chromium-")
    options = Options()
    options.binary_location = chromium
    for arg in chromium_args(
        user_data_dir, fake_mic_wav=fake_mic_wav, grant_mic=grant_mic, window=window, loop_mic=loop_mic
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=chromedriver, log_output=str(log_dir / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        with contextlib.suppress(Exception):
            console = driver.get_log("browser")
            (log_dir / "browser-console.json").write_text(json.dumps(console, indent=1))
        driver.quit()
        shutil.rmtree(user_data_dir, ignore_errors=True)


def wait_until(
    driver: WebDriver,
    probe: Callable[[WebDriver], T],
    *,
    timeout: float,
    what: str,
    poll: float = 0.1,
) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` saying ``what`` was awaited,
    with the page's state for diagnosis."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe(driver)
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}; {page_diagnosis(driver)}")
        time.sleep(poll)


def page_diagnosis(driver: WebDriver) -> str:
    """The page's status, its transcript and a count of the server events it received, for a failure message
    (CI keeps only the test's output, not its artifacts)."""
    state: Any = None
    with contextlib.suppress(Exception):
        state = driver.execute_script(
            "const t = window.lkoTest; if (!t) return null;"
            " const counts = {}; for (const e of t.events()) counts[e.type] = (counts[e.type] || 0) + 1;"
            " return {status: t.status(), resumes: t.resumes(), transcripts: t.transcripts(), events: counts,"
            " errors: t.errors()};"
        )
    return f"page: {state}"


def page_call(driver: WebDriver, method: str, *args: Any) -> Any:
    """``window.lkoTest[method](...args)`` in the page (the test hooks of ``?test=1``)."""
    return driver.execute_script(f"return window.lkoTest.{method}(...arguments);", *args)


def pull_capture(driver: WebDriver) -> tuple[npt.NDArray[np.int16], int, float]:
    """The audio the page received from the server, as captured in its AudioWorklet: (mono PCM16, rate, start
    time on the page's AudioContext clock in seconds). Pulled in chunks through execute_script."""
    info = page_call(driver, "captureInfo")
    total, rate = int(info["samples"]), int(info["rate"])
    parts: list[bytes] = []
    for offset in range(0, total, CAPTURE_CHUNK_SAMPLES):
        b64 = page_call(driver, "captureChunk", offset, min(CAPTURE_CHUNK_SAMPLES, total - offset))
        parts.append(base64.b64decode(b64))
    pcm = np.frombuffer(b"".join(parts), dtype="<i2").astype(np.int16)
    start = (info["frame0"] or 0) / rate
    return pcm, rate, start
