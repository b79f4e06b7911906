"""Seeded fuzzing of every edge of a real ``livekit-omni serve`` (loopback engine: no model time).

    python benchmarks/fuzz_edges.py                       # 10,000 inputs per edge, seed 0
    python benchmarks/fuzz_edges.py --seed 7 --inputs 500 --edges live_json,control
    python benchmarks/fuzz_edges.py --edges sip                 # the SIP endpoint alone (UDP)

Edges, generators and the judge live in :mod:`testkit.fuzz` (tests/test_fuzz_edges.py runs the same
code with fewer inputs). A run is reproducible from its seed: each edge draws from its own stream. Prints a table per
edge (outcomes per mutation, the first bad outcomes with what was sent), then one JSON line: ``inputs``,
``engine_deaths``, ``unexpected_closes``, ``bad_outcomes`` and ``rss_growth_mb`` in total and per edge. Targets:
0 engine deaths, 0 unexpected closes, 0 bad outcomes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import finish
from testkit.fuzz import EDGES, FuzzTarget, fuzz_edge
from tests.conftest import start_server
from tests.sip_peers import free_udp_port

#: The server under test. The fuzzer answers no offer it posts, so each answered offer holds an engine slot until
#: the connect deadline: a short one, and room for many, keep the offers reaching aiortc instead of a full engine.
SERVER_ENV = {
    "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": "64",
    "LIVEKIT_OMNI_LIMITS__WEBRTC_CONNECT_TIMEOUT_S": "2",
    "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
    "LIVEKIT_OMNI_LOG_LEVEL": "WARNING",
}


async def main_async(args: argparse.Namespace) -> int:
    edges = [e.strip() for e in args.edges.split(",") if e.strip()]
    unknown = set(edges) - set(EDGES)
    if unknown:
        raise SystemExit(f"unknown edges {sorted(unknown)}; choose from {', '.join(EDGES)}")
    sip_port = free_udp_port()
    env = {**SERVER_ENV, "LIVEKIT_OMNI_SIP__ENABLED": "true", "LIVEKIT_OMNI_SIP__PORT": str(sip_port)}
    server = await asyncio.to_thread(start_server, adapter="loopback", env=env)
    target = FuzzTarget(server.url, server.proc.pid, "unix:" + server.socket_path, sip_port=sip_port)
    per_edge: dict[str, dict[str, object]] = {}
    t0 = time.monotonic()
    try:
        for edge in edges:
            report = await fuzz_edge(target, edge, seed=args.seed, inputs=args.inputs)
            print(report.table(), flush=True)
            print(flush=True)
            per_edge[edge] = report.summary()
    finally:
        server.stop()
    total = {
        k: sum(int(e[k]) for e in per_edge.values())  # type: ignore[call-overload]
        for k in ("inputs", "engine_deaths", "unexpected_closes", "bad_outcomes")
    }
    finish(
        {
            "benchmark": "fuzz_edges",
            "seed": args.seed,
            **total,
            "rss_growth_mb": round(sum(float(e["rss_growth_mb"]) for e in per_edge.values()), 1),  # type: ignore[arg-type]
            "seconds": round(time.monotonic() - t0, 1),
            "edges": per_edge,
        }
    )
    return 0 if total["engine_deaths"] == 0 and total["bad_outcomes"] == 0 else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inputs", type=int, default=10_000, help="inputs per edge")
    ap.add_argument("--edges", default=",".join(EDGES), help=f"comma-separated, from {', '.join(EDGES)}")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
