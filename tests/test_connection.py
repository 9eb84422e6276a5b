"""The Redis connection factory against a real Redis, on the URL forms README lists."""

from __future__ import annotations

from pathlib import Path

import pytest

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
