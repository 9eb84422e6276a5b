"""``edgeq capacity --redis-ceiling``: how many stream events one Redis core takes, with no
Python in the way.

``edgeq capacity`` cannot load Redis to its limit on a small machine: the simulated boxes'
Python runs out of CPU first. This drives edgeq's real publish script (edgeq.core.events) with
``redis-benchmark`` (C) instead, on a private redis-server, with one ``redis-cli`` subscribed to
every job's channel (so each PUBLISH is delivered, as a client following its streams makes it),
and reports the events/s and the Redis CPU per event when Redis is the busy one.

    edgeq capacity --redis-ceiling [--rounds 3] [--events 400000] [--out FILE]

Modes, alternated over the rounds:

- ``pipelined``: EVALSHA one event per call, 16 calls per pipeline (``-P 16``), as a worker
  sent them before its batches became one script call each (core/batching.py): the publish
  script's own cost per event, without the batch's loop;
- ``unpipelined``: one call per round trip.

Each delta goes to one of 256 jobs (``-r 256``: a box's batch), with a 5-character text.
``redis-benchmark`` and ``redis-cli`` come with Debian's redis-tools.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from edgeq.core.events import _PUBLISH
from edgeq.core.keys import events_key, stream_channel, terminal_key
from edgeq.testing.processes import RedisServer

JOBS = 256
CLIENTS = 8
PIPELINE = 16
MODES = {"pipelined": PIPELINE, "unpipelined": 1}
#: redis-benchmark's stand-in for a random 12-digit number below -r.
RANDOM = "__rand_int__"
HEAD = '{"type":"delta","job_id":"0123456789abcdef0123456789abcdef",'
TAIL = '"text":" word"}'
REPLAY_TTL_MS = "600000"
TOOLS = ("redis-benchmark", "redis-cli")


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


def measure(
    rounds: int, events: int, *, say: Callable[[str], None]
) -> dict[str, list[dict[str, float]]]:
    """Per mode, each round's events/s and Redis CPU µs per event."""
    server = RedisServer().start()
    # Each of redis-benchmark's random ids is 12 digits; subscribe to all 256 channels.
    channels = [stream_channel(f"{n:012d}") for n in range(JOBS)]
    subscriber = subprocess.Popen(
        ["redis-cli", "-p", str(server.port), "subscribe", *channels],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    try:
        client = redis.Redis(port=server.port)
        sha = client.script_load(_PUBLISH)
        deadline = time.monotonic() + 10
        while client.pubsub_numsub(channels[-1])[0][1] == 0:  # the subscriptions are in place
            if time.monotonic() > deadline:
                raise TimeoutError("redis-cli did not subscribe within 10 s")
            time.sleep(0.05)
        for round_ in range(1, rounds + 1):
            for mode, pipeline in MODES.items():
                client.flushall()
                client.config_resetstat()
                cpu_before, began = _cpu_s(client), time.monotonic()
                rate = _benchmark(server.port, events, pipeline, sha)
                wall_s = time.monotonic() - began
                cpu_s = _cpu_s(client) - cpu_before
                calls = int(client.info("commandstats")["cmdstat_publish"]["calls"])
                per_event_us = 1e6 * cpu_s / calls
                results[mode].append({"events_per_s": rate, "redis_cpu_us_per_event": per_event_us})
                say(
                    f"round {round_} {mode}: {rate:,.0f} events/s, Redis CPU "
                    f"{100 * cpu_s / wall_s:.0f} %, {per_event_us:.1f} µs/event"
                )
        client.close()
    finally:
        subscriber.kill()
        subscriber.wait()
        server.stop()
    return results


def format_table(results: dict[str, list[dict[str, float]]], events: int) -> str:
    lines = [
        f"{JOBS} jobs, {CLIENTS} connections, {events:,} events per mode and round",
        "mode | events/s | Redis CPU µs/event",
        "--- | --- | ---",
    ]
    for mode, rows in results.items():
        rates = [row["events_per_s"] for row in rows]
        costs = [row["redis_cpu_us_per_event"] for row in rows]
        lines.append(
            f"{mode} | {statistics.median(rates):,.0f} [{min(rates):,.0f}-{max(rates):,.0f}] | "
            f"{statistics.median(costs):.1f} [{min(costs):.1f}-{max(costs):.1f}]"
        )
    return "\n".join(lines)


def run_redis_ceiling_command(args: Any) -> int:
    def say(message: str) -> None:
        print(f"edgeq capacity: {message}", file=sys.stderr, flush=True)

    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        say(f"--redis-ceiling needs {' and '.join(missing)} (apt-get install redis-tools)")
        return 1
    results = measure(args.rounds, args.events, say=say)
    print(format_table(results, args.events))
    out: Path | None = args.out
    if out:
        out.write_text(json.dumps({"events": args.events, "modes": results}, indent=2))
    return 0
