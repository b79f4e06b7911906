"""The vLLM-Omni bridge adapter (``engine.adapter = "omni_bridge"``): speech-to-speech models served by a
``vllm-omni serve`` sidecar, behind the engine's rings. See :mod:`.adapter`."""

from engine_bridge.adapters.omni.adapter import OmniBridgeAdapter

__all__ = ["OmniBridgeAdapter"]
