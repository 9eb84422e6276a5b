"""Structured-output fields on the wire, and the worker's reading of tool calls, without an
engine (the end-to-end behaviour is in test_structured_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from edgeq import InvalidAnswer, InvalidRequest
from edgeq.core.protocol import ChatRequest, ChatResult, Timings, Usage
from edgeq.core.structured import json_schema_format, parse_answer
from edgeq.producer.client import build_request
from edgeq.worker.structured import (
    AnswerReader,
    JsonStringEscaper,
    forced_calls_schema,
    grammar_problem,
    structured_outputs,
)

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def read(request: ChatRequest, tokenizer, pieces: list[str]) -> tuple[list[str], str, list]:
    reader = AnswerReader(request, tokenizer)
    streamed = [reader.feed(piece) for piece in pieces]
    tail, calls = reader.finish()
    return streamed, tail, calls


def auto_request() -> ChatRequest:
    return build_request("q", tools=[TOOL])


def test_auto_streams_text_until_a_tool_call_even_when_its_tag_is_split(tokenizer) -> None:
    pieces = ["Looking ", "it up.<tool", "_call>", CALL.removeprefix("<tool_call>")]
    streamed, tail, calls = read(auto_request(), tokenizer, pieces)
    assert "".join(streamed) == "Looking it up."
    assert all("<" not in piece for piece in streamed)
    assert tail == ""
    [call] = calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"q": "x"})


def test_a_held_back_tail_that_was_no_tag_is_streamed_at_the_end(tokenizer) -> None:
    streamed, tail, calls = read(auto_request(), tokenizer, ["a < b and c <tool"])
    assert "".join(streamed) + tail == "a < b and c <tool"
    assert calls is None


def test_a_broken_tool_call_is_text_not_a_call(tokenizer) -> None:
    text = "<tool_call>\n{not json}\n</tool_call>"
    streamed, tail, calls = read(auto_request(), tokenizer, [text])
    assert ("".join(streamed) + tail, calls) == (text, None)


def test_without_tools_or_with_tool_choice_none_text_streams_untouched(tokenizer) -> None:
    for request in (build_request("q"), build_request("q", tools=[TOOL], tool_choice="none")):
        streamed, tail, calls = read(request, tokenizer, ["a", CALL])
        assert (streamed, tail, calls) == (["a", CALL], "", None)


def test_forced_calls_are_parsed_from_json_and_nothing_streams(tokenizer) -> None:
    required = build_request("q", tools=[TOOL], tool_choice="required")
    answer = json.dumps([{"name": "lookup", "parameters": {"q": "a"}}] * 2)
    streamed, tail, calls = read(required, tokenizer, [answer[:5], answer[5:]])
    assert (streamed, tail) == (["", ""], "")
    assert [call.function.arguments for call in calls] == ['{"q": "a"}', '{"q": "a"}']
    assert len({call.id for call in calls}) == 2
    named = build_request(
        "q", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "lookup"}}
    )
    _, _, [call] = read(named, tokenizer, ['{"q": "b"}'])
    assert call.function.name == "lookup"
    _, _, cut = read(required, tokenizer, ['[{"name": "lookup", "para'])  # max_tokens hit
    assert cut is None


def test_forced_calls_schema_lists_each_function_and_honours_parallel_false() -> None:
    request = build_request("q", tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = forced_calls_schema(request)
    assert schema["maxItems"] == 1
    [option] = schema["items"]["anyOf"]
    assert option["properties"]["name"] == {"type": "string", "enum": ["lookup"]}
    assert structured_outputs(request).json == schema
    assert structured_outputs(build_request("q")) is None
    assert structured_outputs(build_request("q", constraint={"choice": ["a"]})).choice == ["a"]


def test_the_client_refuses_bad_structured_fields_naming_them() -> None:
    with pytest.raises(InvalidRequest, match=r"response_format.*not a valid JSON Schema"):
        build_request("q", response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "required": "everything"}}})  # fmt: skip
    with pytest.raises(InvalidRequest, match=r"tools.0.function.parameters"):
        build_request("q", tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": 7}}}])  # fmt: skip
    with pytest.raises(InvalidRequest, match="function names must be unique"):
        build_request("q", tools=[TOOL, TOOL])
    with pytest.raises(InvalidRequest, match="only one can shape an answer"):
        build_request("q", response_format={"type": "json_object"}, constraint={"regex": "a"})


def test_a_json_schema_request_travels_with_the_schema_key_openai_uses() -> None:
    class Point(BaseModel):
        x: int

    request = build_request("q", response_format=json_schema_format(Point))
    wire = json.loads(request.model_dump_json(exclude_none=True))
    assert wire["response_format"]["json_schema"]["schema"]["required"] == ["x"]
    assert ChatRequest.model_validate(wire) == request


def test_parse_answer_returns_the_model_or_says_why_not() -> None:
    class Point(BaseModel):
        x: int

    def result(text: str, finish_reason: str = "stop") -> ChatResult:
        timings = Timings(queued_ms=1, ttft_ms=2, total_ms=3)
        usage = Usage(prompt_tokens=1, completion_tokens=1)
        return ChatResult(job_id="j", text=text, finish_reason=finish_reason, usage=usage,
                          timings=timings)  # fmt: skip

    assert parse_answer(result('{"x": 1}'), Point) == Point(x=1)
    with pytest.raises(InvalidAnswer, match="finish_reason='length'"):
        parse_answer(result('{"x": ', "length"), Point)
    with pytest.raises(InvalidAnswer, match="not a valid Point") as invalid:
        parse_answer(result('{"x": "one"}'), Point)
    assert invalid.value.result.text == '{"x": "one"}'


def test_grammar_problems_keep_the_reason_and_drop_source_locations() -> None:
    try:
        try:
            raise RuntimeError("[12:00:01] /project/cpp/grammar_parser.cc:42: Rule x is undefined")
        except RuntimeError as cause:
            raise ValueError("Invalid grammar specification.") from cause
    except ValueError as error:
        assert grammar_problem(error) == "Invalid grammar specification: Rule x is undefined"


def test_control_characters_inside_json_strings_are_escaped_as_they_stream() -> None:
    escaper = JsonStringEscaper()
    pieces = ['{"a":"x\ty', '","b\\"":"', "\n", '\\\\"}']
    text = "".join(escaper.feed(piece) for piece in pieces)
    assert json.loads(text) == {"a": "x\ty", 'b"': "\n\\"}
    assert JsonStringEscaper().feed('{"a": 1}\n') == '{"a": 1}\n'  # outside strings: as is
