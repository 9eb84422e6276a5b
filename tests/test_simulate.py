"""The simulated GPU box (edgeq.bench.simulate) and `edgeq capacity` on real parts: a real
redis-server, edgeq's real worker in its own process around the stand-in engine, real
subscribers. The stand-in replaces vLLM only, because a GPU's token rate cannot be made here.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeq.bench.capacity import QUEUE, _last_stamp
from edgeq.core.events import read_events
from edgeq.core.protocol import ChatRequest, DeltaEvent, DoneEvent, StreamEvent
from edgeq.producer.client import ChatClient, ChatJob
from edgeq.testing.processes import RedisServer, WorkerProcess
from helpers import EDGEQ

STEP_MS = 10.0
PREFILL_MS = 20.0
TOKENS = 40
CHATS = 64  # all in flight at once on one box
CLI_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def simulated_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer().start()
    env = {
        "EDGEQ_REDIS_URL": server.url,
        "EDGEQ_QUEUE": QUEUE,
        "EDGEQ_MAX_NUM_SEQS": str(CHATS),
        "EDGEQ_METRICS_PORT": "0",
    }
    log = tmp_path_factory.mktemp("simulated-box") / "box.log"
    args = ("--step-ms", f"{STEP_MS:g}", "--prefill-ms", f"{PREFILL_MS:g}")
    box = WorkerProcess(env, log, command="simulate-box", args=args).start()
    try:
        ready = box.wait_ready()
        assert "simulated GPU (10 ms/step" in str(ready["device"])
        yield server
    finally:
        box.stop()
        server.stop()


async def test_a_full_box_of_simulated_chats_keeps_the_wire_contract(
    simulated_box: RedisServer,
) -> None:
    async with ChatClient.from_url(simulated_box.url, queue=QUEUE) as client:
        began = time.monotonic()
        jobs = [await client.submit("Hello there", max_tokens=TOKENS) for _ in range(CHATS)]
        streams = await asyncio.gather(*(_events_of(job) for job in jobs))
        elapsed_s = time.monotonic() - began
        for job, events in zip(jobs, streams, strict=True):
            assert [event.seq for event in events] == list(range(len(events)))
            *deltas, done = events
            assert isinstance(done, DoneEvent), done
            assert all(isinstance(event, DeltaEvent) for event in deltas)
            assert done.usage.completion_tokens == TOKENS
            text = "".join(event.text for event in deltas)
            assert text.count(" ") == TOKENS  # one stamp or filler per token, none lost
            stamps = [float(word) for word in text.split() if word != "x"]
            assert stamps == sorted(stamps)
            # What the subscriber got is what the replay buffer keeps, event for event.
            kept = await read_events(client.redis, job.job_id)
            assert [event.model_dump() for event in kept] == [e.model_dump() for e in events]
    # The stand-in's clock holds the rate: no chat can end before its steps are made.
    assert elapsed_s >= (PREFILL_MS + (TOKENS - 1) * STEP_MS) / 1000


async def _events_of(job: ChatJob) -> list[StreamEvent]:
    return [event async for event in job.stream()]


def test_the_stamp_in_a_delta_is_its_newest_token() -> None:
    assert _last_stamp("1764639000.1000 x 1764639000.2500 ") == pytest.approx(1764639000.25)


def test_a_simulated_chat_honours_the_request_like_the_real_engine() -> None:
    """Sampling params follow the real engine's rules: max_tokens from the request, else the
    box's."""
    from edgeq.bench.simulate import GpuRate, SimulatedEngine
    from edgeq.worker.settings import WorkerSettings

    async def run() -> tuple[int, list[int], int]:
        engine = SimulatedEngine(
            WorkerSettings(max_tokens=7, max_model_len=4096), GpuRate(step_ms=5, prefill_ms=0)
        )
        try:
            request = ChatRequest(messages=[{"role": "user", "content": "hi"}])
            params = engine.rules.sampling_params(request, 10)
            sizes = []
            async for output in engine.generate([0] * 10, params, "r1"):
                sizes.append(len(output.outputs[0].token_ids))
                if len(sizes) == 2:  # a consumer that falls behind gets the missed steps
                    await asyncio.sleep(0.03)
                assert engine.unfinished_requests() == 1
            return params.max_tokens, sizes, engine.unfinished_requests()
        finally:
            engine.shutdown()

    max_tokens, sizes, unfinished = asyncio.run(run())
    assert max_tokens == 7 and sum(sizes) == 7
    assert max(sizes) > 1, sizes
    assert unfinished == 0


def test_a_simulated_engine_holds_outputs_back_like_vllms_stream_interval() -> None:
    """EDGEQ_STREAM_TOKENS=3: the first token at once, then outputs of 3 (the last: the rest)."""
    from edgeq.bench.simulate import GpuRate, SimulatedEngine
    from edgeq.worker.settings import WorkerSettings

    async def run() -> list[int]:
        settings = WorkerSettings(max_tokens=8, max_model_len=4096, stream_tokens=3)
        engine = SimulatedEngine(settings, GpuRate(step_ms=5, prefill_ms=0))
        try:
            request = ChatRequest(messages=[{"role": "user", "content": "hi"}])
            params = engine.rules.sampling_params(request, 10)
            return [
                len(output.outputs[0].token_ids)
                async for output in engine.generate([0] * 10, params, "r1")
            ]
        finally:
            engine.shutdown()

    sizes = asyncio.run(run())
    assert sizes[0] == 1 and sum(sizes) == 8
    assert all(size >= 3 for size in sizes[1:-1]), sizes
    assert len(sizes) <= 4, sizes  # 1 + 3 + 3 + 1, or fewer when steps were missed


def test_capacity_reports_redis_figures_for_a_simulated_box(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    run = subprocess.run(
        [
            *EDGEQ,
            "capacity",
            *("--boxes", "1", "--streams", "16", "--step-ms", "20", "--max-tokens", "32"),
            *("--warmup-s", "2", "--window-s", "3", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Redis CPU µs/event" in run.stdout and "1 box(es), 20 ms" in run.stdout
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    # 16 streams at one token per 20 ms step make up to 800 tokens/s.
    assert row["planned_tokens_per_s"] == 800
    assert 0 < row["delivered_tokens_per_s"] <= 800 * 1.05
    assert row["events_per_s"] > 0 and row["redis_cpu_us_per_event"] > 0
    assert row["latency_p50_ms"] > 0 and row["errors"] == 0
    assert row["replay_bytes_per_event"] > 0


def test_bench_on_a_simulated_gpu_runs_the_queue_and_direct_modes_at_its_rate(
    tiny_model: Path, tmp_path: Path, short_tmp: Path
) -> None:
    out, max_tokens = tmp_path / "report.json", 6
    run = subprocess.run(
        [
            *EDGEQ,
            "bench",
            *("--start-worker", "--direct", "--simulate-gpu", "--step-ms", "5"),
            *("--prefill-ms", "25", "--model", str(tiny_model), "--users", "4"),
            *("--num-prompts", "8", "--max-tokens", str(max_tokens), "--out", str(out)),
        ],
        # TMPDIR: the bench keeps its worker's log there, for the reader; gone with the test.
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(short_tmp)},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    rate = "simulated GPU (5 ms/step, first token after 25 ms)"
    assert [(mode["name"], mode["engine"]) for mode in report["config"]["modes"]] == [
        ("queue", rate), ("direct", rate),
    ]  # fmt: skip
    for mode in report["modes"]:
        assert mode["error"] is None and rate in mode["target"]
        # No model ran: the stand-in makes every token asked for, the first after its prefill.
        assert [r["output_tokens"] for r in mode["requests"]] == [max_tokens] * 8
        assert all(r["ttft_s"] >= 0.025 for r in mode["requests"])
