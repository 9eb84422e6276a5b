"""Running batches: each line becomes an ordinary chat job of the ``batch`` class, under the
batch's tenant, fed to the queue a window at a time.

Every gateway process runs a ``BatchRunner`` (EDGEQ_GATEWAY_BATCH_RUNNER) and ``edgeq batch
submit --wait`` runs one for its own batch. A runner takes a batch by a short lease
(EDGEQ_GATEWAY_BATCH_LEASE_S) that it renews while it runs it; a runner that was killed stops
renewing, and another one, or the same gateway restarted, takes the batch over.

Restart-safe and exactly-once in the output:

- a line is marked in flight (``batch-inflight``) before its job is enqueued, and its job id is
  derived from the batch id, the line number and the attempt, so a runner taking over attaches
  to the job a line already has (its result kept in the job's replay buffer) instead of
  enqueueing a second one;
- a line's outcome is written once, keyed by its custom_id (HSETNX), before it leaves the
  in-flight set, and the counts are the sizes of those hashes: a line recorded twice is
  recorded once.

Backpressure: at most EDGEQ_GATEWAY_BATCH_WINDOW lines of a batch, and at most
EDGEQ_GATEWAY_BATCH_QUEUED_MAX lines of all batches together, are queued or running at once
(the queue's batch lines, core/keys.py batch_lines_key); the rest wait in Redis as a list.
Interactive and default jobs are admitted without counting those lines (lua/enqueue.lua), so
batches never get a chat refused. A full queue (EDGEQ_MAX_QUEUE, the tenant's cap) is waited
out, never a line's failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator

import structlog
from redis.asyncio.client import Pipeline

from edgeq.core.cluster import hash_tag
from edgeq.core.connection import REDIS_ERRORS
from edgeq.core.errors import EdgeqError, JobFailed, JobTimeout, RedisUnavailable
from edgeq.core.keys import (
    active_batches_key,
    batch_key,
    batch_lines_key,
    events_key,
    tenant_active_batches_key,
)
from edgeq.core.limits import RateLimitRefusal, waiting_reason
from edgeq.core.protocol import ChatResult, ErrorCode
from edgeq.core.scripts import lua_script
from edgeq.producer.client import ChatClient
from edgeq.producer.queue import Enqueued
from edgeq.resources.batches.store import (
    FINAL_STATUSES,
    OUTPUT_PURPOSE,
    BatchLine,
    BatchRecord,
    BatchStore,
    line_request_id,
)
from edgeq.resources.openai_api import completion_json, error_json
from edgeq.resources.settings import ResourceSettings
from edgeq.resources.webhooks import queue_event

log = structlog.get_logger("edgeq.batch")

#: How often a runner looks for batches to take, and a batch's runner for a cancel or expiry.
POLL_S = 0.5
#: A full queue is tried again after this long.
QUEUE_FULL_RETRY_S = 0.5
#: A line its tenant's rate limits or budgets refused is tried again when their window turns,
#: or after this long at most (a limit raised at run time is noticed that soon).
LIMITS_RETRY_S = 5.0
#: A line whose job ended with one of these (its worker died and it could not be continued)
#: is run again, with a new job, up to this many times.
RETRIED_CODES = (ErrorCode.WORKER_LOST, ErrorCode.SHUTDOWN)
MAX_ATTEMPTS = 3
#: Input lines read (and unrun lines recorded) per round trip when a batch finishes.
FINISH_CHUNK = 1000
#: The HTTP status an output line reports for a job's error code.
LINE_STATUS = {"invalid_request": 400, "prompt_too_long": 400, "cancelled": 499}

_LEASE = lua_script("batch_lease")
# KEYS and ARGV: lua/take_batch_line.lua.
_TAKE_LINE = lua_script("take_batch_line")


def line_member(batch_id: str, line: int) -> str:
    """A line's entry in the queue's batch lines (core/keys.py batch_lines_key)."""
    return f"{batch_id}:{line}"


def line_job_id(queue: str, batch_id: str, line: int, attempt: int) -> str:
    """The job a line's attempt runs as: the same for every runner, so a runner taking a
    batch over finds the job instead of enqueueing another (see core/keys.new_job_id)."""
    digest = hashlib.sha256(f"{batch_id}:{line}:{attempt}".encode()).hexdigest()[:32]
    tag = hash_tag(queue)
    return f"{{{tag}}}{digest}" if tag is not None else digest


class LeaseLost(Exception):
    """Another runner holds the batch now (this one was too slow to renew)."""


class BatchRun:
    """One batch, run by the runner holding its lease, until it ends."""

    def __init__(self, runner: BatchRunner, batch_id: str) -> None:
        self.runner = runner
        self.store = runner.store
        self.client = runner.client
        self.batch_id = batch_id
        self.log = log.bind(batch_id=batch_id)
        # Why the batch stops early ("cancelled", "expired"): the error code of its unfinished
        # lines, and a line's task enqueues nothing more once it is set.
        self.stopping: str | None = None
        # The record says the lines wait for the tenant's limits (this runner wrote it). Its
        # line tasks change it under the lock, so their writes land in the order they decided
        # them: unlocked, a refused line's "waiting" could land after an admitted one's clear.
        self.waiting_for_limits = False
        self._waiting_lock = asyncio.Lock()

    async def run(self) -> None:
        record = await self.store.record(self.batch_id)
        if record is None or record.status in FINAL_STATUSES:  # a runner died finishing it
            return await self.clean_up(record)
        self.tenant, self.total, self.expires_at = record.tenant, record.total, record.expires_at
        self.log = self.log.bind(tenant=self.tenant)
        next_line = record.next_line
        tasks = await self.resume()
        self.log.info("batch_running", lines=self.total, next_line=next_line, resumed=len(tasks))
        try:
            while True:
                now = await self.store.record(self.batch_id)
                status = None if now is None else now.status
                if status == "cancelling":
                    return await self.stop(tasks, "cancelled")
                if status != "in_progress":
                    return  # finished elsewhere, or expired out of Redis
                if time.time() >= self.expires_at:
                    return await self.stop(tasks, "expired")
                next_line = await self.start_lines(tasks, next_line)
                if not tasks and next_line >= self.total:
                    return await self.finish("completed")
                if not tasks:  # other batches hold the whole budget: look again later
                    await asyncio.sleep(POLL_S)
                    continue
                await self.reap(tasks)
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def clean_up(self, record: BatchRecord | None) -> None:
        """What a runner that died finishing the batch left: its working keys, its place in
        the active sets, and (in case it died before queuing it) its webhook event."""
        await self.runner.release_lines(self.batch_id)
        parts = ("input", "inflight", "out", "err", "attempts")
        async with self.store.redis.pipeline(transaction=True) as pipe:
            pipe.srem(active_batches_key(self.store.queue), self.batch_id)
            pipe.delete(*(self.store.part(part, self.batch_id) for part in parts))
            if record is not None:
                self.queue_ended_event(pipe, record.status, record.tenant)
                pipe.srem(
                    tenant_active_batches_key(self.store.queue, record.tenant), self.batch_id
                )
            await pipe.execute()

    async def resume(self) -> dict[int, asyncio.Task[None]]:
        """The lines a runner before us left in flight, running again (in the batches' budget
        still, or again)."""
        store = self.store
        inflight_key = store.part("inflight", self.batch_id)
        resumed = [int(raw) for raw in await store.redis.smembers(inflight_key)]
        if resumed:
            await store.redis.sadd(
                batch_lines_key(store.queue), *(line_member(self.batch_id, n) for n in resumed)
            )
        return {line: asyncio.create_task(self.run_line(line)) for line in resumed}

    async def start_lines(self, tasks: dict[int, asyncio.Task[None]], next_line: int) -> int:
        """Start lines from ``next_line`` while the batch's window has room; the next line."""
        while len(tasks) < self.runner.settings.gateway_batch_window and next_line < self.total:
            # In flight before enqueued: a runner taking over finds every line whose job may
            # exist (and attaches to it: its id is fixed). Taken from the batches' common
            # budget too (EDGEQ_GATEWAY_BATCH_QUEUED_MAX): none left, the line waits for one of
            # any batch to end.
            if not await self.runner.take_line(self.batch_id, next_line):
                break
            tasks[next_line] = asyncio.create_task(self.run_line(next_line))
            next_line += 1
        return next_line

    async def reap(self, tasks: dict[int, asyncio.Task[None]]) -> None:
        """Wait a little for lines to end; one that failed on Redis runs again."""
        done, _ = await asyncio.wait(
            tasks.values(), timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED
        )
        for line, task in list(tasks.items()):
            if task in done:
                del tasks[line]
                if task.exception() is not None:  # Redis away: the line runs again
                    self.log.warning("batch_line_retry", line=line, error=str(task.exception()))
                    await asyncio.sleep(QUEUE_FULL_RETRY_S)
                    tasks[line] = asyncio.create_task(self.run_line(line))

    async def run_line(self, line: int) -> None:
        """Run one line to its outcome and record it (once), then take it out of flight."""
        store, redis = self.store, self.store.redis
        item = await store.line(self.batch_id, line)
        if not await store.is_recorded(self.batch_id, item.custom_id):
            attempt = await store.attempt(self.batch_id, line)
            while True:
                job_id = line_job_id(store.queue, self.batch_id, line, attempt)
                outcome = await self.job_outcome(job_id, item)
                if (
                    isinstance(outcome, JobFailed)
                    and outcome.code in RETRIED_CODES
                    and attempt + 1 < MAX_ATTEMPTS
                    and self.stopping is None
                ):
                    attempt = await store.next_attempt(self.batch_id, line)
                    self.log.info("batch_line_again", line=line, code=outcome.code)
                    continue
                break
            await self.record(line, item, job_id, outcome)
        async with redis.pipeline(transaction=True) as pipe:
            pipe.srem(store.part("inflight", self.batch_id), line)
            pipe.srem(batch_lines_key(store.queue), line_member(self.batch_id, line))
            await pipe.execute()

    async def job_outcome(self, job_id: str, item: BatchLine) -> ChatResult | JobFailed:
        """Enqueue the line's job unless it exists (or ended), then wait for its end."""
        client = self.client
        while True:
            # Not started: no events (a job that ended has its terminal event among them).
            # Enqueue it; DUPLICATE_ID means it is queued already (a runner before us enqueued
            # it). Looked at again after each silence, so a job a Redis restart without AOF
            # lost is enqueued again.
            if not await client.redis.exists(events_key(job_id)):
                while not await self.enqueue_line(job_id, item):
                    if self.stopping is not None:
                        return JobFailed(
                            job_id,
                            f"batch_{self.stopping}",
                            f"the batch was {self.stopping} before this line ran",
                        )
            job = await client.attach(job_id)
            try:
                return await job.result()
            except JobFailed as error:
                return error
            except JobTimeout:
                continue  # queued behind other work: no event yet, keep waiting

    async def enqueue_line(self, job_id: str, item: BatchLine) -> bool:
        """Enqueue the line's job (True: it is queued, by this call or a runner before us), or
        wait a little (False) while the queue, the tenant's cap or its rate limits refuse it.
        A line refused by its tenant's limits is not failed: it waits for their window to
        turn, and the batch's record says why meanwhile (``waiting``, docs/limits.md)."""
        if self.stopping is not None:
            return False
        outcome, detail = await self.client.queue.enqueue(
            job_id,
            item.request,
            # A line not started when the batch's window ends never starts.
            deadline_s=max(1.0, self.expires_at - time.time()),
            # Bounded by the batches' own budget instead (take_line), and left out of
            # EDGEQ_MAX_QUEUE, which is the other classes' (enqueue.lua).
            max_depth=0,
            tenant=self.tenant,
            priority="batch",
            key_name=item.request.get("key_name"),
        )
        if outcome in (Enqueued.ACCEPTED, Enqueued.DUPLICATE_ID):
            if self.waiting_for_limits:
                await self.say_waiting(None)
            return True
        if isinstance(detail, RateLimitRefusal):
            if not self.waiting_for_limits:
                reason = waiting_reason(self.tenant, detail, item.request.get("key_name"))
                await self.say_waiting(reason)
            # Tried again when its window turns, or sooner: a limit raised meanwhile.
            await asyncio.sleep(min(max(detail.reset_s, QUEUE_FULL_RETRY_S), LIMITS_RETRY_S))
            return False
        await asyncio.sleep(QUEUE_FULL_RETRY_S)  # the queue or the tenant is full
        return False

    async def say_waiting(self, reason: str | None) -> None:
        """Record that the lines wait for the tenant's limits (``reason``) or no longer do
        (None): one write per change, in the order the line tasks decided them."""
        async with self._waiting_lock:
            if self.waiting_for_limits == (reason is not None):
                return  # another line task changed it first
            self.waiting_for_limits = reason is not None
            await self.store.set_waiting(self.batch_id, reason)

    async def record(
        self, line: int, item: BatchLine, job_id: str, outcome: ChatResult | JobFailed
    ) -> None:
        request_id = line_request_id(self.batch_id, line)
        if isinstance(outcome, ChatResult):
            body = completion_json(outcome, model=item.model, created=int(time.time()))
            entry = {
                "id": request_id,
                "custom_id": item.custom_id,
                "response": {"status_code": 200, "request_id": job_id, "body": body},
                "error": None,
            }
        else:
            code = outcome.code
            if code == "cancelled" and self.stopping is not None:
                code = f"batch_{self.stopping}"  # stopped by the batch's cancel or expiry
            entry = {
                "id": request_id,
                "custom_id": item.custom_id,
                "response": None,
                "error": {"code": code, "message": outcome.message},
            }
            if not code.startswith("batch_"):  # the job ran and failed: its answer's status
                status = LINE_STATUS.get(code, 500)
                entry["response"] = {
                    "status_code": status,
                    "request_id": job_id,
                    "body": error_json(
                        outcome.message,
                        code=code,
                        type="invalid_request_error" if status < 500 else "server_error",
                    ),
                }
        ok = isinstance(outcome, ChatResult)
        await self.store.record_line(self.batch_id, line, item.custom_id, entry, ok=ok)

    async def stop(self, tasks: dict[int, asyncio.Task[None]], why: str) -> None:
        """Cancel or expiry: no line starts any more, running ones are stopped (each records
        what its job ended with), the rest are recorded as ``batch_<why>``; then finish."""
        self.stopping = why
        self.log.info("batch_stopping", why=why, in_flight=len(tasks))
        reason = f"the batch was {why}"
        for line in tasks:
            attempt = await self.store.attempt(self.batch_id, line)
            await self.client.cancel(
                line_job_id(self.store.queue, self.batch_id, line, attempt), reason
            )
        if tasks:  # each records what its job ended with (cancelled, or done just before)
            await asyncio.wait(tasks.values(), timeout=30)
        await self.finish(why)

    async def finish(self, status: str) -> None:
        """Write the output and error files (partial ones for a cancel or expiry) and end the
        batch. Safe to run again after a crash: the files' ids are the batch's."""
        store, batch_id = self.store, self.batch_id
        since = ("cancelling",) if status == "cancelled" else ("in_progress",)
        if status == "completed":
            await store.set_status(batch_id, "finalizing", since=("in_progress",))
            since = ("finalizing",)
        await self.record_unrun(status)
        record_fields = await self.write_files()
        # The counts move into the record: the lines' hashes are the files now, not kept twice.
        out_key, err_key = store.part("out", batch_id), store.part("err", batch_id)
        record_fields["completed"] = str(await store.redis.hlen(out_key))
        record_fields["failed"] = str(await store.redis.hlen(err_key))
        await store.update_batch(batch_id, record_fields)
        await store.set_status(batch_id, status, since=since)  # type: ignore[arg-type]
        await self.runner.release_lines(batch_id)
        async with store.redis.pipeline(transaction=True) as pipe:
            self.queue_ended_event(pipe, status, self.tenant)
            store.forget_batch_work(pipe, batch_id, self.tenant)
            await pipe.execute()
        self.log.info("batch_finished", status=status)

    async def record_unrun(self, status: str) -> None:
        """Put each line that never ran in the error file, once: the lines read and written
        a chunk per round trip, not one by one (a batch may have 50,000)."""
        redis, batch_id = self.store.redis, self.batch_id
        out_key, err_key = self.store.part("out", batch_id), self.store.part("err", batch_id)
        recorded = set(await redis.hkeys(out_key)) | set(await redis.hkeys(err_key))
        input_key = self.store.part("input", batch_id)
        for start in range(0, self.total, FINISH_CHUNK):
            raws = await redis.lrange(input_key, start, start + FINISH_CHUNK - 1)
            async with redis.pipeline(transaction=False) as pipe:
                for line, raw in enumerate(raws, start=start):
                    item = BatchLine.model_validate_json(raw)
                    if item.custom_id.encode() in recorded:
                        continue
                    entry = {
                        "id": line_request_id(batch_id, line),
                        "custom_id": item.custom_id,
                        "response": None,
                        "error": {
                            "code": f"batch_{status}",
                            "message": f"the batch was {status} before this line ran",
                        },
                    }
                    pipe.hsetnx(err_key, item.custom_id, f"{line} {json.dumps(entry)}")
                await pipe.execute()

    async def write_files(self) -> dict[str, str]:
        """The output and error files, each line in input order; their ids, as the record's
        ``output_file_id`` and ``error_file_id`` (none for an empty one)."""
        store, batch_id = self.store, self.batch_id
        file_ids: dict[str, str] = {}
        for part, suffix in (("out", "output"), ("err", "error")):
            entries = sorted(
                (int(line), text)
                for line, _, text in (
                    raw.decode().partition(" ")
                    for raw in await store.redis.hvals(store.part(part, batch_id))
                )
            )
            if not entries:
                continue
            content = "".join(f"{text}\n" for _, text in entries).encode()
            file_id = f"file-{batch_id.removeprefix('batch_')}-{suffix}"
            await store.create_file(
                self.tenant, f"{batch_id}_{suffix}.jsonl", OUTPUT_PURPOSE, content, file_id=file_id
            )
            file_ids[f"{suffix}_file_id"] = file_id
        return file_ids

    def queue_ended_event(self, pipe: Pipeline, status: str, tenant: str) -> None:
        """``batch.<status>`` for the webhook endpoints that take the tenant's events; queued
        with the batch's leaving the active set, so a runner that dies before that queues it
        again when it takes the batch up (the same event: delivered at least once)."""
        queue_event(
            pipe, self.runner.settings, event_type=f"batch.{status}", object_id=self.batch_id,
            tenant=tenant,
        )  # fmt: skip


class BatchRunner:
    """Takes unfinished batches by lease and runs them (see the module doc)."""

    def __init__(self, client: ChatClient, settings: ResourceSettings) -> None:
        self.client = client
        self.settings = settings
        self.store = BatchStore(client.redis, settings)
        self.token = uuid.uuid4().hex
        self._lease = client.redis.register_script(_LEASE)
        self._take_line = client.redis.register_script(_TAKE_LINE)
        self._running: dict[str, asyncio.Task[None]] = {}

    async def hold(self, batch_id: str) -> bool:
        """Take or renew the batch's lease: False if another runner holds it."""
        ttl_ms = int(self.settings.gateway_batch_lease_s * 1000)
        key = self.store.part("lease", batch_id)
        return bool(await self._lease(keys=[key], args=[self.token, ttl_ms]))

    async def take_line(self, batch_id: str, line: int) -> bool:
        """Put the batch's line in flight, if the batches' common budget has room for it."""
        store = self.store
        return bool(
            await self._take_line(
                keys=[
                    batch_lines_key(store.queue),
                    store.part("inflight", batch_id),
                    batch_key(store.queue, batch_id),
                ],
                args=[self.settings.gateway_batch_queued_max, line_member(batch_id, line), line],
            )
        )

    async def release_lines(self, batch_id: str) -> None:
        """Give back whatever the batch still holds of the batches' common budget."""
        key = batch_lines_key(self.store.queue)
        held = [
            raw async for raw in self.client.redis.sscan_iter(key, match=f"{batch_id}:*")
        ]  # fmt: skip
        if held:
            await self.client.redis.srem(key, *held)

    async def release_orphan_lines(self) -> None:
        """Lines of batches that are no longer active (their runner died and the batch
        ended, or expired out of Redis) give their place in the budget back."""
        redis, queue = self.client.redis, self.store.queue
        members = [raw.decode() for raw in await redis.smembers(batch_lines_key(queue))]
        batch_ids = sorted({member.rpartition(":")[0] for member in members})
        if not batch_ids:
            return
        active = await redis.smismember(active_batches_key(queue), batch_ids)
        gone = {batch_id for batch_id, is_active in zip(batch_ids, active, strict=True)
                if not is_active}  # fmt: skip
        orphans = [member for member in members if member.rpartition(":")[0] in gone]
        if orphans:
            await redis.srem(batch_lines_key(queue), *orphans)

    async def run_batch(self, batch_id: str) -> None:
        """Run one batch while holding its lease; LeaseLost if another runner took it."""
        run = asyncio.create_task(BatchRun(self, batch_id).run())
        renew_s = self.settings.gateway_batch_lease_s / 3
        try:
            while not run.done():
                await asyncio.wait([run], timeout=renew_s)
                if not run.done() and not await self.hold(batch_id):
                    raise LeaseLost(batch_id)
            run.result()
        finally:
            if not run.done():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
            with contextlib.suppress(EdgeqError, *REDIS_ERRORS):
                await self.client.redis.delete(self.store.part("lease", batch_id))

    async def poll_once(self, only: str | None = None) -> None:
        """Take every unfinished batch nobody runs (or only ``only``)."""
        await self.release_orphan_lines()
        for raw in await self.client.redis.smembers(active_batches_key(self.store.queue)):
            batch_id = raw.decode()
            if only not in (None, batch_id) or batch_id in self._running:
                continue
            if await self.hold(batch_id):
                task = asyncio.create_task(self._guarded(batch_id))
                self._running[batch_id] = task

    async def _guarded(self, batch_id: str) -> None:
        try:
            await self.run_batch(batch_id)
        except LeaseLost:
            log.warning("batch_lease_lost", batch_id=batch_id)
        except (RedisUnavailable, EdgeqError, *REDIS_ERRORS) as error:
            log.warning("batch_runner_error", batch_id=batch_id, error=str(error))
        except Exception:
            log.exception("batch_runner_failed", batch_id=batch_id)
        finally:
            self._running.pop(batch_id, None)

    async def run_forever(self, only: str | None = None) -> None:
        try:
            while True:
                try:
                    await self.poll_once(only)
                # Redis away (restarting): the runner lives on and looks again.
                except (RedisUnavailable, EdgeqError, *REDIS_ERRORS) as error:
                    log.warning("batch_runner_poll_failed", error=str(error))
                await asyncio.sleep(POLL_S)
        finally:
            tasks = list(self._running.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def running_batches(settings: ResourceSettings) -> AsyncIterator[BatchRunner | None]:
    """A BatchRunner in the background for as long as the block runs (the gateway's life),
    on a ChatClient of its own, so its lines never wait for the interactive requests' Redis
    connections; None when EDGEQ_GATEWAY_BATCH_RUNNER is off."""
    if not settings.gateway_batch_runner:
        yield None
        return
    async with ChatClient(settings) as client:
        runner = BatchRunner(client, settings)
        task = asyncio.create_task(runner.run_forever())
        try:
            yield runner
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
