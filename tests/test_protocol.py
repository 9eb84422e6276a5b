"""The wire contract as data: what is accepted, what is refused, what goes on the channel."""

from __future__ import annotations

import json
from typing import get_args

import pytest
from pydantic import BaseModel, ValidationError

from edgeq.core.errors import InvalidRequest
from edgeq.core.keys import stream_channel
from edgeq.core.protocol import (
    ChatRequest,
    ChatResult,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Timings,
    Usage,
    decode_event,
    dump_json,
    encode_event,
    load_json,
)
from edgeq.producer.client import build_request


def test_stream_channel_is_the_documented_name() -> None:
    assert stream_channel("abc") == "edgeq:stream:abc"


def test_a_prompt_string_becomes_one_user_message() -> None:
    request = build_request("hello", max_tokens=5, stop="END")
    assert request.messages[0].role == "user"
    assert request.messages[0].content == "hello"
    assert request.stop == ["END"]
    assert request.temperature is None  # left to the worker's default


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": ["ok", ""]}, "stop.1"),
        ({"n": 2}, "n"),
    ],
)
def test_each_bad_field_is_named_in_the_error(fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as failure:
        build_request("hi", **fields)
    assert str(failure.value).startswith(f"{field}: ")


def test_valid_edge_values_are_accepted() -> None:
    request = build_request("hi", temperature=0, top_p=1, max_tokens=1, seed=0)
    assert (request.temperature, request.top_p, request.max_tokens) == (0, 1, 1)


def test_events_round_trip_and_leave_out_empty_fields() -> None:
    done = DoneEvent(
        job_id="j",
        seq=3,
        finish_reason="stop",
        usage=Usage(prompt_tokens=5, completion_tokens=2),
        timings=Timings(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0),
    )
    raw = json.loads(encode_event(done))
    assert "reasoning" not in raw
    assert raw["type"] == "done" and raw["seq"] == 3
    for event in (done, DeltaEvent(job_id="j", seq=0, text="a"),
                  ErrorEvent(job_id="j", seq=0, code="cancelled", message="m")):  # fmt: skip
        assert decode_event(encode_event(event)) == event


def test_a_done_event_without_a_first_token_round_trips() -> None:
    """Found by the chaos campaign (#34): a continued job whose dead worker had streamed every
    token ends with a done event whose ttft_ms is None; the event leaves None fields out, and
    every client then failed to decode it (StreamBroken) and saw no terminal event."""
    done = DoneEvent(
        job_id="j", seq=4, finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=0),
        timings=Timings(queued_ms=1.0, ttft_ms=None, total_ms=3.0), continued=1,
    )  # fmt: skip
    assert "ttft_ms" not in json.loads(encode_event(done))["timings"]
    assert decode_event(encode_event(done)) == done


def _models_under(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    if model in seen:
        return seen
    seen.add(model)
    for info in model.model_fields.values():
        for inner in _classes_in(info.annotation):
            if issubclass(inner, BaseModel):
                _models_under(inner, seen)
    return seen


def _classes_in(annotation: object) -> list[type]:
    if isinstance(annotation, type):
        return [annotation]
    return [cls for arg in get_args(annotation) for cls in _classes_in(arg)]


def test_every_field_that_may_be_none_on_the_wire_has_a_default() -> None:
    # The wire leaves None fields out (encode_event, ChatResult's dump), so a field that may be
    # None but is required could never be read back.
    models: set[type[BaseModel]] = set()
    for root in (DeltaEvent, DoneEvent, ErrorEvent, ChatResult):
        _models_under(root, models)
    required_nullable = [
        f"{model.__name__}.{name}"
        for model in models
        for name, info in model.model_fields.items()
        if info.is_required() and type(None) in _classes_in(info.annotation)
    ]
    assert required_nullable == []


def test_an_unknown_event_type_is_refused() -> None:
    with pytest.raises(ValidationError):
        decode_event(b'{"job_id": "j", "seq": 0, "type": "surprise"}')


def test_the_arq_serializer_is_json_and_keeps_exceptions_readable() -> None:
    raw = dump_json({"r": TimeoutError("took too long"), "a": [ChatRequest(messages=[
        {"role": "user", "content": "x"}])]})  # fmt: skip
    assert load_json(raw) == {
        "r": {"exception": "TimeoutError", "message": "took too long"},
        "a": [{"messages": [{"role": "user", "content": "x"}], "return_reasoning": False}],
    }
