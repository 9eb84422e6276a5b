"""SyncChatClient: the blocking twin of ChatClient, from plain threads with no event loop of
their own, against the real parts (a private redis-server, the real worker and engine).

Every test here is a plain ``def``: that is the point of the sync client."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from redis import Redis

from edgeq.core.errors import (
    ConfigError,
    EdgeqError,
    InvalidRequest,
    JobFailed,
    JobTimeout,
    QueueFull,
    RedisUnavailable,
)
from edgeq.core.keys import stream_channel
from edgeq.core.protocol import ChatResult, DeltaEvent, DoneEvent, ErrorEvent
from edgeq.producer.sync_client import SyncChatClient, SyncChatJob
from edgeq.testing.processes import RedisServer, WorkerProcess, free_port
from helpers import FULL_LENGTH_SEEDS, assert_intact

# Long enough for several deltas, short enough for 2 cores.
ANSWER_TOKENS = 64
# Long enough that the job is still generating when a reader stops after its first delta.
LONG_ANSWER_TOKENS = 300
THREADS = 8
PORTAL_THREAD_PREFIX = "edgeq-sync-client"


@pytest.fixture
def sync_client(worker: WorkerProcess) -> Iterator[SyncChatClient]:
    with SyncChatClient(
        redis_url=worker.env["EDGEQ_REDIS_URL"], queue=worker.env["EDGEQ_QUEUE"]
    ) as client:
        yield client


def unserved_client(redis_server: RedisServer, **overrides: Any) -> SyncChatClient:
    """A client on a queue of its own that no worker serves: accepted jobs stay queued."""
    queue = f"edgeq:sync-test:{uuid.uuid4().hex}"
    return SyncChatClient.from_url(redis_server.url, queue=queue, **overrides)


def subscribers(redis_url: str, job_id: str) -> int:
    """How many connections listen on the job's channel right now."""
    channel = stream_channel(job_id)
    with Redis.from_url(redis_url, decode_responses=True) as redis:
        return int(dict(redis.pubsub_numsub(channel))[channel])


def queue_depth(redis_url: str, queue: str) -> int:
    with Redis.from_url(redis_url) as redis:
        return int(redis.zcard(queue))


def connections_named(redis_url: str, name: str) -> int:
    with Redis.from_url(redis_url, decode_responses=True) as redis:
        return sum(1 for connection in redis.client_list() if connection["name"] == name)


def portal_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(PORTAL_THREAD_PREFIX)}


@pytest.mark.engine
def test_chat_returns_the_text_a_streamed_job_with_the_same_seed_streams(
    sync_client: SyncChatClient,
) -> None:
    prompt = "Tell me a long story."
    seed = FULL_LENGTH_SEEDS[0]
    job = sync_client.submit(prompt, max_tokens=ANSWER_TOKENS, seed=seed)
    events = list(job.stream())
    streamed = job.result()
    chatted = sync_client.chat(prompt, max_tokens=ANSWER_TOKENS, seed=seed)

    assert_intact(events, job.job_id)
    deltas = "".join(event.text for event in events if isinstance(event, DeltaEvent))
    assert deltas, "the tiny model stopped before its first token"
    assert isinstance(streamed, ChatResult) and isinstance(chatted, ChatResult)
    assert streamed.job_id == job.job_id
    assert streamed.text == deltas
    assert chatted.job_id != job.job_id
    assert chatted.text == deltas
    assert chatted.usage == streamed.usage
    assert chatted.finish_reason == streamed.finish_reason


@pytest.mark.engine
def test_stream_is_a_plain_iterator_of_deltas_then_one_done_with_gap_free_seqs(
    sync_client: SyncChatClient, worker: WorkerProcess
) -> None:
    job = sync_client.submit("Count.", max_tokens=ANSWER_TOKENS, seed=FULL_LENGTH_SEEDS[1])
    assert isinstance(job, SyncChatJob)
    stream = job.stream()
    assert isinstance(stream, Iterator) and not isinstance(stream, AsyncIterator)
    arrived: list[float] = []
    events = []
    for event in stream:
        events.append(event)
        arrived.append(time.monotonic())

    assert [event.seq for event in events] == list(range(len(events)))
    *deltas, done = events
    assert len(deltas) >= 2, "the answer came in one piece: nothing was streamed"
    assert all(isinstance(event, DeltaEvent) for event in deltas)
    assert isinstance(done, DoneEvent)
    assert done.usage.completion_tokens == ANSWER_TOKENS
    assert arrived[0] < arrived[-1]
    assert {event.job_id for event in events} == {job.job_id}
    # The stream ended, so its subscription was dropped on the loop's side too.
    assert subscribers(worker.env["EDGEQ_REDIS_URL"], job.job_id) == 0


@pytest.mark.engine
def test_breaking_out_of_stream_closes_it_and_attach_from_another_client_replays_it_all(
    sync_client: SyncChatClient, worker: WorkerProcess
) -> None:
    redis_url = worker.env["EDGEQ_REDIS_URL"]
    job = sync_client.submit(
        "Tell me a long story.", max_tokens=LONG_ANSWER_TOKENS, seed=FULL_LENGTH_SEEDS[2]
    )
    seen = []
    for event in job.stream():
        seen.append(event)
        listening = subscribers(redis_url, job.job_id)
        break
    assert listening == 1
    assert isinstance(seen[0], DeltaEvent) and seen[0].seq == 0
    # Leaving the loop closed the async stream on the portal: its subscription is gone.
    assert subscribers(redis_url, job.job_id) == 0
    with pytest.raises(EdgeqError, match="closed before it ended"):
        job.result()

    with SyncChatClient.from_url(redis_url, queue=worker.env["EDGEQ_QUEUE"]) as other:
        replay = list(other.attach(job.job_id).stream())

    assert_intact(replay, job.job_id)
    assert replay[: len(seen)] == seen
    done = replay[-1]
    assert isinstance(done, DoneEvent)
    assert done.usage.completion_tokens == LONG_ANSWER_TOKENS  # it went on without a reader


def test_an_invalid_request_raises_invalid_request_naming_the_field(
    redis_server: RedisServer,
) -> None:
    with unserved_client(redis_server, max_tokens_limit=100) as client:
        with pytest.raises(InvalidRequest) as bad_temperature:
            client.submit("hi", temperature=5)
        with pytest.raises(InvalidRequest) as bad_messages:
            client.chat([])
        with pytest.raises(InvalidRequest) as over_limit:
            client.chat("hi", max_tokens=101)
        depth = queue_depth(redis_server.url, client.settings.queue)

    assert type(bad_temperature.value) is InvalidRequest
    assert isinstance(bad_temperature.value, ValueError)
    assert str(bad_temperature.value).startswith("temperature:")
    assert str(bad_messages.value).startswith("messages:")
    assert "EDGEQ_MAX_TOKENS_LIMIT" in str(over_limit.value)
    assert depth == 0  # refused before anything was enqueued


def test_a_full_queue_raises_queue_full_and_enqueues_nothing(redis_server: RedisServer) -> None:
    with unserved_client(redis_server, max_queue=1) as client:
        first = client.submit("one", max_tokens=4)
        with pytest.raises(QueueFull) as full:
            client.submit("two", max_tokens=4)
        depth = queue_depth(redis_server.url, client.settings.queue)
        first.cancel()

    assert type(full.value) is QueueFull
    assert client.settings.queue in str(full.value)
    assert depth == 1


def test_cancelling_a_queued_job_ends_its_stream_with_cancelled(
    redis_server: RedisServer,
) -> None:
    with unserved_client(redis_server) as client:
        job = client.submit("never", max_tokens=4)
        assert client.cancel(job.job_id, reason="not needed any more") is True
        events = list(job.stream())
        with pytest.raises(JobFailed) as failed:
            job.result()
        cancelled_again = job.cancel()

        second = client.submit("never either", max_tokens=4)
        assert second.cancel() is True
        with unserved_client(redis_server) as other, other.attach(second.job_id) as attached:
            with pytest.raises(JobFailed) as failed_attached:
                attached.result()
        second.close()
        depth = queue_depth(redis_server.url, client.settings.queue)

    assert len(events) == 1
    (event,) = events
    assert isinstance(event, ErrorEvent)
    assert (event.seq, event.code, event.job_id) == (0, "cancelled", job.job_id)
    assert event.message == "not needed any more"
    assert type(failed.value) is JobFailed
    assert (failed.value.code, failed.value.job_id) == ("cancelled", job.job_id)
    assert cancelled_again is False  # it had already ended
    assert (failed_attached.value.code, failed_attached.value.job_id) == (
        "cancelled",
        second.job_id,
    )
    assert depth == 0  # neither job can start any more


def test_no_event_within_the_stream_timeout_raises_job_timeout(
    redis_server: RedisServer,
) -> None:
    with unserved_client(redis_server, stream_timeout_s=0.5) as client:
        waiting = client.submit("nobody serves this queue", max_tokens=4)
        with pytest.raises(JobTimeout) as from_result:
            waiting.result()
        streaming = client.submit("nor this one", max_tokens=4)
        with pytest.raises(JobTimeout) as from_stream:
            for _ in streaming.stream():
                pass

    assert type(from_result.value) is JobTimeout
    assert (from_result.value.job_id, from_result.value.waited_s) == (waiting.job_id, 0.5)
    assert from_stream.value.job_id == streaming.job_id


def test_an_unreachable_redis_raises_redis_unavailable_without_the_password() -> None:
    port = free_port()  # nothing listens there
    url = f"redis://edgeq:s3cret-pass@127.0.0.1:{port}/0"
    calls = {
        "submit": lambda client: client.submit("hi"),
        "chat": lambda client: client.chat("hi"),
        "attach": lambda client: client.attach(uuid.uuid4().hex),
        "cancel": lambda client: client.cancel(uuid.uuid4().hex),
    }
    with SyncChatClient.from_url(url, redis_connect_timeout_s=0.5) as client:
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(RedisUnavailable) as unavailable:
                call(client)
            took = time.monotonic() - started
            message = str(unavailable.value)
            assert type(unavailable.value) is RedisUnavailable, name
            assert f"127.0.0.1:{port}" in message, name
            assert "s3cret-pass" not in message and "***" in message, name
            assert took < 5, f"{name} took {took:.1f} s to give up"


@pytest.mark.engine
def test_threads_sharing_one_client_each_get_their_own_chat(sync_client: SyncChatClient) -> None:
    everyone_ready = threading.Barrier(THREADS)

    def one_chat(index: int) -> dict[str, Any]:
        everyone_ready.wait(timeout=30)
        job = sync_client.submit(
            f"Question number {index}?",
            max_tokens=ANSWER_TOKENS,
            seed=FULL_LENGTH_SEEDS[index % len(FULL_LENGTH_SEEDS)],
        )
        events = list(job.stream())
        return {"job_id": job.job_id, "events": events, "result": job.result()}

    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        outcomes = list(pool.map(one_chat, range(THREADS)))

    assert len({outcome["job_id"] for outcome in outcomes}) == THREADS
    for outcome in outcomes:
        events, result = outcome["events"], outcome["result"]
        assert_intact(events, outcome["job_id"])  # no event of another thread's job
        done = events[-1]
        assert isinstance(done, DoneEvent), done
        assert result.job_id == outcome["job_id"]
        assert result.text == "".join(e.text for e in events if isinstance(e, DeltaEvent))
        assert result.usage == done.usage
        assert 0 < done.usage.completion_tokens <= ANSWER_TOKENS


def test_a_thread_blocked_on_a_job_does_not_hold_up_the_other_threads(
    redis_server: RedisServer,
) -> None:
    """Eight threads each wait on a job nobody serves; each can submit while the others are
    blocked, and each is released by a cancel from this thread: no call waits for another."""
    submitted: list[str] = []
    all_submitted = threading.Event()

    def wait_for_a_job(client: SyncChatClient) -> tuple[str, JobFailed]:
        job = client.submit("nobody serves this queue", max_tokens=4)
        submitted.append(job.job_id)
        if len(submitted) == THREADS:
            all_submitted.set()
        with pytest.raises(JobFailed) as failed:
            job.result()
        return job.job_id, failed.value

    with (
        unserved_client(redis_server, stream_timeout_s=60) as client,
        ThreadPoolExecutor(max_workers=THREADS) as pool,
    ):
        waiting = [pool.submit(wait_for_a_job, client) for _ in range(THREADS)]
        assert all_submitted.wait(timeout=30), f"only {len(submitted)} threads got to submit"
        time.sleep(0.2)  # let every thread block in result()
        assert not any(future.done() for future in waiting)
        assert all(client.cancel(job_id, reason=f"release {job_id}") for job_id in submitted)
        outcomes = [future.result(timeout=30) for future in waiting]

    assert sorted(job_id for job_id, _ in outcomes) == sorted(submitted)
    for job_id, failure in outcomes:
        assert (failure.job_id, failure.code, failure.message) == (
            job_id,
            "cancelled",
            f"release {job_id}",
        )


def test_close_ends_a_call_blocked_in_another_thread_and_stops_the_portal_thread(
    redis_server: RedisServer,
) -> None:
    before = set(threading.enumerate())
    client = unserved_client(redis_server, stream_timeout_s=60)
    started = set(threading.enumerate()) - before
    assert started & portal_threads(), "no portal thread was started"
    job = client.submit("nobody serves this queue", max_tokens=4)

    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(job.result)
        time.sleep(0.5)
        assert not waiting.done()
        closing = time.monotonic()
        client.close()
        with pytest.raises(EdgeqError, match=r"^the client is closed$"):
            waiting.result(timeout=10)
        took = time.monotonic() - closing

    assert took < 5, f"the blocked call took {took:.1f} s to end"  # not the 60 s stream wait
    assert not started & set(threading.enumerate()), "close() left a thread behind"


def test_a_closed_client_raises_a_clear_error_and_leaves_no_thread(
    redis_server: RedisServer,
) -> None:
    before = set(threading.enumerate())
    with unserved_client(redis_server) as client:
        started = set(threading.enumerate()) - before
        job = client.submit("never", max_tokens=4)
        assert client.cancel(job.job_id)
    assert started and not started & set(threading.enumerate())

    calls = {
        "submit": lambda: client.submit("hi"),
        "chat": lambda: client.chat("hi"),
        "attach": lambda: client.attach(job.job_id),
        "cancel": lambda: client.cancel(job.job_id),
        "job.result": job.result,
        "job.cancel": job.cancel,
        "job.stream": lambda: next(job.stream()),
    }
    for name, call in calls.items():
        with pytest.raises(EdgeqError) as closed:
            call()
        assert type(closed.value) is EdgeqError, name
        assert str(closed.value) == "the client is closed", name
    client.close()  # again: no error
    job.close()  # after the client: no error, nothing left to close


def test_closing_a_job_drops_its_subscription_and_closing_the_client_every_connection(
    redis_server: RedisServer,
) -> None:
    name = f"edgeq-sync-test-{uuid.uuid4().hex[:12]}"  # CLIENT LIST shows our connections only
    client = SyncChatClient.from_url(
        f"{redis_server.url}?client_name={name}", queue=f"edgeq:sync-test:{uuid.uuid4().hex}"
    )
    with client.submit("never", max_tokens=4) as closed_job:
        assert subscribers(redis_server.url, closed_job.job_id) == 1
    assert subscribers(redis_server.url, closed_job.job_id) == 0
    open_job = client.submit("never either", max_tokens=4)
    assert subscribers(redis_server.url, open_job.job_id) == 1
    assert connections_named(redis_server.url, name) >= 2  # commands, and the job's pub/sub
    client.close()

    deadline = time.monotonic() + 5
    while (left := connections_named(redis_server.url, name)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the server notices a closed socket on its next event-loop turn
    assert left == 0, "close() left Redis connections open"
    assert subscribers(redis_server.url, open_job.job_id) == 0


@pytest.mark.usefixtures("clean_edgeq_env")
def test_a_bad_setting_raises_config_error_and_leaves_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match="EDGEQ_REDIS_URL"):
        SyncChatClient(redis_url="http://127.0.0.1:6379")
    with pytest.raises(ConfigError, match="EDGEQ_STREAM_TIMEOUT_S"):
        SyncChatClient.from_url("redis://127.0.0.1:6379/0", stream_timeout_s=0)
    monkeypatch.setenv("EDGEQ_MAX_QUEUE", "-1")
    with pytest.raises(ConfigError, match="EDGEQ_MAX_QUEUE"):
        SyncChatClient()
    assert set(threading.enumerate()) == before

    monkeypatch.setenv("EDGEQ_MAX_QUEUE", "7")
    monkeypatch.setenv("EDGEQ_QUEUE", "from-the-env")
    with SyncChatClient.from_url("redis://127.0.0.1:1/3", stream_timeout_s=9) as client:
        settings = client.settings
    assert (settings.redis_url, settings.queue) == ("redis://127.0.0.1:1/3", "from-the-env")
    assert (settings.max_queue, settings.stream_timeout_s) == (7, 9)


def test_a_client_used_after_a_fork_says_so_instead_of_hanging(
    redis_server: RedisServer,
) -> None:
    with unserved_client(redis_server) as client:
        pid = os.fork()
        if pid == 0:  # the child: only this thread survived the fork, not the portal's
            try:
                client.cancel(uuid.uuid4().hex)
                code = 1
            except EdgeqError as error:
                code = 0 if "fork" in str(error) else 2
            except BaseException:
                code = 3
            os._exit(code)
        deadline = time.monotonic() + 30
        while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung on the client")
            time.sleep(0.05)
        # The parent's client is untouched by the child's attempt.
        assert client.cancel(uuid.uuid4().hex) is True
    assert os.waitstatus_to_exitcode(waited[1]) == 0
