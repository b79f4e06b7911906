"""docker-compose.yml and deploy/ without Docker (not available here): every file, build context and config it
references exists, and the services agree with each other and with the code — ports, keys, addresses, agent
names, dependency order, pinned versions.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from agents import sip_agent
from livekit_omni.plugin import model as plugin_model
from livekit_omni.plugin import options as plugin_options
from livekit_omni.plugin import worker
from livekit_omni.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def load_yaml(rel: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / rel).read_text())


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def published(service: dict[str, Any]) -> set[tuple[int, str]]:
    """(container port, protocol) for every published port, ranges expanded."""
    out: set[tuple[int, str]] = set()
    for spec in service.get("ports", []):
        spec, _, proto = str(spec).partition("/")
        host, _, container = spec.rpartition(":")
        assert host, f"{spec}: publish with an explicit host port"
        lo, _, hi = container.partition("-")
        hlo, _, hhi = host.partition("-")
        assert (hlo, hhi) == (lo, hi), f"{spec}: WebRTC/RTP ports must be published 1:1"
        for port in range(int(lo), int(hi or lo) + 1):
            out.add((port, proto or "tcp"))
    return out


def dockerfile_of(service: dict[str, Any]) -> Path:
    build = service["build"]
    return ROOT / build["context"] / build.get("dockerfile", "Dockerfile")


def test_every_referenced_file_and_build_context_exists(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            ctx = ROOT / svc["build"]["context"]
            assert ctx.is_dir(), (name, ctx)
            dockerfile = dockerfile_of(svc)
            assert dockerfile.is_file(), (name, dockerfile)
            for line in dockerfile.read_text().splitlines():
                words = line.split()
                if words and words[0] == "COPY" and not any(w.startswith("--from") for w in words):
                    for src in [w for w in words[1:-1] if not w.startswith("--")]:
                        assert (ctx / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"
        for vol in svc.get("volumes", []):
            src = str(vol).split(":", 1)[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), (name, src)
        # Scripts the containers run exist in the image's context.
        for word in svc.get("command", []) if isinstance(svc.get("command"), list) else []:
            if word.endswith(".py"):
                assert (ROOT / word).is_file(), (name, word)


def test_named_volumes_are_declared_and_dependencies_are_wired(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = str(vol).split(":", 1)[0]
            if not src.startswith((".", "/")):
                assert src in declared, (name, src)
        deps = svc.get("depends_on") or {}
        for dep, cond in deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps):
            assert dep in services, (name, dep)
            condition = (cond or {}).get("condition", "service_started")
            assert condition in ("service_started", "service_healthy", "service_completed_successfully")
            if condition == "service_healthy":
                target = services[dep]
                has_check = "healthcheck" in target or (
                    "build" in target and "HEALTHCHECK" in dockerfile_of(target).read_text()
                )
                assert has_check, f"{name} waits for {dep} to be healthy, but {dep} has no health check"
    # Start order: LiveKit and SIP after Redis, workers after LiveKit and a healthy engine.
    assert services["livekit"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert {"redis", "livekit"} <= set(services["sip"]["depends_on"])
    for agent in ("agent", "sip-agent", "agent-colocated"):
        deps = services[agent]["depends_on"]
        assert "livekit" in deps and deps["omni"]["condition"] == "service_healthy", agent


def test_livekit_and_sip_ports_keys_and_redis_agree(services: dict[str, dict[str, Any]]) -> None:
    lk, sip = load_yaml("deploy/livekit.yaml"), load_yaml("deploy/sip.yaml")
    ports = published(services["livekit"])
    assert (lk["port"], "tcp") in ports and (lk["rtc"]["tcp_port"], "tcp") in ports
    assert {
        (p, "udp") for p in range(lk["rtc"]["port_range_start"], lk["rtc"]["port_range_end"] + 1)
    } <= ports
    sip_ports = published(services["sip"])
    assert {(sip["sip_port"], "udp"), (sip["sip_port"], "tcp")} <= sip_ports
    lo, hi = (int(x) for x in str(sip["rtp_port"]).split("-"))
    assert {(p, "udp") for p in range(lo, hi + 1)} <= sip_ports
    # No two services publish the same host port.
    seen: set[tuple[int, str]] = set()
    for svc in services.values():
        mine = published(svc)
        assert not (mine & seen), mine & seen
        seen |= mine
    # One key pair everywhere, with a secret LiveKit accepts (32+ characters).
    ((key, secret),) = lk["keys"].items()
    assert len(secret) >= 32
    assert (sip["api_key"], sip["api_secret"]) == (key, secret)
    for name in ("agent", "sip-agent", "agent-colocated"):
        env = env_of(services[name])
        assert (env["LIVEKIT_API_KEY"], env["LIVEKIT_API_SECRET"]) == (key, secret), name
        assert env["LIVEKIT_URL"] == f"ws://livekit:{lk['port']}", name
    assert sip["ws_url"] == f"ws://livekit:{lk['port']}"
    # Both reach Redis by its service name.
    for cfg in (lk, sip):
        host, _, port = cfg["redis"]["address"].partition(":")
        assert host in services and port == "6379"
    # The SIP service reads the mounted config.
    mount = next(v for v in services["sip"]["volumes"] if "sip.yaml" in v).split(":")[1]
    assert env_of(services["sip"])["SIP_CONFIG_FILE"] == mount
    lk_mount = next(v for v in services["livekit"]["volumes"] if "livekit.yaml" in v).split(":")[1]
    assert lk_mount in services["livekit"]["command"]


def test_omni_server_config_loads_and_matches_its_service(services: dict[str, dict[str, Any]]) -> None:
    omni = services["omni"]
    cmd = omni["command"]
    config_path = cmd[cmd.index("--config") + 1]
    source = next(v.split(":")[0] for v in omni["volumes"] if v.split(":")[1] == config_path)
    settings = Settings.load(ROOT / source)
    assert settings.host == "0.0.0.0" and settings.engine.adapter == "cascade"
    assert (settings.port, "tcp") in published(omni)
    # The engine's socket sits on the volume a co-located worker shares.
    sock_dir = str(Path(settings.engine.address.removeprefix("unix:")).parent)
    volume = next(v.split(":")[0] for v in omni["volumes"] if v.split(":")[1] == sock_dir)
    assert not volume.startswith(".")
    assert omni.get("ipc") == "shareable"


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m)", duration)
    assert m, f"stop_grace_period {duration!r}: write it as e.g. 45s or 2m"
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


def test_stop_grace_outlasts_the_drain(services: dict[str, dict[str, Any]]) -> None:
    """`docker compose stop` sends SIGTERM, then SIGKILL after stop_grace_period (default 10 s): it must leave the
    server its drain grace, and each worker LiveKit's drain of the same length, with time to spare."""
    omni = services["omni"]
    cmd = omni["command"]
    config_path = cmd[cmd.index("--config") + 1]
    source = next(v.split(":")[0] for v in omni["volumes"] if v.split(":")[1] == config_path)
    grace = Settings.load(ROOT / source).drain_grace_s
    assert _seconds(omni["stop_grace_period"]) >= grace + 10
    for name in ("agent", "sip-agent", "agent-colocated"):
        svc = services[name]
        drain = float(env_of(svc).get(worker.ENV_DRAIN_GRACE, worker.AgentSettings().drain_grace_s))
        assert _seconds(svc["stop_grace_period"]) >= drain + 10, name


def test_agents_reach_the_engine_the_way_their_mode_needs(services: dict[str, dict[str, Any]]) -> None:
    settings = Settings.load(ROOT / "deploy/omni.toml")
    for name in ("agent", "sip-agent"):
        env = env_of(services[name])
        assert env[plugin_options.ENV_BASE_URL] == f"http://omni:{settings.port}/v1", name
        model = plugin_model.OmniDuplexModel(base_url=env[plugin_options.ENV_BASE_URL])
        assert model.mode == "remote"
    colo = services["agent-colocated"]
    env = env_of(colo)
    assert env[plugin_options.ENV_ENGINE_ADDRESS] == settings.engine.address
    assert (
        plugin_model.OmniDuplexModel(engine_address=env[plugin_options.ENV_ENGINE_ADDRESS]).mode
        == "colocated"
    )
    # Shared memory and PIDs of the engine's container, and its socket volume at the same place.
    assert colo["ipc"] == "service:omni" and colo["pid"] == "service:omni"
    sock_dir = str(Path(settings.engine.address.removeprefix("unix:")).parent)
    omni_vol = next(v.split(":")[0] for v in services["omni"]["volumes"] if v.split(":")[1] == sock_dir)
    assert f"{omni_vol}:{sock_dir}" in colo["volumes"]
    assert colo.get("profiles") == ["colocated"]
    # Every LIVEKIT_OMNI_* variable a worker is given is one the code reads.
    known = {
        plugin_options.ENV_ENGINE_ADDRESS,
        plugin_options.ENV_BASE_URL,
        plugin_options.ENV_API_KEY,
        worker.ENV_AGENT_NAME,
        worker.ENV_INSTRUCTIONS,
        worker.ENV_GREETING,
        worker.ENV_LOAD_THRESHOLD,
    }
    for name in ("agent", "sip-agent", "agent-colocated"):
        used = {k for k in env_of(services[name]) if k.startswith("LIVEKIT_OMNI_")}
        assert used <= known, (name, used - known)


def test_agent_names_route_rooms_and_calls_once(services: dict[str, dict[str, Any]]) -> None:
    rule = json.loads((ROOT / "deploy/sip-dispatch-rule.json").read_text())["dispatch_rule"]
    (dispatched,) = [a["agentName"] for a in rule["roomConfig"]["agents"]]
    assert dispatched == sip_agent.DEFAULTS.agent_name
    assert env_of(services["sip-agent"])[worker.ENV_AGENT_NAME] == dispatched
    assert "dispatchRuleIndividual" in rule["rule"]  # one room per caller
    json.loads((ROOT / "deploy/sip-inbound-trunk.json").read_text())["trunk"]["numbers"]
    # The remote room agent takes every new room (no name); any other room worker needs a name of its own.
    names = [
        env_of(services[n]).get(worker.ENV_AGENT_NAME, "") for n in ("agent", "sip-agent", "agent-colocated")
    ]
    assert names[0] == "" and len(set(names)) == 3


def test_worker_image_pins_match_the_project() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(re.match(r"([A-Za-z0-9_.-]+)(.*)", d).groups() for d in project)  # type: ignore[union-attr]
    reqs = [
        line.strip()
        for line in (ROOT / "deploy/agent-requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for req in reqs:
        name, _, version = req.partition("==")
        assert version, f"{req}: pin an exact version"
        spec = pins[name]
        if spec.startswith("=="):
            assert spec == f"=={version}", (name, spec, version)
        else:
            assert name == "livekit-agents" and spec == ">=1.8.9,<1.9" and version.startswith("1.8.")
    assert "torch" not in " ".join(reqs)


def test_deployment_doc_covers_running_and_scaling() -> None:
    doc = (ROOT / "docs/deployment.md").read_text()
    for needle in ("docker compose up", "--profile colocated", "load", "dispatch", "LIVEKIT_NODE_IP", "sip"):
        assert needle in doc, needle
