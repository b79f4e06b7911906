"""A LiveKit SIP agent on livekit-omni: phone calls that LiveKit SIP places in rooms.

An inbound call reaches LiveKit SIP through an inbound trunk; a dispatch rule (deploy/sip-dispatch-rule.json) puts
each caller in a room of their own and dispatches this agent by name (``omni-sip`` unless
``LIVEKIT_OMNI_AGENT_NAME`` says otherwise). The caller joins as a SIP participant and is an ordinary audio track
from then on: narrowband 8 kHz speech, which the plugin resamples to the engine's rate like any other input.
Keypad presses (DTMF) are logged with the call they belong to.

    python agents/sip_agent.py start
"""

from __future__ import annotations

import functools
import logging

from livekit import rtc
from livekit.agents import Agent, JobContext, cli

# Imported at module top level, on the main thread: this registers the plugin with LiveKit.
import livekit_omni.plugin  # noqa: F401
from livekit_omni.plugin.worker import AgentSettings, SessionIOFactory, server_builder, start_agent_session

logger = logging.getLogger("livekit_omni.agents.sip")

DEFAULTS = AgentSettings(
    agent_name="omni-sip",
    instructions=(
        "You are a friendly voice assistant answering a phone call. Answer in one or two short sentences, and "
        "stop talking when the caller talks."
    ),
    # Said in the model's own words (a commentary for the engine), before the caller says anything.
    greeting="Hello, thanks for calling. How can I help you today?",
)


def log_dtmf(room_name: str, ev: rtc.SipDTMF) -> None:
    """One keypad press: the digit, its code, and the caller (SIP participants carry their number)."""
    caller = ""
    if ev.participant is not None:
        caller = ev.participant.attributes.get("sip.phoneNumber", "") or ev.participant.identity
    logger.info("DTMF %r (code %d) from %s in %s", ev.digit, ev.code, caller or "unknown", room_name)


def log_caller(room_name: str, participant: rtc.RemoteParticipant) -> None:
    if participant.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP:
        attrs = participant.attributes
        logger.info(
            "call %s from %s to %s in %s",
            attrs.get("sip.callID", "?"),
            attrs.get("sip.phoneNumber", "?"),
            attrs.get("sip.trunkPhoneNumber", "?"),
            room_name,
        )


async def entrypoint(ctx: JobContext, *, session_io: SessionIOFactory | None = None) -> None:
    settings = AgentSettings.from_env(DEFAULTS)
    room_name = ctx.room.name
    ctx.room.on("sip_dtmf_received", functools.partial(log_dtmf, room_name))
    ctx.room.on("participant_connected", functools.partial(log_caller, room_name))
    await start_agent_session(
        ctx, Agent(instructions=settings.instructions), session_io=session_io, greeting=settings.greeting
    )


build_server = server_builder(entrypoint, DEFAULTS)


if __name__ == "__main__":
    cli.run_app(build_server())
