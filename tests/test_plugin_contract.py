"""Offline guards for the LiveKit plugin: the livekit-agents contract it relies on (run on every upgrade of the
pin), and the plugin's own configuration surface. Nothing here needs an engine, a server or LiveKit.

The duplex contract is provisional upstream (its hooks are underscored "until the shape settles"), so every
member, signature and event name the plugin uses is asserted here; a failure names what moved.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import Agent, AgentServer, AgentSession, JobContext, Plugin, function_tool, llm, metrics
from livekit.agents.llm import duplex, duplex_adapter
from livekit.agents.voice import io

import livekit_omni
from engine_bridge import protocol as p
from livekit_omni.plugin import gate as gate_mod
from livekit_omni.plugin import session as session_module
from livekit_omni.plugin.colocated import ColocatedSession
from livekit_omni.plugin.gate import IN_REPLY, OmniGate
from livekit_omni.plugin.model import OmniDuplexModel
from livekit_omni.plugin.options import OmniOptions
from livekit_omni.plugin.remote import RemoteSession, health_url, live_sessions_url
from livekit_omni.plugin.session import DropOldestQueue, OmniSession, mono_pcm16_frame, render_item

ROOT = Path(__file__).resolve().parent.parent


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


# --- the livekit-agents contract --------------------------------------------------------------------------------


def test_duplex_model_and_session_abstract_members_are_the_ones_we_implement() -> None:
    assert llm.DuplexModel.__abstractmethods__ == {"session", "aclose"}
    assert llm.DuplexSession.__abstractmethods__ == {
        "audio_stream",
        "tools",
        "push_audio",
        "_update_instructions",
        "_append_items",
        "_update_tools",
        "_update_options",
    }
    # Nothing of them is left abstract in ours.
    assert not OmniDuplexModel.__abstractmethods__
    assert not ColocatedSession.__abstractmethods__
    assert not RemoteSession.__abstractmethods__


def test_duplex_hook_signatures() -> None:
    s = llm.DuplexSession
    assert params(llm.DuplexModel.__init__) == ["self", "capabilities"]
    assert params(s.__init__) == ["self", "duplex_model"]
    assert params(s.push_audio) == ["self", "frame"]
    assert params(s._update_instructions) == ["self", "instructions"]
    assert params(s._append_items) == ["self", "items"]
    assert params(s._update_tools) == ["self", "tools"]
    assert params(s._update_options) == ["self", "tool_choice"]
    assert params(s._generate_reply) == ["self", "instructions", "tool_choice", "tools"]
    assert params(s._update_session) == ["self", "instructions", "chat_ctx", "tools"]
    assert params(s._report_connection_acquired) == ["self", "acquire_time"]
    for name in ("_update_instructions", "_append_items", "_update_tools", "_update_session", "aclose"):
        assert inspect.iscoroutinefunction(getattr(s, name)), name
    for name in ("push_audio", "_update_options", "_generate_reply"):
        assert not inspect.iscoroutinefunction(getattr(s, name)), name
    # Our overrides keep the same shapes (the adapter calls them by keyword).
    for cls in (OmniSession, ColocatedSession, RemoteSession):
        for name in (
            "push_audio",
            "_update_instructions",
            "_append_items",
            "_update_tools",
            "_generate_reply",
        ):
            assert params(getattr(cls, name)) == params(getattr(s, name)), (cls, name)
    # The base releases a waiting model on close and configures in this order.
    src = inspect.getsource(s._update_session)
    assert src.index("_update_instructions") < src.index("_append_items") < src.index("_update_tools")
    assert src.index("_update_tools") < src.index("self._configured.set()")
    assert "self._configured.set()" in inspect.getsource(s.aclose)


def test_duplex_event_names_and_payloads() -> None:
    assert set(typing.get_args(duplex.DuplexEventTypes)) == {
        "transcript_delta",
        "function_call",
        "input_speech_started",
        "input_speech_stopped",
        "input_audio_transcription_completed",
        "session_reconnected",
        "metrics_collected",
        "error",
    }
    assert params(llm.DuplexCapabilities) == [
        "user_transcription",
        "auto_tool_reply_generation",
        "mutable_chat_context",
        "mutable_instructions",
        "mutable_tools",
    ]
    assert params(llm.DuplexAudioFrame) == ["frame", "start_ms"]
    assert params(llm.DuplexOutputTranscriptDelta) == ["text", "start_ms", "end_ms"]
    assert params(llm.InputSpeechStartedEvent) == []
    assert params(llm.InputSpeechStoppedEvent) == ["user_transcription_enabled"]
    assert params(llm.InputTranscriptionCompleted) == [
        "item_id",
        "transcript",
        "is_final",
        "confidence",
        "turn_started_at",
    ]
    assert params(llm.RealtimeSessionReconnectedEvent) == []
    assert set(llm.RealtimeModelError.model_fields) >= {"timestamp", "label", "error", "recoverable"}
    assert params(llm.RealtimeError.__init__) == ["self", "message", "code"]
    m = metrics.RealtimeModelMetrics.model_fields
    assert {"session_duration", "request_id", "timestamp", "label", "metadata", "acquire_time"} <= set(m)


def test_adapter_behaviour_the_plugin_relies_on() -> None:
    sess = duplex_adapter._DuplexRealtimeSession
    # The adapter forwards exactly these events from the duplex session.
    init = inspect.getsource(sess.__init__)
    for name in typing.get_args(duplex.DuplexEventTypes):
        assert f'"{name}"' in init, name
    # The gate sees the very frame we yield (so its userdata carries our in-reply mark), and the model's gate is used.
    assert "self._gate.update(f.frame)" in inspect.getsource(sess._on_audio_frame)
    assert "audio_gate()" in inspect.getsource(duplex_adapter.DuplexRealtimeAdapter.session)
    # A frame's start_ms resets the adapter's clock; transcript spans are anchored on it.
    assert "f.start_ms" in inspect.getsource(sess._on_audio_frame)
    # The gate protocol and the floor clamp our gate mirrors.
    assert {"update", "deactivate"} <= set(dir(llm.AudioGate))
    assert params(llm.FixedGate) == [
        "silence",
        "activation_ratio",
        "deactivation_ratio",
        "min_silence_duration",
    ]
    assert duplex_adapter._SILENCE_FLOOR == gate_mod.GATE_SILENCE_RMS
    fixed = inspect.signature(llm.FixedGate).parameters
    assert fixed["activation_ratio"].default == gate_mod.GATE_ACTIVATION_RATIO
    assert fixed["deactivation_ratio"].default == gate_mod.GATE_DEACTIVATION_RATIO
    # rtc frames carry userdata.
    assert "userdata" in params(rtc.AudioFrame.__init__)


def test_worker_and_session_api_the_agents_use() -> None:
    assert params(Plugin.register_plugin) == ["plugin"]
    assert "main_thread" in inspect.getsource(Plugin.register_plugin)
    assert {"load_fnc", "load_threshold", "job_executor_type", "num_idle_processes", "port"} <= set(
        params(AgentServer.__init__)
    )
    assert params(AgentServer.rtc_session)[:3] == ["self", "func", "agent_name"]
    assert {"devmode", "unregistered"} <= set(params(AgentServer.run))
    assert {"room", "fake_job", "agent_identity"} <= set(params(AgentServer.simulate_job))
    assert {"llm", "aec_warmup_duration"} <= set(params(AgentSession.__init__))
    assert {"agent", "room", "record"} <= set(params(AgentSession.start))
    assert {"add_shutdown_callback", "is_fake_job"} <= set(dir(JobContext))
    assert isinstance(Agent.__dict__["duplex_session"], property)
    assert params(rtc.SipDTMF) == ["code", "digit", "participant"]
    assert io.AudioOutput.__abstractmethods__ == {"capture_frame", "flush", "clear_buffer"}
    assert "__anext__" in io.AudioInput.__dict__


# --- the plugin's surface ---------------------------------------------------------------------------------------


def test_import_is_cheap_and_registers_the_plugin_on_first_use() -> None:
    code = (
        "import sys, json, livekit_omni\n"
        "before = 'livekit.agents' in sys.modules\n"
        "m = livekit_omni.OmniDuplexModel\n"
        "from livekit.agents import Plugin\n"
        "print(json.dumps([before, [p.package for p in Plugin.registered_plugins], m.__module__]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, packages, module = json.loads(out.stdout.strip().splitlines()[-1])
    assert before is False, "import livekit_omni must not import livekit.agents"
    assert "livekit_omni.plugin" in packages
    assert module == "livekit_omni.plugin.model"


def test_options_have_one_set_of_defaults_and_exactly_one_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LIVEKIT_OMNI_ENGINE_ADDRESS", "LIVEKIT_OMNI_BASE_URL", "LIVEKIT_OMNI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="exactly one"):
        OmniDuplexModel()
    with pytest.raises(ValueError, match="exactly one"):
        OmniDuplexModel(engine_address="unix:/tmp/x.sock", base_url="http://h:1/v1")
    with pytest.raises(ValueError, match="engine address"):
        OmniDuplexModel(engine_address="nonsense")
    with pytest.raises(ValueError, match="base_url"):
        OmniDuplexModel(base_url="ftp://h/v1")
    with pytest.raises(ValueError):
        OmniDuplexModel(engine_address="unix:/tmp/x.sock", input_queue_frames=0)
    m = OmniDuplexModel(engine_address="unix:/tmp/x.sock")
    defaults = OmniOptions()
    for name in OmniOptions.__dataclass_fields__:
        if name != "engine_address":
            assert getattr(m.options, name) == getattr(defaults, name), name
    assert m.mode == "colocated" and m.model == "livekit-omni" and m.provider == "livekit-omni"
    monkeypatch.setenv("LIVEKIT_OMNI_BASE_URL", "http://omni:8080/v1")
    monkeypatch.setenv("LIVEKIT_OMNI_API_KEY", "sk-test")
    r = OmniDuplexModel(max_retries=7)
    assert r.mode == "remote" and r.options.api_key == "sk-test" and r.options.max_retries == 7
    # Every constructor argument is an option and vice versa.
    assert params(OmniDuplexModel.__init__)[1:] == list(OmniOptions.__dataclass_fields__)


def test_capabilities_are_honest() -> None:
    for model in (
        OmniDuplexModel(engine_address="unix:/tmp/x.sock"),
        OmniDuplexModel(base_url="http://h/v1"),
    ):
        caps = model.capabilities
        assert caps.user_transcription is True
        # A tool's result asks for no reply by itself: the framework asks for the answer (_generate_reply).
        assert caps.auto_tool_reply_generation is False
        assert caps.mutable_instructions is False and caps.mutable_chat_context is False
        assert caps.mutable_tools is True  # UpdateSession.tools / the Live delegation's session.update


def test_the_framework_asks_for_the_answer_to_a_tool_result() -> None:
    """What the plugin's tool flow relies on in livekit-agents: with ``auto_tool_reply_generation=False`` the
    framework sends the results through ``update_chat_ctx`` and then asks for the reply (``_realtime_reply_task``
    with ``tool_reply=True``, which reaches ``_generate_reply``); the tool choice of that reply is set session-wide
    (``update_options``) because a duplex model has no per-response tool choice; a call with no burst open becomes
    a generation of its own; function tools have LiveKit's OpenAI schema helper."""
    from livekit.agents.voice.agent_activity import AgentActivity

    src = inspect.getsource(AgentActivity._realtime_generation_task_impl)
    assert "auto_tool_reply_generation" in src and "tool_reply=True" in src
    assert src.index("update_chat_ctx(chat_ctx)") < src.index("tool_reply=True")
    reply = inspect.getsource(AgentActivity._realtime_reply_task)
    assert "per_response_tool_choice" in reply and "update_options(tool_choice=" in reply
    assert "generate_reply(" in reply
    adapter = inspect.getsource(duplex_adapter.DuplexRealtimeAdapter.__init__)
    assert "per_response_tool_choice=False" in adapter and "auto_tool_reply_generation=caps" in adapter
    assert '_open_burst(kind="tool")' in inspect.getsource(
        duplex_adapter._DuplexRealtimeSession._on_function_call
    )
    assert params(llm.utils.build_legacy_openai_schema) == ["function_tool", "internally_tagged"]
    assert {"call_id", "name", "arguments"} <= set(llm.FunctionCall.model_fields)
    assert {"call_id", "output", "is_error", "reply_required", "name"} <= set(
        llm.FunctionCallOutput.model_fields
    )


async def test_tools_and_tool_choice_reach_the_engine_configuration() -> None:
    """The agent's tools become the engine's tool definitions (LiveKit's schema of a ``@function_tool``, a raw
    schema as given), the tool choice option goes with them, and none without tools."""

    @function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        return city

    raw = function_tool(
        lambda raw_arguments: "",
        raw_schema={
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    )
    model = OmniDuplexModel(
        engine_address="unix:/tmp/x.sock", tool_choice="get_weather", acknowledgement_delay_ms=800
    )
    s = model.session()
    assert isinstance(s, ColocatedSession)
    try:
        assert s.tools.flatten() == [] and s.tool_choice == p.ToolChoiceSpec()
        await s._update_tools([get_weather, raw])
        assert set(s.tools.function_tools) == {"get_weather", "lookup"}
        config = s._session_config()
        assert [t.name for t in config.tools] == ["get_weather", "lookup"]
        weather = config.tools[0]
        assert weather.description == "Get the current weather in a given city."
        assert weather.parameters["properties"]["city"]["type"] == "string"
        assert weather.parameters["required"] == ["city"]
        assert config.tools[1].parameters == {"type": "object", "properties": {"q": {"type": "string"}}}
        assert config.tool_choice == p.ToolChoiceSpec(mode="function", name="get_weather")
        assert config.acknowledgement_delay_ms == 800
        # The framework's choice overrides the option while it sets one; None restores it.
        s._update_options(tool_choice="none")
        assert s.tool_choice == p.ToolChoiceSpec(mode="none")
        s._update_options(tool_choice={"type": "function", "function": {"name": "lookup"}})
        assert s.tool_choice == p.ToolChoiceSpec(mode="function", name="lookup")
        s._update_options(tool_choice=None)
        assert s.tool_choice == p.ToolChoiceSpec(mode="function", name="get_weather")
    finally:
        await s.aclose()
    # No tools: no choice to make (the engine refuses "required" without tools).
    s = OmniDuplexModel(engine_address="unix:/tmp/x.sock", tool_choice="required").session()
    try:
        assert s.tool_choice == p.ToolChoiceSpec()
    finally:
        await s.aclose()


async def test_tools_the_plugin_can_tell_are_unusable_are_refused_by_name() -> None:
    s = OmniDuplexModel(engine_address="unix:/tmp/x.sock").session()
    bad_name = function_tool(
        lambda raw_arguments: "", raw_schema={"name": "no spaces allowed", "parameters": {"type": "object"}}
    )
    try:
        with pytest.raises(llm.RealtimeError, match="no spaces allowed") as e:
            await s._update_tools([bad_name])
        assert e.value.code == "invalid_tools"
        assert s.tools.flatten() == []
    finally:
        await s.aclose()
    with pytest.raises(ValueError, match="tool_choice"):
        OmniOptions(tool_choice="not a name")
    with pytest.raises(ValueError, match="acknowledgement_delay_ms"):
        OmniOptions(acknowledgement_delay_ms=-5)


def frame(level: float, ms: int = 20, *, in_reply: bool = False) -> rtc.AudioFrame:
    n = 24 * ms
    x = (np.sin(np.arange(n) / 3.0) * level * 32767 * np.sqrt(2)).astype(np.int16)
    return rtc.AudioFrame(x.tobytes(), 24000, 1, n, userdata={IN_REPLY: True} if in_reply else None)


def test_gate_opens_on_the_first_audible_frame_and_closes_after_our_silence() -> None:
    gate = OmniDuplexModel(engine_address="unix:/tmp/x.sock").audio_gate()
    assert isinstance(gate, OmniGate)
    assert not gate.update(frame(0.0))  # digital zeros
    assert not gate.update(frame(2e-4))  # -74 dBFS: below the 3e-4 opening level
    assert gate.update(frame(4e-4))  # -68 dBFS: a soft onset already opens it
    assert gate.update(frame(0.1))
    for _ in range(39):  # 0.78 s of zeros: a pause inside the utterance
        assert gate.update(frame(0.0))
    assert gate.update(frame(0.1))  # speech again resets the count
    states = [gate.update(frame(0.0)) for _ in range(41)]
    assert states[38] is True and states[39] is False  # closes after 0.8 s of silence
    # A gap inside a reply the engine is still producing does not split it, for a bounded time.
    gate.deactivate()
    assert gate.update(frame(0.1, in_reply=True))
    assert all(gate.update(frame(0.0, in_reply=True)) for _ in range(150))  # 3 s clause gap
    assert gate.update(frame(0.1, in_reply=True))
    held = [gate.update(frame(0.0, in_reply=True)) for _ in range(300)]
    # Held for the 4 s pause cap, then closed by the usual 0.8 s of silence (±1 frame of float accumulation).
    assert held[-1] is False and 239 <= held.count(True) <= 241


def test_gate_matches_fixed_gate_outside_replies() -> None:
    ours, theirs = OmniGate(), llm.FixedGate(gate_mod.GATE_SILENCE_RMS, min_silence_duration=0.8)
    rng = np.random.default_rng(3)
    levels = np.concatenate([np.zeros(20), rng.uniform(0, 0.2, 100), np.zeros(60), rng.uniform(0, 5e-4, 80)])
    for lv in levels:
        f = frame(float(lv))
        assert ours.update(f) == theirs.update(f)


async def test_drop_oldest_queue_never_blocks_and_counts() -> None:
    q: DropOldestQueue[int] = DropOldestQueue(3)
    for i in range(10):
        q.put(i)
    assert q.dropped == 7 and len(q) == 3
    assert [await q.get(), await q.get(), q.get_nowait()] == [7, 8, 9]
    q.put(1)
    q.close()
    assert [x async for x in q] == [1]
    q.put(2)  # ignored once closed
    assert await q.get() is None


def test_urls_and_item_rendering() -> None:
    assert live_sessions_url("http://h:8080/v1") == "ws://h:8080/v1/live/sessions"
    assert live_sessions_url("https://h/v1/") == "wss://h/v1/live/sessions"
    assert live_sessions_url("ws://h:1/v1/live/sessions?x=1") == "ws://h:1/v1/live/sessions"
    assert health_url("http://h:8080/v1") == "http://h:8080/health"
    assert health_url("wss://h/v1") == "https://h/health"
    assert render_item(llm.ChatMessage(role="system", content=["be brief"])) == ("developer", "be brief")
    assert render_item(llm.ChatMessage(role="user", content=["hi"])) == ("user", "hi")
    assert render_item(llm.ChatMessage(role="assistant", content=[""])) is None
    call = llm.FunctionCall(call_id="c1", name="f", arguments='{"a": 1}')
    assert render_item(call) == ("developer", 'Called tool f with {"a": 1}')
    assert livekit_omni.OmniDuplexModel is OmniDuplexModel


def test_mono_pcm16_frames_read_back_like_constructed_frames() -> None:
    """The output frames' fast path (no ``rtc.AudioFrame`` constructor) is on with the installed livekit, and what
    it builds is indistinguishable from a constructed frame: data, rate, channels, length, userdata, duration,
    WAV export and LiveKit's own resampling."""
    assert session_module.FAST_FRAMES, (
        "the fast path's check failed on the installed livekit: frames use the constructor"
    )
    pcm = (np.arange(480, dtype=np.int16) * 37).tobytes()
    for data, rate, userdata in (
        (pcm, 24_000, None),
        (pcm[:320], 16_000, {"in_reply": True}),
        (b"", 24_000, None),
    ):
        fast = mono_pcm16_frame(data, rate, userdata)
        built = rtc.AudioFrame(data, rate, 1, len(data) // 2, userdata=userdata)
        assert bytes(fast.data.cast("B")) == bytes(built.data.cast("B")) == data
        assert (fast.sample_rate, fast.num_channels, fast.samples_per_channel, fast.userdata) == (
            built.sample_rate,
            built.num_channels,
            built.samples_per_channel,
            built.userdata,
        )
        assert fast.duration == built.duration
        if data:
            assert fast.to_wav_bytes() == built.to_wav_bytes()
    resampler = rtc.AudioResampler(24_000, 48_000, num_channels=1)
    out = resampler.push(mono_pcm16_frame(pcm, 24_000)) + resampler.flush()
    assert sum(f.samples_per_channel for f in out) > 0


def test_mono_pcm16_frame_falls_back_to_the_constructor_when_the_check_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(session_module, "FAST_FRAMES", False)
    calls: list[int] = []
    real_init = rtc.AudioFrame.__init__

    def counting_init(self: rtc.AudioFrame, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(rtc.AudioFrame, "__init__", counting_init)
    frame = mono_pcm16_frame(bytes(960), 24_000)
    assert calls == [1] and frame.samples_per_channel == 480
