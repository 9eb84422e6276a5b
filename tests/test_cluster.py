"""edgeq on a real Redis Cluster: 3 primaries + 3 replicas of Debian's redis-server on loopback,
made with `redis-cli --cluster create`, a real worker on the tiny model, real clients.

Every key of a queue lives in the queue's slot (edgeq.core.cluster): chats, cancel, leases,
backpressure and replay work as on one Redis, a forced failover during streaming loses no job
and no event, and two queues can live on two different primaries.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from edgeq.core.cluster import ClusterTarget, hash_tag, parse_cluster_url, queue_slot
from edgeq.core.connection import make_redis
from edgeq.core.errors import ConfigError, QueueFull
from edgeq.core.events import EventLog
from edgeq.core.keys import events_key, leases_key, new_job_id
from edgeq.core.ledger import LedgerScope
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, StreamEvent, Timings, Usage
from edgeq.core.settings import ConnectionSettings, load_settings
from edgeq.producer.client import ChatClient, ChatJob
from edgeq.testing.processes import WorkerProcess
from helpers import (
    EDGEQ,
    FULL_LENGTH_SEEDS,
    LocalCluster,
    assert_intact,
    engine_env,
    frozen,
    slowed,
)

QUEUE = "{edgeq:cluster}"
LONG = {"max_tokens": 300, "temperature": 1.0}  # with a full-length seed: ~300 tokens
CHAT_TIMEOUT_S = 120
LEASE_TTL_S = 3  # a killed worker's chat is handed over this long after its last renewal


# --- settings (no cluster needed) ----------------------------------------------------------


def test_a_cluster_url_names_its_seed_nodes_and_credentials() -> None:
    assert parse_cluster_url("redis+cluster://:pw@h1:7000,[::1]:7001") == ClusterTarget(
        seeds=(("h1", 7000), ("::1", 7001)), password="pw"
    )
    assert "pw" not in repr(parse_cluster_url("redis+cluster://u:pw@h:1"))
    for url, problem in [
        ("redis+cluster://h:1/2", "only database 0"),
        ("rediss+cluster://h:1", "not supported yet"),
        ("redis+cluster://", "names no cluster node"),
        ("redis+cluster://h", "not host:port"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_cluster_url(url)


def test_on_a_cluster_the_queue_needs_a_hash_tag(clean_edgeq_env: None) -> None:
    url = "redis+cluster://127.0.0.1:7000"
    with pytest.raises(ConfigError, match=r"needs a hash tag.*\{edgeq:queue\}"):
        load_settings(ConnectionSettings, redis_url=url)
    assert load_settings(ConnectionSettings, redis_url=url, queue=QUEUE).queue == QUEUE


def test_job_ids_carry_the_queues_tag_so_all_their_keys_share_its_slot() -> None:
    from edgeq.core.keys import events_key, in_progress_key, job_key, retry_key, terminal_key

    job_id = new_job_id(QUEUE)
    assert hash_tag(job_id) == "edgeq:cluster"
    keys = [job_key(job_id), in_progress_key(job_id), retry_key(job_id)]
    keys += [events_key(job_id), terminal_key(job_id), leases_key(QUEUE)]
    assert {queue_slot(key) for key in keys} == {queue_slot(QUEUE)}
    # On one Redis nothing changes: a plain id, its streams tagged by the id.
    assert hash_tag(new_job_id("edgeq:queue")) is None
    assert events_key("abc") == "edgeq:events:{abc}"


# --- on a real cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    nodes = LocalCluster(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def cluster_worker(
    cluster: LocalCluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(
        _worker_env(tiny_model, cluster), tmp_path_factory.mktemp("cluster-worker") / "worker.log"
    )
    worker.start()
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


def _worker_env(tiny_model: Path, cluster: LocalCluster) -> dict[str, str]:
    return engine_env(tiny_model, cluster.url, QUEUE) | {
        "EDGEQ_LEASE_TTL_S": str(LEASE_TTL_S),
        "PYTHONUNBUFFERED": "1",  # the hand-over test reads the logs live
    }


async def _events(job: ChatJob) -> list[StreamEvent]:
    """The job's whole stream."""
    async with asyncio.timeout(CHAT_TIMEOUT_S):
        return [event async for event in job.stream()]


@pytest.mark.engine
async def test_chats_cancel_leases_and_replay_on_a_cluster(
    cluster: LocalCluster, cluster_worker: WorkerProcess
) -> None:
    async with ChatClient.from_url(cluster.url, queue=QUEUE) as client:
        jobs = [
            await client.submit(f"Chat {n}", seed=seed, **LONG)
            for n, seed in enumerate(FULL_LENGTH_SEEDS)
        ]
        # Slowed, then held once it streams, so it is still running at the cancel however
        # loaded the machine (CI runs saw answers end before their first event was stored).
        with slowed(cluster_worker) as engine:
            cancelled = await client.submit("Cancel me", seed=FULL_LENGTH_SEEDS[0], **LONG)
            stream = cancelled.stream()
            await asyncio.to_thread(_first_event_stored, cluster, [cancelled.job_id])
            with engine.held():
                first = await anext(stream)
                assert isinstance(first, DeltaEvent)
                # A running job holds a lease in the queue's slot, on the slot's primary.
                with cluster.node(cluster.owner(queue_slot(QUEUE))) as owner:
                    assert owner.zscore(leases_key(QUEUE), cancelled.job_id) is not None
                assert await client.cancel(cancelled.job_id)
        rest = [event async for event in stream]
        assert isinstance(rest[-1], ErrorEvent) and rest[-1].code == "cancelled"
        assert_intact([first, *rest], cancelled.job_id)

        streams = await asyncio.gather(*(_events(job) for job in jobs))
        for job, events in zip(jobs, streams, strict=True):
            assert_intact(events, job.job_id)
            assert isinstance(events[-1], DoneEvent)
            # A late reader replays the stream from any seq: what the replay buffer kept.
            replayed = [
                event async for event in (await client.attach(job.job_id, after_seq=2)).stream()
            ]
            assert [e.model_dump() for e in replayed] == [e.model_dump() for e in events[3:]]
        # Every key of the queue is on the slot's primary; no other primary holds one.
        for port in cluster.ports:
            with cluster.node(port) as node:
                if node.info("replication")["role"] != "master":
                    continue
                tagged = list(node.scan_iter(match="*edgeq:cluster*"))
                if port == cluster.owner(queue_slot(QUEUE)):
                    assert tagged
                else:
                    assert tagged == []


@pytest.mark.engine
async def test_backpressure_on_a_cluster(
    cluster: LocalCluster, cluster_worker: WorkerProcess
) -> None:
    # Jobs of the tests before leave arq's queue just after their done event.
    await asyncio.to_thread(_wait_until_empty, cluster)
    async with ChatClient.from_url(cluster.url, queue=QUEUE, max_queue=2) as client:
        # The engine frozen from before they are sent: the two chats are still running at the
        # third submit however fast this machine is (a CI run saw the first end first).
        with frozen(cluster_worker):
            running = [
                await client.submit("Busy", seed=seed, **LONG) for seed in FULL_LENGTH_SEEDS[:2]
            ]
            with pytest.raises(QueueFull, match="already holds 2 jobs"):
                await client.submit("One too many", max_tokens=4)
        for job in running:
            assert isinstance((await _events(job))[-1], DoneEvent)


def _first_event_stored(cluster: LocalCluster, job_ids: list[str]) -> None:
    """Until one of the jobs has an event in its replay stream. Read on the queue's primary,
    not from the client's live stream: under load a test saw its subscription deliver the
    first event only after every chat had ended, and froze the engine too late."""
    deadline = time.monotonic() + CHAT_TIMEOUT_S
    with cluster.node(cluster.owner(queue_slot(QUEUE))) as owner:
        while not any(owner.xlen(events_key(job_id)) for job_id in job_ids):
            assert time.monotonic() < deadline, f"no event of {job_ids} after {CHAT_TIMEOUT_S} s"
            time.sleep(0.005)


def _wait_until_empty(cluster: LocalCluster, timeout_s: float = 10) -> None:
    with cluster.node(cluster.owner(queue_slot(QUEUE))) as owner:
        deadline = time.monotonic() + timeout_s
        while owner.zcard(QUEUE) and time.monotonic() < deadline:
            time.sleep(0.05)


def test_two_queues_live_on_two_primaries(cluster: LocalCluster) -> None:
    owner = cluster.owner(queue_slot(QUEUE))
    other = next(
        f"{{edgeq:pool-{n}}}"
        for n in range(100)
        if cluster.owner(queue_slot(f"{{edgeq:pool-{n}}}")) != owner
    )

    async def enqueue_on(queue: str) -> str:
        async with ChatClient.from_url(cluster.url, queue=queue) as client:
            job = await client.submit("Nobody serves this queue", max_tokens=4)
            await job.aclose()
            return job.job_id

    job_id = asyncio.run(enqueue_on(other))
    with cluster.node(cluster.owner(queue_slot(other))) as node:
        assert node.zscore(other, job_id) is not None
    with cluster.node(owner) as node:
        with pytest.raises(redis.ResponseError, match="MOVED"):
            node.zscore(other, job_id)


def test_the_usage_ledger_lives_in_the_queues_slot(cluster: LocalCluster) -> None:
    # The publish script's keys, the ledger's too, must share one slot, or the terminal
    # event itself would fail (CROSSSLOT): the ledger's keys carry the queue's tag.
    tenant = f"ledger-{uuid.uuid4().hex[:8]}"
    job_id = new_job_id(QUEUE)

    async def end_a_job() -> None:
        settings = load_settings(ConnectionSettings, redis_url=cluster.url, queue=QUEUE)
        redis_client = make_redis(settings)
        try:
            log = EventLog(redis_client, replay_ttl_s=60, queue=QUEUE, usage_keep_s=86_400)
            done = DoneEvent(
                job_id=job_id, seq=0, finish_reason="stop",
                usage=Usage(prompt_tokens=5, completion_tokens=2),
                timings=Timings(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0),
            )  # fmt: skip
            await log.append_many([done], ledger=LedgerScope(tenant, "tiny", "batch"))
        finally:
            await redis_client.aclose(close_connection_pool=True)

    asyncio.run(end_a_job())
    env = {**os.environ, "EDGEQ_REDIS_URL": cluster.url, "EDGEQ_QUEUE": QUEUE}
    run = subprocess.run(
        [*EDGEQ, "usage", "--tenant", tenant, "--format", "json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    [row] = json.loads(run.stdout)
    assert (row["tenant"], row["priority"], row["prompt_tokens"]) == (tenant, "batch", 5)


@pytest.mark.engine
async def test_a_failover_during_streaming_loses_no_job_and_no_event(
    cluster: LocalCluster, cluster_worker: WorkerProcess
) -> None:
    slot = queue_slot(QUEUE)
    async with ChatClient.from_url(cluster.url, queue=QUEUE) as client:
        # The engine slowed until the failover and held through it, so every chat is still
        # running when it is done however loaded the machine (CI runs saw all six end first):
        # their next events go to the demoted primary first and must find the new one.
        with slowed(cluster_worker) as engine:
            jobs = [
                await client.submit(f"Failover {n}", seed=FULL_LENGTH_SEEDS[n % 3], **LONG)
                for n in range(6)
            ]
            collected = [asyncio.create_task(_events(job)) for job in jobs]
            await asyncio.to_thread(_first_event_stored, cluster, [job.job_id for job in jobs])
            with engine.held():
                old, new = await asyncio.to_thread(cluster.fail_over, slot)
                ended_before_the_failover = sum(task.done() for task in collected)
        streams = await asyncio.gather(*collected)
    assert cluster.owner(slot) == new != old
    assert ended_before_the_failover < len(jobs)  # some chats streamed through it
    for job, events in zip(jobs, streams, strict=True):
        assert_intact(events, job.job_id)
        assert isinstance(events[-1], DoneEvent), events[-1]
        with cluster.node(new) as node:  # the new primary keeps every event
            assert node.xlen(f"edgeq:events:{job.job_id}") == len(events)


@pytest.mark.engine
def test_edgeq_status_reads_the_queue_on_a_cluster(
    cluster: LocalCluster, cluster_worker: WorkerProcess
) -> None:
    env = {**os.environ, "EDGEQ_REDIS_URL": cluster.url, "EDGEQ_QUEUE": QUEUE}
    run = subprocess.run(
        [*EDGEQ, "status", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    assert status["queue"] == QUEUE
    assert [worker["pid"] for worker in status["workers"]] == [cluster_worker.process.pid]
    assert status["outcomes"]["last_5m"].get("done", 0) > 0


# Last in the module: it kills whichever worker runs its chat, maybe the shared one.
@pytest.mark.engine
async def test_a_killed_workers_chat_is_continued_by_another_on_the_cluster(
    cluster: LocalCluster,
    cluster_worker: WorkerProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    second = WorkerProcess(_worker_env(tiny_model, cluster), tmp_path / "second.log").start()
    try:
        second.wait_ready()
        workers = [cluster_worker, second]
        async with ChatClient.from_url(cluster.url, queue=QUEUE) as client:
            # Both engines slowed, then held at once, so the chat is provably unfinished when
            # its worker dies however loaded the machine; then the worker that ran it is found.
            with slowed(*workers) as engines:
                job = await client.submit("Hand me over", seed=FULL_LENGTH_SEEDS[1], **LONG)
                stream = job.stream()
                await asyncio.to_thread(_first_event_stored, cluster, [job.job_id])
                with engines.held():
                    runner = _runner(workers, job.job_id)
                    survivor = second if runner is cluster_worker else cluster_worker
                    runner.process.kill()
            async with asyncio.timeout(CHAT_TIMEOUT_S):
                seen = [event async for event in stream]
        runner.stop(signal.SIGKILL)  # reap it, and its engine
        assert_intact(seen, job.job_id)
        done = seen[-1]
        assert isinstance(done, DoneEvent) and done.continued == 1, done
        assert any(
            event.get("event") == "job_continued" and event.get("job_id") == job.job_id
            for event in survivor.log_events()
        )
    finally:
        second.stop()


def _runner(workers: list[WorkerProcess], job_id: str) -> WorkerProcess:
    """The worker that started the job, from the job_started lines of their logs."""
    deadline = time.monotonic() + CHAT_TIMEOUT_S
    while not (found := [worker for worker in workers if _ran(worker, job_id)]):
        assert time.monotonic() < deadline, f"no worker logged the start of {job_id}"
        time.sleep(0.05)
    return found[0]


def _ran(worker: WorkerProcess, job_id: str) -> bool:
    return any(
        event.get("event") == "job_started" and event.get("job_id") == job_id
        for event in worker.log_events()
    )
