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
from engine_bridge.thinker.prompting import MARKUP_CHARS
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
    spoken_schema,
    spoken_spans,
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


def test_spoken_spans_read_numbers_without_thousands_separators() -> None:
    """whisper writes a spoken order number with a thousands comma ("Has order 5,512 shipped yet?"): the argument
    is the number as said, while a comma between words stays a comma."""
    spans = spoken_spans("Has order 5,512 shipped yet? Order 1,234,567, or 12,34.")
    assert "5512" in spans and "order 5512" in spans and "5,512" not in spans
    assert "1234567" in spans and "12,34" in spans


def test_spoken_spans_are_the_callers_runs_of_words() -> None:
    spans = spoken_spans("Can we book a table on New Year's Eve, December 12th?")
    assert {"New Year's Eve", "December 12th", "table", "Can we book a table on"} <= set(spans)
    assert "Eve," not in spans and "12th?" not in spans and len(spans) == len(set(spans))
    assert all(len(s.split()) <= 6 for s in spans) and spoken_spans(" ... ") == []


def test_a_spoken_schema_takes_free_strings_from_the_spans() -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "A city", "maxLength": 6},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "day": {"type": "string", "format": "date"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "n": {"type": "integer"},
        },
    }
    out = spoken_schema(schema, ["Paris", "in Paris today"])
    assert out["properties"]["city"] == {**schema["properties"]["city"], "enum": ["Paris"]}  # fits maxLength
    assert out["properties"]["tags"]["items"]["enum"] == ["Paris", "in Paris today"]
    for kept in ("unit", "day", "n"):
        assert out["properties"][kept] == schema["properties"][kept]
    assert spoken_schema(schema, []) == schema


def test_a_spoken_grammar_allows_only_the_callers_words(grammars: ToolGrammars) -> None:
    fmt = TOOL_FORMATS["smollm2"]
    spec = grammar_spec(fmt, [WEATHER], ToolChoice("required"), spoken="Is it raining in Berlin?")
    assert spec is not None
    call = fmt.render_call(ToolCall("c", "get_weather", '{"city": "Berlin"}'))
    assert _accepts(grammars, spec, call)
    assert not _accepts(grammars, spec, call.replace("Berlin", "London"))


def _decode(th: Any, sid: str, decoding: Any) -> tuple[str, Any]:
    """Begin a reply with ``decoding`` and step it to its end: (what it said aloud, its last step output)."""
    th.begin_reply(sid, decoding=decoding)
    said, out = "", None
    while out is None or not out.done:
        out = th.step([sid])[sid]
        said += out.text
    return said, out


def test_spoken_arguments_are_on_for_the_built_in_model_only(tmp_path: Any) -> None:
    from engine_bridge.config import EngineSettings
    from engine_bridge.thinker.factory import spoken_arguments

    def settings(**thinker: Any) -> EngineSettings:
        return EngineSettings.model_validate({"thinker": thinker})

    assert spoken_arguments(EngineSettings()) is True  # smollm2, the default
    # A model of your own writes its own values.
    assert spoken_arguments(settings(model=str(tmp_path))) is False
    assert spoken_arguments(settings(model=str(tmp_path), spoken_arguments="on")) is True
    assert spoken_arguments(settings(spoken_arguments="off")) is False


def test_the_tool_router_is_on_for_the_built_in_model_only(tmp_path: Any) -> None:
    from engine_bridge.config import EngineSettings
    from engine_bridge.thinker.factory import tool_router_threshold
    from engine_bridge.thinker.tool_router import ROUTER_THRESHOLD

    def settings(**thinker: Any) -> EngineSettings:
        return EngineSettings.model_validate({"thinker": thinker})

    assert tool_router_threshold(EngineSettings()) == ROUTER_THRESHOLD
    assert tool_router_threshold(settings(model=str(tmp_path))) is None  # a model of your own decides itself
    assert tool_router_threshold(settings(model=str(tmp_path), tool_router="on")) == ROUTER_THRESHOLD
    assert tool_router_threshold(settings(tool_router="off")) is None
    assert tool_router_threshold(settings(tool_router_threshold=0.1)) == 0.1


@pytest.mark.slow
def test_real_model_routes_the_weather_to_get_weather_and_the_capital_to_words() -> None:
    """The engine's default thinker (SmolLM2-135M with the tool router and spoken arguments) under ``auto``:
    "What is the weather like in Paris today?" calls get_weather with Paris; "What is the capital of France?" is
    answered in words."""
    from engine_bridge.config import EngineSettings
    from engine_bridge.thinker.factory import make_thinker, spoken_decoding, spoken_examples

    settings = EngineSettings()
    th = make_thinker(settings)
    results = {}
    for sid, text in (
        ("w", "What is the weather like in Paris today?"),
        ("c", "What is the capital of France?"),
    ):
        th.open(sid, None, [], examples=spoken_examples(settings), tools=[WEATHER])
        th.append(sid, "user", text)
        said, out = _decode(
            th, sid, dataclasses.replace(spoken_decoding(settings), tool_choice=ToolChoice("auto"))
        )
        results[sid] = (said, out.tool_call)
        th.close(sid)
    said, call = results["w"]
    assert said == "" and call is not None and call.name == "get_weather", results
    assert json.loads(call.arguments) == {"city": "Paris"}
    said, call = results["c"]
    assert call is None and "Paris" in said, results


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
        said, out = _decode(th, mode, dataclasses.replace(SPOKEN_DECODING, tool_choice=ToolChoice(mode)))
        results[mode] = (said, out.tool_call)
        th.close(mode)
    call = results["required"][1]
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert results["auto"][1] is None and "Paris" in results["auto"][0]


@pytest.mark.slow
def test_real_model_books_the_day_the_caller_said() -> None:
    """SmolLM2-135M made to call with spoken arguments (the engine's default for it) writes the day as the caller
    said it: without them it wrote "2022-01-01T00:00:00Z" for "tonight" (benchmarks/tool_calls.py)."""
    from engine_bridge.thinker.prompting import SPOKEN_DECODING
    from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

    book = ToolSpec(
        "book_table",
        "Book a table at the restaurant for a given day.",
        {"type": "object", "properties": {"date": {"type": "string"}}, "required": ["date"]},
    )
    th = TorchThinker(TorchThinkerConfig(spoken_arguments=True))
    th.open("s", tools=[book])
    th.append("s", "user", "Book a table for tonight, please.")
    _, out = _decode(th, "s", dataclasses.replace(SPOKEN_DECODING, tool_choice=ToolChoice("required")))
    th.close("s")
    assert out.tool_call is not None and out.tool_call.name == "book_table"
    assert json.loads(out.tool_call.arguments) == {"date": "tonight"}


@pytest.mark.slow
def test_the_spoken_length_rule_never_cuts_a_call() -> None:
    """A spoken reply stops at ``brief_max_tokens`` (the engine's 48-token rule), but a call has its own budget
    (``max_call_tokens``): with the rule at 4 tokens, a required call still comes out whole."""
    from engine_bridge.thinker.prompting import SPOKEN_DECODING
    from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

    th = TorchThinker(TorchThinkerConfig())
    th.open("s", tools=[WEATHER])
    th.append("s", "user", "What is the weather like in Paris today?")
    dec = dataclasses.replace(SPOKEN_DECODING, tool_choice=ToolChoice("required"), brief_max_tokens=4)
    _, out = _decode(th, "s", dec)
    th.close("s")
    assert out.finish_reason == "tool_call" and out.tool_call is not None, out
    assert json.loads(out.tool_call.arguments)["city"]


@pytest.mark.slow
def test_real_model_says_a_tool_result_in_words_without_markup() -> None:
    """The engine's default thinker, after a tool's result, says the result: SmolLM2-135M imitated the call format
    instead ("<tool_call-1>[{"name": "booked", ..." for a booking, "<too_cabl>[..." for an order), so a words reply
    of a routed tools session has no markup tokens (benchmarks/tool_calls.py's requests and results)."""
    from engine_bridge.config import EngineSettings
    from engine_bridge.thinker.factory import make_thinker, spoken_decoding, spoken_examples

    book = ToolSpec(
        "book_table",
        "Book a table at the restaurant on a date.",
        {"type": "object", "properties": {"date": {"type": "string"}}, "required": ["date"]},
    )
    order = ToolSpec(
        "get_order_status",
        "Look up the delivery status of an order by its number.",
        {"type": "object", "properties": {"order_number": {"type": "string"}}, "required": ["order_number"]},
    )
    settings = EngineSettings()
    th = make_thinker(settings)
    auto = dataclasses.replace(spoken_decoding(settings), tool_choice=ToolChoice("auto"))
    cases = (
        ("Book me a table on October second.", "book_table", '{"booked": true, "time": "7 pm"}', "7 pm"),
        (
            "When will order 7702 arrive?",
            "get_order_status",
            '{"status": "shipped", "arrives": "Friday"}',
            "shipped",
        ),
    )
    for i, (text, tool, result, heard) in enumerate(cases):
        sid = f"s{i}"
        th.open(sid, None, [], examples=spoken_examples(settings), tools=[WEATHER, book, order])
        th.append(sid, "user", text)
        _, out = _decode(th, sid, auto)
        th.end_reply(sid)
        assert out.tool_call is not None and out.tool_call.name == tool, (text, out)
        th.append(sid, "tool", result)
        said, out = _decode(th, sid, auto)
        th.close(sid)
        assert out.tool_call is None and said.strip(), (text, said)
        assert not set(said) & set(MARKUP_CHARS), (text, said)
        assert heard in said.lower(), (text, said)
