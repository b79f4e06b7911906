"""Shared-memory rings: wraparound, overrun, stale epochs, invariants, ownership and the janitor.

The ingress ring's write/read_into have two implementations, the C core (engine_bridge/_ringcore.c, used when it
is built) and the pure-Python reference path; every ingress test runs against each one that is available.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from engine_bridge.ring import (
    NATIVE,
    ChunkInfo,
    EgressRing,
    IngressRing,
    RingError,
    RingPair,
    list_our_segments,
    remove_orphan_segments,
    unlink_segment,
)

#: The ring implementations to test: the Python path always, the C core when it is built.
PATHS = [pytest.param(False, id="python")] + ([pytest.param(True, id="native")] if NATIVE else [])


def test_capacity_must_be_power_of_two() -> None:
    with pytest.raises(ValueError):
        IngressRing.create(1000, 16000)


@pytest.mark.parametrize("native", PATHS)
def test_ingress_wraparound_is_bit_exact(native: bool) -> None:
    ring = IngressRing.create(1024, 16000, native=native)
    try:
        assert ring.native is native
        reader = IngressRing.attach(ring.name, native=native)
        out = np.zeros(1024, dtype=np.int16)
        rng = np.random.default_rng(1)
        sent: list[np.ndarray] = []
        got: list[np.ndarray] = []
        # 300-sample frames against a 1024-sample ring: wraps every few frames at ever-changing offsets.
        for _ in range(200):
            frame = rng.integers(-32768, 32767, 300, dtype=np.int16)
            assert ring.write(frame)
            sent.append(frame)
            n = reader.read_into(out[:300])
            got.append(out[:n].copy())
        assert np.array_equal(np.concatenate(sent), np.concatenate(got))
        assert ring.write_cursor == 200 * 300 * 2 == ring.read_cursor
        assert ring.overruns == 0
        reader.close()
    finally:
        ring.close()


@pytest.mark.parametrize("native", PATHS)
def test_overrun_is_detected_counted_and_never_corrupts(native: bool) -> None:
    ring = IngressRing.create(1024, 16000, native=native)
    try:
        a = np.arange(600, dtype=np.int16)
        b = np.arange(600, 1200, dtype=np.int16)
        assert ring.write(a)
        assert not ring.write(b)  # only 424 samples free: the new frame is refused, not written over `a`
        assert ring.overruns == 1
        out = np.zeros(1024, dtype=np.int16)
        assert ring.read_into(out) == 600
        assert np.array_equal(out[:600], a)
        assert ring.write(b)
        assert ring.read_into(out) == 600
        assert np.array_equal(out[:600], b)
        with pytest.raises(ValueError):
            ring.write(np.zeros(2048, dtype=np.int16))
        with pytest.raises(TypeError):
            ring.write(np.zeros(10, dtype=np.float32))
    finally:
        ring.close()


@pytest.mark.parametrize("native", PATHS)
def test_ingress_takes_bytes_and_rejects_what_is_not_pcm16(native: bool) -> None:
    ring = IngressRing.create(1024, 16000, native=native)
    try:
        pcm = np.arange(-160, 160, dtype=np.int16)
        assert ring.write(pcm.tobytes())  # what a decoded base64 append is
        assert ring.write(bytearray(pcm.tobytes()))
        out = np.zeros(640, dtype=np.int16)
        assert ring.read_into(out) == 640
        assert np.array_equal(out, np.concatenate([pcm, pcm]))
        with pytest.raises(ValueError):
            ring.write(b"\x01\x02\x03")  # half a sample
        with pytest.raises(TypeError):
            ring.write(np.zeros((2, 160), dtype=np.int16))
        with pytest.raises(TypeError):
            ring.read_into(np.zeros(10, dtype=np.float32))
        assert ring.write_cursor == ring.read_cursor == 1280  # refused writes moved nothing
    finally:
        ring.close()


@pytest.mark.parametrize("native", PATHS)
def test_ingress_broken_cursors_raise_instead_of_copying(native: bool) -> None:
    """A header whose cursors contradict each other (a bug or a foreign writer) is an error on both sides."""
    ring = IngressRing.create(1024, 16000, native=native)
    try:
        reader = IngressRing.attach(ring.name, native=native)
        ring._words[16] = 4096  # read cursor ahead of the write cursor (word 16 = byte 128)
        with pytest.raises(RingError):
            ring.write(np.zeros(10, dtype=np.int16))
        with pytest.raises(RingError):
            reader.read_into(np.zeros(10, dtype=np.int16))
        ring._words[16] = 0
        ring._words[8] = 1 << 20  # more written than the ring holds
        with pytest.raises(RingError):
            reader.read_into(np.zeros(10, dtype=np.int16))
        ring._words[8] = 0
        reader.close()
        with pytest.raises(ValueError):  # a closed ring refuses politely, whatever the path
            reader.read_into(np.zeros(10, dtype=np.int16))
    finally:
        ring.close()
    with pytest.raises(ValueError):
        ring.write(np.zeros(10, dtype=np.int16))


def test_rings_are_mapped_at_set_up_so_frames_take_no_page_faults() -> None:
    """Both sides map every page when they create or attach; without that each 4 KiB of audio faulted once."""
    ring = IngressRing.create(1 << 16, 16000)  # 128 KiB: 32 pages
    try:
        reader = IngressRing.attach(ring.name)
        frame = np.ones(320, dtype=np.int16)
        out = np.zeros(320, dtype=np.int16)
        ring.write(frame), reader.read_into(out)  # warm the code paths themselves
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(220):  # a full lap of the ring on both sides
            ring.write(frame)
            reader.read_into(out)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert faults < 16, f"{faults} page faults in one lap of a prefaulted ring (64 without prefaulting)"
        reader.close()
    finally:
        ring.close()


@pytest.mark.parametrize("native", PATHS)
def test_egress_chunks_wrap_and_keep_tags(native: bool) -> None:
    ring = EgressRing.create(4096, 24000)
    try:
        reader = EgressRing.attach(ring.name, native=native)
        assert reader.native is native
        out = np.zeros(4096, dtype=np.int16)
        for seq in range(100):
            # Random samples at odd lengths: the header and the audio wrap at every offset over the laps.
            pcm = np.random.default_rng(seq).integers(-32768, 32767, 480 + seq % 7, dtype=np.int16)
            assert ring.write_chunk(2**32 - 1 if seq == 99 else 0, 3, seq, pcm)
            info = reader.read_chunk(out)
            assert isinstance(info, ChunkInfo)
            epoch = 2**32 - 1 if seq == 99 else 0  # the tag's words are u32: the largest survives
            assert (info.epoch, info.turn_id, info.seq, info.nsamples) == (epoch, 3, seq, pcm.shape[0])
            assert np.array_equal(out[: info.nsamples], pcm)
        assert reader.read_chunk(out) is None
        assert ring.read_cursor == ring.write_cursor
        reader.close()
    finally:
        ring.close()


@pytest.mark.parametrize("native", PATHS)
def test_egress_reader_refuses_small_buffers_and_broken_chunks(native: bool) -> None:
    """A buffer too small for the chunk, a chunk that runs past the write cursor, a closed ring: each an error,
    the cursor left where it was."""
    ring = EgressRing.create(4096, 24000)
    try:
        reader = EgressRing.attach(ring.name, native=native)
        ring.write_chunk(0, 1, 0, np.ones(480, dtype=np.int16))
        with pytest.raises(ValueError):
            reader.read_chunk(np.zeros(100, dtype=np.int16))
        assert ring.read_cursor == 0
        ring._words[8] = 100  # the write cursor now cuts the chunk (16-byte tag + 960 bytes) short
        with pytest.raises(RingError):
            reader.read_chunk(np.zeros(4096, dtype=np.int16))
        assert ring.read_cursor == 0
        ring._words[8] = 1 << 20  # more written than the ring holds
        with pytest.raises(RingError):
            reader.read_chunk(np.zeros(4096, dtype=np.int16))
        ring._words[8] = 16 + 960
        info = reader.read_chunk(np.zeros(4096, dtype=np.int16))
        assert info == ChunkInfo(0, 1, 0, 480)
        reader.close()
        with pytest.raises(ValueError):  # a closed ring refuses politely, whatever the path
            reader.read_chunk(np.zeros(4096, dtype=np.int16))
    finally:
        ring.close()


@pytest.mark.parametrize("native", PATHS)
def test_stale_epoch_chunks_are_dropped(native: bool) -> None:
    ring = EgressRing.create(1 << 16, 24000, native=native)
    try:
        out = np.zeros(4096, dtype=np.int16)
        for seq in range(5):
            ring.write_chunk(0, 1, seq, np.full(480, 1, dtype=np.int16))
        assert ring.bump_epoch() == 1  # barge-in: the queued answer is now stale
        ring.write_chunk(1, 2, 0, np.full(480, 2, dtype=np.int16))
        info = ring.read_chunk(out)
        assert info is not None and info.epoch == 1 and info.turn_id == 2
        assert ring.stale_dropped == 5
        assert ring.read_chunk(out) is None
        with pytest.raises(RingError):
            ring.bump_epoch(0)
    finally:
        ring.close()


def test_drop_stale_and_playout_words() -> None:
    ring = EgressRing.create(1 << 14, 24000)
    try:
        reader = EgressRing.attach(ring.name)
        ring.write_chunk(0, 1, 0, np.zeros(480, dtype=np.int16))
        ring.bump_epoch()
        assert reader.drop_stale() == 1
        reader.report_playout(1, 7, 4800)
        assert ring.playout() == (1, 7, 4800)
        reader.close()
    finally:
        ring.close()


def test_attach_refuses_foreign_segments() -> None:
    with pytest.raises(RingError):
        IngressRing.attach("not_ours")
    egress = EgressRing.create(1024, 24000)
    try:
        with pytest.raises(RingError):
            IngressRing.attach(egress.name)  # wrong kind
    finally:
        egress.close()


def test_owner_close_unlinks_and_pair_is_idempotent() -> None:
    pair = RingPair.create(input_rate=16000, output_rate=24000)
    names = pair.names
    assert set(names) <= set(list_our_segments())
    other = RingPair.attach(*names)
    other.close()  # the attaching side never unlinks
    assert set(names) <= set(list_our_segments())
    pair.close()
    pair.close()
    assert not set(names) & set(list_our_segments())


def test_janitor_removes_orphans_of_dead_creators_only() -> None:
    """A child creates a ring and dies by SIGKILL without cleaning up. Its resource tracker would normally unlink
    the segment when the child's pipe closes; the janitor is for when that tracker died too (kill -9 of the
    process group, an OOM kill), so the child unregisters from it first and the orphan really is left behind."""
    code = textwrap.dedent(
        """
        import os, signal
        from engine_bridge.ring import IngressRing, _untrack
        r = IngressRing.create(1024, 16000)
        _untrack(r._shm)
        print(r.name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    orphan = proc.stdout.strip()
    assert orphan.startswith("lko_")
    dead_pid = int(orphan[len("lko_") :].split("_", 1)[0])
    assert orphan in list_our_segments(), "the orphan must exist before the janitor runs"
    live = IngressRing.create(1024, 16000)  # ours and alive: must survive the janitor
    # Our prefix and the same dead creator, but not our magic: the janitor must read the header and leave it.
    foreign = f"lko_{dead_pid}_notours_in"
    with open(f"/dev/shm/{foreign}", "wb") as f:
        f.write(b"\0" * 64)
    try:
        removed = remove_orphan_segments()
        names = list_our_segments()
        assert orphan in removed and orphan not in names
        assert live.name in names and live.name not in removed
        assert foreign in names and foreign not in removed
    finally:
        live.close()
        os.unlink(f"/dev/shm/{foreign}")
        unlink_segment(orphan)


def _consume(name: str, frames: int, frame_samples: int, native: bool, q: mp.Queue) -> None:
    ring = IngressRing.attach(name, native=native)
    out = np.zeros(frame_samples, dtype=np.int16)
    digest = hashlib.sha256()
    got = 0
    while got < frames:
        if ring.available() < frame_samples:
            time.sleep(0.0002)
            continue
        ring.read_into(out)
        digest.update(out.tobytes())
        got += 1
    total = ring.read_cursor
    ring.close()
    q.put((digest.hexdigest(), total))


@pytest.mark.parametrize("native", PATHS)
def test_two_processes_exchange_ten_minutes_bit_exact(native: bool) -> None:
    """10 minutes of 20 ms frames at 16 kHz (30,000 frames) through a real second process, faster than real time."""
    frames, fs = 30_000, 320
    ring = IngressRing.create(4096, 16000, native=native)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_consume, args=(ring.name, frames, fs, native, q))
    t0 = time.monotonic()
    proc.start()
    try:
        rng = np.random.default_rng(7)
        digest = hashlib.sha256()
        sent = 0
        frame = rng.integers(-32768, 32767, fs, dtype=np.int16)
        while sent < frames:
            if ring.write(frame):
                digest.update(frame.tobytes())
                sent += 1
                frame = rng.integers(-32768, 32767, fs, dtype=np.int16)
            else:
                time.sleep(0.0002)
        their_digest, total = q.get(timeout=300)
        proc.join(timeout=30)
        elapsed = time.monotonic() - t0
        assert total == frames * fs * 2
        assert their_digest == digest.hexdigest()
        assert elapsed < 600, f"10 minutes of audio took {elapsed:.0f} s: not faster than real time"
    finally:
        if proc.is_alive():
            proc.kill()
        ring.close()


def _read_chunks(name: str, until_seq: int, native: bool, q: mp.Queue) -> None:
    ring = EgressRing.attach(name, native=native)
    out = np.zeros(ring.capacity_bytes // 2, dtype=np.int16)
    digest = hashlib.sha256()
    tags: list[tuple[int, int, int, int]] = []
    while True:
        info = ring.read_chunk(out)
        if info is None:
            time.sleep(0.0002)
            continue
        digest.update(out[: info.nsamples].tobytes())
        tags.append(tuple(info))
        if info.seq == until_seq:
            break
    q.put((digest.hexdigest(), tags, ring.stale_dropped))
    ring.close()


@pytest.mark.parametrize("native", PATHS)
def test_two_processes_exchange_tagged_chunks_with_barge_ins_bit_exact(native: bool) -> None:
    """The engine's side writes 5,000 chunks of random sizes (a few samples to half the ring, so they wrap at every
    offset) and bumps the epoch now and then, as a barge-in does; a real second process reads them. It must receive
    every chunk it reads bit-exact with its tag, in order, count every other one as stale, and never read an older
    epoch's chunk after a newer one."""
    ring = EgressRing.create(1 << 14, 24000)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    chunks = 5_000
    proc = ctx.Process(target=_read_chunks, args=(ring.name, chunks - 1, native, q))
    proc.start()
    try:
        rng = np.random.default_rng(11)
        sent: list[tuple[tuple[int, int, int, int], bytes]] = []
        epoch = 0
        seq = 0
        while seq < chunks:
            if seq % 500 == 250 and seq < chunks - 1:
                epoch = ring.bump_epoch()  # whatever is still queued is stale from now on
            pcm = rng.integers(-32768, 32767, int(rng.integers(1, 4096)), dtype=np.int16)
            if ring.write_chunk(epoch, epoch + 1, seq, pcm):
                sent.append(((epoch, epoch + 1, seq, pcm.shape[0]), pcm.tobytes()))
                seq += 1
            else:
                time.sleep(0.0002)
        their_digest, tags, stale = q.get(timeout=300)
        proc.join(timeout=30)
        received = set(tags)
        assert tags == sorted(tags, key=lambda t: t[2]), "chunks arrived out of order"
        assert len(tags) + stale == chunks, "every chunk is either read or counted stale"
        assert tags[-1][2] == chunks - 1
        # What was read is exactly the written chunks that were read, in order, bit-exact.
        digest = hashlib.sha256()
        for tag, data in sent:
            if tag in received:
                digest.update(data)
        assert their_digest == digest.hexdigest()
        # The writer bumps the epoch before it writes the new epoch's chunks, so once the reader has read a chunk
        # of epoch e it sees the epoch word at e or later: an older chunk read after it would be stale audio played.
        epochs = [t[0] for t in tags]
        assert epochs == sorted(epochs), "a stale chunk was read after a newer epoch's"
    finally:
        if proc.is_alive():
            proc.kill()
        ring.close()


class _TurnRecord:
    """Stands in for the media player's turn record: ``play`` advances its ``played``."""

    def __init__(self, played: int = 0) -> None:
        self.played = played


@pytest.mark.skipif(not NATIVE, reason="EgressRing.play has a C core only; the Python path always declines")
def test_egress_play_takes_only_the_steady_state_and_declines_without_side_effects() -> None:
    """``play`` fills a frame only when the gain is unity, the epoch is the one the cursor saw and every sample is
    the last-played turn's; anything else returns -1 with the cursor, the record, the read cursor and the playout
    words untouched. A frame it takes is bit-exact, spans chunks, keeps a chunk's tail held, zero-fills an underrun
    and reports the turn's playout."""
    ring = EgressRing.create(1 << 14, 24000)
    try:
        cur = ring.play_cursor(np.zeros(ring.capacity_bytes // 2, np.int16))
        work = np.full(480, 7, np.int16)
        x = np.arange(1000, dtype=np.int16)

        def state() -> tuple[object, ...]:
            return (
                cur.pos,
                cur.len,
                cur.chunk_epoch,
                cur.chunk_turn,
                rec.played,
                ring.read_cursor,
                ring.playout(),
            )

        rec = _TurnRecord(100)
        ring.write_chunk(0, 1, 0, x[:300])
        assert ring.play(work, cur) == -1  # no turn has played yet (cursor.last is None)
        cur.last, cur.last_epoch, cur.last_turn = rec, 0, 1
        assert ring.play(work, cur) == -1  # the epoch word (0) is not the one the cursor saw (-1)
        cur.epoch_seen = 0
        cur.gain = 0.5
        assert ring.play(work, cur) == -1  # a gain ramp is pending
        cur.gain = 1.0
        ring.set_gain(0.5)
        before = state()
        assert ring.play(work, cur) == -1 and state() == before  # ducked
        ring.set_gain(1.0)
        ring.write_chunk(0, 1, 1, x[300:1000])
        assert ring.play(work, cur) == 480  # 300 + 180 of the next chunk, whose tail stays held
        assert np.array_equal(work, x[:480])
        assert (cur.pos, cur.len, rec.played, ring.playout()) == (180, 700, 580, (0, 1, 580))
        ring.write_chunk(0, 2, 0, x[:10])  # another turn queued behind the held tail
        assert ring.play(work, cur) == 480 and np.array_equal(work, x[480:960])  # still all turn 1
        before = state()
        assert ring.play(work, cur) == -1 and state() == before  # the frame would reach turn 2
        cur.pos = cur.len  # (as if the general path had played the rest and turn 2)
        ring.read_chunk(np.zeros(100, np.int16))
        assert ring.play(work, cur) == 0 and not work.any()  # nothing queued: silence, nothing reported
        ring.write_chunk(0, 1, 2, x[:100])
        assert ring.play(work, cur) == 100  # an underrun: the rest is zero
        assert np.array_equal(work[:100], x[:100]) and not work[100:].any()
        assert ring.playout() == (0, 1, 1160)  # 100 before, 480, 480 and 100
        ring.write_chunk(0, 1, 3, x[:10])
        ring.bump_epoch()
        before = state()
        assert ring.play(work, cur) == -1 and state() == before  # a barge-in is the general path's
        cur.epoch_seen = 1
        before = state()
        assert ring.play(work, cur) == -1 and state() == before  # a stale chunk: skipped on the general path
        cur.last_epoch = 1
        ring.drop_stale()
        ring.write_chunk(1, 1, 0, x[:600])
        small = ring.play_cursor(np.zeros(500, np.int16))
        small.epoch_seen, small.last, small.last_epoch, small.last_turn = 1, rec, 1, 1
        before = state()
        assert ring.play(work, small) == -1 and state() == before  # the chunk buffer cannot hold the chunk
        with pytest.raises(TypeError):
            ring.play(np.zeros(480, np.float32), cur)
        with pytest.raises(TypeError):
            ring.play(work, object())  # type: ignore[arg-type]
        del small.last
        with pytest.raises(AttributeError):
            ring.play(work, small)
    finally:
        ring.close()
    assert ring.play(work, cur) == -1  # closed: the Python path, which declines
