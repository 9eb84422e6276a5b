"""How many stream events one Redis core takes, with no Python in the way.

`edgeq capacity` cannot load Redis to its limit on this 2-core machine: the simulated boxes'
Python runs out of CPU first. This drives edgeq's real publish script (edgeq.core.events)
with redis-benchmark (C) instead, on a private redis-server, with one `redis-cli` subscribed to
every job's channel (so each PUBLISH is delivered, as a client following its streams makes it),
and reports the events/s and the Redis CPU per event when Redis is the busy one.

    .venv/bin/python scripts/measure_redis_ceiling.py [--rounds 3] [--events 400000]

Modes, alternated over the rounds:

- ``pipelined``: EVALSHA one event per call, 16 calls per pipeline (``-P 16``), as the
  worker sent them until its batches became one script call each (core/batching.py): the
  publish script's own cost per event, without the batch's loop;
- ``unpipelined``: one call per round trip.

Each delta goes to one of 256 jobs (``-r 256``: a box's batch), with a 5-character text.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time

import redis

from edgeq.core.events import _PUBLISH
from edgeq.core.keys import events_key, stream_channel, terminal_key
from edgeq.testing.processes import RedisServer

JOBS = 256
CLIENTS = 8
PIPELINE = 16
#: redis-benchmark's stand-in for a random 12-digit number below -r.
RANDOM = "__rand_int__"
HEAD = '{"type":"delta","job_id":"0123456789abcdef0123456789abcdef",'
TAIL = '"text":" word"}'
REPLAY_TTL_MS = "600000"


def _benchmark(port: int, events: int, pipeline: int, sha: str) -> float:
    command = [
        "redis-benchmark",
        *("-p", str(port), "-n", str(events), "-c", str(CLIENTS), "-P", str(pipeline)),
        *("-r", str(JOBS), "--csv"),
        *("EVALSHA", sha, "3"),
        *(events_key(RANDOM), terminal_key(RANDOM), stream_channel(RANDOM)),
        *(HEAD, TAIL, "0", REPLAY_TTL_MS, "-1"),
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    # A header, then one row per test: "test","rps", then 6 latencies. The test's name is the
    # command, quotes unescaped, so the row is read from its end.
    row = output.strip().splitlines()[-1]
    return float(row.rsplit(",", 7)[1].strip('"'))


def _cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=400_000, help="per mode and round")
    args = parser.parse_args()

    server = RedisServer().start()
    # Each of redis-benchmark's random ids is 12 digits; subscribe to all 256 channels.
    channels = [stream_channel(f"{n:012d}") for n in range(JOBS)]
    subscriber = subprocess.Popen(
        ["redis-cli", "-p", str(server.port), "subscribe", *channels],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: dict[str, list[tuple[float, float]]] = {"pipelined": [], "unpipelined": []}
    try:
        client = redis.Redis(port=server.port)
        sha = client.script_load(_PUBLISH)
        assert sha == hashlib.sha1(_PUBLISH.encode()).hexdigest()
        time.sleep(0.5)  # the subscriptions are in place
        for round_ in range(1, args.rounds + 1):
            for mode, pipeline in (("pipelined", PIPELINE), ("unpipelined", 1)):
                client.flushall()
                client.config_resetstat()
                cpu_before, began = _cpu_s(client), time.monotonic()
                rate = _benchmark(server.port, args.events, pipeline, sha)
                wall_s = time.monotonic() - began
                cpu_s = _cpu_s(client) - cpu_before
                calls = int(client.info("commandstats")["cmdstat_publish"]["calls"])
                per_event_us = 1e6 * cpu_s / calls
                results[mode].append((rate, per_event_us))
                print(
                    f"round {round_} {mode}: {rate:,.0f} events/s, Redis CPU "
                    f"{100 * cpu_s / wall_s:.0f} %, {per_event_us:.1f} µs/event",
                    file=sys.stderr,
                )
    finally:
        subscriber.kill()
        subscriber.wait()
        server.stop()

    print(f"{JOBS} jobs, {CLIENTS} connections, {args.events:,} events per mode and round")
    print("mode | events/s | Redis CPU µs/event")
    print("--- | --- | ---")
    for mode, values in results.items():
        rates = [rate for rate, _ in values]
        costs = [cost for _, cost in values]
        print(
            f"{mode} | {statistics.median(rates):,.0f} [{min(rates):,.0f}-{max(rates):,.0f}] | "
            f"{statistics.median(costs):.1f} [{min(costs):.1f}-{max(costs):.1f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
