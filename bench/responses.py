"""The Responses API's costs on this machine (issue #31): three figures, on one private
Redis, one worker on the generated tiny model, and gateways of the bench's own.

    .venv/bin/python -m edgeq.bench.responses [--rounds 3] [--chats 10] [--webhooks 100]
                                              [--streams 50]

1. Time to first delta: a background response followed over SSE (``stream`` and
   ``background``) against a streamed chat completion of the same prompt, alternating one of
   each, ``--chats`` of each per round; per round the median of each, then over the rounds
   each mode's median [min-max] and the median of the per-round differences.
2. Webhook latency: ``--webhooks`` background responses, each event's arrival at a receiver
   in this process less the job's end (the response's ``completed_at``: its created_at plus
   the job's own total time from enqueue to done); p50 and p99.
3. ``--workers 1`` against ``--workers 2``: ``--streams`` concurrent streamed chat
   completions, the time to each one's first content; per round the p50, alternating the
   two gateways (both running, one loaded at a time).

On a CPU-only machine the engine shares the cores with Redis, the worker, the gateways and
this client: the figures say what the gateway costs here, not on a GPU box.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from edgeq.bench.rounds import spread_text
from edgeq.testing.processes import (
    GatewayProcess,
    RedisServer,
    WorkerProcess,
    free_port,
    tiny_model_env,
)
from edgeq.testing.tiny_model import make_tiny_model

PROMPT = "Write one sentence about the sea."
#: A seed whose answer on the tiny model runs its whole length: every request has text.
SEED = 10
SECRET = "whsec_" + base64.b64encode(b"edgeq-bench-secret-0123456789").decode()


class Receiver:
    """Takes every webhook and notes when it came (wall clock)."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.came = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                now = time.time()
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with receiver.came:
                    receiver.arrived.setdefault(body["data"]["id"], now)
                    receiver.came.notify_all()
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, response_id: str, timeout_s: float = 60) -> None:
        with self.came:
            if not self.came.wait_for(lambda: response_id in self.arrived, timeout_s):
                raise TimeoutError(f"no webhook for {response_id}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"


async def first_chunk_ms(http: httpx.AsyncClient, base: str, model: str, mode: str) -> float:
    """Milliseconds from sending the request to its first piece of text (NaN: none came, as
    when the request failed)."""
    if mode == "chat":
        path = "/chat/completions"
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 16,
            "seed": SEED,
            "stream": True,
        }
    else:
        path = "/responses"
        body = {
            "model": model,
            "input": PROMPT,
            "max_output_tokens": 16,
            "seed": SEED,
            "stream": True,
            "background": True,
        }
    started = time.perf_counter()
    first: float | None = None
    async with http.stream("POST", base + path, json=body) as reply:
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                text = (
                    data.get("delta")
                    if mode == "responses" and data.get("type") == "response.output_text.delta"
                    else (data.get("choices") or [{}])[0].get("delta", {}).get("content")
                    if mode == "chat"
                    else None
                )
                if text:
                    first = (time.perf_counter() - started) * 1000
    return math.nan if first is None else first


async def time_to_first_delta(base: str, model: str, rounds: int, chats: int) -> None:
    print(f"1. time to first delta, {chats} of each per round, alternating (ms)")
    medians: dict[str, list[float]] = {"chat": [], "responses": []}
    async with httpx.AsyncClient(timeout=60) as http:
        for mode in medians:  # one unmeasured request each: connections, caches
            await first_chunk_ms(http, base, model, mode)
        for number in range(1, rounds + 1):
            times: dict[str, list[float]] = {"chat": [], "responses": []}
            for _ in range(chats):
                for mode in times:
                    times[mode].append(await first_chunk_ms(http, base, model, mode))
            for mode, values in times.items():
                medians[mode].append(statistics.median(v for v in values if not math.isnan(v)))
            print(
                f"   round {number}: chat {medians['chat'][-1]:.1f}, "
                f"background response {medians['responses'][-1]:.1f}"
            )
    differences = [r - c for r, c in zip(medians["responses"], medians["chat"], strict=True)]
    print(
        f"   streamed chat {spread_text(medians['chat'])}; background response followed over SSE "
        f"{spread_text(medians['responses'])}; difference {spread_text(differences)}"
    )


async def webhook_latency(base: str, model: str, receiver: Receiver, count: int) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        ids: list[str] = []
        for _ in range(count):  # one after another: a latency, not a backlog
            created = await http.post(
                base + "/responses",
                json={"model": model, "input": PROMPT, "max_output_tokens": 8, "background": True},
            )
            response_id = created.json()["id"]
            ids.append(response_id)
            await asyncio.to_thread(receiver.wait_for, response_id)
        latencies = []
        for response_id in ids:
            final = (await http.get(f"{base}/responses/{response_id}")).json()
            latencies.append((receiver.arrived[response_id] - final["completed_at"]) * 1000)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(
        f"2. webhook latency, job done -> delivered, {count} responses: "
        f"p50 {statistics.median(latencies):.1f} ms, p99 {p99:.1f} ms, max {latencies[-1]:.1f} ms"
    )


async def concurrent_first_content(base: str, model: str, streams: int) -> float:
    async with httpx.AsyncClient(
        timeout=120, limits=httpx.Limits(max_connections=streams + 10)
    ) as http:
        times = await asyncio.gather(
            *(first_chunk_ms(http, base, model, "chat") for _ in range(streams))
        )
    answered = [value for value in times if not math.isnan(value)]
    if len(answered) < len(times):
        print(f"   ({len(times) - len(answered)} of {len(times)} streams had no text)")
    return statistics.median(answered)


async def gateway_processes(bases: dict[int, str], model: str, rounds: int, streams: int) -> None:
    print(f"3. {streams} concurrent streamed chats, first content p50 (ms), alternating")
    p50s: dict[int, list[float]] = {n: [] for n in bases}
    for base in bases.values():  # unmeasured: every process's connections opened
        await concurrent_first_content(base, model, streams)
    for number in range(1, rounds + 1):
        for n, base in bases.items():
            p50s[n].append(await concurrent_first_content(base, model, streams))
        print(f"   round {number}: " + ", ".join(f"--workers {n} {p50s[n][-1]:.1f}" for n in bases))
    ratios = [two / one for one, two in zip(p50s[1], p50s[2], strict=True)]
    print(
        "   "
        + "; ".join(f"--workers {n} {spread_text(values)}" for n, values in p50s.items())
        + f"; --workers 2 / --workers 1: {statistics.median(ratios):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chats", type=int, default=10)
    parser.add_argument("--webhooks", type=int, default=100)
    parser.add_argument("--streams", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgeq-bench-responses-") as work:
        directory = Path(work)
        model = make_tiny_model(directory / "model").directory
        redis = RedisServer().start()
        env = tiny_model_env(model, redis.url, "edgeq:bench-responses") | {
            "EDGEQ_MAX_MODEL_LEN": "1024",
            "EDGEQ_MAX_NUM_BATCHED_TOKENS": "128",
        }
        receiver = Receiver()
        webhooks = json.dumps([{"url": receiver.url, "secret": SECRET}])
        started: list[GatewayProcess] = []
        worker = WorkerProcess(env, directory / "worker.log").start()
        try:
            worker.wait_ready()
            shared = {name: env[name] for name in ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")}
            for n in (1, 2):
                gateway_env = shared | {
                    "EDGEQ_GATEWAY_WORKERS": str(n),
                    "EDGEQ_GATEWAY_WEBHOOKS": webhooks,
                    "EDGEQ_LOG_LEVEL": "warning",
                }
                started.append(GatewayProcess(gateway_env, directory / f"gateway{n}.log").start())
            one, two = (gateway.base_url for gateway in started)
            asyncio.run(time_to_first_delta(one, str(model), args.rounds, args.chats))
            asyncio.run(webhook_latency(one, str(model), receiver, args.webhooks))
            asyncio.run(gateway_processes({1: one, 2: two}, str(model), args.rounds, args.streams))
        finally:
            for gateway in started:
                if gateway.process is not None and gateway.process.poll() is None:
                    os.killpg(gateway.process.pid, 15)
                    gateway.process.wait(timeout=30)
            worker.stop()
            redis.stop()
            receiver.server.shutdown()


if __name__ == "__main__":
    main()
