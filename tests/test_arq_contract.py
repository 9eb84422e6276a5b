"""What a producer that speaks arq sees of edgeq's jobs (worker/arq_seam.py).

A service may enqueue with arq's own ``ArqRedis.enqueue_job("chat", …)`` and a JSON
serializer, and follow the job with arq's ``Job``: its status while queued, running and
complete, and its result record (arq's envelope, the outcome under ``r``). The worker runs its
own loop, not arq's ``Worker``; this pins that arq's side still reads edgeq's records.
Against the shared worker on the tiny model and its real Redis.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest
from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.jobs import Job, JobStatus, SerializationError

from edgeq.core.keys import result_key, wake_channel
from edgeq.core.protocol import JOB_FUNCTION
from edgeq.testing.processes import WorkerProcess

pytestmark = pytest.mark.engine

REQUEST = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 8}


def serialize(value: object) -> bytes:
    return json.dumps(value).encode()


@pytest.fixture
async def arq_redis(worker: WorkerProcess) -> AsyncIterator[ArqRedis]:
    # As an arq producer connects: arq's own pool, with a JSON serializer.
    redis = await create_pool(
        RedisSettings.from_dsn(worker.env["EDGEQ_REDIS_URL"]),
        job_serializer=serialize,
        job_deserializer=json.loads,
    )
    yield redis
    await redis.aclose()


async def enqueue(redis: ArqRedis, queue: str, request: object, **options: object) -> Job:
    job = await redis.enqueue_job(
        JOB_FUNCTION, request, _job_id=uuid.uuid4().hex, _queue_name=queue, **options
    )
    assert job is not None
    await redis.publish(wake_channel(queue), "")  # as README asks of producers without edgeq
    return job


async def test_a_chat_enqueued_with_arq_completes_and_arq_reads_its_result(
    arq_redis: ArqRedis, worker: WorkerProcess
) -> None:
    queue = worker.env["EDGEQ_QUEUE"]
    job = await enqueue(arq_redis, queue, REQUEST)
    assert await job.status() in {JobStatus.queued, JobStatus.in_progress, JobStatus.complete}

    outcome = await job.result(timeout=120, poll_delay=0.1)

    assert await job.status() == JobStatus.complete
    assert set(outcome) >= {"job_id", "text", "finish_reason", "usage", "timings"}, outcome
    assert outcome["job_id"] == job.job_id
    assert outcome["usage"]["completion_tokens"] >= 1
    # The record itself, as a reader in another language sees it: arq's envelope.
    record = json.loads(await arq_redis.get(result_key(job.job_id)))
    assert record["s"] is True and record["r"] == outcome
    assert (record["f"], record["a"], record["t"], record["q"]) == (
        JOB_FUNCTION, [REQUEST], 1, queue,
    )  # fmt: skip
    assert record["ft"] >= record["st"] >= record["et"] > 0


async def test_a_request_the_worker_refuses_is_a_complete_job_whose_result_is_the_error(
    arq_redis: ArqRedis, worker: WorkerProcess
) -> None:
    job = await enqueue(arq_redis, worker.env["EDGEQ_QUEUE"], {"messages": []})

    outcome = await job.result(timeout=60, poll_delay=0.1)

    assert outcome["type"] == "error" and outcome["code"] == "invalid_request", outcome
    assert "messages" in outcome["message"]
    assert await job.status() == JobStatus.complete


async def test_a_job_past_its_queue_deadline_fails_and_arq_raises_with_the_error_event(
    arq_redis: ArqRedis, worker: WorkerProcess
) -> None:
    # arq's _expires: the payload is gone before the worker could take the job.
    job = await arq_redis.enqueue_job(
        JOB_FUNCTION, REQUEST, _job_id=uuid.uuid4().hex,
        _queue_name=worker.env["EDGEQ_QUEUE"], _expires=0.05, _defer_by=0.2,
    )  # fmt: skip
    assert job is not None and await job.status() == JobStatus.deferred

    with pytest.raises(SerializationError) as raised:
        await asyncio.wait_for(job.result(poll_delay=0.1), 60)

    # arq cannot rebuild an exception from JSON: it raises with the record's result, which
    # for a job that never started is its error event.
    (failure,) = raised.value.args
    assert failure["type"] == "error" and failure["code"] == "expired", failure
    assert await job.status() == JobStatus.complete
