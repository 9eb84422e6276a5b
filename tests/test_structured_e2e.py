"""Structured answers and tool calls on the real worker and engine (tiny model).

The tiny model's weights are random, so whatever shape an answer has comes from the grammar
the worker gives the engine: a JSON answer that validates, a regex that matches, a tool call
whose arguments fit the function, all from a model that knows nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from redis.asyncio import Redis
from transformers import AutoTokenizer

from edgeq import InvalidAnswer, SyncChatClient
from edgeq.core.protocol import ChatMessage, DeltaEvent, DoneEvent
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import WorkerProcess
from helpers import EDGEQ, arq_job_bytes, run_raw_job

pytestmark = pytest.mark.engine

TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "kind": {"type": "string", "enum": ["bug", "feature", "question"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "reporter": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10}, "id": {"type": "integer"}},
            "required": ["name", "id"],
        },
        "urgent": {"type": "boolean"},
    },
    "required": ["title", "kind", "tags", "reporter"],
}
TICKET_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET_SCHEMA}}
# Room for the longest answer the schema allows, whitespace-free (EDGEQ_JSON_ANY_WHITESPACE).
JSON_MAX_TOKENS = 400

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
# What Qwen3 writes when it calls a tool, after a sentence of its own.
QWEN3_CALL = (
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    "\n</tool_call>"
)


class Reporter(BaseModel):
    name: str = Field(max_length=10)
    id: int


class Ticket(BaseModel):
    title: str = Field(max_length=16)
    kind: Literal["bug", "feature", "question"]
    reporter: Reporter


async def streamed(client: ChatClient, prompt: str, **fields) -> tuple[str, DoneEvent]:
    job = await client.submit(prompt, **fields)
    text, done = [], None
    async for event in job.stream():
        if isinstance(event, DeltaEvent):
            text.append(event.text)
        else:
            assert isinstance(event, DoneEvent), event
            done = event
    return "".join(text), done


@pytest.mark.parametrize("stream", [False, True], ids=["result", "stream"])
async def test_every_answer_to_a_json_schema_request_validates(
    client: ChatClient, stream: bool
) -> None:
    for seed in range(10):
        prompt = f"Open a ticket about problem {seed}"
        fields = dict(response_format=TICKET_FORMAT, max_tokens=JSON_MAX_TOKENS, seed=seed)
        if stream:
            text, done = await streamed(client, prompt, **fields)
            finish_reason = done.finish_reason
        else:
            result = await client.chat(prompt, **fields)
            text, finish_reason = result.text, result.finish_reason
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), TICKET_SCHEMA)


async def test_a_json_object_answer_is_a_json_object(client: ChatClient) -> None:
    for seed in range(4):
        result = await client.chat(
            "Any JSON", response_format={"type": "json_object"}, max_tokens=200, seed=seed
        )
        assert result.text.startswith("{")
        if result.finish_reason == "stop":
            assert isinstance(json.loads(result.text), dict)


async def test_choice_and_regex_constraints_hold_on_every_answer(client: ChatClient) -> None:
    choices = ["approve", "reject", "escalate"]
    pattern = r"[A-Z]{3}-\d{4}"
    for seed in range(6):
        picked = await client.chat("Decide", constraint={"choice": choices}, seed=seed)
        assert picked.text in choices
        matched = await client.chat("Ticket id?", constraint={"regex": pattern}, seed=seed)
        assert re.fullmatch(pattern, matched.text), matched.text


async def test_a_grammar_constraint_holds(client: ChatClient) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
    for seed in range(4):
        result = await client.chat("Well?", constraint={"grammar": grammar}, seed=seed)
        assert re.fullmatch(r"yes|no|maybe [0-9]", result.text), result.text


async def test_schema_helper_returns_a_model_instance(client: ChatClient, worker) -> None:
    ticket = await client.chat("Open a ticket", schema=Ticket, max_tokens=JSON_MAX_TOKENS, seed=3)
    assert isinstance(ticket, Ticket)
    with SyncChatClient(
        redis_url=worker.env["EDGEQ_REDIS_URL"], queue=worker.env["EDGEQ_QUEUE"]
    ) as sync:
        assert isinstance(
            sync.chat("Open a ticket", schema=Ticket, max_tokens=JSON_MAX_TOKENS), Ticket
        )
    with pytest.raises(InvalidAnswer, match="finish_reason='length'") as cut:
        await client.chat("Open a ticket", schema=Ticket, max_tokens=3)
    assert cut.value.result.usage.completion_tokens == 3


async def test_required_tool_choice_ends_with_calls_that_fit_their_functions(
    client: ChatClient,
) -> None:
    for seed in range(5):
        text, done = await streamed(
            client, "What is the weather?", tools=TOOLS, tool_choice="required", seed=seed
        )
        assert done.finish_reason == "tool_calls"
        assert text == ""  # calls are not text: nothing streamed
        assert done.tool_calls
        for call in done.tool_calls:
            assert call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


async def test_a_named_tool_choice_calls_that_function(client: ChatClient) -> None:
    result = await client.chat(
        "Time?", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert result.finish_reason == "tool_calls"
    [call] = result.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_time"])


async def test_a_tool_result_sent_back_is_rendered_by_the_template(
    client: ChatClient, tiny_model: Path
) -> None:
    first = await client.chat("Weather in Paris?", tools=TOOLS, tool_choice="required", seed=2)
    history = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", tool_calls=first.tool_calls),
        ChatMessage(role="tool", tool_call_id=first.tool_calls[0].id, content="18 C, sunny"),
    ]
    second = await client.chat(history, tools=TOOLS, max_tokens=4, seed=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rendered = tokenizer.apply_chat_template(
        [message.model_dump(exclude_none=True) for message in history],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in rendered
    assert first.tool_calls[0].function.arguments in rendered
    assert second.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


async def test_auto_tool_calls_in_qwen3_format_are_parsed_and_never_streamed(
    client: ChatClient,
) -> None:
    # A random model never calls a tool of its own accord; the regex makes it write what
    # Qwen3 writes, so the real tokens go through the real parser.
    text, done = await streamed(
        client,
        "Weather in Paris?",
        tools=TOOLS,
        constraint={"regex": re.escape("Let me check." + QWEN3_CALL)},
        max_tokens=200,
    )
    assert text == "Let me check."
    assert done.finish_reason == "tool_calls"
    [call] = done.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris", "unit": "c"},
    )


async def test_text_that_only_looks_like_a_tool_call_is_streamed_as_it_was(
    client: ChatClient,
) -> None:
    broken = "See <tool_call>\nnot json\n</tool_call> here"
    text, done = await streamed(
        client, "Hi", tools=TOOLS, constraint={"regex": re.escape(broken)}, max_tokens=200
    )
    assert (text, done.finish_reason, done.tool_calls) == (broken, "stop", None)


async def test_logprobs_cover_every_generated_token(client: ChatClient) -> None:
    result = await client.chat(
        "Decide", constraint={"choice": ["approve", "reject"]}, logprobs=True, top_logprobs=2
    )
    assert len(result.logprobs) == result.usage.completion_tokens
    assert "".join(item.token for item in result.logprobs).startswith(result.text)
    for item in result.logprobs:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        # Sampling may draw a token outside the top 2; inside, both lists agree on it.
        for alternative in item.top_logprobs:
            if alternative.token == item.token:
                assert alternative.logprob == item.logprob
    plain = await client.chat("Decide", max_tokens=4)
    assert plain.logprobs is None


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"$ref": "#/$defs/missing"}},
                        }
                    },
                }
            },
            "response_format",
            "missing",
        ),
        ({"constraint": {"regex": "([a-"}}, "constraint", "Regex parsing error"),
        ({"constraint": {"grammar": "root ::= undefined_rule"}}, "constraint", "undefined_rule"),
    ],
)
async def test_a_grammar_the_engine_cannot_compile_is_an_invalid_request(
    worker: WorkerProcess, redis: Redis, client: ChatClient, fields: dict, field: str, says: str
) -> None:
    # These pass the producer's checks (the schema is well-formed JSON Schema); the worker
    # finds out when the engine compiles the grammar.
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    events = await run_raw_job(redis, worker.env["EDGEQ_QUEUE"], arq_job_bytes(body))
    assert [(event["type"], event["code"]) for event in events] == [("error", "invalid_request")]
    assert f"{field}: " in events[0]["message"] and says in events[0]["message"]
    assert ".cc:" not in events[0]["message"]  # no C++ source locations
    assert (await client.chat("Still there?", max_tokens=4)).usage.completion_tokens >= 1


def test_edgeq_chat_takes_a_json_schema_file_and_a_tools_file(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    schema_file = tmp_path / "ticket.json"
    schema_file.write_text(json.dumps(TICKET_SCHEMA))
    answered = subprocess.run(
        [*EDGEQ, "chat", "Open a ticket", "--json-schema", str(schema_file),
         "--max-tokens", str(JSON_MAX_TOKENS), "--seed", "4"],
        env=cli_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert answered.returncode == 0, answered.stderr
    jsonschema.validate(json.loads(answered.stdout), TICKET_SCHEMA)

    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS))
    called = subprocess.run(
        [*EDGEQ, "chat", "Time?", "--tools", str(tools_file), "--tool-choice", "get_time"],
        env=cli_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert called.returncode == 0, called.stderr
    [line] = [line for line in called.stdout.splitlines() if line]
    call = json.loads(line)
    assert call["function"]["name"] == "get_time"

    missing = subprocess.run(
        [*EDGEQ, "chat", "x", "--json-schema", str(tmp_path / "nope.json")],
        env=cli_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "--json-schema: cannot read" in missing.stderr
