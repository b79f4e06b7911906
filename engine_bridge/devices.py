"""Where the engine's models run: ``engine.device = "auto" | "cpu" | "cuda"`` resolved once, for every stage.

``auto`` picks CUDA when a CUDA device is visible to the libraries that would use it, else the CPU. Each stage
maps the choice onto its own library: faster-whisper (CTranslate2) runs ``cuda``/``float16`` or
``cpu``/``int8``; Piper and Silero (onnxruntime) put the CUDA execution provider first when the installed
onnxruntime has it (``onnxruntime-gpu``), else they stay on the CPU provider; the thinker uses the device for
torch or vLLM. Nothing here imports a model library at module import.
"""

from __future__ import annotations

import logging
from typing import Literal

log = logging.getLogger(__name__)

DeviceSetting = Literal["auto", "cpu", "cuda"]
Device = Literal["cpu", "cuda"]


def cuda_device_count() -> int:
    """CUDA devices visible to torch (0 when torch has no CUDA build or no device)."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install must not stop a CPU start
        return 0


def resolve_device(setting: DeviceSetting) -> Device:
    if setting == "cpu":
        return "cpu"
    if setting == "cuda":
        if cuda_device_count() == 0:
            raise RuntimeError("engine.device is 'cuda' but no CUDA device is visible (torch.cuda)")
        return "cuda"
    return "cuda" if cuda_device_count() > 0 else "cpu"


def onnx_providers(device: Device) -> list[str]:
    """onnxruntime execution providers for a device: CUDA first when this onnxruntime build has it."""
    if device == "cuda":
        import onnxruntime

        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        log.warning("engine.device is cuda but onnxruntime has no CUDA provider (install onnxruntime-gpu)")
    return ["CPUExecutionProvider"]


def whisper_placement(device: Device) -> tuple[str, str]:
    """faster-whisper ``(device, compute_type)``: float16 on CUDA, int8 on the CPU."""
    if device == "cuda":
        try:
            import ctranslate2

            if ctranslate2.get_cuda_device_count() > 0:
                return "cuda", "float16"
        except Exception:
            pass
        log.warning("engine.device is cuda but CTranslate2 sees no CUDA device; whisper runs on the CPU")
    return "cpu", "int8"
