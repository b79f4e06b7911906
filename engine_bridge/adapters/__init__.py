"""Model adapters: what a model family implements to run inside the engine's sessions."""

from engine_bridge.adapters.base import AdapterCaps, ModelAdapter, make_adapter

__all__ = ["AdapterCaps", "ModelAdapter", "make_adapter"]
