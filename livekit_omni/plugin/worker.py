"""What the agent workers in ``agents/`` share: the LiveKit ``AgentServer`` with an engine-occupancy load, and
starting an ``AgentSession`` on ``OmniDuplexModel`` inside a job.

The workers themselves (``agents/room_agent.py``, ``agents/sip_agent.py``) only choose names, instructions and
room events; the engine specifics live here, on the ``livekit_omni`` side of the import rule.

Configuration comes from the environment, so one image serves every deployment:

* ``LIVEKIT_URL`` / ``LIVEKIT_API_KEY`` / ``LIVEKIT_API_SECRET``: the LiveKit server (read by LiveKit itself);
* ``LIVEKIT_OMNI_ENGINE_ADDRESS`` (co-located) or ``LIVEKIT_OMNI_BASE_URL`` (+ ``LIVEKIT_OMNI_API_KEY``, remote):
  where the sessions run, see :class:`~livekit_omni.plugin.model.OmniDuplexModel`;
* ``LIVEKIT_OMNI_AGENT_NAME``: explicit dispatch name (empty: every new room gets the room agent);
* ``LIVEKIT_OMNI_AGENT_INSTRUCTIONS`` / ``LIVEKIT_OMNI_AGENT_GREETING``: what the agent is told / says first;
* ``LIVEKIT_OMNI_LOAD_THRESHOLD``: the occupancy at which the worker reports FULL (default 1.0: every engine
  slot in use);
* ``LIVEKIT_OMNI_DRAIN_GRACE_S``: on SIGTERM, how long LiveKit's worker drain lets running jobs finish before it
  stops (default 30 s, the server's own drain grace; docs/deployment.md, Drain).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from livekit.agents import Agent, AgentServer, AgentSession, JobContext, JobExecutorType
from livekit.agents.voice import io

from livekit_omni.plugin.model import OmniDuplexModel
from livekit_omni.plugin.occupancy import EngineOccupancy

#: A job's audio when it does not come from the room: console-like runs and offline tests of the worker.
SessionIO = tuple[io.AudioInput, io.AudioOutput]
SessionIOFactory = Callable[[JobContext], SessionIO]
Entrypoint = Callable[[JobContext], Awaitable[None]]

ENV_AGENT_NAME: Final = "LIVEKIT_OMNI_AGENT_NAME"
ENV_INSTRUCTIONS: Final = "LIVEKIT_OMNI_AGENT_INSTRUCTIONS"
ENV_GREETING: Final = "LIVEKIT_OMNI_AGENT_GREETING"
ENV_LOAD_THRESHOLD: Final = "LIVEKIT_OMNI_LOAD_THRESHOLD"
ENV_DRAIN_GRACE: Final = "LIVEKIT_OMNI_DRAIN_GRACE_S"


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """One worker's settings; ``from_env`` overlays the environment on the worker's own defaults."""

    agent_name: str = ""
    instructions: str = "You are a friendly voice assistant. Keep answers short: one or two sentences."
    greeting: str = ""
    #: Occupancy (0–1) at which LiveKit stops offering this worker jobs. The engine's own limit is the real bound,
    #: so the default lets every slot fill; lower it to keep headroom when several workers share one engine.
    load_threshold: float = 1.0
    #: LiveKit's worker drain on SIGTERM: no new jobs, running ones get this long (LiveKit's default is an hour,
    #: longer than any container stop grace, so the container would be killed mid-call instead).
    drain_grace_s: float = 30.0

    @classmethod
    def from_env(cls, defaults: AgentSettings | None = None) -> AgentSettings:
        d = defaults or cls()
        return cls(
            agent_name=os.environ.get(ENV_AGENT_NAME, d.agent_name),
            instructions=os.environ.get(ENV_INSTRUCTIONS, d.instructions),
            greeting=os.environ.get(ENV_GREETING, d.greeting),
            load_threshold=float(os.environ.get(ENV_LOAD_THRESHOLD, d.load_threshold)),
            drain_grace_s=float(os.environ.get(ENV_DRAIN_GRACE, d.drain_grace_s)),
        )


def create_server(
    entrypoint: Entrypoint,
    settings: AgentSettings,
    *,
    load_fnc: Callable[[], float] | None = None,
    job_executor_type: JobExecutorType | None = None,
    num_idle_processes: int | None = None,
    port: int | None = None,
) -> AgentServer:
    """An ``AgentServer`` running ``entrypoint`` per job, reporting engine occupancy as its load.

    ``load_fnc`` defaults to :class:`EngineOccupancy` of the engine the environment names.
    """
    kwargs: dict[str, object] = {
        "load_fnc": load_fnc if load_fnc is not None else EngineOccupancy(),
        "load_threshold": settings.load_threshold,
        "drain_timeout": max(1, round(settings.drain_grace_s)),
    }
    if job_executor_type is not None:
        kwargs["job_executor_type"] = job_executor_type
    if num_idle_processes is not None:
        kwargs["num_idle_processes"] = num_idle_processes
    if port is not None:
        kwargs["port"] = port
    server = AgentServer(**kwargs)  # type: ignore[arg-type]
    server.rtc_session(entrypoint, agent_name=settings.agent_name)
    return server


def server_builder(
    entrypoint: Callable[..., Awaitable[None]], defaults: AgentSettings
) -> Callable[..., AgentServer]:
    """``build_server(*, session_io=None, load_fnc=None, job_executor_type=None, port=None)`` for an agent module:
    settings come from the environment over ``defaults`` when it is called; ``session_io`` replaces the room's
    audio in every job (offline runs and tests)."""

    def build_server(
        *,
        session_io: SessionIOFactory | None = None,
        load_fnc: Callable[[], float] | None = None,
        job_executor_type: JobExecutorType | None = None,
        port: int | None = None,
    ) -> AgentServer:
        fn = functools.partial(entrypoint, session_io=session_io) if session_io is not None else entrypoint
        return create_server(
            fn,
            AgentSettings.from_env(defaults),
            load_fnc=load_fnc,
            job_executor_type=job_executor_type,
            port=port,
        )

    return build_server


async def start_agent_session(
    ctx: JobContext,
    agent: Agent,
    *,
    model: OmniDuplexModel | None = None,
    session_io: SessionIOFactory | None = None,
    greeting: str = "",
) -> AgentSession:
    """Start ``agent`` on livekit-omni in a job: in the job's room, or on ``session_io``'s audio when given.

    The model (from the environment unless given) is closed when the job shuts down: LiveKit closes the
    session but leaves the model to its owner.
    """
    model = model or OmniDuplexModel()
    ctx.add_shutdown_callback(model.aclose)
    # The engine owns echo handling and barge-in; LiveKit's AEC warm-up would feed it silence instead of the
    # caller during the agent's first seconds of speech, so the caller could not interrupt the greeting.
    session: AgentSession[None] = AgentSession(llm=model, aec_warmup_duration=None)
    if session_io is not None:
        session.input.audio, session.output.audio = session_io(ctx)
        await session.start(agent, record=False)
    else:
        await session.start(agent, room=ctx.room)
    if greeting:
        session.generate_reply(instructions=greeting)
    return session
