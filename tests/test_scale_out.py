"""Many workers on one queue, what each exposes to Prometheus, and `edgeq status`.

A second worker joins the session's worker on its queue for this module, connected through a
Redis Sentinel: one queue, two workers, nothing but EDGEQ_REDIS_URL told apart.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgeq.core.errors import JobFailed
from edgeq.core.protocol import ChatResult
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess
from helpers import EDGEQ, FIGURES, FULL_LENGTH_SEEDS, SentinelServer, engine_env, ready_worker

pytestmark = pytest.mark.engine

# Each worker takes at most max_jobs (EDGEQ_MAX_NUM_SEQS's default, 64) jobs at once.
MAX_JOBS = 64
# A burst one worker cannot hold. Whichever worker takes first takes at most MAX_JOBS, and the
# rest wait until the other worker looks (at the wake-up each enqueue sends) or until one of
# the first jobs ends, which takes BURST_TOKENS engine steps: the other worker gets the rest.
BURST = MAX_JOBS + 16
BURST_TOKENS = 128


@pytest.fixture(scope="module")
def second_worker(
    worker: WorkerProcess,
    redis_server: RedisServer,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    directory = tmp_path_factory.mktemp("second-worker")
    sentinel = SentinelServer(master_port=redis_server.port, directory=directory).start()
    env = engine_env(tiny_model, sentinel.url(), worker.env["EDGEQ_QUEUE"])
    try:
        with ready_worker(env, directory / "worker.log") as process:
            yield process
    finally:
        sentinel.stop()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(process: WorkerProcess) -> Samples:
    """Every sample on the worker's metrics page, keyed by name and labels."""
    page = httpx.get(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).text
    samples: Samples = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(value for (key, have), value in samples.items()
               if key == name and wanted <= set(have))  # fmt: skip


def growth(before: list[Samples], after: list[Samples], name: str, **labels: str) -> float:
    """How much a counter grew, summed over the workers."""
    return sum(total(b, name, **labels) for b in after) - sum(
        total(a, name, **labels) for a in before
    )


def started_job_ids(process: WorkerProcess) -> Counter[str]:
    return Counter(
        str(event["job_id"])
        for event in process.log_events()
        if event.get("event") == "job_started"
    )


def edgeq_status(process: WorkerProcess, *args: str, queue: str | None = None) -> str:
    env = {"EDGEQ_REDIS_URL": process.env["EDGEQ_REDIS_URL"],
           "EDGEQ_QUEUE": queue or process.env["EDGEQ_QUEUE"], "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(
        [*EDGEQ, "status", *args], env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout


async def test_a_burst_is_served_by_both_workers_each_job_exactly_once(
    client: ChatClient, worker: WorkerProcess, second_worker: WorkerProcess
) -> None:
    before = (started_job_ids(worker), started_job_ids(second_worker))
    jobs = await asyncio.gather(*(
        client.submit(f"burst {n}", max_tokens=BURST_TOKENS, seed=FULL_LENGTH_SEEDS[n % 3])
        for n in range(BURST)
    ))  # fmt: skip
    results = await asyncio.gather(*(job.result() for job in jobs))

    submitted = {result.job_id for result in results}
    first = started_job_ids(worker) - before[0]
    second = started_job_ids(second_worker) - before[1]
    assert set(first) | set(second) == submitted
    assert not set(first) & set(second), "a job ran on both workers"
    assert set((first + second).values()) == {1}, "a job ran twice"

    assert first and second, f"one worker served the whole burst: {len(first)} / {len(second)}"
    FIGURES["scale-out: burst jobs served by worker 1 / worker 2"] = f"{len(first)} / {len(second)}"


async def test_the_metrics_count_what_the_workers_did(
    client: ChatClient, worker: WorkerProcess, second_worker: WorkerProcess
) -> None:
    workers = [worker, second_worker]
    before = [scrape(process) for process in workers]
    results: list[ChatResult] = []
    for n, seed in enumerate(FULL_LENGTH_SEEDS):
        results.append(await client.chat(f"count me {n}", max_tokens=20 + n, seed=seed))
    with pytest.raises(JobFailed) as refused:  # longer than the 1024-token context
        await client.chat("x" * 5000, max_tokens=8)
    assert refused.value.code == "prompt_too_long"
    after = [scrape(process) for process in workers]

    done = len(results)
    tokens = sum(result.usage.completion_tokens for result in results)
    assert growth(before, after, "edgeq:requests_total", outcome="done") == done
    assert growth(before, after, "edgeq:requests_total", outcome="prompt_too_long") == 1
    assert growth(before, after, "edgeq:time_to_first_token_seconds_count") == done
    assert growth(before, after, "edgeq:e2e_request_latency_seconds_count") == done
    assert growth(before, after, "edgeq:request_queue_time_seconds_count") == done
    assert growth(before, after, "edgeq:inter_token_latency_seconds_count") == tokens - done
    assert growth(before, after, "edgeq:generation_tokens_total") == tokens
    assert growth(before, after, "edgeq:prompt_tokens_total") == sum(
        result.usage.prompt_tokens for result in results
    )
    # Each e2e latency is at least its TTFT, and the histogram's sum holds the seconds.
    e2e = growth(before, after, "edgeq:e2e_request_latency_seconds_sum")
    ttft = growth(before, after, "edgeq:time_to_first_token_seconds_sum")
    assert 0 < ttft <= e2e
    assert e2e == pytest.approx(sum(r.timings.total_ms for r in results) / 1000, rel=0.2, abs=0.05)
    for samples in after:
        names = {name for name, _ in samples}
        assert {"vllm:kv_cache_usage_perc", "edgeq:num_requests_waiting"} <= names
        assert total(samples, "edgeq:num_requests_running") == 0
        assert 0 <= total(samples, "vllm:kv_cache_usage_perc") <= 1


async def test_status_json_shows_both_workers_and_the_queue_depth(
    worker: WorkerProcess, second_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    served = json.loads(edgeq_status(worker, "--json"))
    ids = {entry["worker_id"] for entry in served["workers"]}
    assert len(ids) == 2
    ports = {entry["metrics_port"] for entry in served["workers"]}
    assert ports == {worker.metrics_port, second_worker.metrics_port}
    for entry in served["workers"]:
        assert entry["state"] == "ready"
        assert entry["device"] == "cpu"
        assert entry["model"] == worker.env["EDGEQ_MODEL"]
        assert entry["max_jobs"] == MAX_JOBS
        assert served["checked_at"] - entry["heartbeat_at"] < 10  # within one lease
    assert served["capacity"] == 2 * MAX_JOBS
    assert served["outcomes"]["last_5m"]["done"] >= BURST
    assert served["depth"] == {"waiting": 0, "running": 0}

    unserved_queue = "edgeq:status-unserved"
    async with ChatClient(redis_url=redis_server.url, queue=unserved_queue) as idle:
        for n in range(3):
            await (await idle.submit(f"wait {n}")).aclose()
        waiting = json.loads(edgeq_status(worker, "--json", queue=unserved_queue))
        assert waiting["depth"] == {"waiting": 3, "running": 0}
        assert waiting["workers"] == [] and waiting["capacity"] == 0
        for job_id in await idle.redis.zrange(unserved_queue, 0, -1):
            await idle.cancel(job_id.decode())
        cancelled = json.loads(edgeq_status(worker, "--json", queue=unserved_queue))
    assert cancelled["depth"]["waiting"] == 0
    assert cancelled["outcomes"]["last_5m"] == {"cancelled": 3}

    text = edgeq_status(worker)
    assert all(worker_id in text for worker_id in ids)
    # Outcomes are listed most frequent first; earlier tests on the shared
    # worker may have refused more jobs than were served, so find "done" anywhere.
    last_5m = next(line for line in text.splitlines() if line.startswith("ended in the last 5m:"))
    done_count = int(re.search(r"\bdone (\d+)", last_5m).group(1))
    assert done_count >= BURST


def test_a_stopped_worker_leaves_the_status_at_once(
    worker: WorkerProcess, second_worker: WorkerProcess
) -> None:
    second_worker.stop()
    started = time.monotonic()
    left = json.loads(edgeq_status(worker, "--json"))
    assert len(left["workers"]) == 1, "a worker that stopped is still listed"
    assert left["workers"][0]["metrics_port"] == worker.metrics_port
    assert time.monotonic() - started < 30
