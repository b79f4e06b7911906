"""Tool calls without a model: the formats' rendering and parsing, OpenAI's tool and tool_choice shapes, what a
reply with tools says aloud, and the grammar (compiled by xgrammar for SmolLM2's tokenizer) on written text. The
backends' side, on both backends, is in tests/test_thinker_contract.py; the real model's at the end here."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import xgrammar as xgr

from engine_bridge.thinker.model_store import load_tokenizer
from engine_bridge.thinker.tool_grammar import ToolGrammars
from engine_bridge.thinker.tools import (
    TOOL_FORMATS,
    ToolCall,
    ToolChoice,
    ToolReplyState,
    ToolSchemaError,
    ToolSpec,
    detect_tool_format,
    grammar_spec,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = ToolSpec("get_weather", "Get the current weather in a given city.", CITY)


@pytest.fixture(scope="module")
def grammars() -> ToolGrammars:
    tok = load_tokenizer()
    return ToolGrammars(tok, len(tok), [tok.eos_token_id])


def test_openai_tool_shapes_parse_to_the_same_spec() -> None:
    chat = {
        "type": "function",
        "function": {"name": "get_weather", "description": WEATHER.description, "parameters": CITY},
    }
    flat = {"type": "function", "name": "get_weather", "description": WEATHER.description, "parameters": CITY}
    assert ToolSpec.parse(chat) == ToolSpec.parse(flat) == WEATHER
    assert ToolSpec.parse({"type": "function", "name": "noargs"}).parameters == {
        "type": "object",
        "properties": {},
    }
    with pytest.raises(ToolSchemaError):
        ToolSpec.parse({"type": "web_search"})
    with pytest.raises(ToolSchemaError):
        ToolSpec("has space", "", CITY)


def test_tool_choice_reads_openai_values() -> None:
    assert ToolChoice.parse(None) == ToolChoice.parse("auto") == ToolChoice("auto")
    assert ToolChoice.parse("none").mode == "none" and ToolChoice.parse("required").mode == "required"
    named = ToolChoice("function", "get_weather")
    assert ToolChoice.parse({"type": "function", "function": {"name": "get_weather"}}) == named
    assert ToolChoice.parse({"type": "function", "name": "get_weather"}) == named
    with pytest.raises(ToolSchemaError):
        ToolChoice.parse("sometimes")
    with pytest.raises(ToolSchemaError):
        named.check([])


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_a_rendered_call_parses_back(name: str) -> None:
    fmt = TOOL_FORMATS[name]
    block = fmt.render_tools([WEATHER])
    assert "<tools>" in block and '"name": "get_weather"' in block and fmt.render_tools([]) == ""
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    text = "Let me check. " + fmt.render_call(call)
    parsed = fmt.parse_call(text)
    assert parsed is not None and (parsed.name, parsed.parsed_arguments()) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert fmt.parse_call(text[:-3]) is None  # cut before the closer: no call


def test_smollm2_and_hermes_calls_look_like_their_templates() -> None:
    call = ToolCall("c", "get_weather", '{"city": "Paris"}')
    assert TOOL_FORMATS["smollm2"].render_call(call) == (
        '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'
    )
    assert TOOL_FORMATS["hermes"].render_call(call) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    qwen_like = "{% for tool in tools %}...{% endfor %}<tool_call>\\n{{ tool_call.name }}</tool_call>"
    assert detect_tool_format(qwen_like).name == "hermes"
    assert detect_tool_format(load_tokenizer().chat_template).name == "smollm2"


def test_speakable_text_never_includes_the_call() -> None:
    state = ToolReplyState(TOOL_FORMATS["hermes"], ToolChoice("auto"))
    said = state.speakable("Sure. <tool", 3)
    assert said == "Sure. " and not state.in_call  # a tail that may become the trigger is held back
    assert state.speakable('Sure. <tool_call>\n{"name"', 6) == "" and state.call_token_start == 6
    state = ToolReplyState(TOOL_FORMATS["hermes"], ToolChoice("auto"))
    assert state.speakable("a <", 2) == "a "
    assert state.speakable("a < b", 3) == "< b"  # it was not the trigger after all
    assert state.speakable("a < b <", 4, final=True) == " <"  # the reply ended: nothing is held back


def _accepts(grammars: ToolGrammars, spec: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammars.compile(spec))
    return bool(matcher.accept_string(text))


def test_auto_allows_words_then_one_valid_call(grammars: ToolGrammars) -> None:
    fmt = TOOL_FORMATS["smollm2"]
    spec = grammar_spec(fmt, [WEATHER], ToolChoice("auto"))
    assert spec is not None
    good = fmt.render_call(ToolCall("c", "get_weather", '{"city": "Paris"}'))
    assert _accepts(grammars, spec, "It is sunny.")
    assert _accepts(grammars, spec, "One moment. " + good)
    assert not _accepts(grammars, spec, "One moment. " + good.replace('"Paris"', "42"))
    assert not _accepts(grammars, spec, good.replace("get_weather", "get_stock"))


def test_required_starts_in_the_call_and_none_never_opens_one(grammars: ToolGrammars) -> None:
    fmt = TOOL_FORMATS["hermes"]
    good = fmt.render_call(ToolCall("c", "get_weather", '{"city": "Paris"}'))
    required = grammar_spec(fmt, [WEATHER], ToolChoice("required"))
    none = grammar_spec(fmt, [WEATHER], ToolChoice("none"))
    assert required is not None and none is not None
    assert _accepts(grammars, required, good) and not _accepts(grammars, required, "Hi " + good)
    assert _accepts(grammars, none, "It is sunny.") and not _accepts(grammars, none, "x <tool_call>")
    assert grammar_spec(fmt, [], ToolChoice("auto")) is None


def test_a_schema_the_library_cannot_compile_is_a_typed_error(grammars: ToolGrammars) -> None:
    bad = ToolSpec("lookup", "", {"type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}})
    with pytest.raises(ToolSchemaError, match="lookup"):
        grammars.check(TOOL_FORMATS["smollm2"], [bad])


@pytest.mark.slow
def test_real_model_calls_get_weather_for_paris() -> None:
    """SmolLM2-135M, greedy: with ``required`` it calls get_weather(city="Paris"). With ``auto`` it answers in
    words (it was not trained on tools; docs/speech-stack.md, Thinker: tool calls), so that is what is checked."""
    from engine_bridge.thinker.prompting import SPOKEN_DECODING
    from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

    th = TorchThinker(TorchThinkerConfig())
    results: dict[str, Any] = {}
    for mode in ("auto", "required"):
        th.open(mode, tools=[WEATHER])
        th.append(mode, "user", "What is the weather like in Paris today?")
        th.begin_reply(mode, decoding=dataclasses.replace(SPOKEN_DECODING, tool_choice=ToolChoice(mode)))
        said, out = "", None
        while out is None or not out.done:
            out = th.step([mode])[mode]
            said += out.text
        results[mode] = (said, out.tool_call)
        th.close(mode)
    call = results["required"][1]
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert results["auto"][1] is None and "Paris" in results["auto"][0]
