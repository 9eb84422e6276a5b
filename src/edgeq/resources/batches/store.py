"""OpenAI's Files and Batches, kept in Redis: the Python API the gateway's routes and
``edgeq batch`` share (no FastAPI here).

    store = BatchStore(redis, settings)
    file = await store.create_file("acme", "in.jsonl", "batch", content)
    batch = await store.create_batch("acme", file.id)       # validated; runs in a runner
    batch = await store.get_batch("acme", batch.id)          # request_counts, status, ...

Files are Redis hashes that expire after EDGEQ_GATEWAY_FILE_RETENTION_S. A batch's input is
validated line by line when it is created, all of it before anything runs: a bad line fails the
batch with ``errors`` naming every bad line, and nothing is enqueued. A valid batch keeps each
line's edgeq request in a list and waits for a runner (runner.py) to feed it to the queue.
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
from collections.abc import Awaitable, Callable
from enum import IntEnum
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ValidationError, field_validator
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from edgeq.core.errors import EdgeqError
from edgeq.core.keys import (
    active_batches_key,
    batch_key,
    batch_key_prefix,
    batch_part_key,
    batches_key,
    file_key,
    file_key_prefix,
    files_key,
    tenant_active_batches_key,
)
from edgeq.core.protocol import describe_validation_error, dump_json, job_payload
from edgeq.core.scripts import lua_script
from edgeq.producer.client import build_request
from edgeq.resources.openai_api import (
    ChatCompletionRequest,
    UnsupportedField,
    encodable,
    unencodable_at,
)
from edgeq.resources.settings import ResourceSettings
from edgeq.resources.webhooks import queue_event

#: The one endpoint a batch line may name (the chat endpoint; every line runs as a chat job).
ENDPOINT = "/v1/chat/completions"
COMPLETION_WINDOW = "24h"
#: How many bad lines a failed batch's ``errors`` lists (the rest are counted in the last one).
MAX_ERRORS_LISTED = 100
#: The longest message one listed bad line gets (the rest is cut).
MAX_ERROR_CHARS = 300
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
# KEYS and ARGV: lua/store_file.lua, lua/start_batch.lua, lua/usage.lua.
_STORE_FILE = lua_script("tenant_usage", "store_file")
_START_BATCH = lua_script("tenant_usage", "start_batch")
_USAGE = lua_script("tenant_usage", "usage")


class CapReached(IntEnum):
    """Which of a tenant's caps a script refused at (lua/store_file.lua, start_batch.lua)."""

    FILES = -1
    BYTES = -2
    BATCHES = -3


class TenantUsage(BaseModel):
    """What one tenant keeps in Redis against its caps (``edgeq batch usage``)."""

    tenant: str
    files: int
    file_bytes: int
    active_batches: int
    batch_bytes: int

    @property
    def bytes(self) -> int:
        """What EDGEQ_GATEWAY_BYTES_PER_TENANT counts."""
        return self.file_bytes + self.batch_bytes


class BatchApiError(EdgeqError):
    """A request the Files/Batches API refuses: the HTTP status, and a message naming why."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


Order = Literal["asc", "desc"]


class ListLimit(NamedTuple):
    """The bounds of a list's ``limit`` (OpenAI's), and its default."""

    low: int
    high: int
    default: int

    def check(self, limit: int) -> None:
        if not self.low <= limit <= self.high:
            raise BatchApiError(
                400,
                f"limit: must be between {self.low} and {self.high} (got {limit})",
                code="invalid_limit",
                param="limit",
            )


FILES_LIMIT = ListLimit(1, 10_000, 10_000)
BATCHES_LIMIT = ListLimit(1, 100, 20)


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


#: The moments a batch's record stamps (Unix s), each when its status began.
STAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


class BatchRecord(BaseModel):
    """A batch as its hash keeps it: what was fixed when it was created (the JSON ``doc``
    field), its owner, and what changes while it runs (status and its stamps, the line to
    start next, the files and counts of a finished batch). Written by this module only."""

    # The document fixed at creation.
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    total: int
    # The hash's other fields.
    tenant: str
    status: str
    next_line: int = 0
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    #: A finished batch's counts (its lines' hashes are gone then); None while it runs.
    completed: int | None = None
    failed: int | None = None
    stamps: dict[str, int | None] = {}

    @classmethod
    def from_hash(cls, fields: dict[str, str]) -> BatchRecord:
        doc = json.loads(fields["doc"])
        return cls(
            **doc,
            tenant=fields["tenant"],
            status=fields["status"],
            next_line=int(fields.get("next_line", 0)),
            errors=BatchErrors.model_validate_json(fields["errors"])
            if "errors" in fields
            else None,
            output_file_id=fields.get("output_file_id"),
            error_file_id=fields.get("error_file_id"),
            completed=_int(fields.get("completed")),
            failed=_int(fields.get("failed")),
            stamps={stamp: _int(fields.get(stamp)) for stamp in STAMPS},
        )

    def shown(self, completed: int, failed: int) -> BatchObject:
        """OpenAI's Batch object; ``completed`` and ``failed`` count the lines recorded so far
        (a finished batch's own counts win)."""
        return BatchObject(
            id=self.id,
            endpoint=self.endpoint,
            input_file_id=self.input_file_id,
            completion_window=self.completion_window,
            created_at=self.created_at,
            expires_at=self.expires_at,
            metadata=self.metadata,
            status=self.status,  # type: ignore[arg-type]  # written by this module only
            errors=self.errors,
            output_file_id=self.output_file_id,
            error_file_id=self.error_file_id,
            request_counts=RequestCounts(
                total=self.total,
                completed=self.completed if self.completed is not None else completed,
                failed=self.failed if self.failed is not None else failed,
            ),
            **self.stamps,
        )


class BatchLine(BaseModel):
    """One validated input line, as the runner needs it."""

    custom_id: str
    model: str
    request: dict[str, Any]  # edgeq's ChatRequest fields, the class and tenant set


def _problem(line: int, code: str, message: str, param: str | None = None) -> BatchErrorItem:
    # A message may quote what the line sent (a url, a value): cut, so a failed batch's record,
    # kept for the retention and counted against no cap, stays small whatever the lines hold.
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 1] + "…"
    return BatchErrorItem(code=code, message=f"line {line}: {message}", param=param, line=line)


def _envelope(number: int, raw: bytes) -> dict[str, Any] | BatchErrorItem:
    """The line's JSON object, if its envelope is right: a custom_id, POST to the endpoint,
    a body; else what is wrong with it."""
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
    if not isinstance(item.get("body"), dict):
        return _problem(number, "invalid_request", "body: missing (a JSON object)", "body")
    return item


def parse_line(
    number: int,
    raw: bytes,
    *,
    tenant: str,
    models: list[str] | None,
    settings: ResourceSettings,
    key_name: str | None = None,
) -> BatchLine | BatchErrorItem:
    """One input line (numbered from 1) as a BatchLine, or what is wrong with it."""
    item = _envelope(number, raw)
    if isinstance(item, BatchErrorItem):
        return item
    try:
        chat = ChatCompletionRequest.model_validate(item["body"])
        if chat.stream:
            raise UnsupportedField("stream: a batch line's answer is not streamed; leave it out")
        fields = chat.edgeq_fields()
        # Every line runs in the batch class, under the batch's tenant (what it sent is ignored),
        # and is not streamed: the runner wants its result only, and a line's job then stores
        # 2 events in Redis, not one for each stream interval of its answer.
        fields.update(priority="batch", tenant=tenant, stream=False)
        if key_name is not None:
            fields["key_name"] = key_name
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
    return BatchLine(custom_id=item["custom_id"], model=chat.model, request=payload)


def parse_batch_file(
    content: bytes,
    *,
    tenant: str,
    models: list[str] | None,
    settings: ResourceSettings,
    key_name: str | None = None,
) -> tuple[list[BatchLine], list[BatchErrorItem]]:
    """Every line of an input file, validated; blank lines are skipped (they count in the
    numbering, as an editor shows it). CPU-bound: run it in a thread."""
    lines: list[BatchLine] = []
    problems: list[BatchErrorItem] = []
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        parsed = parse_line(
            number, raw, tenant=tenant, models=models, settings=settings, key_name=key_name
        )
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


def _glob_escaped(text: str) -> str:
    """``text`` matched literally in a SCAN pattern (a queue's name may hold ``{`` or ``*``)."""
    return "".join(f"\\{char}" if char in "*?[]\\" else char for char in text)


def line_request_id(batch_id: str, line: int) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:32]


def _int(value: bytes | str | None) -> int | None:
    return None if value is None else int(float(value))


def _check_endpoint(endpoint: str, completion_window: str) -> None:
    """The only endpoint and completion window a batch may have (OpenAI's ``24h``)."""
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


class BatchStore:
    """Files and batches of one queue's Redis (see the module doc)."""

    def __init__(self, redis: Redis, settings: ResourceSettings) -> None:
        self.redis = redis
        self.settings = settings
        self.queue = settings.queue
        self._status = redis.register_script(_STATUS)
        self._store_file = redis.register_script(_STORE_FILE)
        self._start_batch = redis.register_script(_START_BATCH)
        self._usage = redis.register_script(_USAGE)

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
            self.check_upload(purpose, content)
            file_id = f"file-{uuid.uuid4().hex}"
            max_files = settings.gateway_files_per_tenant
            max_bytes = settings.gateway_bytes_per_tenant
        else:
            max_files = max_bytes = 0  # a batch's output: always written, and counted
        now = int(time.time())
        record = FileObject(
            id=file_id,
            bytes=len(content),
            created_at=now,
            expires_at=now + int(settings.gateway_file_retention_s),
            filename=filename,
            purpose=purpose,
        )
        # Checked and taken in one step: concurrent uploads, from any number of gateway
        # processes, never keep more than the caps.
        outcome, *kept = await self._store_file(
            keys=[
                files_key(self.queue, owner),
                tenant_active_batches_key(self.queue, owner),
                file_key(self.queue, file_id),
            ],
            args=[
                file_key_prefix(self.queue),
                batch_key_prefix(self.queue),
                file_id,
                now,
                record.model_dump_json(),
                owner,
                content,
                int(settings.gateway_file_retention_s * 1000),
                max_files,
                max_bytes,
            ],
        )
        if outcome != 1:
            raise self.over_cap(owner, int(outcome), int(kept[0]), len(content))
        return record

    def check_upload(self, purpose: str, content: bytes) -> None:
        """An upload's purpose, size and line count, within EDGEQ_GATEWAY_FILE_MAX_*."""
        settings = self.settings
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

    def over_cap(self, owner: str, outcome: int, kept: int, adding: int) -> BatchApiError:
        """A cap's refusal (a store_file or start_batch script's answer), naming its setting."""
        settings = self.settings
        if outcome == CapReached.FILES:
            return BatchApiError(
                400,
                f"tenant {owner!r} already keeps {kept} files (uploads and batch output), "
                f"the most allowed (EDGEQ_GATEWAY_FILES_PER_TENANT="
                f"{settings.gateway_files_per_tenant}); "
                f"delete one first",
                code="too_many_files",
            )
        if outcome == CapReached.BYTES:
            return BatchApiError(
                400,
                f"tenant {owner!r} already keeps {kept} bytes in files and running batches; "
                f"{adding} more would pass the "
                f"{settings.gateway_bytes_per_tenant} allowed (EDGEQ_GATEWAY_BYTES_PER_TENANT); "
                f"delete a file first",
                code="storage_limit_reached",
            )
        return BatchApiError(
            400,
            f"tenant {owner!r} already has {kept} batches in progress, the most allowed "
            f"(EDGEQ_GATEWAY_BATCHES_PER_TENANT={settings.gateway_batches_per_tenant}); wait "
            f"for one to end or cancel one",
            code="too_many_batches",
        )

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

    async def list_files(
        self,
        tenant: str | None,
        purpose: str | None = None,
        *,
        after: str | None = None,
        limit: int = FILES_LIMIT.default,
        order: Order = "desc",
    ) -> tuple[list[FileObject], bool]:
        """One page of the tenant's files, by ``created_at`` (``order``), from the one after
        ``after``; and whether more follow it (expired ones dropped from its index here)."""
        FILES_LIMIT.check(limit)

        async def load(ids: list[str]) -> list[FileObject | None]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in ids:
                    pipe.hget(file_key(self.queue, file_id), "record")
                records = await pipe.execute()
            return [FileObject.model_validate_json(raw) if raw else None for raw in records]

        return await self._page(
            files_key(self.queue, self.tenant_of(tenant)), "file", load, after, limit, order,
            keep=lambda file: purpose in (None, file.purpose),
        )  # fmt: skip

    async def _page(
        self,
        index: str,
        kind: str,
        load: Callable[[list[str]], Awaitable[list[Any]]],
        after: str | None,
        limit: int,
        order: Order,
        keep: Callable[[Any], bool] = lambda item: True,
    ) -> tuple[list[Any], bool]:
        """A page of a tenant's index (a sorted set by creation time) as OpenAI pages its
        lists: up to ``limit`` items after ``after`` in ``order``, and whether any follow.
        ``load`` gives each id's object, None for one that is gone (dropped from the index
        here); ``keep`` says which of them this list shows."""
        if order not in ("asc", "desc"):
            raise BatchApiError(
                400, f"order: must be 'asc' or 'desc' (got {order!r})", code="invalid_order",
                param="order",
            )  # fmt: skip
        start = 0
        if after is not None:
            rank = await (self.redis.zrevrank if order == "desc" else self.redis.zrank)(
                index, after
            )
            if rank is None:  # not one of the tenant's (or gone): the cursor has no place
                raise BatchApiError(
                    400,
                    f"after: no {kind} with id {after!r} in this list (deleted or expired?)",
                    code="invalid_cursor",
                    param="after",
                )
            start = rank + 1
        read = self.redis.zrevrange if order == "desc" else self.redis.zrange
        items: list[Any] = []
        chunk = min(limit + 1, 1000)
        # One more than the page: whether it exists is has_more.
        while len(items) <= limit:
            ids = [raw.decode() for raw in await read(index, start, start + chunk - 1)]
            if not ids:
                break
            start += len(ids)
            loaded = await load(ids)
            gone = [item_id for item_id, item in zip(ids, loaded, strict=True) if item is None]
            if gone:
                await self.redis.zrem(index, *gone)
                start -= len(gone)
            items += [item for item in loaded if item is not None and keep(item)]
        return items[:limit], len(items) > limit

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
        key_name: str | None = None,
    ) -> BatchObject:
        """Validate every line of the input file, then either fail the batch (``errors``
        names each bad line; nothing runs) or leave it ``in_progress`` for a runner. Its
        lines' jobs carry ``key_name``, the API key it was created with (that key's limits
        and ledger rows)."""
        _check_endpoint(endpoint, completion_window)
        owner = self.tenant_of(tenant)
        await self._input_file(owner, input_file_id)
        usage = await self.usage(owner)  # a batch at the cap is refused before it is parsed
        if usage.active_batches >= self.settings.gateway_batches_per_tenant:
            raise self.over_cap(owner, CapReached.BATCHES, usage.active_batches, 0)
        content = await self.file_content(owner, input_file_id)
        lines, problems = await asyncio.to_thread(
            parse_batch_file,
            content,
            tenant=owner,
            models=models,
            settings=self.settings,
            key_name=key_name,
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
        if problems:
            await self._fail_batch(owner, batch_id, fields, problems, now)
        else:
            await self.start_batch(owner, batch_id, fields, lines, int(now * 1000))
        return await self.get_batch(owner, batch_id)

    async def _input_file(self, owner: str, input_file_id: str) -> FileObject:
        """The batch's input file: the tenant's own, uploaded for a batch."""
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
        return file

    async def _fail_batch(
        self,
        owner: str,
        batch_id: str,
        fields: dict[str, Any],
        problems: list[BatchErrorItem],
        now: float,
    ) -> None:
        """Store a batch with bad lines as ``failed``, its errors naming the first of them."""
        shown = problems[:MAX_ERRORS_LISTED]
        if len(problems) > len(shown):
            more = len(problems) - len(shown)
            shown.append(BatchErrorItem(code="more_errors", message=f"and {more} more bad lines"))
        errors = BatchErrors(data=shown).model_dump_json()
        fields |= {"status": "failed", "failed_at": int(now), "errors": errors}
        key = batch_key(self.queue, batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, int(self.settings.gateway_file_retention_s * 1000))
            queue_event(
                pipe, self.settings, event_type="batch.failed", object_id=batch_id, tenant=owner
            )
            pipe.zadd(batches_key(self.queue, owner), {batch_id: int(now * 1000)})
            await pipe.execute()

    async def start_batch(
        self, owner: str, batch_id: str, fields: dict[str, Any], lines: list[BatchLine],
        created_ms: int,
    ) -> None:  # fmt: skip
        """Leave a valid batch ``in_progress`` for a runner, if the tenant's caps allow it
        (checked and taken in one step with lua/start_batch.lua)."""
        settings = self.settings
        encoded = [line.model_dump_json() for line in lines]
        input_bytes = sum(len(text) for text in encoded)
        fields = fields | {
            "status": "in_progress", "in_progress_at": created_ms // 1000,
            "input_bytes": input_bytes,
        }  # fmt: skip
        # The lines first: a runner only looks at a batch once the script made it active.
        input_key = self.part("input", batch_id)
        await self.redis.rpush(input_key, *encoded)
        try:
            outcome, *kept = await self._start_batch(
                keys=[
                    files_key(self.queue, owner),
                    tenant_active_batches_key(self.queue, owner),
                    batch_key(self.queue, batch_id),
                    active_batches_key(self.queue),
                    batches_key(self.queue, owner),
                ],
                args=[
                    file_key_prefix(self.queue),
                    batch_key_prefix(self.queue),
                    batch_id,
                    created_ms,
                    settings.gateway_batches_per_tenant,
                    settings.gateway_files_per_tenant,
                    settings.gateway_bytes_per_tenant,
                    input_bytes,
                    *(item for pair in fields.items() for item in pair),
                ],
            )
        except BaseException:
            await self.redis.delete(input_key)
            raise
        if outcome != 1:
            await self.redis.delete(input_key)
            raise self.over_cap(owner, int(outcome), int(kept[0]), input_bytes)

    async def usage(self, tenant: str | None) -> TenantUsage:
        """What the tenant keeps against its caps (expired files and ended batches are
        dropped from its indexes on the way)."""
        owner = self.tenant_of(tenant)
        files, file_bytes, batches, batch_bytes = await self._usage(
            keys=[files_key(self.queue, owner), tenant_active_batches_key(self.queue, owner)],
            args=[file_key_prefix(self.queue), batch_key_prefix(self.queue)],
        )
        return TenantUsage(
            tenant=owner, files=files, file_bytes=file_bytes, active_batches=batches,
            batch_bytes=batch_bytes,
        )  # fmt: skip

    async def tenants(self) -> list[str]:
        """Every tenant that keeps files or batches on this queue."""
        found: set[str] = set()
        for index in (files_key(self.queue, "*"), batches_key(self.queue, "*")):
            prefix = index.removesuffix("*")
            async for raw in self.redis.scan_iter(match=_glob_escaped(prefix) + "*", count=1000):
                found.add(raw.decode().removeprefix(prefix))
        return sorted(found)

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
        return BatchRecord.from_hash(fields).shown(completed, failed)

    async def set_waiting(self, batch_id: str, why: str | None) -> None:
        """Say why a running batch's lines wait (its tenant's limits: docs/limits.md), or
        that they no longer do (None)."""
        if why is None:
            await self.redis.hdel(batch_key(self.queue, batch_id), "waiting")
        else:
            await self.redis.hset(batch_key(self.queue, batch_id), "waiting", why)

    async def waiting(self, tenant: str | None, batch_id: str) -> str | None:
        """Why the batch's lines wait, if they do (``set_waiting``); None for a batch that
        ended, or another tenant's."""
        fields = await self.redis.hmget(batch_key(self.queue, batch_id), "tenant", "waiting",
                                        "status")  # fmt: skip
        owner, why, status = (value.decode() if value else None for value in fields)
        if owner != self.tenant_of(tenant) or why is None or status in FINAL_STATUSES:
            return None
        return why

    async def record(self, batch_id: str) -> BatchRecord | None:
        """A batch's record, whoever owns it (the runner's view); None if it is gone."""
        fields = await self.redis.hgetall(batch_key(self.queue, batch_id))
        if not fields:
            return None
        return BatchRecord.from_hash({name.decode(): value.decode() for name, value in
                                      fields.items()})  # fmt: skip

    async def list_batches(
        self,
        tenant: str | None,
        *,
        after: str | None = None,
        limit: int = BATCHES_LIMIT.default,
        order: Order = "desc",
    ) -> tuple[list[BatchObject], bool]:
        """One page of the tenant's batches, newest first (``order="desc"``), from the one
        after ``after``; and whether more follow it."""
        BATCHES_LIMIT.check(limit)
        owner = self.tenant_of(tenant)

        async def load(ids: list[str]) -> list[BatchObject | None]:
            batches: list[BatchObject | None] = []
            for batch_id in ids:
                try:
                    batches.append(await self.get_batch(owner, batch_id))
                except BatchApiError:  # expired after its retention: dropped from the index
                    batches.append(None)
            return batches

        return await self._page(batches_key(self.queue, owner), "batch", load, after, limit, order)

    # --- a running batch's lines (the runner's) ----------------------------------------------

    async def line(self, batch_id: str, line: int) -> BatchLine:
        """The batch's validated line (numbered from 0)."""
        raw = await self.redis.lindex(self.part("input", batch_id), line)
        return BatchLine.model_validate_json(raw)

    async def is_recorded(self, batch_id: str, custom_id: str) -> bool:
        """Whether the line's outcome is in the output or the error file already."""
        if await self.redis.hexists(self.part("out", batch_id), custom_id):
            return True
        return bool(await self.redis.hexists(self.part("err", batch_id), custom_id))

    async def attempt(self, batch_id: str, line: int) -> int:
        """How often the line was run again (0: its first job)."""
        return int(await self.redis.hget(self.part("attempts", batch_id), line) or 0)

    async def next_attempt(self, batch_id: str, line: int) -> int:
        return int(await self.redis.hincrby(self.part("attempts", batch_id), line))

    async def record_line(
        self, batch_id: str, line: int, custom_id: str, entry: dict[str, Any], *, ok: bool
    ) -> None:
        """The line's output (``ok``) or error entry, written once per custom_id: a line run
        again by a runner taking over is not doubled."""
        key = self.part("out" if ok else "err", batch_id)
        await self.redis.hsetnx(key, custom_id, f"{line} {json.dumps(entry)}")

    async def update_batch(self, batch_id: str, fields: dict[str, str]) -> None:
        """Set fields of the batch's record (its files' ids, its final counts)."""
        await self.redis.hset(batch_key(self.queue, batch_id), mapping=fields)

    def forget_batch_work(self, pipe: Pipeline, batch_id: str, tenant: str) -> None:
        """Queue, on ``pipe``: the batch out of the active sets, its working keys deleted, its
        record kept for the retention (EDGEQ_GATEWAY_FILE_RETENTION_S) only."""
        pipe.srem(active_batches_key(self.queue), batch_id)
        pipe.srem(tenant_active_batches_key(self.queue, tenant), batch_id)
        pipe.delete(*(self.part(part, batch_id) for part in ("input", "out", "err", "inflight",
                                                            "attempts")))  # fmt: skip
        pipe.pexpire(
            batch_key(self.queue, batch_id), int(self.settings.gateway_file_retention_s * 1000)
        )

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
