"""The browser frontend in a real headless Chromium, against a real ``livekit-omni serve`` with the cascade engine
(VAD → whisper → SmolLM2 → Piper), over WebRTC on 127.0.0.1.

The microphone is a fake capture device playing a Piper WAV (tests/browser.py). The page runs with ``?test=1``
(window.lkoTest: transcripts, page-measured latencies and barge-ins, per-10 ms level timelines of the local mic and
the received audio on the AudioContext clock, and the received audio itself) and ``?aec=0`` (browser audio
processing mangles a fake-file mic, and with a file there is no acoustic echo to cancel).

One server for the module, with an API key (the tests type it into the page, as a person would) and one session
slot (so the full-server message is cheap to provoke; each test ends its call and waits for the slot to free).
Artifacts (screenshots, the received audio, the page's report, browser logs) go to the test's output_dir.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import soxr
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from engine_bridge.speech.asr import WhisperTranscriber
from engine_bridge.speech.text import normalize_text, text_words
from livekit_omni.settings import Settings
from tests.browser import launch_chromium, page_call, pull_capture, wait_until, write_fake_mic
from tests.conftest import ServerProcess, start_server
from tests.speech_fixtures import write_wav

pytestmark = [pytest.mark.models, pytest.mark.browser]

API_KEY = "sk-browser-test"
#: aiortc ends a call whose peer stopped answering consent checks after about this long.
ICE_CONSENT_EXPIRY_S = 30
#: Received audio above this is model speech (the server sends digital silence between replies); as in the page.
REMOTE_SPEECH_DB = -50.0
#: The fake mic is digital silence around Piper speech, so any clear level is speech.
LOCAL_SPEECH_DB = -45.0
#: Silence longer than this in the received audio is the end of an answer: pauses between the clauses of one
#: answer measured 0.4-1.1 s here (sentence breaks and the thinker catching up on 2 busy cores).
ANSWER_GAP_S = 2.0
#: The issue's bound: the first answer's audio must stop this soon after the caller starts talking over it.
BARGE_IN_STOP_MS = 500
#: What the caller says over the answer. It starts with half a second of continuous speech: the server counts
#: speech as a barge-in after 200 ms of it (so a cough does not interrupt), and in Piper's voice the "Wait," of
#: "Wait, stop. …" is 180 ms followed by a 330 ms pause, which made the test time "stop." instead of the onset
#: (the answer then stopped 780-830 ms after "Wait," began, and 270-300 ms after it when the VAD counted it).
INTERRUPTION = "Hold on, what is the capital of Italy?"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server(
        adapter="cascade",
        env={
            "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
            "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
            "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": "1",
        },
    )
    yield s
    s.stop()


@pytest.fixture
def idle_server(server: ServerProcess) -> ServerProcess:
    """The server once its single session slot is free (a previous test's call may still be closing; after a
    failed test that quit the browser without hanging up, the server only notices when ICE consent expires, about
    30 s, and then keeps the detached session for its resume grace)."""
    deadline = time.monotonic() + ICE_CONSENT_EXPIRY_S + Settings.model_fields["resume_grace_s"].default + 30
    while (active := server.health()[1]["engine"].get("active_sessions", 0)) != 0:
        assert time.monotonic() < deadline, f"the previous call still holds {active} session(s)"
        time.sleep(0.2)
    return server


@pytest.fixture(scope="module")
def asr() -> WhisperTranscriber:
    return WhisperTranscriber()


# --- page helpers -----------------------------------------------------------------------------------------------


def load_page(driver: WebDriver, server: ServerProcess, query: str = "test=1&aec=0") -> None:
    driver.get(f"{server.url}/?{query}")
    wait_until(
        driver, lambda d: d.execute_script("return Boolean(window.lkoTest)"), timeout=15, what="the page"
    )


def open_page(driver: WebDriver, server: ServerProcess, *, key: str | None = API_KEY) -> None:
    """Load the page and type ``key`` into its API key field (or empty it)."""
    load_page(driver, server)
    field = driver.find_element(By.ID, "api-key")
    field.clear()
    if key:
        field.send_keys(key)


def click_connect(driver: WebDriver) -> None:
    driver.find_element(By.ID, "connect").click()


def connect(driver: WebDriver) -> dict[str, Any]:
    """Click Connect and wait for ``session.started``; fails with the page's notice if it shows one."""
    click_connect(driver)

    def settled(d: WebDriver) -> dict[str, Any] | None:
        s: dict[str, Any] = page_call(d, "status")
        return s if s["connected"] or s["notice"] else None

    status = wait_until(driver, settled, timeout=30, what="the call to connect")
    assert status["connected"], f"the page could not connect: {status['notice']}"
    mic = status["mic"]
    assert status["aec"] == mic["echoCancellation"] == mic["noiseSuppression"] == mic["autoGainControl"], mic
    return status


def hang_up(driver: WebDriver) -> None:
    """Click Disconnect and wait until the page says the call ended (so the server frees the session slot)."""
    click_connect(driver)
    wait_until(driver, lambda d: not page_call(d, "status")["connected"], timeout=10, what="the call to end")


def notice(driver: WebDriver, timeout: float = 30) -> dict[str, str]:
    return wait_until(driver, lambda d: page_call(d, "status")["notice"], timeout=timeout, what="a notice")


def save_report(driver: WebDriver, out: Path, name: str, **extra: Any) -> dict[str, Any]:
    report = {
        "status": page_call(driver, "status"),
        "transcripts": page_call(driver, "transcripts"),
        "latencies": page_call(driver, "latencies"),
        "barge_ins": page_call(driver, "bargeIns"),
        "overlaps": page_call(driver, "overlaps"),
        "errors": page_call(driver, "errors"),
        "events": page_call(driver, "events"),
        **extra,
    }
    (out / name).write_text(json.dumps(report, indent=1, default=str))
    return report


def model_turns(transcripts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in transcripts if t["kind"] == "turn" and t["role"] == "model"]


def caller_turns(transcripts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in transcripts if t["kind"] == "turn" and t["role"] == "caller"]


# --- the page's level timelines ---------------------------------------------------------------------------------


def _db(rms: list[float]) -> npt.NDArray[np.float64]:
    return 20 * np.log10(np.maximum(np.asarray(rms, dtype=np.float64), 1e-9))


@dataclass
class Timeline:
    """Per-10 ms levels (dBFS) of the local mic and the received audio, on the page's AudioContext clock."""

    t0: float
    dt: float
    local: npt.NDArray[np.float64]
    remote: npt.NDArray[np.float64]

    @classmethod
    def pull(cls, driver: WebDriver) -> Timeline:
        tl = page_call(driver, "timeline")
        return cls(float(tl["t0"]), float(tl["dt"]), _db(tl["local"]), _db(tl["remote"]))

    def segments(self, which: str, threshold: float, max_gap_s: float) -> list[tuple[float, float]]:
        """(start, end) of stretches above ``threshold``, joining ones less than ``max_gap_s`` apart. Blips
        shorter than 30 ms (clicks, codec onsets) are not speech and are left out."""
        levels = self.local if which == "local" else self.remote
        loud = np.flatnonzero(levels > threshold)
        runs: list[list[int]] = []
        for i in loud:
            if runs and i - runs[-1][1] <= 1:
                runs[-1][1] = int(i)
            else:
                runs.append([int(i), int(i)])
        runs = [r for r in runs if r[1] - r[0] + 1 >= 3]
        merged: list[list[int]] = []
        for a, b in runs:
            if merged and (a - merged[-1][1] - 1) * self.dt < max_gap_s:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        return [(self.t0 + a * self.dt, self.t0 + (b + 1) * self.dt) for a, b in merged]

    def loud_end(self, which: str, threshold: float, t_from: float, hangover_s: float) -> float:
        """End of the last loud 10 ms window from ``t_from`` on before ``hangover_s`` of quiet: the page's own
        rule (frontend/activity.js), which, unlike ``segments``, counts a lone loud window too."""
        levels = self.local if which == "local" else self.remote
        end = i = max(0, round((t_from - self.t0) / self.dt))
        gap = round(hangover_s / self.dt)
        while i < len(levels) and i - end < gap:
            if levels[i] > threshold:
                end = i + 1
            i += 1
        return self.t0 + end * self.dt

    def loud_between(self, which: str, threshold: float, t_from: float, t_to: float) -> bool:
        levels = self.local if which == "local" else self.remote
        i0 = max(0, round((t_from - self.t0) / self.dt))
        i1 = max(i0, round((t_to - self.t0) / self.dt))
        return bool(np.any(levels[i0:i1] > threshold))


# --- tests ------------------------------------------------------------------------------------------------------


#: The question the page's fake microphone asks, and the word its answer must hold.
BROWSER_QUESTION = "What is the capital of France?"
BROWSER_ANSWER = "paris"


def words_missed(said: list[str], heard: list[str]) -> list[str]:
    """The words of ``said`` that whisper did not hear in ``heard``. A word counts as heard when it is one of the
    heard words, part of the heard words run together (a split or merge: "is Berlin" heard as "israel and" still
    has "is"), or close in spelling to one of them (a proper noun misspelled: "bralen" for "Berlin")."""
    joined = "".join(heard)
    return [
        w
        for w in said
        if w not in heard
        and w not in joined
        and not any(SequenceMatcher(None, w, h).ratio() >= 0.5 for h in heard)
    ]


def test_words_missed_tolerates_spelling_but_not_other_words() -> None:
    answer = "the capital of germany is berlin".split()
    assert words_missed(answer, answer) == []
    assert words_missed(answer, "the capital of germany is bralen".split()) == []
    assert words_missed(answer, "the capital of germany israel and".split()) == ["berlin"]
    assert words_missed(answer, "the opposite of hot is cold".split()) == ["capital", "germany", "berlin"]
    assert words_missed(answer, []) == answer


def test_spoken_question_is_answered_in_the_browser(
    idle_server: ServerProcess, output_dir: Path, asr: WhisperTranscriber
) -> None:
    wav = output_dir / "fake-mic.wav"
    write_fake_mic(wav, BROWSER_QUESTION)
    with launch_chromium(output_dir, fake_mic_wav=wav) as driver:
        open_page(driver, idle_server)
        assert connect(driver)["mic"]["echoCancellation"] is False, "?aec=0 turns audio processing off"
        # The model's speaking indicator and level meter light up while the answer plays.
        wait_until(
            driver,
            lambda d: d.execute_script(
                "return document.getElementById('speaker-model').dataset.speaking === 'true'"
                " && Number(document.getElementById('meter-model').getAttribute('aria-valuenow')) > -50"
            ),
            timeout=45,
            what="the model to speak (indicator and meter)",
        )
        wait_until(
            driver,
            lambda d: (
                (t := page_call(d, "transcripts"))
                and any(BROWSER_ANSWER in normalize_text(m["text"]) for m in model_turns(t))
                and t
            ),
            timeout=45,
            what="the answer's transcript",
        )
        driver.save_screenshot(str(output_dir / "browser-conversation.png"))
        # Let the answer finish playing before hanging up.
        wait_until(
            driver,
            lambda d: (
                not d.execute_script(
                    "return document.getElementById('speaker-model').dataset.speaking === 'true'"
                )
            ),
            timeout=30,
            what="the answer to end",
        )
        timeline = Timeline.pull(driver)
        pcm, rate, _ = pull_capture(driver)
        hang_up(driver)
        report = save_report(driver, output_dir, "page-report.json")

    write_wav(output_dir / "received.wav", pcm, rate)
    callers = caller_turns(report["transcripts"])
    assert len(callers) == 1, report["transcripts"]
    heard_by_server = normalize_text(callers[0]["text"])
    assert "capital" in heard_by_server and "france" in heard_by_server, callers
    assert report["events"][0]["type"] == "session.started"
    assert report["errors"] == []
    assert any(m["type"] == "end" for m in report["transcripts"] if m["kind"] == "marker")

    # The browser received real speech: loud enough, long enough, and whisper hears the answer in it.
    win = rate // 100
    frames = pcm[: len(pcm) // win * win].astype(np.float64).reshape(-1, win)
    frame_db = 20 * np.log10(np.maximum(np.sqrt(np.mean(frames**2, axis=1)) / 32767, 1e-9))
    assert frame_db.max() > -30, f"the received audio peaks at {frame_db.max():.1f} dBFS"
    assert np.count_nonzero(frame_db > REMOTE_SPEECH_DB) * 0.01 > 0.8, "under 0.8 s of received speech"
    # Whether whisper spells the answer's city right is not the point (it heard "Berlin" as "bralen" in 1 of 3
    # calls, and "is Berlin" as "israel and" once): the audio must be the answer the page shows, most of its
    # words heard in it (see words_missed for what counts as heard).
    answer_words = text_words(model_turns(report["transcripts"])[0]["text"])
    heard = text_words(asr.transcribe(soxr.resample(pcm, rate, 16_000).astype(np.int16)).text)
    assert BROWSER_ANSWER in answer_words, answer_words
    missing = words_missed(answer_words, heard)
    assert len(missing) <= max(1, len(answer_words) // 5), (
        f"whisper heard {heard} in the audio the browser received; the answer was {answer_words}"
    )

    # The page's response time: one per answer, shown on the answer, and the same as what the level timelines
    # say (end of the caller's speech → first sound of the answer).
    assert len(report["latencies"]) == 1, report["latencies"]
    page_latency = report["latencies"][0]
    speech = timeline.segments("local", LOCAL_SPEECH_DB, 0.5)
    answer = timeline.segments("remote", REMOTE_SPEECH_DB, ANSWER_GAP_S)
    assert len(speech) == 1 and len(answer) == 1, (speech, answer)
    latency_s = answer[0][0] - speech[0][1]
    assert abs(page_latency["ms"] - latency_s * 1000) <= 30, (page_latency, speech, answer)
    assert 0 < latency_s < 15
    assert model_turns(report["transcripts"])[0]["latencyMs"] == page_latency["ms"]
    (output_dir / "latency.json").write_text(json.dumps({"voice_to_voice_ms": round(latency_s * 1000)}))


def _talk_over_the_answer(driver: WebDriver, wav: Path, *, timeout: float) -> float:
    """Wait until the model is mid-sentence in its answer, then make the fake mic speak the interruption: rewrite
    its WAV and have the page re-open the microphone (Chromium's fake capture device reads the file again, from
    the start, for every new capture). Returns the page clock at the switch.

    "Mid-sentence": 0.3 s into a stretch of speech that is either not the answer's first (the engine voices a
    short first clause early, ~1 s, and the next one often comes after a pause) or has run 1.5 s already."""
    remote: list[float] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tl = page_call(driver, "timeline", len(remote))
        remote += tl["remote"]
        dt = tl["dt"]
        loud = np.flatnonzero(_db(remote) > REMOTE_SPEECH_DB)
        if len(loud) and (len(remote) - 1 - loud[-1]) * dt < 0.05:
            # Stretches: loud windows with gaps under 150 ms (between syllables) joined.
            breaks = np.flatnonzero(np.diff(loud) * dt >= 0.15)
            run_s = (loud[-1] - loud[breaks[-1] + 1 if len(breaks) else 0] + 1) * dt
            if run_s >= 0.3 and (len(breaks) > 0 or run_s >= 1.5):
                # The lead-in covers getUserMedia → replaceTrack: no word is cut before the new track is sent.
                write_fake_mic(wav, INTERRUPTION, 300)
                return float(page_call(driver, "reopenMicrophone"))
        time.sleep(0.05)
    raise TimeoutError(f"the model did not get into its answer within {timeout} s")


def _barge_in_attempt(
    server: ServerProcess, out: Path, attempt: int
) -> tuple[dict[str, Any], Timeline, float]:
    """One call: the caller asks for a story, then talks over the answer. Returns the page's report, its level
    timelines and the page clock when the interruption was started."""
    wav = out / "fake-mic.wav"
    write_fake_mic(wav, "Tell me a long story about a dragon.")
    with launch_chromium(out / f"attempt-{attempt}", fake_mic_wav=wav) as driver:
        open_page(driver, server)
        connect(driver)
        switched_at = _talk_over_the_answer(driver, wav, timeout=45)
        wait_until(
            driver,
            lambda d: len(page_call(d, "latencies")) >= 2,
            timeout=45,
            what="the answer after the interruption",
        )
        if page_call(driver, "bargeIns"):
            driver.save_screenshot(str(out / "browser-barge-in.png"))
        # The second answer plays on a little, so the transcript shows it.
        time.sleep(3)
        timeline = Timeline.pull(driver)
        pcm, rate, _ = pull_capture(driver)
        hang_up(driver)
        report = save_report(
            driver,
            out,
            f"page-report-{attempt}.json",
            switched_at=switched_at,
            timeline_db={
                "t0": timeline.t0,
                "dt": timeline.dt,
                "local": timeline.local.round(1).tolist(),
                "remote": timeline.remote.round(1).tolist(),
            },
        )
    write_wav(out / f"received-{attempt}.wav", pcm, rate)
    return report, timeline, switched_at


def test_barge_in_stops_the_answer_in_the_browser(idle_server: ServerProcess, output_dir: Path) -> None:
    # The interruption must start while the first answer is audible. The test starts it mid-sentence; the
    # speech itself begins ~0.3 s later (the clip's lead-in), and the end of a clause followed by a pause (the
    # thinker catching up, 0.4-5 s on a busy machine) can still fall there. Then the call is repeated: only the
    # timing repeats, every assertion below is made on the first call whose interruption landed on model speech.
    attempts: list[dict[str, Any]] = []
    for attempt in range(1, 4):
        report, timeline, switched_at = _barge_in_attempt(idle_server, output_dir, attempt)
        speech = timeline.segments("local", LOCAL_SPEECH_DB, 0.5)
        assert len(speech) >= 2, f"the page's mic timeline shows {speech}, not a question and an interruption"
        onset = speech[1][0]
        # "Audible" as the page judges it: the model was loud within the 150 ms before the caller's onset.
        playing = timeline.loud_between("remote", REMOTE_SPEECH_DB, onset - 0.15, onset + 0.01)
        attempts.append(
            {"switched_at": switched_at, "onset": onset, "question": speech[0], "playing": playing}
        )
        if playing:
            break
    (output_dir / "attempts.json").write_text(json.dumps(attempts, indent=1))
    assert attempts[-1]["playing"], f"the interruption never landed on the model's speech: {attempts}"
    assert 0 < onset - switched_at < 1.0, attempts

    # The first answer's audio, as received by the browser: the stretch of model speech around the onset, up to
    # the first silence long enough to be the end of an answer.
    answers = timeline.segments("remote", REMOTE_SPEECH_DB, ANSWER_GAP_S)
    first = next((s for s in answers if s[0] < onset <= s[1] + 0.15), None)
    assert first is not None, (onset, answers)
    # Negative (at most -150 ms) when the answer paused just before the onset and never went on: had the server
    # not stopped it, its next clause would have followed within the pause and the stretch would run on.
    stop_ms = (first[1] - onset) * 1000
    (output_dir / "barge-in.json").write_text(
        json.dumps(
            {"onset_s": onset, "answer": first, "stop_after_onset_ms": round(stop_ms), "answers": answers},
            indent=1,
        )
    )
    assert stop_ms <= BARGE_IN_STOP_MS, (
        f"the first answer kept playing {stop_ms:.0f} ms after the caller started talking over it"
    )
    # Nothing more of the first answer: the next model audio is the answer to the interruption, after the caller
    # finished speaking (a first answer that merely stalled would resume while the caller still talks).
    later = [s for s in answers if s[0] > first[1]]
    assert later, f"no answer after the interruption: {answers}"
    assert later[0][0] > speech[1][1], (later, speech)
    assert len(report["latencies"]) >= 2, report["latencies"]

    # The page saw the same thing: a barge-in marker at that onset with that stop time, the talked-over answer
    # flagged in the transcript, and the answer after it.
    page = report["barge_ins"]
    assert len(page) == 1, page
    # The page ends the answer at its last loud window before 300 ms of quiet (its hangover), a lone 10 ms
    # blip of codec decay included, where ``segments`` above drops blips under 30 ms: compare like with like.
    page_rule_stop_ms = (timeline.loud_end("remote", REMOTE_SPEECH_DB, first[1] - 0.01, 0.3) - onset) * 1000
    assert abs(page[0]["onset"] - onset) < 0.05 and abs(page[0]["stopMs"] - page_rule_stop_ms) <= 30, (
        page,
        onset,
        stop_ms,
        page_rule_stop_ms,
    )
    items = report["transcripts"]
    marker = next(i for i, t in enumerate(items) if t["kind"] == "marker" and t["type"] == "barge-in")
    assert any(t["kind"] == "turn" and t["role"] == "model" and t["interrupted"] for t in items[:marker]), (
        items
    )
    after = [t for t in items[marker:] if t["kind"] == "turn"]
    assert [t["role"] for t in after] == ["caller", "model"], items
    assert "italy" in normalize_text(after[0]["text"]), after
    assert report["errors"] == []


#: The resume test's microphone loops a question every ~25 s (20 s of silence, the question, 2 s of silence): the
#: ones that play while the network is stalled are lost, and the first one after the page resumed (Chromium gives
#: the connection up after ~30 s of ICE consent) is asked on the resumed call, whenever the resume lands.
RESUME_MIC_LEAD_MS = 20_000
RESUME_MIC_TAIL_MS = 2_000


def test_a_lost_connection_resumes_the_same_session_and_the_call_goes_on(
    idle_server: ServerProcess, output_dir: Path
) -> None:
    """The server stops answering (SIGSTOP: its ICE consent replies stop, as when the network between the browser
    and the server dies) until Chromium declares the connection failed; the page offers again with the session's
    resume token, and once the server runs again (SIGCONT) the same session goes on: same id, one engine session,
    no error, and a question asked after the resume is answered."""
    wav = output_dir / "fake-mic.wav"
    write_fake_mic(wav, BROWSER_QUESTION, RESUME_MIC_LEAD_MS, RESUME_MIC_TAIL_MS)
    with launch_chromium(output_dir, fake_mic_wav=wav, loop_mic=True) as driver:
        open_page(driver, idle_server)
        before = connect(driver)
        sid = before["sessionId"]
        assert sid
        os.kill(idle_server.proc.pid, signal.SIGSTOP)
        try:
            lost = wait_until(
                driver,
                lambda d: (s := page_call(d, "status"))["state"] == "connecting" and s,
                timeout=ICE_CONSENT_EXPIRY_S + 30,
                what="the page to notice the lost connection and resume",
            )
            assert "resuming" in lost["text"], lost
        finally:
            os.kill(idle_server.proc.pid, signal.SIGCONT)
        wait_until(driver, lambda d: page_call(d, "resumes") == 1, timeout=30, what="the resume")
        after = page_call(driver, "status")
        assert after["connected"] and after["sessionId"] == sid, (before, after)
        assert idle_server.health()[1]["engine"]["active_sessions"] == 1, (
            "the same engine session, no second one"
        )
        wait_until(
            driver,
            lambda d: any(
                BROWSER_ANSWER in normalize_text(m["text"]) for m in model_turns(page_call(d, "transcripts"))
            ),
            timeout=2 * (RESUME_MIC_LEAD_MS + RESUME_MIC_TAIL_MS) / 1000 + 45,
            what="the answer to the question asked after the resume",
        )
        hang_up(driver)
        report = save_report(driver, output_dir, "page-report.json")
    assert report["errors"] == [], report["errors"]
    markers = [m["text"] for m in report["transcripts"] if m["kind"] == "marker"]
    assert any("resuming" in m for m in markers) and "Resumed." in markers, markers
    assert [e["type"] for e in report["events"]].count("session.started") == 2, (
        "the first call's, the resume's"
    )


def test_wrong_or_missing_api_key_is_explained(idle_server: ServerProcess, output_dir: Path) -> None:
    with launch_chromium(output_dir) as driver:
        open_page(driver, idle_server, key="sk-wrong")
        click_connect(driver)
        n = notice(driver)
        assert n["code"] == "invalid_api_key" and "refused this API key" in n["text"], n
        driver.save_screenshot(str(output_dir / "browser-wrong-key.png"))
        assert driver.switch_to.active_element.get_attribute("id") == "api-key"
        open_page(driver, idle_server, key=None)
        click_connect(driver)
        n = notice(driver)
        assert n["code"] == "invalid_api_key" and "needs an API key" in n["text"], n
        assert not page_call(driver, "status")["connected"]


def test_denied_microphone_is_explained(idle_server: ServerProcess, output_dir: Path) -> None:
    with launch_chromium(output_dir, grant_mic=False) as driver:
        open_page(driver, idle_server)
        click_connect(driver)
        n = notice(driver)
        assert n["code"] == "mic_denied" and "Microphone access is blocked" in n["text"], n
        driver.save_screenshot(str(output_dir / "browser-mic-denied.png"))
        assert page_call(driver, "status")["state"] == "error"


def test_full_server_is_explained_and_the_key_is_remembered(
    idle_server: ServerProcess, output_dir: Path
) -> None:
    wav = output_dir / "fake-mic.wav"
    write_fake_mic(wav, "Hello.", 1500)
    with launch_chromium(output_dir, fake_mic_wav=wav) as driver:
        # Without ?aec=0: echo cancellation, noise suppression and auto gain are on by default.
        load_page(driver, idle_server, "test=1")
        driver.find_element(By.ID, "api-key").send_keys(API_KEY)
        assert connect(driver)["mic"]["echoCancellation"] is True  # takes the server's only session slot
        # The prompt box sends commentary on the data channel; the server acknowledges it.
        driver.find_element(By.ID, "prompt-text").send_keys("Say hello.")
        driver.find_element(By.ID, "prompt-send").click()
        wait_until(
            driver,
            lambda d: any(e["type"] == "session.commentary.appended" for e in page_call(d, "events")),
            timeout=15,
            what="session.commentary.appended",
        )
        first = driver.current_window_handle
        driver.switch_to.new_window("tab")
        # The key typed in the first tab was stored (localStorage) and fills the field here.
        load_page(driver, idle_server, "test=1")
        assert driver.find_element(By.ID, "api-key").get_attribute("value") == API_KEY
        click_connect(driver)
        n = notice(driver)
        assert n["code"] == "session_limit_reached" and "server is full" in n["text"], n
        driver.save_screenshot(str(output_dir / "browser-server-full.png"))
        driver.close()
        driver.switch_to.window(first)
        hang_up(driver)
