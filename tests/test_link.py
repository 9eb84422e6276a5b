"""The chaos campaign's degradable link (testing/link.py) against a real Redis: it forwards,
it slows every round trip by twice its delay, a stall holds everything (new connections too),
and healing after a stall resets the connections that lived through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from edgeq.testing.link import LinkProxy
from edgeq.testing.processes import RedisServer


@pytest.fixture
async def link(redis_server: RedisServer) -> AsyncIterator[LinkProxy]:
    proxy = await LinkProxy(redis_server.port).start()
    try:
        yield proxy
    finally:
        await proxy.close()


def through(link: LinkProxy) -> Redis:
    # No retries: the test sees what the link does to one connection.
    return Redis.from_url(f"redis://127.0.0.1:{link.port}/0", retry_on_error=[], retry=None)


async def timed_ping(redis: Redis) -> float:
    started = time.monotonic()
    assert await redis.ping()
    return time.monotonic() - started


async def test_a_healthy_link_forwards_commands_both_ways(link: LinkProxy) -> None:
    redis = through(link)
    try:
        await redis.set("link:key", b"x" * 200_000)  # more than one chunk each way
        assert await redis.get("link:key") == b"x" * 200_000
        assert link.connections == 1
    finally:
        await redis.aclose()


async def test_a_slowed_link_delays_each_round_trip_by_its_delay_each_way(link: LinkProxy) -> None:
    redis = through(link)
    try:
        fast = await timed_ping(redis)
        link.slow(0.2)
        slow = await timed_ping(redis)
        link.heal()
        again = await timed_ping(redis)
    finally:
        await redis.aclose()
    # Only the lower bound is exact (0.2 s each way); a loaded machine adds to any round trip.
    assert 0.4 <= slow < 3
    assert fast < 0.4 and again < 0.4  # neither waited out the delay


async def test_a_stall_holds_every_connection_and_healing_resets_the_old_ones(
    link: LinkProxy,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    new = through(link)
    try:
        writer.write(b"PING\r\n")
        assert await reader.readline() == b"+PONG\r\n"
        link.stall()
        writer.write(b"PING\r\n")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await reader.readline()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await new.ping()  # a connection made during the stall hangs as well
        link.heal()
        # Reset, as TCP ends a connection whose retransmissions timed out: no late PONG.
        try:
            async with asyncio.timeout(2):
                assert await reader.read() == b""
        except ConnectionResetError:
            pass
        fresh = through(link)
        async with asyncio.timeout(5):  # a fresh connection gets through, not hangs
            assert await fresh.ping()
        await fresh.aclose()
    finally:
        writer.close()
        await new.aclose()


async def test_a_link_to_a_redis_that_is_away_refuses_at_once() -> None:
    server = RedisServer().start()
    link = await LinkProxy(server.port).start()
    server.stop()
    redis = through(link)
    try:
        with pytest.raises(RedisConnectionError):
            async with asyncio.timeout(5):
                await redis.ping()
    finally:
        await redis.aclose()
        await link.close()
