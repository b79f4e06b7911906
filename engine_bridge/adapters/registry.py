"""Which model adapter the ``engine.adapter`` setting names: a table from name to a lazily imported target.

Each entry maps a setting value (``"cascade"``) to a ``"module:attribute"`` target naming a
:class:`~engine_bridge.adapters.base.ModelAdapter` subclass. The target is imported only when that adapter is made,
so importing this module (or the engine) does not import the cascade's speech models, and an adapter module may
import :mod:`engine_bridge.adapters.base` without closing an import cycle through this table.

A new adapter plugs in by name: add it to :data:`BUILTIN_ADAPTERS` (adapters shipped with the engine) or call
:func:`register_adapter` in the engine process before the engine starts (adapters living elsewhere).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from engine_bridge.adapters.base import ModelAdapter
from engine_bridge.config import ADAPTER_NAME_PATTERN, EngineSettings

NAME_PATTERN: Final = re.compile(ADAPTER_NAME_PATTERN)
_TARGET_PATTERN: Final = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")

#: The adapters that ship with the engine.
BUILTIN_ADAPTERS: Final[Mapping[str, str]] = MappingProxyType(
    {
        # VAD -> ASR -> thinker with a KV lease -> TTS; the product's default.
        "cascade": "engine_bridge.adapters.cascade:CascadeAdapter",
        # A vLLM-Omni duplex sidecar (MiniCPM-o 4.5, Qwen3-Omni, PersonaPlex, Nemotron VoiceChat) over its WebSocket.
        "omni_bridge": "engine_bridge.adapters.omni:OmniBridgeAdapter",
        # Echoes the caller after a delay: a test fixture for the data plane, loads no models.
        "loopback": "engine_bridge.adapters.loopback:LoopbackFixtureAdapter",
    }
)

_adapters: dict[str, str] = dict(BUILTIN_ADAPTERS)


class UnknownAdapterError(ValueError):
    """The setting names no registered adapter."""


def adapter_names() -> list[str]:
    """Every name the ``engine.adapter`` setting may take, sorted."""
    return sorted(_adapters)


def register_adapter(name: str, target: str, *, replace: bool = False) -> None:
    """Make ``name`` select the adapter class at ``target`` (``"package.module:ClassName"``, imported on use).

    Registering a name again with a different target needs ``replace=True``, so two adapters cannot silently
    claim one name.
    """
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"adapter name {name!r} must match {NAME_PATTERN.pattern}")
    if not _TARGET_PATTERN.fullmatch(target):
        raise ValueError(f"adapter target {target!r} must look like 'package.module:ClassName'")
    current = _adapters.get(name)
    if current is not None and current != target and not replace:
        raise ValueError(f"adapter {name!r} is already registered as {current!r} (pass replace=True)")
    _adapters[name] = target


def adapter_class(name: str) -> type[ModelAdapter]:
    """Import and return the adapter class registered as ``name``."""
    target = _adapters.get(name)
    if target is None:
        raise UnknownAdapterError(
            f"unknown model adapter {name!r}; known adapters: {', '.join(adapter_names())}"
        )
    module_name, _, attribute = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attribute)
    if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)):
        raise TypeError(f"adapter {name!r} ({target}) is not a ModelAdapter subclass")
    return cls


def make_adapter(settings: EngineSettings) -> ModelAdapter:
    """The adapter the settings name (``settings.adapter``), constructed with them; models load later (``load``)."""
    return adapter_class(settings.adapter)(settings)
