"""Batched script calls against a real Redis: one script call per batch, a reply per caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from edgeq.core.batching import BatchedScript
from edgeq.testing.processes import RedisServer

# Appends ARGV[1] to the list KEYS[1] and answers {its new length, the key count, the argument
# count}; a call with a second key also copies the list there; a call with no argument answers
# nothing.
APPEND = """
if #ARGV == 0 then return end
local length = redis.call('RPUSH', KEYS[1], ARGV[1])
if #KEYS > 1 then redis.call('SET', KEYS[2], length) end
return {length, #KEYS, #ARGV}
"""


@pytest.fixture
async def private_redis() -> AsyncIterator[Redis]:
    """A Redis nobody else talks to, so its command counts are this test's alone."""
    server = RedisServer().start()
    client = Redis.from_url(server.url)
    try:
        yield client
    finally:
        await client.aclose()
        server.stop()


async def evalsha_calls(redis: Redis) -> int:
    return int((await redis.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


async def test_calls_from_many_coroutines_go_out_as_one_script_call_each_with_its_reply(
    private_redis: Redis,
) -> None:
    script = BatchedScript(private_redis, APPEND)
    await script(["warm"], ["x"])  # loads the script (one NOSCRIPT, one retry)
    before = await evalsha_calls(private_redis)

    calls = [
        script(["list:a"], ["1"]),
        script(["list:b", "copy:b"], ["1", "extra"]),
        script(["list:a"], ["2"]),
        script(["list:c"], []),
        script(["list:a"], ["3"]),
    ]
    replies = await asyncio.gather(*calls)

    assert await evalsha_calls(private_redis) - before == 1
    assert replies == [[1, 1, 1], [1, 2, 2], [2, 1, 1], None, [3, 1, 1]]
    assert await private_redis.lrange("list:a", 0, -1) == [b"1", b"2", b"3"]
    assert await private_redis.get("copy:b") == b"1"


async def test_a_batch_redis_lost_the_script_of_is_loaded_and_sent_again(
    private_redis: Redis,
) -> None:
    script = BatchedScript(private_redis, APPEND)
    assert await script(["list"], ["1"]) == [1, 1, 1]
    await private_redis.script_flush()  # as a restart without persistence would
    replies = await script.call_many([(["list"], ["2"]), (["list"], ["3"])])
    assert replies == [[2, 1, 1], [3, 1, 1]]  # each call ran once
    assert await private_redis.lrange("list", 0, -1) == [b"1", b"2", b"3"]


async def test_a_call_that_raises_fails_alone_and_the_others_of_its_batch_run(
    private_redis: Redis,
) -> None:
    script = BatchedScript(private_redis, APPEND)
    await private_redis.set("not-a-list", "x")
    results = await asyncio.gather(
        script(["before"], ["1"]),
        script(["not-a-list"], ["1"]),
        script(["after"], ["1"]),
        return_exceptions=True,
    )
    assert results[0] == results[2] == [1, 1, 1]
    assert isinstance(results[1], ResponseError) and "WRONGTYPE" in str(results[1]), results
    assert await script(["after"], ["2"]) == [2, 1, 1]  # the connection is clean


async def test_a_call_after_a_future_reaches_redis_only_once_it_is_done(
    private_redis: Redis,
) -> None:
    script = BatchedScript(private_redis, APPEND)
    written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    held = asyncio.create_task(script(["list"], ["held"], after=written))
    free = await script(["other"], ["free"])  # a call after nothing is not held up
    assert free == [1, 1, 1]
    await asyncio.sleep(0.05)
    assert not held.done() and await private_redis.llen("list") == 0
    written.set_result(None)
    assert await held == [1, 1, 1]


async def test_a_call_whose_future_fails_is_never_sent_and_fails_with_its_error(
    private_redis: Redis,
) -> None:
    script = BatchedScript(private_redis, APPEND)
    written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    held = asyncio.gather(
        script(["list"], ["held"], after=written),
        script(["list"], ["unrelated"]),  # same batch, nothing to wait for: runs
        return_exceptions=True,
    )
    await asyncio.sleep(0)
    written.set_exception(ConnectionError("subscribe failed"))
    results = await held
    assert isinstance(results[0], ConnectionError) and "subscribe failed" in str(results[0])
    assert results[1] == [1, 1, 1]
    assert await private_redis.lrange("list", 0, -1) == [b"unrelated"]
