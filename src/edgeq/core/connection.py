"""The one way edgeq opens Redis: a pooled client per process, plain, through Sentinels or to
the queue's primary in a Redis Cluster, with bounded timeouts (knob 6 of the seed), and one
translation of redis-py's errors."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import redis.exceptions
from arq.connections import ArqRedis
from redis.asyncio import BlockingConnectionPool, ConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool

from edgeq.core.cluster import SlotOwnerConnection, is_cluster_url, parse_cluster_url, queue_slot
from edgeq.core.errors import RedisUnavailable
from edgeq.core.protocol import dump_json, load_json
from edgeq.core.sentinel import is_sentinel_url, parse_sentinel_url
from edgeq.core.settings import ConnectionSettings, redacted_url

# A dead connection is noticed within this long even while a stream sits idle.
REDIS_HEALTH_CHECK_INTERVAL_S = 15
#: What redis-py raises when Redis is away (refused, reset, loading, timed out): an outage to
#: ride out, not a bug.
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def make_redis(
    settings: ConnectionSettings,
    *,
    job_serializer: Callable[[Any], bytes] = dump_json,
    job_deserializer: Callable[[bytes], Any] = load_json,
    max_connections: int | None = None,
) -> ArqRedis:
    """One pooled client (arq's Redis subclass, JSON serializers) for a process or a client.

    ``max_connections`` caps the pool: past it, a command waits (up to the socket timeout)
    for a connection to come free instead of opening another, so a burst from one client
    does not cost Redis one connection per caller. None: no cap (the worker's pool, whose
    callers are bounded by its jobs). A Sentinel pool is never capped (redis-py has no
    blocking Sentinel pool: a cap there would fail commands instead of queueing them).

    With a ``redis+sentinel://`` URL the pool asks the Sentinels where the master is before
    each new connection, and again after a failover (as arq's own ``create_pool`` does); with
    a ``redis+cluster://`` URL it asks the cluster which primary owns the queue's slot
    (core/cluster.py).
    """
    sockets: dict[str, Any] = {
        "socket_connect_timeout": settings.redis_connect_timeout_s,
        "socket_timeout": settings.redis_socket_timeout_s,
    }
    if not settings.redis_url.startswith("unix://"):  # a Unix socket has no TCP keepalive
        sockets["socket_keepalive"] = True
    if not is_sentinel_url(settings.redis_url):
        pool_class = _PromptPool if max_connections is None else _BlockingPool
        capped: dict[str, Any] = {}
        if max_connections is not None:
            capped = {
                "max_connections": max_connections,
                "timeout": settings.redis_socket_timeout_s,
            }
        if is_cluster_url(settings.redis_url):
            target = parse_cluster_url(settings.redis_url)
            pool = pool_class(
                connection_class=SlotOwnerConnection,
                seeds=target.seeds,
                slot=queue_slot(settings.queue),
                username=target.username,
                password=target.password,
                health_check_interval=REDIS_HEALTH_CHECK_INTERVAL_S,
                **capped,
                **sockets,
            )
        else:
            pool = pool_class.from_url(
                settings.redis_url,
                health_check_interval=REDIS_HEALTH_CHECK_INTERVAL_S,
                **capped,
                **sockets,
            )
        return ArqRedis(
            pool,
            job_serializer=job_serializer,
            job_deserializer=job_deserializer,
            default_queue_name=settings.queue,
        )
    target = parse_sentinel_url(settings.redis_url)
    sentinels = Sentinel(
        target.hosts,
        sentinel_kwargs={
            **sockets,
            "username": target.sentinel_username,
            "password": target.sentinel_password,
        },
    )
    redis = sentinels.master_for(
        target.service_name,
        redis_class=ArqRedis,
        connection_pool_class=_SentinelPool,
        db=target.db,
        username=target.username,
        password=target.password,
        ssl=target.ssl,
        health_check_interval=REDIS_HEALTH_CHECK_INTERVAL_S,
        **sockets,
    )
    redis.job_serializer = job_serializer
    redis.job_deserializer = job_deserializer
    redis.default_queue_name = settings.queue
    return redis


def _received_unread(connection: AbstractConnection) -> bool:
    """Whether a connection holds bytes no command read (a reply left behind), or its server
    closed it: what redis-py's own check before each command finds, without waiting for the
    socket. Looks at redis-py 5's private stream reader and hiredis parser."""
    stream = connection._reader
    parser = getattr(connection._parser, "_reader", None)  # hiredis.Reader
    return bool(
        (stream is not None and (stream.at_eof() or len(stream._buffer)))
        or (parser is not None and parser.has_data())
    )


class _PromptWrites(AbstractConnection):
    """Writes a command at once. redis-py 5 writes under ``asyncio.wait_for``, which on Python
    3.11 runs the write in a task of its own: the command goes out only after every task
    already waiting to run has run (and pays for the task and its timer).

    And no health check while the connection is being set up: redis-py's ``on_connect`` sends
    its two ``CLIENT SETINFO`` before it reads either reply, and a health check between them
    (due when the process stalled there past the check interval: a worker frozen by the chaos
    campaign mid-reconnect) read the first one's reply as its PING's, failing the chat's
    command with that reply."""

    _connecting = False

    async def on_connect(self) -> None:
        self._connecting = True
        try:
            await super().on_connect()
        finally:
            self._connecting = False

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        # redis-py's, with asyncio.timeout in place of wait_for.
        if not self.is_connected:
            await self.connect()
        elif check_health and not self._connecting:
            await self.check_health()
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        try:
            async with asyncio.timeout(self.socket_timeout or None):
                self._writer.writelines(command)
                await self._writer.drain()
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
        except OSError as error:
            await self.disconnect(nowait=True)
            raise redis.exceptions.ConnectionError(
                f"Error while writing to socket: {error}"
            ) from error
        except BaseException:  # a write cut short: what was sent of it cannot be taken back
            await self.disconnect(nowait=True)
            raise


@functools.cache
def _with_prompt_writes(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    return type(connection_class.__name__, (_PromptWrites, connection_class), {})


class _PromptPool(ConnectionPool):
    """A pool whose commands go out the moment they are sent. Under a burst, redis-py 5 let
    every command wait behind whatever tasks were ready: the worker's next claim went out only
    after the jobs it had just started reached the engine, a first token's publish after the
    other jobs' work (on a 2-vCPU machine, 2026-12-05, a GET took 120 µs through redis-py's
    pool and 82 through this one; 50 concurrent GETs through 4 connections ~4.1 ms and ~2.9).
    Its connections write at once (``_PromptWrites``), and the check before each command that
    no reply was left behind looks at what the connection already received instead of reading
    the socket under a zero timeout (two event-loop turns). A reply still in the kernel's buffer
    then goes unseen; redis-py drops a connection whose command was interrupted, so none is
    left there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection_class = _with_prompt_writes(self.connection_class)

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        await connection.connect()  # at once when connected
        if _received_unread(connection):
            await connection.disconnect()
            await connection.connect()


class _BlockingPool(_PromptPool, BlockingConnectionPool):
    pass


class _SentinelPool(_PromptPool, SentinelConnectionPool):
    """Closing the client closes its connections to the Sentinels too (redis-py leaves them
    open); they reopen if the client is used again."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # closing, not just dropping idle links to a former master
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.connection_pool.disconnect()


@contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """Turn redis-py's exceptions into RedisUnavailable with the (redacted) URL in the message."""
    try:
        yield
    except redis.exceptions.AuthenticationError as error:
        raise RedisUnavailable(
            f"Redis at {redacted_url(url)} refused the credentials: {error}"
        ) from None
    except redis.exceptions.ResponseError as error:
        if "NOPERM" in str(error) or "NOAUTH" in str(error):
            raise RedisUnavailable(
                f"Redis at {redacted_url(url)} refused the command: {error}"
            ) from None
        # What Redis answers, instead of NOAUTH, a client that sent no password and a command
        # of more than 10 arguments (edgeq's scripts' are) as its first.
        if "Protocol error: unauthenticated" in str(error):
            raise RedisUnavailable(
                f"Redis at {redacted_url(url)} refused the credentials: Authentication "
                f"required ({error})"
            ) from None
        raise
    except MasterNotFoundError as error:  # a ConnectionError: no Sentinel named a master
        raise RedisUnavailable(
            f"the Sentinels at {redacted_url(url)} named no master: {error} (check the service "
            f"name, the Sentinels' host:port and ?sentinel_password= in EDGEQ_REDIS_URL)"
        ) from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as error:
        raise RedisUnavailable(
            f"cannot reach Redis at {redacted_url(url)}: {error}{tls_hint(error)}"
        ) from None


def tls_hint(error: BaseException) -> str:
    """What to check when a connection failed on the server's certificate, else ""."""
    if "CERTIFICATE_VERIFY_FAILED" not in str(error):
        return ""
    return (
        " (TLS: the server's certificate does not verify against the CA in ssl_ca_certs= of "
        "EDGEQ_REDIS_URL, or its names do not include the host)"
    )
