"""The engine's thinker: LLM backends whose unit is a conversation holding a KV lease.

``base`` (the contract, data types, errors and the authoritative token log) is cheap to import. The torch
backend, the model store and the prompting helpers import torch/transformers, so they load on first use::

    from engine_bridge.thinker import TorchThinker, TorchThinkerConfig   # imports torch here
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Before any submodule can import transformers/huggingface_hub (they read it at import time): the thinker
# never downloads. Every load also passes local paths with local_files_only=True, so this is belt and
# braces; an operator who sets HF_HUB_OFFLINE=0 explicitly for other stages keeps that choice.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from .base import (
    APPEND_ROLES,
    AppendResult,
    Checkpoint,
    DecodingSettings,
    LogSnapshot,
    Message,
    Role,
    Segment,
    StepOutput,
    ThinkerBackend,
    ThinkerCapacityError,
    ThinkerCaps,
    ThinkerError,
    ThinkerStateError,
    ThinkerStats,
    TokenLog,
    UnknownSessionError,
)

if TYPE_CHECKING:
    from .model_store import DEFAULT_MODEL, TINY_RANDOM, LoadedModel, ensure_converted, load_model
    from .prompting import DEFAULT_SYSTEM_PROMPT, SPOKEN_DECODING, ChatFormat
    from .tools import ToolCall, ToolChoice, ToolSchemaError, ToolSpec
    from .torch_backend import TorchThinker, TorchThinkerConfig

_LAZY: dict[str, str] = {
    "TorchThinker": "torch_backend",
    "TorchThinkerConfig": "torch_backend",
    "DEFAULT_MODEL": "model_store",
    "TINY_RANDOM": "model_store",
    "LoadedModel": "model_store",
    "ensure_converted": "model_store",
    "load_model": "model_store",
    "ToolCall": "tools",
    "ToolChoice": "tools",
    "ToolSchemaError": "tools",
    "ToolSpec": "tools",
    "DEFAULT_SYSTEM_PROMPT": "prompting",
    "SPOKEN_DECODING": "prompting",
    "ChatFormat": "prompting",
}

__all__ = [
    "APPEND_ROLES",
    "DEFAULT_MODEL",
    "DEFAULT_SYSTEM_PROMPT",
    "SPOKEN_DECODING",
    "TINY_RANDOM",
    "AppendResult",
    "ChatFormat",
    "Checkpoint",
    "DecodingSettings",
    "LoadedModel",
    "LogSnapshot",
    "Message",
    "Role",
    "Segment",
    "StepOutput",
    "ThinkerBackend",
    "ThinkerCapacityError",
    "ThinkerCaps",
    "ThinkerError",
    "ThinkerStateError",
    "ThinkerStats",
    "TokenLog",
    "ToolCall",
    "ToolChoice",
    "ToolSchemaError",
    "ToolSpec",
    "TorchThinker",
    "TorchThinkerConfig",
    "UnknownSessionError",
    "ensure_converted",
    "load_model",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
