"""The floor under one chat's trip through the queue on this machine: the same Redis hops as
edgeq's, made with raw sockets and nothing else.

    .venv/bin/python -m edgeq.bench.hop_floor [--chats 60] [--rounds 3] [--pause-ms 450]

A private Redis; a "worker" process that listens on a wake channel, claims with a script,
"generates" for ``--first-token-ms`` (a sleep, as `edgeq bench --simulate-gpu`'s first token
takes 30 ms), then publishes the first token; a "client" that enqueues with a script (which
publishes the wake) and waits for that token on its own pub/sub connection. Between chats the
client pauses ``--pause-ms`` (a 16-token chat's stream on the simulated GPU), so every process
is idle when the next chat starts, as in `edgeq bench --users 1`. Prints, per round, the time
from the enqueue to the token beyond the worker's own sleep: median [p10-p90]. What edgeq adds
to a chat's TTFT over the engine's own, less this, is its software. docs/performance.md states
its figure; tests/test_bench_hop_floor.py runs it briefly.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

from hiredis import pack_command

from edgeq.testing.processes import RedisServer

ENQUEUE = """
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', 'job:' .. ARGV[2], ARGV[3])
redis.call('PUBLISH', KEYS[2], '')
return 1
"""
CLAIM = """
local taken = {}
for _, job in ipairs(redis.call('ZRANGE', KEYS[1], 0, 63)) do
  redis.call('ZREM', KEYS[1], job)
  taken[#taken + 1] = redis.call('GET', 'job:' .. job)
end
return taken
"""
QUEUE, WAKE, TOKENS = "floor:queue", "floor:wake", "floor:tokens"
STOP = b"stop"


def connect(port: int) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port))
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def subscribed(port: int, channel: str) -> socket.socket:
    connection = connect(port)
    connection.sendall(pack_command(("SUBSCRIBE", channel)))
    connection.recv(1024)  # the confirmation
    return connection


def worker(port: int, first_token_s: float) -> None:
    wakes, redis = subscribed(port, WAKE), connect(port)
    while True:
        wakes.recv(1024)
        redis.sendall(pack_command(("EVAL", CLAIM, 1, QUEUE)))
        if STOP in redis.recv(65536):
            return
        began = time.perf_counter()
        time.sleep(first_token_s)
        generated = time.perf_counter() - began
        redis.sendall(pack_command(("PUBLISH", TOKENS, f"{generated:.6f}")))
        redis.recv(1024)


def client(port: int, chats: int, pause_s: float) -> list[float]:
    tokens, redis = subscribed(port, TOKENS), connect(port)
    beyond_ms = []
    for chat in range(chats):
        time.sleep(pause_s)
        began = time.perf_counter()
        redis.sendall(pack_command(("EVAL", ENQUEUE, 2, QUEUE, WAKE, chat, chat, "x" * 400)))
        redis.recv(1024)
        message = tokens.recv(1024)
        arrived = time.perf_counter()
        generated = float(message.split(b"\r\n")[-2])
        beyond_ms.append((arrived - began - generated) * 1000)
    redis.sendall(pack_command(("EVAL", ENQUEUE, 2, QUEUE, WAKE, 0, "last", STOP)))
    redis.recv(1024)
    return beyond_ms


def one_round(port: int, chats: int, pause_s: float, first_token_s: float) -> list[float]:
    pid = os.fork()
    if pid == 0:
        try:
            worker(port, first_token_s)
        finally:
            os._exit(0)
    time.sleep(0.3)  # the worker subscribed
    try:
        return client(port, chats, pause_s)
    finally:
        os.waitpid(pid, 0)


def measure(
    port: int, *, chats: int, rounds: int, pause_s: float, first_token_s: float
) -> list[list[float]]:
    """Each round's chats, ms from the enqueue to the token beyond the worker's sleep, sorted."""
    return [sorted(one_round(port, chats, pause_s, first_token_s)) for _ in range(rounds)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pause-ms", type=float, default=450.0)
    parser.add_argument("--first-token-ms", type=float, default=30.0)
    args = parser.parse_args(argv)
    server = RedisServer().start()
    try:
        rounds = measure(
            server.port,
            chats=args.chats,
            rounds=args.rounds,
            pause_s=args.pause_ms / 1000,
            first_token_s=args.first_token_ms / 1000,
        )
    finally:
        server.stop()
    for number, beyond in enumerate(rounds, 1):
        tenth = len(beyond) // 10
        print(
            f"round {number}: enqueue -> first token, beyond the worker's "
            f"{args.first_token_ms:g} ms: median {statistics.median(beyond):.3f} ms "
            f"[{beyond[tenth]:.3f}-{beyond[-tenth - 1]:.3f}] over {len(beyond)} chats"
        )


if __name__ == "__main__":
    main()
