"""The Redis commands a worker sends per chat (issue #42: the settlement's round trip).

    .venv/bin/python -m edgeq.bench.chat_round_trips [--chats 50] [--max-tokens 8]

A private ``redis-server`` and one ``edgeq simulate-box`` worker (edgeq's real worker around a
stand-in engine, edgeq.bench.simulate); a client submits ``--chats`` chats one after the other
for a tenant with a token budget (so each is admitted, reserved and settled) and reads each
result. Redis's MONITOR sees every command; those from the worker process's own connections
(found by their ports) and sent by it, not run inside a script, are its round trips' commands
(a pipeline's commands count one each). Printed: per chat, those commands, and by command
(EVALSHA by script: ``publish``, ``claim``…). The keep-alive's renewals run on a timer, so a
figure depends a little on how long the chats took.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import tempfile
from pathlib import Path

import psutil
from redis.asyncio import Redis

from edgeq.core import events, leases
from edgeq.core.batching import combined
from edgeq.core.scripts import lua_script
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess
from edgeq.worker import claim

QUEUE = "edgeq:bench-round-trips"


def _script_names() -> dict[str, str]:
    """SHA1 -> a name, for the worker's scripts (the old settlement's too, by its text)."""
    sources = {
        "publish": combined(events._PUBLISH),
        "claim": claim._CLAIM,
        "renew": leases._RENEW,
        "hand_over": leases._HAND_OVER,
        "settle (before #42)": lua_script("settle"),
    }
    return {hashlib.sha1(text.encode()).hexdigest(): name for name, text in sources.items()}


def _worker_ports(pid: int, redis_port: int) -> set[str]:
    """The local ports of the worker process's (and its children's) connections to Redis."""
    process = psutil.Process(pid)
    ports = set()
    for each in [process, *process.children(recursive=True)]:
        for connection in each.net_connections(kind="tcp"):
            if connection.raddr and connection.raddr.port == redis_port:
                ports.add(str(connection.laddr.port))
    return ports


async def _chats(url: str, chats: int, max_tokens: int) -> None:
    async with ChatClient(redis_url=url, queue=QUEUE) as client:
        for _ in range(chats):
            job = await client.submit("hi", tenant="bench", max_tokens=max_tokens)
            await job.result()


async def measure(chats: int, max_tokens: int) -> tuple[int, collections.Counter[str]]:
    """(the worker's commands over ``chats`` chats, by command), on a Redis of its own."""
    server = RedisServer().start()
    log = Path(tempfile.mkdtemp()) / "worker.log"
    env = {"EDGEQ_REDIS_URL": server.url, "EDGEQ_QUEUE": QUEUE,
           "EDGEQ_TENANT_TOKENS_PER_DAY": "bench=1000000000"}  # fmt: skip
    worker = WorkerProcess(env, log, command="simulate-box").start()
    seen: list[dict[str, str]] = []
    try:
        await asyncio.to_thread(worker.wait_ready, 180)
        await _chats(server.url, 3, max_tokens)  # scripts loaded, connections made
        async with Redis.from_url(server.url).monitor() as monitor:
            async def listen() -> None:
                while True:
                    seen.append(dict(await monitor.next_command()))

            listening = asyncio.create_task(listen())
            await asyncio.sleep(0.2)
            await _chats(server.url, chats, max_tokens)
            await asyncio.sleep(0.2)
            listening.cancel()
        assert worker.process is not None
        ports = _worker_ports(worker.process.pid, server.port)
    finally:
        if worker.process is not None:
            worker.process.terminate()
            worker.process.wait(60)
        server.stop()
    return len(seen), _by_command(seen, ports)


def _by_command(seen: list[dict[str, str]], ports: set[str]) -> collections.Counter[str]:
    names = _script_names()
    counts: collections.Counter[str] = collections.Counter()
    for entry in seen:
        if entry["client_type"] != "tcp" or entry["client_port"] not in ports:
            continue
        words = entry["command"].split(" ")
        name = words[0].upper()
        if name == "EVALSHA":
            name = f"EVALSHA {names.get(words[1].lower(), words[1][:8])}"
        counts[name] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    _, counts = asyncio.run(measure(args.chats, args.max_tokens))
    total = sum(counts.values())
    print(f"worker: {total / args.chats:.2f} Redis commands per chat over {args.chats} chats")
    for name, count in counts.most_common():
        print(f"  {name}: {count / args.chats:.2f}")


if __name__ == "__main__":
    main()
