"""The Redis connection factory against a real Redis, on the URL forms README lists."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis import Redis as SyncRedis

from edgeq.core.connection import make_redis
from edgeq.core.settings import ConnectionSettings
from edgeq.testing.processes import RedisServer


@pytest.mark.parametrize("max_connections", [None, 4], ids=["worker-pool", "client-pool"])
async def test_a_unix_socket_url_connects(tmp_path: Path, max_connections: int | None) -> None:
    # redis-edgeq.conf suggests unix:// for a worker on the Redis box; a Unix socket takes
    # no TCP keepalive option, which redis-py refuses with a TypeError.
    socket = tmp_path / "redis.sock"
    server = RedisServer(extra_args=("--unixsocket", str(socket))).start()
    redis = make_redis(
        ConnectionSettings(redis_url=f"unix://{socket}"), max_connections=max_connections
    )
    try:
        assert await redis.ping()
    finally:
        await redis.aclose()
        server.stop()


@pytest.mark.parametrize("max_connections", [None, 4], ids=["worker-pool", "client-pool"])
async def test_a_command_goes_out_before_the_tasks_waiting_to_run(
    redis_server: RedisServer, max_connections: int | None
) -> None:
    """A worker starting a burst sends its next Redis command, then runs the jobs it started:
    the command must be on its way first, not queued behind them (redis-py 5 wrote it in a
    task of its own, after every task already waiting to run)."""
    redis = make_redis(
        ConnectionSettings(redis_url=redis_server.url), max_connections=max_connections
    )
    key = f"edgeq-test-prompt-{max_connections}"
    seen: list[bytes | None] = []

    def waiting_task() -> None:  # what a job does before its first suspension: no yielding
        with SyncRedis.from_url(redis_server.url) as other:
            seen.append(other.get(key))

    try:
        await redis.delete(key)
        loop = asyncio.get_running_loop()
        loop.call_soon(waiting_task)  # ready to run before the command below is sent
        await redis.set(key, b"sent")
        assert seen == [b"sent"]
    finally:
        await redis.delete(key)
        await redis.aclose()


async def test_a_connection_left_with_an_unread_reply_is_not_reused(
    redis_server: RedisServer,
) -> None:
    redis = make_redis(ConnectionSettings(redis_url=redis_server.url))
    try:
        await redis.set("edgeq-test-left", b"value")
        pool = redis.connection_pool
        connection = await pool.get_connection()
        await connection.send_command("PING")  # its reply is never read
        await asyncio.sleep(0.1)  # the reply arrives
        await pool.release(connection)
        assert await redis.get("edgeq-test-left") == b"value"  # not the PONG left behind
    finally:
        await redis.delete("edgeq-test-left")
        await redis.aclose()


async def test_a_connection_stalled_between_its_setup_commands_still_connects(
    redis_server: RedisServer,
) -> None:
    """redis-py sends its two CLIENT SETINFO before it reads a reply; a health check due
    between them (the process stalled there past the check interval) must not be sent, or
    it reads the first one's reply as its PING's and the command fails (the chaos campaign
    froze a worker there: one chat ended engine_error with CLIENT SETINFO's error)."""
    redis = make_redis(ConnectionSettings(redis_url=redis_server.url))
    try:
        connection = await redis.connection_pool.get_connection()
        await connection.disconnect()
        send_command = connection.send_command

        async def stalled_after_the_first_setinfo(*args: object, **options: object) -> None:
            await send_command(*args, **options)
            if args[:2] == ("CLIENT", "SETINFO"):
                connection.next_health_check = -1  # the check interval has passed meanwhile

        connection.send_command = stalled_after_the_first_setinfo  # type: ignore[method-assign]
        await connection.connect()
        await connection.send_command("GET", "edgeq-test-stalled")
        assert await connection.read_response() is None
        await redis.connection_pool.release(connection)
    finally:
        await redis.aclose()
