"""The thinker the engine settings ask for: ``engine.thinker.backend`` picks the torch or the vLLM backend."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine_bridge.config import EngineSettings
from engine_bridge.devices import resolve_device

from .base import DecodingSettings, Message, ThinkerBackend, ThinkerError
from .model_store import DEFAULT_MODEL, TINY_RANDOM
from .prompting import DEFAULT_SYSTEM_PROMPT, SPOKEN_DECODING, SPOKEN_EXAMPLE_NAMES, SPOKEN_EXAMPLES


def model_source(name: str) -> str:
    """The model store's name for a setting: ``smollm2`` is the built-in model; a folder must exist."""
    if name == "smollm2":
        return DEFAULT_MODEL
    if name in (DEFAULT_MODEL, TINY_RANDOM):
        return name
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ThinkerError(
            f"engine.thinker.model {name!r}: no such folder (and not 'smollm2' or 'tiny-random')"
        )
    if not (folder / "config.json").is_file():
        raise ThinkerError(f"engine.thinker.model {name!r}: not a Hugging Face model folder (no config.json)")
    if not any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        raise ThinkerError(f"engine.thinker.model {name!r}: the folder has no tokenizer")
    return str(folder)


def spoken_examples(settings: EngineSettings) -> tuple[Message, ...]:
    """The example turns voice sessions open with (``engine.thinker.spoken_examples``)."""
    mode = settings.thinker.spoken_examples
    if mode == "on" or (mode == "auto" and settings.thinker.model == "smollm2"):
        return SPOKEN_EXAMPLES
    return ()


def spoken_arguments(settings: EngineSettings) -> bool:
    """Whether forced calls take their free strings from the caller's words (``engine.thinker.spoken_arguments``)."""
    mode = settings.thinker.spoken_arguments
    return mode == "on" or (mode == "auto" and settings.thinker.model == "smollm2")


def tool_router_threshold(settings: EngineSettings) -> float | None:
    """The tool router's threshold when ``auto`` replies are routed (``engine.thinker.tool_router``), else None."""
    from .tool_router import ROUTER_THRESHOLD

    t = settings.thinker
    if t.tool_router == "off" or (t.tool_router == "auto" and t.model != "smollm2"):
        return None
    return ROUTER_THRESHOLD if t.tool_router_threshold is None else t.tool_router_threshold


def spoken_decoding(settings: EngineSettings) -> DecodingSettings:
    """How voice sessions' replies are decoded by default: ``max_reply_tokens`` and two sentences, a request
    for length ``long_reply_tokens`` and six (``prompting.asks_for_length``). With the example turns, their
    names may not be said until the conversation says them (``prompting.SPOKEN_EXAMPLE_NAMES``)."""
    t = settings.thinker
    names = SPOKEN_EXAMPLE_NAMES if spoken_examples(settings) else ()
    if t.long_reply_tokens > t.max_reply_tokens:
        return dataclasses.replace(
            SPOKEN_DECODING,
            max_tokens=t.long_reply_tokens,
            brief_max_tokens=t.max_reply_tokens,
            unprompted_words=names,
        )
    return dataclasses.replace(
        SPOKEN_DECODING,
        max_tokens=t.max_reply_tokens,
        brief_max_tokens=None,
        long_max_sentences=None,
        unprompted_words=names,
    )


def make_thinker(settings: EngineSettings) -> ThinkerBackend:
    t = settings.thinker
    device = resolve_device(settings.device)
    source = model_source(t.model)
    decoding = spoken_decoding(settings)
    system_prompt = t.system_prompt or DEFAULT_SYSTEM_PROMPT
    cache_dir = str(settings.cache_dir / "models")
    # Voice sessions and text requests share the thinker: text gets its own slots beyond the voice sessions'.
    sessions = settings.max_sessions + t.max_text_requests
    if t.backend == "vllm":
        from .vllm_backend import VllmThinker, VllmThinkerConfig

        return VllmThinker(
            VllmThinkerConfig(
                model=source,
                dtype=t.dtype,
                device=device,
                max_context_tokens=t.max_model_len,
                max_sessions=sessions,
                system_prompt=system_prompt,
                decoding=decoding,
                cache_dir=cache_dir,
                gpu_memory_utilization=t.gpu_memory_utilization,
                tensor_parallel_size=t.tensor_parallel_size,
                enforce_eager=t.enforce_eager,
                block_size=t.block_size,
                cpu_kv_cache_gib=t.cpu_kv_cache_gib,
                multiprocessing=None if t.engine_core == "auto" else t.engine_core == "own_process",
                spoken_arguments=spoken_arguments(settings),
                tool_router_threshold=tool_router_threshold(settings),
            )
        )
    from .torch_backend import TorchThinker, TorchThinkerConfig

    dtype = t.dtype if t.dtype in ("float32", "bfloat16") else ("bfloat16" if device == "cuda" else "float32")
    return TorchThinker(
        TorchThinkerConfig(
            model=source,
            dtype=dtype,
            weights="int8" if t.quantization == "int8" else "float",
            device=device,
            threads=settings.threads,
            max_context_tokens=t.max_model_len,
            context_trim=t.context_trim,
            max_sessions=sessions,
            system_prompt=system_prompt,
            decoding=decoding,
            cache_dir=cache_dir,
            spoken_arguments=spoken_arguments(settings),
            tool_router_threshold=tool_router_threshold(settings),
        )
    )
