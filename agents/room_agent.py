"""A LiveKit room agent on livekit-omni: one full-duplex voice session per room.

Run it next to a LiveKit server (``LIVEKIT_URL``, ``LIVEKIT_API_KEY``, ``LIVEKIT_API_SECRET``) and a livekit-omni
engine or server (``LIVEKIT_OMNI_ENGINE_ADDRESS=unix:/…`` co-located, or ``LIVEKIT_OMNI_BASE_URL=http://host:8080/v1``
remote)::

    python agents/room_agent.py start     # production: registers with LiveKit, waits for jobs
    python agents/room_agent.py dev       # development: reloads on change

With ``LIVEKIT_OMNI_AGENT_NAME`` empty (the default) every new room gets this agent; with a name, only rooms that
dispatch it explicitly do. The worker's load is the engine's occupancy, so LiveKit stops sending it rooms when the
engine is full, whatever the worker's CPU says. See docs/deployment.md.
"""

from __future__ import annotations

from livekit.agents import Agent, JobContext, cli

# Imported at module top level, on the main thread: this registers the plugin with LiveKit.
import livekit_omni.plugin  # noqa: F401
from livekit_omni.plugin.worker import AgentSettings, SessionIOFactory, server_builder, start_agent_session

DEFAULTS = AgentSettings(
    agent_name="",
    instructions=(
        "You are a friendly voice assistant in a LiveKit room. Answer in one or two short sentences, and stop "
        "talking when the caller talks."
    ),
)


async def entrypoint(ctx: JobContext, *, session_io: SessionIOFactory | None = None) -> None:
    settings = AgentSettings.from_env(DEFAULTS)
    await start_agent_session(
        ctx, Agent(instructions=settings.instructions), session_io=session_io, greeting=settings.greeting
    )


build_server = server_builder(entrypoint, DEFAULTS)


if __name__ == "__main__":
    cli.run_app(build_server())
