"""The OpenAI Agents SDK's realtime runner as a caller, run by tests/test_realtime_clients.py in a subprocess.

A subprocess because this repository's own top-level ``agents`` package (the LiveKit room and SIP workers) would
shadow the SDK's ``agents`` package in the test process, whose path starts at the repository root. Run it with
``python -P`` and a PYTHONPATH without the repository.

Usage: ``python -P tests/agents_sdk_caller.py <ws-url> <api-key> <instructions> <pcm-file>``, where the file holds
PCM16 mono 24 kHz to speak (at real time). Prints one JSON object: the answer's transcript, the bytes of answer
audio heard, the SDK's error events (it reports a server event that fails its validation as one), and the types
of the events it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from agents.realtime import RealtimeAgent, RealtimeRunner

SAMPLES_PER_SEND = 2400  # 100 ms at 24 kHz


async def main(url: str, key: str, instructions: str, pcm_path: str) -> dict[str, Any]:
    audio = Path(pcm_path).read_bytes()
    runner = RealtimeRunner(starting_agent=RealtimeAgent(name="Assistant", instructions=instructions))
    session = await runner.run(model_config={"url": url, "api_key": key})
    out: dict[str, Any] = {"answer": "", "audio_bytes": 0, "errors": [], "events": []}
    async with session:

        async def mic() -> None:
            # At real time, never catching up in a burst after a slow send (the server drops a burst).
            step = SAMPLES_PER_SEND * 2  # bytes
            for i in range(0, len(audio), step):
                await session.send_audio(audio[i : i + step])
                await asyncio.sleep(0.1)

        feeder: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(90):
                async for event in session:
                    if feeder is None:
                        feeder = asyncio.create_task(mic())  # the session is up: the microphone opens
                    out["events"].append(event.type)
                    if event.type == "error":
                        out["errors"].append(repr(event.error))
                    elif event.type == "audio":
                        out["audio_bytes"] += len(event.audio.data)
                    elif event.type == "history_updated":
                        for item in event.history:
                            if (
                                getattr(item, "role", None) == "assistant"
                                and getattr(item, "status", None) == "completed"
                            ):
                                parts = getattr(item, "content", [])
                                out["answer"] = " ".join(getattr(p, "transcript", None) or "" for p in parts)
                    if out["answer"] and event.type == "agent_end":
                        break
        except TimeoutError:
            out["errors"].append("timed out waiting for the answer")
        finally:
            if feeder is not None:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
