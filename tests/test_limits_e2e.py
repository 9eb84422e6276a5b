"""Rate limits and token budgets against a real worker, on the real clock (issue #42's "Done
means"; the door's own rules, on a frozen clock and no worker: tests/test_rate_limits.py).

- Two tenants at 3:1 weights, a tokens-per-minute limit on the heavier one: its chats are held
  to the limit over a whole UTC minute, counted as the limit counts them (the engine's prompt
  plus the answer's tokens, settled), while the other is never refused. The limit is put on
  the weight-3 tenant because that is where it has something to hold back: unlimited, fair
  queuing would give it three quarters of the engine; limited, it gets its TPM and no more,
  and the weight-1 tenant is not slowed to a share by it.
- A daily budget spent in the middle of a batch: the batch's lines wait (none failed) and the
  batch says so; raised at run time, the batch goes on and completes.

One worker (one engine start) and one gateway serve both tests, on a queue of their own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.batch_request_counts import BatchRequestCounts
from redis.asyncio import Redis

from edgeq import ChatClient, ChatJob, RateLimited
from edgeq.core.keys import batch_key, events_key, limits_usage_key, reservation_key
from edgeq.core.limits import estimate_prompt_tokens, read_usage, set_limit, windows_at
from edgeq.core.protocol import ChatResult
from edgeq.resources.batches.runner import line_job_id
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess
from helpers import FIGURES, FULL_LENGTH_SEEDS, engine_env, ready_worker

pytestmark = pytest.mark.engine

QUEUE = "edgeq:test-limits-e2e"
HEAVY, LIGHT = "heavy", "light"  # weights 3 and 1; HEAVY has the TPM limit
BATCH_TENANT, BATCH_KEY = "nightly", "sk-nightly"
MESSAGES = [{"role": "user", "content": "Say something."}]
# Each chat reserves its estimated prompt (15 tokens) plus its max_tokens, and settles at the
# engine's prompt (25 on the tiny model) plus MAX_TOKENS: FULL_LENGTH_SEEDS run to max_tokens.
# One chat reserves ~5 % of TPM, so a minute admits 18 of them: a saturated minute's
# reservations end within one chat of the limit, and the settlement adds the estimate's error,
# 18 x 10 tokens (4.5 %) at most (4050 settled, 101.2 % of TPM, in each run here).
MAX_TOKENS = 200
TPM = 4000
MINUTE_MS = 60_000
# Producers start this long before the measured minute, so that it is whole and they are
# running when it begins, but the test does not run a minute before it.
LEAD_MS = 3_000


@pytest.fixture(scope="module")
def limits_worker(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    env = engine_env(tiny_model, redis_server.url, QUEUE) | {
        "EDGEQ_TENANT_WEIGHTS": f"{HEAVY}=3,{LIGHT}=1",
        "EDGEQ_TENANT_TPM": f"{HEAVY}={TPM}",
    }
    with ready_worker(env, tmp_path_factory.mktemp("limits-e2e") / "worker.log") as process:
        yield process


@pytest.fixture(scope="module")
def limits_gateway(
    limits_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    names = ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")
    env = {name: limits_worker.env[name] for name in names}
    env["EDGEQ_GATEWAY_TENANT_KEYS"] = f"{BATCH_TENANT}={BATCH_KEY}"
    log = tmp_path_factory.mktemp("limits-e2e-gateway") / "gateway.log"
    process = GatewayProcess(env, log).start()
    yield process
    process.stop()


@pytest.fixture
async def client(limits_worker: WorkerProcess) -> AsyncIterator[ChatClient]:
    async with ChatClient(redis_url=limits_worker.env["EDGEQ_REDIS_URL"], queue=QUEUE) as chat:
        yield chat


async def redis_now_ms(redis: Redis) -> int:
    """Redis's clock: the one the limits' windows are numbered on (lua/limits.lua)."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


# --- tokens per minute, two tenants --------------------------------------------------------


@dataclass
class Admitted:
    """A chat admitted between two readings of Redis's clock (its admission's minute is
    known when both are in the same one)."""

    before_ms: int
    after_ms: int
    job: ChatJob
    result: asyncio.Task[ChatResult]


@dataclass
class Tally:
    admitted: list[Admitted] = field(default_factory=list)
    refused: list[RateLimited] = field(default_factory=list)


async def produce(
    client: ChatClient, tenant: str, stop_ms: int, tally: Tally, *, wait_for_answers: bool
) -> None:
    """Submit chats of ``tenant`` until Redis's clock reaches ``stop_ms``, as a client that
    is told when to come back would: refused, it waits the ``retry_after_s`` it was given.
    ``wait_for_answers``: one chat at a time (a closed loop); otherwise it submits on
    while it is admitted (an open loop that can spend any minute's limit at once)."""
    count = 0
    while (before := await redis_now_ms(client.redis)) < stop_ms:
        seed = FULL_LENGTH_SEEDS[count % len(FULL_LENGTH_SEEDS)]
        count += 1
        try:
            job = await client.submit(MESSAGES, tenant=tenant, seed=seed, max_tokens=MAX_TOKENS)
        except RateLimited as refusal:
            tally.refused.append(refusal)
            await asyncio.sleep(refusal.retry_after_s)
            continue
        after = await redis_now_ms(client.redis)
        result = asyncio.create_task(job.result())
        tally.admitted.append(Admitted(before, after, job, result))
        if wait_for_answers:
            await asyncio.wait([result])


def spent(result: ChatResult) -> int:
    """A chat's tokens as its settlement counts them."""
    return result.usage.prompt_tokens + result.usage.completion_tokens


async def settled(redis: Redis, chats: list[Admitted], timeout_s: float = 180) -> None:
    """Every chat answered and its reservation settled (the worker settles after the
    terminal write)."""
    async with asyncio.timeout(timeout_s):
        await asyncio.gather(*(chat.result for chat in chats))
        for chat in chats:
            while await redis.exists(reservation_key(QUEUE, chat.job.job_id)):  # noqa: ASYNC110
                await asyncio.sleep(0.05)


async def run_producers(client: ChatClient, minute: int) -> tuple[Tally, Tally]:
    """Both tenants' producers from just before ``minute`` until it ends: two open loops of
    the limited tenant, two closed loops of the other."""
    heavy, light = Tally(), Tally()
    stop_ms = (minute + 1) * MINUTE_MS
    await asyncio.gather(
        *(produce(client, HEAVY, stop_ms, heavy, wait_for_answers=False) for _ in range(2)),
        *(produce(client, LIGHT, stop_ms, light, wait_for_answers=True) for _ in range(2)),
    )
    await settled(client.redis, heavy.admitted + light.admitted)
    return heavy, light


async def test_a_tpm_limit_holds_one_tenant_to_it_and_leaves_the_other_unaffected(
    client: ChatClient, redis: Redis
) -> None:
    now = await redis_now_ms(redis)
    minute = windows_at(now)[0] + 1  # the next whole minute, as lua/limits.lua numbers it
    if minute * MINUTE_MS - now > LEAD_MS:  # not a test condition: only when to begin
        await asyncio.sleep((minute * MINUTE_MS - now - LEAD_MS) / 1000)
    heavy, light = await run_producers(client, minute)

    # The limited tenant's chats admitted in the minute, whatever minute each one's
    # admission fell in when it straddled the turn: counted in both bounds' worst case.
    spans = [(c.before_ms // MINUTE_MS, c.after_ms // MINUTE_MS, c) for c in heavy.admitted]
    inside = [c for first, last, c in spans if first == last == minute]
    straddling = [c for first, last, c in spans if first <= minute <= last and first != last]
    low = sum(spent(c.result.result()) for c in inside)
    high = low + sum(spent(c.result.result()) for c in straddling)
    results = [c.result.result() for c in heavy.admitted + light.admitted]
    early = sum(r.finish_reason != "length" for r in results)
    light_inside = [c for c in light.admitted if c.before_ms // MINUTE_MS == minute]

    # The limit's own count of the minute is kept until the tenant's next admission (none
    # unless one straddled the turn: its producers stopped when the minute ended), with the
    # settlements since: it is the chats' own usage.
    raw = await redis.hgetall(limits_usage_key(QUEUE, HEAVY))
    usage = {key.decode(): int(float(value)) for key, value in raw.items()}
    if not straddling:
        assert (usage["minute"], usage["tokens"]) == (minute, low)

    FIGURES[f"limits: tenant {HEAVY}'s tokens in one UTC minute, TPM {TPM}"] = (
        f"{low} settled ({100 * low / TPM:.1f} % of the limit; {len(inside)} chats admitted, "
        f"{len(heavy.refused)} refusals, {len(straddling)} at the turn, {early} of all "
        f"stopped early); "
        f"{LIGHT} (unlimited): {len(light_inside)} chats in the minute, "
        f"{len(light.refused)} refused"
    )
    assert high <= TPM * 1.1, f"{high} tokens counted in a minute limited to {TPM}"
    assert low >= TPM * 0.9, f"only {low} tokens of {TPM}: the producers did not saturate it"
    assert heavy.refused and all(
        (r.refusal.limit, r.refusal.value) == ("tokens", TPM) for r in heavy.refused
    )
    # The other tenant: never refused, every chat ended done, some of them in that minute.
    assert light.refused == []
    assert light_inside
    assert not await redis.exists(limits_usage_key(QUEUE, LIGHT))  # not even counted


# --- a day's budget spent in the middle of a batch ----------------------------------------


def batch_line(n: int, model: str = "tiny") -> dict[str, Any]:
    return {
        "custom_id": f"line-{n:02d}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"Say something about line-{n:02d}."}],
            "max_tokens": BATCH_MAX_TOKENS,
            "seed": FULL_LENGTH_SEEDS[n % len(FULL_LENGTH_SEEDS)],
        },
    }


BATCH_LINES = 8
BATCH_MAX_TOKENS = 100
# What admission reserves for a line (lines' prompts are all as long): the day's budget lets
# three lines in at once and fewer than all eight in all, however their answers end.
LINE_COST = estimate_prompt_tokens(batch_line(0)["body"]) + BATCH_MAX_TOKENS
DAY_BUDGET = 3 * LINE_COST + LINE_COST // 2


def batch_status(limits_worker: WorkerProcess, batch_id: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "edgeq", "batch", "status", batch_id, "--tenant", BATCH_TENANT,
         "--redis-url", limits_worker.env["EDGEQ_REDIS_URL"], "--queue", QUEUE],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def held_back(redis: Redis, batch_id: str) -> list[str]:
    """The lines that ran, once the batch can go no further on its budget: it says it waits,
    no line's reservation is outstanding (all admitted lines ended and settled) and another
    line's reservation no longer fits in what is left of the day. Nothing changes then until
    the budget is raised. [] until then."""
    if not await redis.hget(batch_key(QUEUE, batch_id), "waiting"):
        return []
    jobs = [line_job_id(QUEUE, batch_id, n, 0) for n in range(BATCH_LINES)]
    if any([await redis.exists(reservation_key(QUEUE, job)) for job in jobs]):
        return []
    if (await read_usage(redis, QUEUE, BATCH_TENANT)).tokens_today + LINE_COST <= DAY_BUDGET:
        return []
    return [job for job in jobs if await redis.exists(events_key(job))]


async def recorded(sdk: openai.AsyncOpenAI, batch_id: str, lines: int) -> BatchRequestCounts:
    """The batch's counts once ``lines`` lines are recorded (the runner records a line after
    its job's end)."""
    while True:
        counts = (await sdk.batches.retrieve(batch_id)).request_counts
        if counts is not None and counts.completed + counts.failed >= lines:
            return counts
        await asyncio.sleep(0.1)


async def test_a_day_budget_spent_mid_batch_pauses_it_and_raising_it_resumes_it(
    redis: Redis, limits_worker: WorkerProcess, limits_gateway: GatewayProcess
) -> None:
    # Nothing spent today by a run before this one (pytest-repeat, make test-stress).
    await redis.delete(limits_usage_key(QUEUE, BATCH_TENANT))
    await set_limit(redis, QUEUE, BATCH_TENANT, "tokens_per_day", DAY_BUDGET)
    model = limits_worker.env["EDGEQ_MODEL"]
    sdk = openai.AsyncOpenAI(base_url=limits_gateway.base_url, api_key=BATCH_KEY, max_retries=0)
    try:
        lines = [json.dumps(batch_line(n, model)) + "\n" for n in range(BATCH_LINES)]
        content = "".join(lines).encode()
        uploaded = await sdk.files.create(file=("in.jsonl", content), purpose="batch")
        batch = await sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        async with asyncio.timeout(180):
            while not (ran := await held_back(redis, batch.id)):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            counts = await recorded(sdk, batch.id, len(ran))
        assert (counts.completed, counts.failed) == (len(ran), 0)
        assert 1 <= len(ran) < BATCH_LINES
        status = batch_status(limits_worker, batch.id)
        assert f"in_progress: {len(ran)} completed, 0 failed of {BATCH_LINES}" in status
        assert f"tokens per day limit ({DAY_BUDGET}, EDGEQ_TENANT_TOKENS_PER_DAY)" in status

        await set_limit(redis, QUEUE, BATCH_TENANT, "tokens_per_day", 1_000_000)  # raised
        async with asyncio.timeout(180):
            while (finished := await sdk.batches.retrieve(batch.id)).status != "completed":
                assert finished.status in ("in_progress", "finalizing"), finished
                await asyncio.sleep(0.25)
        assert finished.request_counts is not None
        assert (finished.request_counts.completed, finished.request_counts.failed) == (
            BATCH_LINES, 0,
        )  # fmt: skip
        assert "lines wait" not in batch_status(limits_worker, batch.id)
        assert finished.output_file_id is not None and finished.error_file_id is None
        output = (await sdk.files.content(finished.output_file_id)).text.splitlines()
        answered = [json.loads(text) for text in output]
        assert sorted(item["custom_id"] for item in answered) == [
            f"line-{n:02d}" for n in range(BATCH_LINES)
        ]
        for item in answered:
            usage = item["response"]["body"]["usage"]
            assert item["error"] is None and item["response"]["status_code"] == 200
            assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        spent_today = sum(i["response"]["body"]["usage"]["total_tokens"] for i in answered)
        assert (await read_usage(redis, QUEUE, BATCH_TENANT)).tokens_today == spent_today
        FIGURES[f"limits: a batch of {BATCH_LINES} lines, tokens per day {DAY_BUDGET}"] = (
            f"{len(ran)} lines ran, then the batch waited with none failed; raised, all "
            f"{BATCH_LINES} completed ({spent_today} tokens counted today, as the lines used)"
        )
    finally:
        await sdk.close()
        await set_limit(redis, QUEUE, BATCH_TENANT, "tokens_per_day", 0)
