"""The engine's C heap trimmer (engine_bridge/heap.py): freed holes inside the heap go back to the system.

The probe runs in a fresh interpreter, because what glibc keeps depends on what the process freed before. It makes
the holes the way the torch backend does (MB-sized buffers freed between live ones, after glibc's dynamic mmap
threshold has risen) with real ``malloc``/``free`` calls, and reads the process's resident size from /proc.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import pytest

from engine_bridge.heap import HeapTrimmer
from tests.conftest import ROOT, connect_engine, spawn_engine

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")

PROBE = textwrap.dedent(
    """
    import ctypes, json, os, sys
    from engine_bridge.heap import HeapTrimmer

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / 2**20

    # Freeing an 8 MiB mapped block raises glibc's dynamic threshold, so the 1 MiB buffers below come from the heap.
    libc.free(libc.malloc(8 << 20))
    blocks = [libc.malloc(1 << 20) for _ in range(64)]
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)  # resident
    filled = rss_mib()
    for b in blocks[:-1]:  # the last one stays: the holes are inside the heap, not at its top
        libc.free(b)
    freed = rss_mib()
    trimmer = HeapTrimmer(float(sys.argv[1]))
    gave_back = trimmer.trim()
    print(json.dumps({"filled": filled, "freed": freed, "trimmed": rss_mib(), "gave_back": gave_back,
                      "trims": trimmer.trims}))
    """
)


def _probe(interval_s: float) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(interval_s)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_holes_inside_the_heap_stay_resident_until_a_trim_gives_them_back() -> None:
    off = _probe(0.0)  # control: the trimmer is off
    assert off["trims"] == 0 and off["gave_back"] is False
    assert off["freed"] > off["filled"] - 8, "control: free() alone leaves the 63 MiB of holes resident"
    assert off["trimmed"] > off["filled"] - 8

    on = _probe(5.0)
    assert on["trims"] == 1 and on["gave_back"] is True
    assert on["freed"] > on["filled"] - 8
    assert on["trimmed"] < on["freed"] - 48, f"the trim should give back most of the 63 MiB of holes: {on}"


def test_trims_wait_for_an_idle_tick_and_the_interval_but_not_forever() -> None:
    trimmer = HeapTrimmer(5.0, max_interval_s=60.0)
    # The module runs on Linux only, whose glibc (every wheel the engine uses is built for it) has malloc_trim.
    assert trimmer.enabled, "no malloc_trim in this process's C library"
    t0 = time.monotonic()
    assert not trimmer.maybe_trim(idle=True, now=t0 + 1.0), "inside the interval"
    assert not trimmer.maybe_trim(idle=False, now=t0 + 10.0), "busy, and the longest interval has not passed"
    assert trimmer.maybe_trim(idle=True, now=t0 + 10.0), "idle after the interval"
    assert trimmer.trims == 1
    last = time.monotonic()
    assert not trimmer.maybe_trim(idle=True, now=last + 1.0)
    assert trimmer.maybe_trim(idle=False, now=last + 61.0), "a scheduler that is never idle still trims"
    assert trimmer.trims == 2 and trimmer.max_ms >= trimmer.last_ms >= 0.0


def test_bad_intervals_are_refused_and_zero_turns_it_off() -> None:
    with pytest.raises(ValueError, match="heap trim"):
        HeapTrimmer(-1.0)
    with pytest.raises(ValueError, match="heap trim"):
        HeapTrimmer(120.0, max_interval_s=60.0)
    off = HeapTrimmer(0.0)
    assert not off.enabled and not off.maybe_trim(idle=True, now=time.monotonic() + 1e6) and off.trims == 0


async def test_the_engine_trims_its_heap_when_idle_and_reports_it() -> None:
    engine = spawn_engine(adapter="loopback", heap_trim_interval_s=0.2)
    try:
        client = await connect_engine(engine)
        try:
            deadline = time.monotonic() + 10.0
            heap: dict[str, object] = {}
            while time.monotonic() < deadline:
                heap = (await client.ping()).details["heap"]
                if int(heap["trims"]) >= 2:  # type: ignore[call-overload]
                    break
                await asyncio.sleep(0.2)
            assert heap["enabled"] is True and heap["interval_s"] == 0.2
            assert int(heap["trims"]) >= 2, f"an idle engine should trim every 0.2 s: {heap}"  # type: ignore[call-overload]
        finally:
            await client.close()
    finally:
        engine.stop()
