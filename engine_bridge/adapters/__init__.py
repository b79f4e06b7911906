"""Model adapters: what a model family implements to run inside the engine's sessions, and the registry that
the ``engine.adapter`` setting selects one from by name."""

from engine_bridge.adapters.base import AdapterCaps, ModelAdapter
from engine_bridge.adapters.registry import (
    UnknownAdapterError,
    adapter_class,
    adapter_names,
    make_adapter,
    register_adapter,
)

__all__ = [
    "AdapterCaps",
    "ModelAdapter",
    "UnknownAdapterError",
    "adapter_class",
    "adapter_names",
    "make_adapter",
    "register_adapter",
]
