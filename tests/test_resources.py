"""OpenAI's resources without HTTP (``edgeq.resources``), in process: the typed records read
and write what was stored before them, and a stopped batch's finish records every line that
never ran, a chunk of lines per round trip (the suite's Redis; no worker, no gateway)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edgeq.producer.client import ChatClient
from edgeq.resources.batches import runner as batch_runner
from edgeq.resources.batches.runner import BatchRun, BatchRunner
from edgeq.resources.batches.store import BatchRecord
from edgeq.resources.openai_api import InvalidField
from edgeq.resources.responses.request import CreateResponse
from edgeq.resources.responses.store import StoredResponse
from edgeq.resources.settings import ResourceSettings
from edgeq.testing.processes import RedisServer

#: A stored response as create_response wrote it before it was typed: every field, in order.
STORED = {
    "job_id": "j1",
    "created_at": 1000.5,
    "tenant": "acme",
    "model": "m",
    "instructions": "be brief",
    "metadata": {"k": "v"},
    "max_output_tokens": 16,
    "temperature": 1,
    "top_p": 0.5,
    "text": {"format": {"type": "text"}},
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "tool_choice": {"type": "function", "name": "f"},
    "parallel_tool_calls": False,
    "store": True,
    "background": True,
    "previous_response_id": "resp_j0",
    "messages": [{"role": "user", "content": "hi"}],
}


def test_a_stored_response_is_written_as_it_always_was() -> None:
    record = StoredResponse.model_validate(STORED)
    assert record.stored_json() == json.dumps(STORED)  # same fields, order and numbers
    assert isinstance(record.temperature, int)


def test_a_stored_response_missing_later_fields_reads_with_their_defaults() -> None:
    first = {"job_id": "j1", "created_at": 1.0, "model": "m", "store": True, "background": False}
    record = StoredResponse.model_validate(first)
    assert record.parallel_tool_calls is True
    assert (record.tenant, record.tools, record.messages) == (None, [], [])


DOC = {
    "id": "batch_1", "endpoint": "/v1/chat/completions", "input_file_id": "file-1",
    "completion_window": "24h", "created_at": 10, "expires_at": 20, "metadata": None, "total": 5,
}  # fmt: skip


def test_a_batch_record_counts_its_lines_until_it_keeps_its_own() -> None:
    fields = {"doc": json.dumps(DOC), "tenant": "acme", "status": "in_progress",
              "next_line": "3", "in_progress_at": "11"}  # fmt: skip
    running = BatchRecord.from_hash(fields)
    assert (running.tenant, running.next_line, running.total) == ("acme", 3, 5)
    shown = running.shown(completed=2, failed=1)
    assert shown.request_counts.model_dump() == {"total": 5, "completed": 2, "failed": 1}
    assert (shown.in_progress_at, shown.completed_at) == (11, None)
    finished = fields | {"status": "completed", "completed": "4", "failed": "1",
                         "output_file_id": "file-out", "completed_at": "15"}  # fmt: skip
    shown = BatchRecord.from_hash(finished).shown(completed=0, failed=0)  # lines gone
    assert shown.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 1}
    assert (shown.status, shown.output_file_id, shown.completed_at) == ("completed", "file-out", 15)


def line(number: int) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": f"hi {number}"}]}
    return {"custom_id": f"c{number}", "method": "POST", "url": "/v1/chat/completions",
            "body": body}  # fmt: skip


@pytest.mark.parametrize("lines", [1, 5])  # within one chunk, and over three
async def test_a_cancelled_batch_records_every_line_that_never_ran(
    redis_server: RedisServer, queue: str, lines: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_runner, "FINISH_CHUNK", 2)
    settings = ResourceSettings(redis_url=redis_server.url, queue=queue, model="m")
    async with ChatClient(settings) as client:
        runner = BatchRunner(client, settings)
        store = runner.store
        content = "\n".join(json.dumps(line(n)) for n in range(lines)).encode()
        upload = await store.create_file("acme", "in.jsonl", "batch", content)
        batch = await store.create_batch("acme", upload.id)
        await store.cancel_batch("acme", batch.id)  # before any line ran
        record = await store.record(batch.id)
        assert record is not None and record.status == "cancelling"
        run = BatchRun(runner, batch.id)
        run.tenant, run.total, run.expires_at = record.tenant, record.total, record.expires_at
        await run.finish("cancelled")
        ended = await store.get_batch("acme", batch.id)
        assert ended.status == "cancelled" and ended.output_file_id is None
        assert ended.request_counts.model_dump() == {"total": lines, "completed": 0,
                                                     "failed": lines}  # fmt: skip
        assert ended.error_file_id is not None
        errors = [json.loads(text) for text in
                  (await store.file_content("acme", ended.error_file_id)).splitlines()]  # fmt: skip
        assert [entry["custom_id"] for entry in errors] == [f"c{n}" for n in range(lines)]
        assert {entry["error"]["code"] for entry in errors} == {"batch_cancelled"}


def test_a_response_body_becomes_a_chat_body_and_the_record_kept() -> None:
    body = CreateResponse.model_validate(
        {"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 16,
         "text": {"format": {"type": "json_object"}}, "temperature": 1}
    )  # fmt: skip
    assert body.chat_fields() == {
        "max_tokens": 16, "temperature": 1, "response_format": {"type": "json_object"},
    }  # fmt: skip
    record = body.stored("j1", "acme", [{"role": "user", "content": "before"}])
    assert (record.job_id, record.tenant, record.text) == ("j1", "acme", body.text.model_dump(
        by_alias=True, exclude_none=True))  # fmt: skip
    assert record.messages == [
        {"role": "user", "content": "before"}, {"role": "user", "content": "hi"},
    ]  # fmt: skip
    assert record.parallel_tool_calls is True and record.store is True


def test_a_json_schema_format_without_a_schema_is_refused_naming_the_field() -> None:
    body = CreateResponse.model_validate(
        {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema"}}}
    )
    with pytest.raises(InvalidField, match="needs a schema") as refused:
        body.chat_fields()
    assert (refused.value.param, refused.value.code) == ("text.format.schema", "invalid_request")
