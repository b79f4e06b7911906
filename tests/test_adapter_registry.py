"""The model-adapter registry: the ``engine.adapter`` setting's name selects a lazily imported adapter class."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from engine_bridge.adapters import registry
from engine_bridge.adapters.base import ModelAdapter
from engine_bridge.adapters.loopback import LoopbackFixtureAdapter
from engine_bridge.config import EngineSettings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test stay in that test."""
    monkeypatch.setattr(registry, "_adapters", dict(registry.BUILTIN_ADAPTERS))


def test_importing_the_registry_imports_no_adapter() -> None:
    code = (
        "import json, sys\n"
        "import engine_bridge.adapters.registry\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('engine_bridge') or m == 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "engine_bridge.adapters.registry" in loaded
    assert not {"engine_bridge.adapters.cascade", "engine_bridge.adapters.loopback", "torch"} & loaded, loaded


def test_every_builtin_name_resolves_to_the_adapter_of_that_name() -> None:
    assert (
        registry.adapter_names()
        == sorted(registry.BUILTIN_ADAPTERS)
        == ["cascade", "loopback", "omni_bridge"]
    )
    for name in registry.adapter_names():
        cls = registry.adapter_class(name)
        assert issubclass(cls, ModelAdapter)
        assert cls.name == name


def test_make_adapter_builds_the_adapter_the_setting_names() -> None:
    settings = EngineSettings(adapter="loopback")
    adapter = registry.make_adapter(settings)
    assert type(adapter) is LoopbackFixtureAdapter
    assert adapter.settings is settings


def test_an_unknown_name_fails_listing_the_known_ones() -> None:
    with pytest.raises(registry.UnknownAdapterError) as err:
        registry.make_adapter(EngineSettings(adapter="moshi_native"))
    assert (
        str(err.value)
        == "unknown model adapter 'moshi_native'; known adapters: cascade, loopback, omni_bridge"
    )


def test_the_setting_refuses_a_malformed_name() -> None:
    with pytest.raises(pydantic.ValidationError):
        EngineSettings(adapter="Cascade Adapter")


@pytest.mark.usefixtures("scratch_registry")
def test_a_registered_name_plugs_in_and_cannot_be_claimed_twice() -> None:
    target = "engine_bridge.adapters.loopback:LoopbackFixtureAdapter"
    registry.register_adapter("echo", target)
    registry.register_adapter("echo", target)  # the same registration again is harmless
    assert "echo" in registry.adapter_names()
    assert type(registry.make_adapter(EngineSettings(adapter="echo"))) is LoopbackFixtureAdapter
    with pytest.raises(ValueError, match="already registered"):
        registry.register_adapter("echo", "engine_bridge.adapters.cascade:CascadeAdapter")
    registry.register_adapter("echo", "engine_bridge.adapters.cascade:CascadeAdapter", replace=True)
    assert registry.adapter_class("echo").name == "cascade"


@pytest.mark.usefixtures("scratch_registry")
def test_registration_checks_the_name_the_target_and_what_it_names() -> None:
    with pytest.raises(ValueError, match="must match"):
        registry.register_adapter("Echo", "engine_bridge.adapters.loopback:LoopbackFixtureAdapter")
    with pytest.raises(ValueError, match=r"package\.module:ClassName"):
        registry.register_adapter("echo", "engine_bridge.adapters.loopback.LoopbackFixtureAdapter")
    registry.register_adapter("not_an_adapter", "engine_bridge.config:EngineSettings")
    with pytest.raises(TypeError, match="not a ModelAdapter subclass"):
        registry.adapter_class("not_an_adapter")
