"""OpenAI's Files and Batches, kept in Redis: the Python API the gateway's routes and
``edgeq batch`` share (no FastAPI here).

    store = BatchStore(redis, settings)
    file = await store.create_file("acme", "in.jsonl", "batch", content)
    batch = await store.create_batch("acme", file.id)       # validated; runs in a runner
    batch = await store.get_batch("acme", batch.id)          # request_counts, status, ...

Files are Redis hashes that expire after EDGEQ_GATEWAY_FILE_RETENTION_S. A batch's input is
validated line by line when it is created, all of it before anything runs: a bad line fails the
batch with ``errors`` naming every bad line, and nothing is enqueued. A valid batch keeps each
line's edgeq request in a list and waits for a runner (batch_runner.py) to feed it to the queue.
Output and error lines are written once per ``custom_id`` (HSETNX), so a line a restarted runner
runs again never appears twice. Files and batches belong to the tenant that made them: another
tenant is told they do not exist.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, field_validator
from redis.asyncio import Redis

from edgeq.core.errors import EdgeqError
from edgeq.core.keys import (
    active_batches_key,
    batch_key,
    batch_part_key,
    batches_key,
    file_key,
    files_key,
)
from edgeq.core.protocol import describe_validation_error, dump_json, job_payload
from edgeq.core.scripts import lua_script
from edgeq.gateway.openai_api import (
    ChatCompletionRequest,
    UnsupportedField,
    encodable,
    unencodable_at,
)
from edgeq.gateway.settings import GatewaySettings
from edgeq.gateway.webhooks import queue_event
from edgeq.producer.client import build_request

#: The one endpoint a batch line may name (the chat endpoint; every line runs as a chat job).
ENDPOINT = "/v1/chat/completions"
COMPLETION_WINDOW = "24h"
#: How many bad lines a failed batch's ``errors`` lists (the rest are counted in the last one).
MAX_ERRORS_LISTED = 100
UPLOAD_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")
BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]

_STATUS = lua_script("batch_status")


class BatchApiError(EdgeqError):
    """A request the Files/Batches API refuses: the HTTP status, and a message naming why."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


def not_found(kind: str, object_id: str) -> BatchApiError:
    # The same answer for another tenant's object as for none: its existence is not told.
    return BatchApiError(404, f"no {kind} with id {object_id!r}", code="not_found", param="id")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = None


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrorItem(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None

    @field_validator("metadata", mode="after")
    @classmethod
    def _shown(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        # A record stored before metadata was checked may hold a lone surrogate: shown with
        # U+FFFD in its place, never failing the listing it is in.
        return encodable(metadata)


class BatchLine(BaseModel):
    """One validated input line, as the runner needs it."""

    custom_id: str
    model: str
    request: dict[str, Any]  # edgeq's ChatRequest fields, the class and tenant set


def _problem(line: int, code: str, message: str, param: str | None = None) -> BatchErrorItem:
    return BatchErrorItem(code=code, message=f"line {line}: {message}", param=param, line=line)


def parse_line(
    number: int, raw: bytes, *, tenant: str, models: list[str] | None, settings: GatewaySettings
) -> BatchLine | BatchErrorItem:
    """One input line (numbered from 1) as a BatchLine, or what is wrong with it."""
    try:
        item = json.loads(raw)
    except ValueError as error:
        return _problem(number, "invalid_json_line", f"not JSON ({error})")
    if not isinstance(item, dict):
        return _problem(number, "invalid_json_line", "not a JSON object")
    where = unencodable_at(item)
    if where is not None:  # it could be neither stored nor shown again
        return _problem(
            number,
            "invalid_request",
            f"{where}: not valid text: it holds a lone surrogate, which cannot be encoded as UTF-8",
            where,
        )
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _problem(
            number, "missing_custom_id", "custom_id: missing (a non-empty string)", "custom_id"
        )
    if item.get("method") != "POST":
        return _problem(
            number, "invalid_method", f"method: must be POST (got {item.get('method')!r})", "method"
        )
    if item.get("url") != ENDPOINT:
        return _problem(
            number,
            "invalid_url",
            f"url: must be {ENDPOINT}, the batch's endpoint (got {item.get('url')!r})",
            "url",
        )
    body = item.get("body")
    if not isinstance(body, dict):
        return _problem(number, "invalid_request", "body: missing (a JSON object)", "body")
    try:
        chat = ChatCompletionRequest.model_validate(body)
        if chat.stream:
            raise UnsupportedField("stream: a batch line's answer is not streamed; leave it out")
        fields = chat.edgeq_fields()
        # Every line runs in the batch class, under the batch's tenant (what it sent is ignored),
        # and is not streamed: the runner wants its result only, and a line's job then stores
        # 2 events in Redis, not one for each stream interval of its answer.
        fields.update(priority="batch", tenant=tenant, stream=False)
        request = build_request(fields.pop("messages"), **fields)
    except ValidationError as error:
        return _problem(
            number, "invalid_request", f"body: {describe_validation_error(error)}", "body"
        )
    except (UnsupportedField, EdgeqError) as error:
        return _problem(number, "invalid_request", f"body: {error}", "body")
    if models is not None and chat.model not in models:
        return _problem(
            number,
            "model_not_found",
            f"body.model: {chat.model!r} is not served here (one of {', '.join(models)})",
            "body.model",
        )
    payload, problem = job_payload(request, settings)
    if problem:
        return _problem(number, "invalid_request", f"body: {problem}", "body")
    return BatchLine(custom_id=custom_id, model=chat.model, request=payload)


def parse_batch_file(
    content: bytes, *, tenant: str, models: list[str] | None, settings: GatewaySettings
) -> tuple[list[BatchLine], list[BatchErrorItem]]:
    """Every line of an input file, validated; blank lines are skipped (they count in the
    numbering, as an editor shows it). CPU-bound: run it in a thread."""
    lines: list[BatchLine] = []
    problems: list[BatchErrorItem] = []
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        parsed = parse_line(number, raw, tenant=tenant, models=models, settings=settings)
        if isinstance(parsed, BatchErrorItem):
            problems.append(parsed)
            continue
        first = first_line_of.setdefault(parsed.custom_id, number)
        if first != number:
            problems.append(
                _problem(
                    number,
                    "duplicate_custom_id",
                    f"custom_id: {parsed.custom_id!r} is already the custom_id of line {first}",
                    "custom_id",
                )
            )
            continue
        lines.append(parsed)
    if not lines and not problems:
        problems.append(BatchErrorItem(code="empty_file", message="the input file has no lines"))
    return lines, problems


def count_lines(content: bytes) -> int:
    return sum(1 for raw in content.split(b"\n") if raw.strip())


def line_request_id(batch_id: str, line: int) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:32]


def _int(value: bytes | str | None) -> int | None:
    return None if value is None else int(float(value))


class BatchStore:
    """Files and batches of one queue's Redis (see the module doc)."""

    def __init__(self, redis: Redis, settings: GatewaySettings) -> None:
        self.redis = redis
        self.settings = settings
        self.queue = settings.queue
        self._status = redis.register_script(_STATUS)

    def tenant_of(self, tenant: str | None) -> str:
        return tenant or self.settings.tenant

    def part(self, name: str, batch_id: str) -> str:
        return batch_part_key(self.queue, name, batch_id)

    # --- files -------------------------------------------------------------------------------

    async def create_file(
        self,
        tenant: str | None,
        filename: str,
        purpose: str,
        content: bytes,
        *,
        file_id: str | None = None,
    ) -> FileObject:
        """Store an upload (purpose ``batch``) or a batch's output (``batch_output``, with the
        id the batch gives it, so finishing a batch twice writes one file)."""
        settings, owner = self.settings, self.tenant_of(tenant)
        if file_id is None:
            if purpose != UPLOAD_PURPOSE:
                raise BatchApiError(
                    400,
                    f"purpose: {purpose!r} is not supported here; upload "
                    f"with purpose {UPLOAD_PURPOSE!r}",
                    code="invalid_purpose",
                    param="purpose",
                )
            if len(content) > settings.gateway_file_max_bytes:
                raise BatchApiError(
                    413,
                    f"file: {len(content)} bytes, more than the "
                    f"{settings.gateway_file_max_bytes} allowed "
                    f"(EDGEQ_GATEWAY_FILE_MAX_BYTES)",
                    code="file_too_large",
                    param="file",
                )
            lines = count_lines(content)
            if lines > settings.gateway_file_max_lines:
                raise BatchApiError(
                    400,
                    f"file: {lines} lines, more than the "
                    f"{settings.gateway_file_max_lines} allowed "
                    f"(EDGEQ_GATEWAY_FILE_MAX_LINES)",
                    code="too_many_lines",
                    param="file",
                )
            uploads = [f for f in await self.list_files(owner) if f.purpose == UPLOAD_PURPOSE]
            if len(uploads) >= settings.gateway_files_per_tenant:
                raise BatchApiError(
                    400,
                    f"tenant {owner!r} already keeps {len(uploads)} files, "
                    f"the most allowed (EDGEQ_GATEWAY_FILES_PER_TENANT); delete "
                    f"one first",
                    code="too_many_files",
                )
            file_id = f"file-{uuid.uuid4().hex}"
        now = int(time.time())
        retention_ms = int(settings.gateway_file_retention_s * 1000)
        record = FileObject(
            id=file_id,
            bytes=len(content),
            created_at=now,
            expires_at=now + int(settings.gateway_file_retention_s),
            filename=filename,
            purpose=purpose,
        )
        key = file_key(self.queue, file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                key,
                mapping={"record": record.model_dump_json(), "tenant": owner, "content": content},
            )
            pipe.pexpire(key, retention_ms)
            pipe.zadd(files_key(self.queue, owner), {file_id: now})
            await pipe.execute()
        return record

    async def _file_fields(self, tenant: str | None, file_id: str, *fields: str) -> list[Any]:
        owner, *values = await self.redis.hmget(file_key(self.queue, file_id), "tenant", *fields)
        if owner is None or owner.decode() != self.tenant_of(tenant):
            raise not_found("file", file_id)
        return values

    async def get_file(self, tenant: str | None, file_id: str) -> FileObject:
        (record,) = await self._file_fields(tenant, file_id, "record")
        return FileObject.model_validate_json(record)

    async def file_content(self, tenant: str | None, file_id: str) -> bytes:
        (content,) = await self._file_fields(tenant, file_id, "content")
        return bytes(content or b"")

    async def delete_file(self, tenant: str | None, file_id: str) -> None:
        await self._file_fields(tenant, file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(file_key(self.queue, file_id))
            pipe.zrem(files_key(self.queue, self.tenant_of(tenant)), file_id)
            await pipe.execute()

    async def list_files(self, tenant: str | None, purpose: str | None = None) -> list[FileObject]:
        """The tenant's files, newest first (expired ones dropped from its index here)."""
        index = files_key(self.queue, self.tenant_of(tenant))
        ids = [raw.decode() for raw in await self.redis.zrevrange(index, 0, -1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hget(file_key(self.queue, file_id), "record")
            records = await pipe.execute()
        gone = [file_id for file_id, record in zip(ids, records, strict=True) if record is None]
        if gone:
            await self.redis.zrem(index, *gone)
        files = [FileObject.model_validate_json(record) for record in records if record]
        return [file for file in files if purpose is None or file.purpose == purpose]

    # --- batches -----------------------------------------------------------------------------

    async def create_batch(
        self,
        tenant: str | None,
        input_file_id: str,
        *,
        endpoint: str = ENDPOINT,
        completion_window: str = COMPLETION_WINDOW,
        metadata: dict[str, str] | None = None,
        models: list[str] | None = None,
    ) -> BatchObject:
        """Validate every line of the input file, then either fail the batch (``errors``
        names each bad line; nothing runs) or leave it ``in_progress`` for a runner."""
        if endpoint != ENDPOINT:
            raise BatchApiError(
                400,
                f"endpoint: only {ENDPOINT} is supported (got {endpoint!r})",
                code="invalid_endpoint",
                param="endpoint",
            )
        if completion_window != COMPLETION_WINDOW:
            raise BatchApiError(
                400,
                f"completion_window: only {COMPLETION_WINDOW!r} is "
                f"supported (got {completion_window!r})",
                code="invalid_completion_window",
                param="completion_window",
            )
        owner = self.tenant_of(tenant)
        try:
            file = await self.get_file(owner, input_file_id)
        except BatchApiError:
            raise BatchApiError(
                404,
                f"input_file_id: no file with id {input_file_id!r}",
                code="not_found",
                param="input_file_id",
            ) from None
        if file.purpose != UPLOAD_PURPOSE:
            raise BatchApiError(
                400,
                f"input_file_id: {input_file_id!r} has purpose "
                f"{file.purpose!r}, not {UPLOAD_PURPOSE!r}",
                code="invalid_purpose",
                param="input_file_id",
            )
        content = await self.file_content(owner, input_file_id)
        lines, problems = await asyncio.to_thread(
            parse_batch_file, content, tenant=owner, models=models, settings=self.settings
        )
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = time.time()
        doc = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "created_at": int(now),
            "expires_at": int(now + self.settings.gateway_batch_completion_window_s),
            "metadata": metadata,
            "total": len(lines) if not problems else 0,
        }
        fields: dict[str, Any] = {"doc": dump_json(doc), "tenant": owner, "next_line": 0}
        key = batch_key(self.queue, batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            if problems:
                shown = problems[:MAX_ERRORS_LISTED]
                if len(problems) > len(shown):
                    more = len(problems) - len(shown)
                    shown.append(
                        BatchErrorItem(code="more_errors", message=f"and {more} more bad lines")
                    )
                errors = BatchErrors(data=shown).model_dump_json()
                fields |= {"status": "failed", "failed_at": int(now), "errors": errors}
                pipe.hset(key, mapping=fields)
                pipe.pexpire(key, int(self.settings.gateway_file_retention_s * 1000))
                queue_event(
                    pipe, self.settings, event_type="batch.failed", object_id=batch_id,
                    tenant=owner,
                )  # fmt: skip
            else:
                fields |= {"status": "in_progress", "in_progress_at": int(now)}
                pipe.hset(key, mapping=fields)
                pipe.rpush(
                    self.part("input", batch_id), *(line.model_dump_json() for line in lines)
                )
                pipe.sadd(active_batches_key(self.queue), batch_id)
            pipe.zadd(batches_key(self.queue, owner), {batch_id: int(now * 1000)})
            await pipe.execute()
        return await self.get_batch(owner, batch_id)

    async def get_batch(self, tenant: str | None, batch_id: str) -> BatchObject:
        key = batch_key(self.queue, batch_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(key)
            pipe.hlen(self.part("out", batch_id))
            pipe.hlen(self.part("err", batch_id))
            record, completed, failed = await pipe.execute()
        fields = {name.decode(): value.decode() for name, value in record.items()}
        if fields.get("tenant") != self.tenant_of(tenant):
            raise not_found("batch", batch_id)
        return self.batch_object(fields, completed, failed)

    async def raw_batch(self, batch_id: str) -> dict[str, str] | None:
        """A batch's record fields, whoever owns it (the runner's view)."""
        record = await self.redis.hgetall(batch_key(self.queue, batch_id))
        return {name.decode(): value.decode() for name, value in record.items()} or None

    @staticmethod
    def batch_object(fields: dict[str, str], completed: int, failed: int) -> BatchObject:
        doc = json.loads(fields["doc"])
        stamps = (
            "in_progress_at",
            "finalizing_at",
            "completed_at",
            "failed_at",
            "expired_at",
            "cancelling_at",
            "cancelled_at",
        )
        return BatchObject(
            id=doc["id"],
            endpoint=doc["endpoint"],
            input_file_id=doc["input_file_id"],
            completion_window=doc["completion_window"],
            created_at=doc["created_at"],
            expires_at=doc["expires_at"],
            metadata=doc["metadata"],
            status=fields["status"],  # type: ignore[arg-type]  # written by this module only
            errors=BatchErrors.model_validate_json(fields["errors"])
            if "errors" in fields
            else None,
            output_file_id=fields.get("output_file_id"),
            error_file_id=fields.get("error_file_id"),
            # A finished batch keeps its counts in its record (its lines' hashes are gone).
            request_counts=RequestCounts(
                total=doc["total"],
                completed=int(fields.get("completed", completed)),
                failed=int(fields.get("failed", failed)),
            ),
            **{stamp: _int(fields.get(stamp)) for stamp in stamps},
        )

    async def list_batches(
        self, tenant: str | None, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[BatchObject], bool]:
        """The tenant's batches, newest first, from the one after ``after``; and whether
        there are more."""
        index = batches_key(self.queue, self.tenant_of(tenant))
        ids = [raw.decode() for raw in await self.redis.zrevrange(index, 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        batches: list[BatchObject] = []
        for batch_id in ids:
            if len(batches) > limit:
                break
            try:
                batches.append(await self.get_batch(tenant, batch_id))
            except BatchApiError:  # expired after its retention: drop it from the index
                await self.redis.zrem(index, batch_id)
        return batches[:limit], len(batches) > limit

    async def set_status(
        self, batch_id: str, status: BatchStatus, *, since: tuple[str, ...]
    ) -> tuple[bool, str]:
        """Move the batch to ``status`` if it is in one of ``since``: (moved, its status)."""
        moved, current = await self._status(
            keys=[batch_key(self.queue, batch_id)],
            args=[
                status,
                f"{status}_at" if status != "in_progress" else "",
                int(time.time()),
                *since,
            ],
        )
        return bool(moved), current.decode() if isinstance(current, bytes) else str(current)

    async def cancel_batch(self, tenant: str | None, batch_id: str) -> BatchObject:
        """Ask the batch's runner to stop: ``cancelling`` now, ``cancelled`` once its lines
        have stopped. A finished batch is refused (409, as OpenAI)."""
        batch = await self.get_batch(tenant, batch_id)
        moved, current = await self.set_status(
            batch_id, "cancelling", since=("validating", "in_progress")
        )
        if not moved and current not in ("cancelling", "cancelled"):
            raise BatchApiError(
                409,
                f"batch {batch.id} is {current}; only a batch in progress can be cancelled",
                code="batch_not_cancellable",
            )
        return await self.get_batch(tenant, batch_id)
