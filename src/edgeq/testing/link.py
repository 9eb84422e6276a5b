"""A network link between a worker and Redis that a test can degrade: a TCP proxy on loopback.

``LinkProxy`` listens on its own port and forwards every connection to Redis. The chaos
campaign (testing/chaos.py) puts one in front of each worker, so a fault reaches one worker's
link and nothing else:

- ``slow(delay_s)``: every byte arrives ``delay_s`` late, in both directions (latency, not a
  bandwidth cap: what a congested or far link does);
- ``stall()``: nothing flows any more, new connections included (they are accepted, then hang,
  as a partition looks to a client whose SYN got through before it);
- ``heal()``: flowing again. After a stall the connections that lived through it are reset, as
  TCP ends a connection whose retransmissions timed out: the client must reconnect and find out
  what happened to its jobs meanwhile.

A connection Redis refuses (Redis away) is closed at once on the worker's side too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from edgeq.testing.processes import free_port

#: Bytes read from a socket at once.
CHUNK = 65536


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    pumps: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            with contextlib.suppress(Exception):
                writer.transport.abort()


@dataclass(eq=False)
class LinkProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``, degraded on demand."""

    upstream_port: int
    port: int = field(default_factory=free_port)
    delay_s: float = 0.0
    _flowing: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _connections: set[_Connection] = field(default_factory=set, init=False)
    _server: asyncio.Server | None = field(default=None, init=False)

    async def start(self) -> LinkProxy:
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.reset()
        pumps = [pump for connection in self._connections for pump in connection.pumps]
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    # --- what a fault does ------------------------------------------------------------------

    def slow(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def stall(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        """Flowing again at full speed; after a stall, the connections it held are reset."""
        self.delay_s = 0.0
        if not self._flowing.is_set():
            for connection in list(self._connections):
                connection.reset()
            self._flowing.set()

    @property
    def connections(self) -> int:
        return len(self._connections)

    # --- forwarding --------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._flowing.wait()  # a partition: the connection hangs
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # Redis away: refused on this side too
            writer.transport.abort()
            return
        connection = _Connection(writer, up_writer)
        self._connections.add(connection)
        connection.pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        try:
            await asyncio.gather(*connection.pumps, return_exceptions=True)
        finally:
            connection.reset()
            self._connections.discard(connection)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Bytes from ``source`` to ``sink``, each chunk ``delay_s`` after it arrived (a
        queue in between, so a delay adds latency without capping the rate)."""
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        writer = asyncio.create_task(self._deliver(chunks, sink))
        try:
            while data := await source.read(CHUNK):
                chunks.put_nowait((time.monotonic() + self.delay_s, data))
            chunks.put_nowait((0.0, b""))  # end of stream
            await writer
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await writer
            with contextlib.suppress(Exception):
                sink.transport.abort()

    async def _deliver(
        self, chunks: asyncio.Queue[tuple[float, bytes]], sink: asyncio.StreamWriter
    ) -> None:
        while True:
            due, data = await chunks.get()
            if not data:
                return
            await self._flowing.wait()
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            await self._flowing.wait()  # a stall that began while this chunk waited
            sink.write(data)
            await sink.drain()
