"""media.egress and media.pacer: the 20 ms output clock, silence, epoch flush, transcripts and playout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from engine_bridge import protocol as p
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE
from engine_bridge.ring import NATIVE, RingPair
from media.codecs import ALAW_ENCODE, ULAW_ENCODE, AudioEncoding
from media.egress import TRANSCRIPT_QUEUE_LIMIT, EgressPlayer
from media.pacer import Pacer

F24 = 480  # one 20 ms frame at 24 kHz


@dataclass
class FakeSession:
    rings: RingPair
    closed: bool = False


#: Every player test runs on both ring paths: the C core's one-call steady-state frame (``EgressRing.play``) and the
#: Python path, where ``play`` always declines and the player's general path does every frame.
RING_PATHS = [pytest.param(False, id="python")] + ([pytest.param(True, id="native")] if NATIVE else [])


@pytest.fixture(params=RING_PATHS)
def session(request: pytest.FixtureRequest) -> Iterator[FakeSession]:
    rings = RingPair.create(
        input_rate=ENGINE_INPUT_RATE, output_rate=ENGINE_OUTPUT_RATE, egress_seconds=4.0, native=request.param
    )
    assert rings.egress.native is request.param
    s = FakeSession(rings)
    yield s
    if not s.closed:
        rings.close()


def _tx(turn: int, epoch: int, start: int, end: int, text: str = "x") -> p.OutputTranscript:
    return p.OutputTranscript(
        session_id="s", turn_id=turn, epoch=epoch, text=text, start_sample=start, end_sample=end
    )


@pytest.mark.parametrize(
    ("rate", "encoding", "size", "zero"),
    [
        (48000, "pcm16", 1920, 0),
        (24000, "pcm16", 960, 0),
        (16000, "pcm16", 640, 0),
        (8000, "pcm16", 320, 0),
        (8000, "pcmu", 160, int(ULAW_ENCODE[0])),
        (8000, "pcma", 160, int(ALAW_ENCODE[0])),
    ],
)
def test_silence_is_digital_zero_in_every_format(
    session: FakeSession, rate: int, encoding: str, size: int, zero: int
) -> None:
    player = EgressPlayer(session, rate=rate, encoding=encoding)
    for i in range(5):
        f = player.next_frame()
        assert f.index == i and f.start_ms == 20 * i
        assert f.payload.nbytes == size
        assert (f.payload == zero).all()
        assert not f.speaking and f.model_samples == 0 and f.transcripts == ()
    assert player.timeline_ms == 100 and not player.speaking


def test_chunks_of_any_size_play_bit_exact_at_24k(session: FakeSession) -> None:
    eg = session.rings.egress
    x = (np.random.default_rng(0).standard_normal(2033) * 5000).astype(np.int16)
    for seq, (a, b) in enumerate([(0, 700), (700, 1033), (1033, 2033)]):
        assert eg.write_chunk(0, 1, seq, x[a:b])
    player = EgressPlayer(session, rate=24000)
    frames, pcm = [], []
    for _ in range(6):
        frames.append(player.next_frame())
        pcm.append(frames[-1].pcm.copy())  # a frame's buffer is reused two frames later
    out = np.concatenate(pcm)
    assert np.array_equal(out[:2033], x) and not out[2033:].any()
    assert [f.model_samples for f in frames] == [480, 480, 480, 480, 113, 0]
    assert [f.speaking for f in frames] == [True] * 5 + [False]
    assert player.underruns == 1 and player.model_frames == 5
    assert eg.playout() == (0, 1, 2033)


def test_the_engine_s_gain_word_scales_the_next_frame_with_a_short_ramp_and_unity_is_bit_exact(
    session: FakeSession,
) -> None:
    eg = session.rings.egress
    x = np.full(10 * F24, 10000, dtype=np.int16)
    assert eg.write_chunk(0, 1, 0, x)
    player = EgressPlayer(session, rate=24000)
    assert np.array_equal(player.next_frame().pcm, x[:F24])  # a zeroed header word is unity
    eg.set_gain(0.01)  # the duck: -40 dB
    ducked = player.next_frame().pcm.copy()
    ramp = 48  # 2 ms at 24 kHz
    assert ducked[0] == 10000 and 100 < ducked[ramp // 2] < 10000, "ramps down from the last frame's level"
    assert (ducked[ramp:] == 100).all(), "-40 dB from 2 ms into the frame on"
    assert (player.next_frame().pcm == 100).all()
    eg.set_gain(1.0)  # a backchannel: the level comes back
    restored = player.next_frame().pcm.copy()
    assert restored[0] == 100 and (restored[ramp:] == 10000).all()
    assert np.array_equal(player.next_frame().pcm, x[:F24]), "unity again: the samples as written"
    assert eg.playout() == (0, 1, 5 * F24), "ducked audio counts as played"
    with pytest.raises(ValueError):
        eg.set_gain(1.5)


def test_48k_output_carries_the_tone(session: FakeSession) -> None:
    t = np.arange(24000) / 24000
    eg = session.rings.egress
    tone = (8000 * np.sin(2 * np.pi * 1000 * t)).astype(np.int16)
    for i in range(0, 24000, 2400):
        eg.write_chunk(0, 1, i, tone[i : i + 2400])
    player = EgressPlayer(session, rate=48000)
    out = np.concatenate([player.next_frame().pcm.copy() for _ in range(50)])
    assert out.shape == (48000,)
    spec = np.abs(np.fft.rfft(out[4800:].astype(float)))
    assert abs(np.fft.rfftfreq(len(out) - 4800, 1 / 48000)[spec.argmax()] - 1000) < 3
    assert 7600 < np.abs(out[4800:]).max() < 8400


@pytest.mark.parametrize("rate", [24000, 48000, 8000])
def test_epoch_bump_stops_stale_audio_within_one_frame(session: FakeSession, rate: int) -> None:
    eg = session.rings.egress
    stale, fresh = 7777, 1234
    eg.write_chunk(0, 1, 0, np.full(24000, stale, np.int16))  # a 1 s chunk: most of it stays held locally
    eg.write_chunk(0, 1, 1, np.full(4800, stale, np.int16))  # and more queued in the ring
    player = EgressPlayer(session, rate=rate)
    for _ in range(3):
        assert player.next_frame().speaking
    eg.bump_epoch()  # barge-in: the engine bumps the epoch word first ...
    f = player.next_frame()  # ... and the very next frame is clean
    assert not f.speaking and not f.pcm.any()
    eg.write_chunk(1, 2, 0, np.full(4800, fresh, np.int16))
    peak = 0
    for _ in range(10):
        fr = player.next_frame()
        assert fr.epoch == 1 and fr.turn_id == 2
        peak = max(peak, int(np.abs(fr.pcm).max()))
    assert peak < 1500  # only the new audio (a filter may overshoot a step by a few %), never 7777
    assert player.stale_chunks_dropped == 1
    assert eg.stale_dropped == 1
    assert eg.playout() == (1, 2, 4800)


def test_epoch_bump_with_new_audio_already_queued(session: FakeSession) -> None:
    eg = session.rings.egress
    eg.write_chunk(0, 1, 0, np.full(4800, 500, np.int16))
    player = EgressPlayer(session, rate=24000)
    player.next_frame()
    eg.bump_epoch()
    eg.write_chunk(1, 2, 0, np.full(960, 42, np.int16))
    f = player.next_frame()
    assert (f.pcm == 42).all() and f.epoch == 1


def test_transcripts_are_released_when_their_audio_plays(session: FakeSession) -> None:
    eg = session.rings.egress
    player = EgressPlayer(session, rate=48000)
    for _ in range(5):  # 100 ms of silence first: the turn starts at 100 ms on the output timeline
        player.next_frame()
    player.add_transcript(_tx(1, 0, 0, 2400, "Hello"))
    player.add_transcript(_tx(1, 0, 4800, 9600, " world"))
    player.add_transcript(_tx(7, 0, 0, 100, "future turn"))
    assert player.next_frame().transcripts == ()  # no audio yet: nothing is due
    eg.write_chunk(0, 1, 0, np.full(12000, 100, np.int16))
    released: dict[int, tuple] = {}
    for _ in range(25):
        f = player.next_frame()
        if f.transcripts:
            released[f.index] = f.transcripts
    assert sorted(released) == [6, 16]
    (hello,) = released[6]
    assert (hello.text, hello.start_ms, hello.end_ms) == ("Hello", 120, 220)
    (world,) = released[16]
    assert (world.text, world.start_ms, world.end_ms) == (" world", 320, 520)
    assert player.stats()["transcripts_pending"] == 1  # turn 7 has not played


def test_words_played_under_the_duck_wait_for_the_verdict(session: FakeSession) -> None:
    """A backchannel (the duck lifted, same epoch) releases them with their play times; a barge-in (epoch bumped,
    then the duck lifted) drops them, so the client's transcript holds only what the model keeps."""
    eg = session.rings.egress
    player = EgressPlayer(session, rate=24000)
    eg.write_chunk(0, 1, 0, np.full(F24 * 20, 100, np.int16))
    player.add_transcript(_tx(1, 0, 0, F24, "before"))
    player.add_transcript(_tx(1, 0, F24 * 3, F24 * 4, "under"))
    assert [t.text for t in player.next_frame().transcripts] == ["before"]
    eg.set_gain(0.01)
    for _ in range(5):
        assert player.next_frame().transcripts == (), "nothing released while ducked"
    eg.set_gain(1.0)  # a backchannel
    (under,) = player.next_frame().transcripts
    assert (under.text, under.start_ms) == ("under", 60), "released at once, with the time it played"

    player.add_transcript(_tx(1, 0, F24 * 8, F24 * 9, "interrupted"))
    eg.set_gain(0.01)
    for _ in range(4):
        assert player.next_frame().transcripts == ()
    eg.bump_epoch()  # the barge-in: the fence first, then the level back
    eg.set_gain(1.0)
    assert player.next_frame().transcripts == ()
    assert player.stats()["transcripts_pending"] == 0 and player.transcripts_stale == 1


def test_stale_transcripts_are_dropped(session: FakeSession) -> None:
    eg = session.rings.egress
    player = EgressPlayer(session, rate=24000)
    eg.write_chunk(0, 1, 0, np.full(960, 1, np.int16))
    player.add_transcript(_tx(1, 0, 2000, 3000, "never heard"))
    player.next_frame()
    eg.bump_epoch()
    assert player.next_frame().transcripts == ()
    player.add_transcript(_tx(1, 0, 0, 10, "late and stale"))
    eg.write_chunk(1, 2, 0, np.full(960, 1, np.int16))
    player.add_transcript(_tx(2, 1, 0, 480, "fresh"))
    f = player.next_frame()
    assert [t.text for t in f.transcripts] == ["fresh"]
    assert player.transcripts_stale == 2


def test_turn_change_inside_a_frame(session: FakeSession) -> None:
    eg = session.rings.egress
    player = EgressPlayer(session, rate=24000)
    eg.write_chunk(0, 1, 0, np.full(300, 1, np.int16))
    eg.write_chunk(0, 2, 0, np.full(1000, 2, np.int16))
    player.add_transcript(_tx(1, 0, 250, 300, "end of one"))
    player.add_transcript(_tx(1, 0, 5000, 6000, "text past its audio"))
    player.add_transcript(_tx(2, 0, 0, 100, "two"))
    f = player.next_frame()
    assert f.pcm[:300].tolist() == [1] * 300 and f.pcm[300:].tolist() == [2] * 180
    assert (f.epoch, f.turn_id) == (0, 2)
    assert [t.text for t in f.transcripts] == ["end of one", "text past its audio", "two"]
    assert f.transcripts[2].start_ms == 300 * 1000 // 24000
    assert eg.playout() == (0, 2, 180)
    player.next_frame()
    assert eg.playout() == (0, 2, 660)


def test_playout_is_counted_per_turn_across_more_turns_than_the_table_holds_and_a_barge_in(
    session: FakeSession,
) -> None:
    """The player counts a frame of the turn that played last through its cursor's record of that turn (in C on the
    native ring); that count must stay the turn's own when turns follow each other (more of them than the table
    keeps) and when a barge-in makes the last turn stale."""
    eg = session.rings.egress
    player = EgressPlayer(session, rate=24000)
    turns = 20  # more than TURN_TABLE_LIMIT (16)
    for t in range(1, turns + 1):
        eg.write_chunk(
            0, t, 0, np.full(720, t, np.int16)
        )  # 1.5 frames each: every other frame holds two turns
    seen: dict[int, int] = {}
    for _ in range(turns * 720 // F24):
        f = player.next_frame()
        epoch, turn, played = eg.playout()
        assert (epoch, turn) == (f.epoch, f.turn_id)
        seen[turn] = played
    assert seen == {t: 720 for t in range(1, turns + 1) if t % 2 == 0} | {
        t: 480 for t in range(1, turns + 1) if t % 2 == 1
    }
    # Turn 21 plays a frame and a half; then a barge-in: its epoch is stale, the rest of it is dropped.
    eg.write_chunk(0, 21, 0, np.full(720, 21, np.int16))
    player.next_frame()
    assert eg.playout() == (0, 21, 480)
    eg.bump_epoch()
    eg.write_chunk(1, 21, 0, np.full(480, 7, np.int16))  # the same turn id in the new epoch is a new record
    f = player.next_frame()
    assert f.pcm.tolist() == [7] * 480
    assert eg.playout() == (1, 21, 480)


def test_transcript_queue_is_bounded(session: FakeSession) -> None:
    player = EgressPlayer(session)
    for i in range(TRANSCRIPT_QUEUE_LIMIT + 44):
        player.add_transcript(_tx(100 + i, 0, 0, 1))
    assert player.transcripts_overflow == 44
    assert player.stats()["transcripts_pending"] == TRANSCRIPT_QUEUE_LIMIT


def test_closed_session_gives_silence_without_touching_the_rings(session: FakeSession) -> None:
    eg = session.rings.egress
    eg.write_chunk(0, 1, 0, np.full(4800, 3000, np.int16))
    player = EgressPlayer(session, rate=48000, encoding=AudioEncoding.PCM16)
    assert player.next_frame().speaking
    session.closed = True
    session.rings.close()  # unmapped: any access would now raise
    for _ in range(3):
        f = player.next_frame()
        assert not f.speaking and not f.pcm.any()
    player.close()
    assert not player.next_frame().pcm.any()


def test_output_buffers_stay_valid_for_one_more_frame(session: FakeSession) -> None:
    eg = session.rings.egress
    eg.write_chunk(0, 1, 0, np.arange(960, dtype=np.int16))
    player = EgressPlayer(session, rate=24000)
    a = player.next_frame()
    b = player.next_frame()
    assert a.pcm.tolist() == list(range(480)) and b.pcm.tolist() == list(range(480, 960))


@pytest.mark.skipif(
    not NATIVE, reason="compares the C steady-state frame with the Python path; needs the C core"
)
@pytest.mark.parametrize(("rate", "seed"), [(24000, 0), (16000, 1), (24000, 2), (48000, 3)])
def test_the_c_steady_state_frame_matches_the_python_player_frame_for_frame(rate: int, seed: int) -> None:
    """Two players, one on a native ring and one on a Python ring, fed the same seeded script of engine writes
    (chunks of any size, new turns, barge-ins with stale chunks left behind, ducks and lifts, transcripts, a full
    ring): every frame (audio, model samples, epoch, turn, transcripts), the playout words and the counters are
    identical, and many speaking frames on the native ring were the C call's (``play`` returned a count)."""
    rng = np.random.default_rng(seed)
    pairs = [
        RingPair.create(
            input_rate=ENGINE_INPUT_RATE, output_rate=ENGINE_OUTPUT_RATE, egress_seconds=1.0, native=native
        )
        for native in (True, False)
    ]
    try:
        c_ring, py_ring = pairs[0].egress, pairs[1].egress
        taken = [0]
        c_play = c_ring.play

        def counting_play(work: np.ndarray, cursor: object) -> int:
            n = c_play(work, cursor)  # type: ignore[arg-type]
            taken[0] += n > 0
            return n

        c_ring.play = counting_play  # type: ignore[method-assign]
        players = [EgressPlayer(FakeSession(pair), rate=rate) for pair in pairs]
        epoch, turn, seq, sent = 0, 1, 0, 0
        speaking_frames = 0
        for _ in range(1500):
            roll = rng.random()
            if (
                roll < 0.03
            ):  # barge-in: the epoch moves, a stale chunk of the old one is already queued behind
                for eg in (c_ring, py_ring):
                    eg.write_chunk(epoch, turn, seq, np.full(300, 99, np.int16))
                    eg.bump_epoch()
                epoch, turn, seq, sent = epoch + 1, turn + 1, 0, 0
            elif roll < 0.08:
                turn, seq, sent = turn + 1, 0, 0
            elif roll < 0.12:
                gain = float(rng.choice([0.0, 0.25, 1.0]))
                for eg in (c_ring, py_ring):
                    eg.set_gain(gain)
            elif roll < 0.15:
                for eg in (c_ring, py_ring):
                    eg.set_gain(1.0)
            if rng.random() < 0.6:
                pcm = rng.integers(-20000, 20000, int(rng.integers(1, 1500)), dtype=np.int16)
                ok = [eg.write_chunk(epoch, turn, seq, pcm) for eg in (c_ring, py_ring)]
                assert ok[0] == ok[1]
                if ok[0]:
                    for player in players:
                        player.add_transcript(
                            _tx(turn, epoch, sent, sent + pcm.shape[0], f"{epoch}/{turn}/{seq}")
                        )
                    seq, sent = seq + 1, sent + pcm.shape[0]
            a, b = (player.next_frame() for player in players)
            assert np.array_equal(a.pcm, b.pcm)
            assert (a.model_samples, a.epoch, a.turn_id, a.speaking, a.start_ms) == (
                b.model_samples,
                b.epoch,
                b.turn_id,
                b.speaking,
                b.start_ms,
            )
            assert a.transcripts == b.transcripts
            assert c_ring.playout() == py_ring.playout()
            assert players[0].stats() == players[1].stats()
            speaking_frames += a.speaking
        assert speaking_frames > 500
        assert taken[0] > speaking_frames // 3, (taken[0], speaking_frames)  # this script ducks often
        assert taken[0] < speaking_frames  # the script reached the general path too
    finally:
        for pair in pairs:
            pair.close()


def test_bad_configurations() -> None:
    rings = RingPair.create(input_rate=16000, output_rate=24000)
    try:
        s = FakeSession(rings)
        with pytest.raises(ValueError):
            EgressPlayer(s, rate=16000, encoding="pcmu")
        with pytest.raises(ValueError):
            EgressPlayer(s, rate=44100)
    finally:
        rings.close()


# --- pacer ------------------------------------------------------------------------------------------------------


async def test_pacer_keeps_an_absolute_grid() -> None:
    pacer = Pacer(0.02)
    t0 = time.monotonic()
    deadlines = [await pacer.tick() for _ in range(26)]
    elapsed = time.monotonic() - t0
    assert deadlines == pytest.approx([deadlines[0] + 0.02 * k for k in range(26)], abs=1e-9)
    assert 0.49 <= elapsed < 0.70  # 25 intervals, plus the last wake-up's latency on a loaded machine
    assert pacer.skipped == 0


async def test_pacer_catches_up_short_stalls_and_skips_long_ones() -> None:
    now = [100.0]  # a controllable clock: "the loop was blocked" is the clock jumping
    pacer = Pacer(0.02, max_catchup=5, clock=lambda: now[0])
    assert await pacer.tick() == 100.0
    now[0] = 100.065  # three ticks are due at once: they return back to back, on the grid
    burst = [await pacer.tick() for _ in range(3)]
    assert burst == pytest.approx([100.02, 100.04, 100.06], abs=1e-9)
    assert pacer.late == 2 and pacer.skipped == 0
    now[0] = 100.365  # fourteen ticks behind: not replayed as a burst
    d = await pacer.tick()
    assert pacer.skipped == 14
    assert d == pytest.approx(100.36, abs=1e-9)  # still on the original grid
    assert pacer.next_deadline == pytest.approx(100.38, abs=1e-9)
    assert await pacer.tick() == pytest.approx(100.38, abs=1e-9)  # sleeps 15 ms of real time


async def test_pacer_nudge_releases_the_pending_tick_at_most_early_s_before_its_deadline() -> None:
    now = [100.0]
    pacer = Pacer(0.02, clock=lambda: now[0], early_s=0.02)
    assert not pacer.nudge()  # nothing pending
    assert await pacer.tick() == 100.0
    pending = asyncio.create_task(pacer.tick())
    await asyncio.sleep(0)  # now waiting for the 100.02 deadline (its timer is 20 ms of real time away)
    now[0] = 99.9999  # more than early_s before the deadline
    assert not pacer.nudge() and not pending.done()
    now[0] = 100.001
    assert pacer.nudge()
    assert await pending == pytest.approx(100.02, abs=1e-9)  # the tick's own deadline, delivered early
    assert pacer.early == 1 and pacer.late == 0
    assert not pacer.nudge()  # released once
    # The grid did not move: the next tick is the next slot, and one more nudge releases it just as early.
    assert pacer.next_deadline == pytest.approx(100.04, abs=1e-9)
    now[0] = 100.021
    pending = asyncio.create_task(pacer.tick())
    await asyncio.sleep(0)
    assert pacer.nudge()
    assert await pending == pytest.approx(100.04, abs=1e-9)


async def test_pacer_with_early_release_keeps_its_grid_on_the_timer_when_not_nudged() -> None:
    pacer = Pacer(0.02, early_s=0.02)
    t0 = time.monotonic()
    deadlines = [await pacer.tick() for _ in range(11)]
    elapsed = time.monotonic() - t0
    assert deadlines == pytest.approx([deadlines[0] + 0.02 * k for k in range(11)], abs=1e-9)
    assert 0.19 <= elapsed < 0.40 and pacer.early == 0


def test_pacer_rejects_releasing_more_than_one_interval_early() -> None:
    with pytest.raises(ValueError):
        Pacer(0.02, early_s=0.03)


async def test_pacer_never_blocks_the_loop() -> None:
    pacer = Pacer(0.02)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await pacer.tick()
            ticks += 1

    task = asyncio.create_task(ticker())
    # 20 beats of 5 ms on the same loop: a pacer that blocked the loop for its 20 ms waits would stretch every
    # beat to a whole interval (>= 0.4 s in all); one that awaits lets them run on time.
    t0 = time.monotonic()
    gaps: list[float] = []
    for _ in range(20):
        b0 = time.monotonic()
        await asyncio.sleep(0.005)
        gaps.append(time.monotonic() - b0)
    elapsed = time.monotonic() - t0
    task.cancel()
    assert elapsed < 0.3, (elapsed, gaps)
    assert sorted(gaps)[len(gaps) // 2] < 0.015, gaps  # the median beat was not held up by a tick
    # ...and it still paced: one tick per 20 ms (the first at once), not a spin.
    assert 3 <= ticks <= elapsed / 0.02 + 2, (ticks, elapsed)
