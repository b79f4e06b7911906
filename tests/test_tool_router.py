"""The tool router's embedder and routing (engine_bridge/thinker/tool_router.py) with the real all-MiniLM-L6-v2 from
its wheel: unpacked once into the model cache, and routing that tells a request a tool serves from a question near
the tool's topic."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_bridge.thinker.model_store import ROUTER_EMBEDDER, router_embedder_folder
from engine_bridge.thinker.tool_router import ROUTER_THRESHOLD, SentenceEmbedder, ToolRouter
from engine_bridge.thinker.tools import ToolSpec

pytestmark = pytest.mark.models

WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
ORDER = ToolSpec(
    "get_order_status",
    "Look up the delivery status of an order by its number.",
    {"type": "object", "properties": {"order_number": {"type": "string"}}, "required": ["order_number"]},
)
UNDESCRIBED = ToolSpec("book_table", "", {"type": "object", "properties": {}})


def test_the_embedder_is_unpacked_once_into_the_cache(tmp_path: Path) -> None:
    folder = router_embedder_folder(tmp_path)
    assert folder == tmp_path / ROUTER_EMBEDDER
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (folder / "1_Pooling").is_dir()
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert router_embedder_folder(tmp_path) == folder
    assert (
        folder / "model.safetensors"
    ).stat().st_mtime_ns == before  # read from the cache, not unpacked again
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def test_requests_route_to_their_tool_and_nearby_questions_to_words(tmp_path: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    folder = str(router_embedder_folder(tmp_path))
    router = ToolRouter(
        SentenceEmbedder(AutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
    )
    assert router.threshold == ROUTER_THRESHOLD
    tools = [WEATHER, ORDER, UNDESCRIBED]
    assert router.route("What is the weather like in Paris today?", tools).tool == "get_weather"
    assert router.route("Has order 5512 shipped yet?", tools).tool == "get_order_status"
    assert router.route("Can you book a table for tomorrow?", tools).tool == "book_table"  # by its name
    # Questions near a tool's topic, which the router before this one sent to a tool:
    for words in (
        "What is two plus two?",
        "At what temperature does water boil?",
        "What is the capital of France?",
    ):
        route = router.route(words, tools)
        assert route.tool is None, (words, route)
    assert router.route("   ", tools).tool is None
    assert router.route("What is the weather like in Paris?", []).tool is None
    with pytest.raises(ValueError, match="cosine"):
        ToolRouter(router.embedder, threshold=1.5)
