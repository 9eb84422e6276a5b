"""Redis Cluster URLs in EDGEQ_REDIS_URL, and the connections that follow a queue's slot.

    redis+cluster://[[username]:password@]host1:port1[,host2:port2,...][/]

The ``host:port`` pairs are seed nodes of the cluster (any of them, primaries or replicas).

On a cluster every key of one queue lives in one hash slot: the queue's name carries a hash tag
(``EDGEQ_QUEUE={edgeq:queue}``), every per-queue key is built from that name, and job ids
begin with the same tag (edgeq.core.keys), so arq's per-job keys and edgeq's streams share it
too. One slot is owned by one primary, so edgeq needs no cluster client: every connection goes
to the primary that owns the queue's slot, found by asking the seeds with ``CLUSTER SLOTS``
each time a connection opens, as the Sentinel pool asks the Sentinels where the master is.
arq's transactions, edgeq's scripts and pub/sub then work as on one Redis. After a failover
or a resharding the old owner answers ``MOVED``: the connection closes, the command fails as
an outage (which the worker and clients ride out), and the next connection finds the new
owner.

Different queues (pools of boxes, tenants) go to different slots, and so can be spread over
the cluster's primaries; one queue is never spread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis.exceptions
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.crc import key_slot

from edgeq.core.sentinel import parse_hosts_and_credentials

CLUSTER_SCHEMES = ("redis+cluster",)
CLUSTER_FORMAT = "redis+cluster://[[username]:password@]host1:port1[,host2:port2,...]"
#: Replies of a node that no longer serves the slot (or the cluster cannot serve it now).
NOT_HERE = ("MOVED ", "ASK ", "CLUSTERDOWN ", "TRYAGAIN ")


@dataclass(frozen=True)
class ClusterTarget:
    """What a cluster URL names. ``repr`` leaves the password out."""

    seeds: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        return f"ClusterTarget({','.join(f'{host}:{port}' for host, port in self.seeds)})"


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in {*CLUSTER_SCHEMES, "rediss+cluster"}


def parse_cluster_url(url: str) -> ClusterTarget:
    """Parse a cluster URL; ValueError (never showing a password) says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme == "rediss+cluster":
        raise ValueError("TLS to a Redis Cluster (rediss+cluster://) is not supported yet")
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"a cluster URL starts with redis+cluster:// ({CLUSTER_FORMAT})")
    seeds, username, password = parse_hosts_and_credentials(
        parts, what="cluster node", url_format=CLUSTER_FORMAT
    )
    if parts.query:
        raise ValueError(f"takes no query parameters ({CLUSTER_FORMAT})")
    if parts.path.strip("/"):
        raise ValueError(
            f"a cluster has only database 0: nothing goes after the hosts, got {parts.path!r}"
        )
    return ClusterTarget(seeds=seeds, username=username, password=password)


def hash_tag(name: str) -> str | None:
    """The part of a key Redis Cluster hashes, if the key has one: what lies between its
    first ``{`` and the first ``}`` after it, when that is not empty."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    if end <= start + 1:
        return None
    return name[start + 1 : end]


async def slot_owner(
    seeds: tuple[tuple[str, int], ...], slot: int, **credentials: Any
) -> tuple[str, int]:
    """The address of the primary that owns ``slot``, from the first seed that answers."""
    failures = []
    for host, port in seeds:
        node = Redis(host=host, port=port, **credentials)
        try:
            ranges = await node.execute_command("CLUSTER SLOTS")
        except (redis.exceptions.RedisError, OSError) as error:
            failures.append(f"{host}:{port}: {error}")
            continue
        finally:
            await node.aclose()
        for first, last, primary, *_replicas in ranges:
            if first <= slot <= last:
                owner = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
                return owner or host, int(primary[1])
        failures.append(f"{host}:{port}: no node serves slot {slot}")
    raise redis.exceptions.ConnectionError(
        f"no cluster node named the owner of slot {slot}: {'; '.join(failures)}"
    )


class SlotOwnerConnection(Connection):
    """A connection to whichever primary owns one hash slot (see the module doc)."""

    def __init__(self, *, seeds: tuple[tuple[str, int], ...], slot: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._seeds = seeds
        self._slot = slot
        self._credentials = {
            key: kwargs[key]
            for key in ("username", "password", "socket_connect_timeout", "socket_timeout")
            if kwargs.get(key) is not None
        }

    async def connect(self) -> None:
        if not self.is_connected:
            self.host, self.port = await slot_owner(self._seeds, self._slot, **self._credentials)
        await super().connect()

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.exceptions.ResponseError as error:
            if not str(error).startswith(NOT_HERE):
                raise
            await self.disconnect()  # the next connection asks the cluster again
            raise redis.exceptions.ConnectionError(
                f"the queue's slot is not served by {self.host}:{self.port} now: {error}"
            ) from error


def queue_slot(queue: str) -> int:
    return int(key_slot(queue.encode()))
