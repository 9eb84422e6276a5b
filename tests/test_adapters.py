"""LoRA adapters (docs/adapters.md) on the real engine: one worker of this module's own, started
with LoRA on and three adapters, serves every test here (LoRA must be on from the engine's
start, so the session's worker cannot); the two-worker test adds a second."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.request import urlopen

import psutil
import pytest
from openai import NotFoundError, OpenAI

from edgeq.core.errors import InvalidRequest, JobFailed
from edgeq.producer.client import ChatClient
from edgeq.testing.engine_hold import EngineHold
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess
from helpers import EDGEQ, engine_env, ready_worker

pytestmark = pytest.mark.engine

QUEUE = "edgeq:test-adapters"
PROMPT = "Tell me about the queue."
# Sampled at temperature 1 with a seed: the tiny model's near-uniform logits make any change
# of weights show in the tokens drawn, and the same weights always draw the same ones.
SAMPLING = {"temperature": 1.0, "seed": 11, "max_tokens": 24}
TENANT = "tuned"  # its default adapter is "one" (EDGEQ_TENANT_ADAPTERS)


@pytest.fixture(scope="module")
def lora_worker(
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    served = ",".join(f"{name}={tiny_adapters[name]}" for name in ("one", "two", "zero"))
    env = engine_env(tiny_model, redis_server.url, QUEUE) | {
        "EDGEQ_ADAPTERS": served,
        "EDGEQ_MAX_ADAPTERS": "5",
        "EDGEQ_MAX_ADAPTER_RANK": "8",
        "EDGEQ_TENANT_ADAPTERS": f"{TENANT}=one",
    }
    with ready_worker(env, tmp_path_factory.mktemp("lora-worker") / "worker.log") as process:
        yield process


@pytest.fixture
async def lora_client(lora_worker: WorkerProcess) -> AsyncIterator[ChatClient]:
    env = lora_worker.env
    async with ChatClient(redis_url=env["EDGEQ_REDIS_URL"], queue=env["EDGEQ_QUEUE"]) as client:
        yield client


def edgeq(worker: WorkerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **worker.env}
    return subprocess.run(
        [*EDGEQ, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


async def answer(client: ChatClient, **fields: object) -> str:
    return (await client.chat(PROMPT, **SAMPLING, **fields)).text  # type: ignore[arg-type]


async def test_an_adapter_changes_the_answer_and_a_zero_one_does_not(
    lora_client: ChatClient,
) -> None:
    """Same prompt and seed: the base, each adapter and the zero-B adapter answer on one warm
    engine; two random adapters answer differently from the base and from each other, and an
    adapter whose update is zero answers exactly as the base does."""
    base = await answer(lora_client)
    one = await answer(lora_client, adapter="one")
    two = await answer(lora_client, adapter="two")
    zero = await answer(lora_client, adapter="zero")
    assert base and one and two
    assert one != base
    assert two != base
    assert one != two
    assert zero == base
    # Each is repeatable: the adapter, not chance, made the difference.
    assert await answer(lora_client, adapter="one") == one
    assert await answer(lora_client) == base


async def test_a_tenant_answers_with_its_default_adapter(lora_client: ChatClient) -> None:
    """EDGEQ_TENANT_ADAPTERS: the tenant's requests that name no adapter answer with its
    default; one naming an adapter answers with that one."""
    one = await answer(lora_client, adapter="one")
    two = await answer(lora_client, adapter="two")
    assert await answer(lora_client, tenant=TENANT) == one
    assert await answer(lora_client, tenant=TENANT, adapter="two") == two


async def test_an_unknown_adapter_is_refused_before_enqueue(lora_client: ChatClient) -> None:
    with pytest.raises(InvalidRequest, match="'nope' is not an adapter of queue"):
        await lora_client.submit(PROMPT, adapter="nope")


def test_the_gateway_serves_adapters_as_models(
    lora_worker: WorkerProcess, tmp_path: Path, tiny_adapters: dict[str, Path]
) -> None:
    """As vLLM's server: /v1/models lists the adapters, and ``model="<adapter>"`` answers with
    it (the same text as the Python client's ``adapter=``); an unknown model is a 404."""
    env = {
        name: lora_worker.env[name] for name in ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")
    }
    gateway = GatewayProcess(env, tmp_path / "gateway.log").start()
    try:
        openai = OpenAI(base_url=gateway.base_url, api_key="unused")
        models = {model.id for model in openai.models.list()}
        assert {lora_worker.env["EDGEQ_MODEL"], "one", "two", "zero"} <= models

        def completion(model: str) -> str:
            reply = openai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPT}],
                **SAMPLING,  # type: ignore[arg-type]
            )
            return reply.choices[0].message.content or ""

        base = completion(lora_worker.env["EDGEQ_MODEL"])
        one = completion("one")
        assert one != base
        assert completion("zero") == base
        with pytest.raises(NotFoundError, match="nope"):
            completion("nope")
    finally:
        gateway.stop()


async def test_an_adapter_loaded_at_run_time_is_served_and_unloaded(
    lora_worker: WorkerProcess, lora_client: ChatClient, tiny_adapters: dict[str, Path]
) -> None:
    """``edgeq adapters load`` registers it and waits for the worker to load it; chats then
    answer with it; ``unload`` takes it away, and a chat naming it is refused."""
    loaded = edgeq(lora_worker, "adapters", "load", "three", str(tiny_adapters["three"]))
    assert loaded.returncode == 0, loaded.stderr
    assert "serving it" in loaded.stdout
    three = await answer(lora_client, adapter="three")
    assert three not in (await answer(lora_client), await answer(lora_client, adapter="one"))
    listed = json.loads(edgeq(lora_worker, "adapters", "list", "--json").stdout)
    assert listed["registered"] == {"three": str(tiny_adapters["three"])}
    (served,) = listed["workers"].values()
    assert served["adapters"] == ["one", "three", "two", "zero"]
    status = edgeq(lora_worker, "status")
    assert "adapters: one, three, two, zero" in status.stdout

    unloaded = edgeq(lora_worker, "adapters", "unload", "three")
    assert unloaded.returncode == 0, unloaded.stderr
    assert "unloaded" in unloaded.stdout
    with pytest.raises(InvalidRequest, match="three"):
        await lora_client.submit(PROMPT, adapter="three")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("rank16", "its rank 16 is above the largest this worker holds, 8"),
        ("otherbase", "does not fit the base model"),
        ("plain", "holds no adapter_config.json: it is not a PEFT adapter"),
    ],
)
async def test_a_bad_adapter_is_refused_by_name_and_the_worker_keeps_serving(
    lora_worker: WorkerProcess,
    lora_client: ChatClient,
    tiny_adapters: dict[str, Path],
    name: str,
    reason: str,
) -> None:
    """Checked on this machine, ``load`` refuses a bad adapter before registering it; with
    --no-check (the path is the workers') the worker refuses it, and says why in ``load``'s
    report, ``edgeq status`` and the error event of a job that names it. Its chats go on."""
    path = str(tiny_adapters[name])
    if name == "plain":  # the only one a look at its files alone can tell
        checked = edgeq(lora_worker, "adapters", "load", name, path)
        assert checked.returncode == 2
        assert f"adapter {name!r}" in checked.stderr and reason in checked.stderr
    loaded = edgeq(lora_worker, "adapters", "load", name, path, "--no-check")
    try:
        assert loaded.returncode == 1
        assert f"refused it: {path}: " in loaded.stdout and reason in loaded.stdout
        assert f"refused adapter {name!r}" in loaded.stderr
        assert f"refused adapter {name}: " in edgeq(lora_worker, "status").stdout
        # Registered, so the producer lets it through; the worker refuses the job by name.
        with pytest.raises(JobFailed) as failed:
            await lora_client.chat(PROMPT, adapter=name, max_tokens=4)
        assert failed.value.code == "invalid_request"
        assert f"adapter {name!r} cannot be served" in str(failed.value)
        assert reason in str(failed.value)
    finally:
        assert edgeq(lora_worker, "adapters", "unload", name).returncode == 0
    assert await answer(lora_client, adapter="one")
    assert lora_worker.process.poll() is None


def adapter_jobs(worker: WorkerProcess, adapter: str) -> float:
    """The worker's edgeq:adapter_requests count for ``adapter`` (jobs it started with it)."""
    page = urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5).read().decode()
    found = re.search(rf'^edgeq:adapter_requests_total{{adapter="{adapter}"}} (\S+)$', page, re.M)
    return float(found[1]) if found else 0.0


@contextmanager
def paused(worker: WorkerProcess) -> Iterator[None]:
    """The worker process stopped (SIGSTOP) for the block: it claims nothing meanwhile."""
    assert worker.process is not None
    process = psutil.Process(worker.process.pid)
    process.suspend()
    try:
        yield
    finally:
        process.resume()


async def test_two_workers_serve_an_adapter_loaded_at_run_time_and_a_continued_job_keeps_it(
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """A worker with LoRA on and no adapter loads one ``edgeq adapters load`` registers while
    it runs; a worker started later loads it at start-up (LoRA turned on by the registry). Each
    answers with it, the same text. A chat whose worker is SIGKILLed mid-answer is continued by
    the other one with the same adapter."""
    queue = f"{QUEUE}-two"
    env = engine_env(tiny_model, redis_server.url, queue) | {"EDGEQ_LEASE_TTL_S": "3"}
    hold = EngineHold(tmp_path / "hold-first")  # the first worker's engine only
    first_env = env | hold.env() | {"EDGEQ_ENABLE_LORA": "true"}
    with ready_worker(first_env, tmp_path / "a.log") as first:
        loaded = edgeq(first, "adapters", "load", "three", str(tiny_adapters["three"]))
        assert loaded.returncode == 0, loaded.stderr
        assert "serving it" in loaded.stdout
        async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
            three = await answer(client, adapter="three")
            assert three != await answer(client)
            with ready_worker(env, tmp_path / "b.log") as second:
                listed = json.loads(edgeq(second, "adapters", "list", "--json").stdout)
                assert [w["adapters"] for w in listed["workers"].values()] == [["three"]] * 2
                with paused(first):
                    assert await answer(client, adapter="three") == three
                assert adapter_jobs(second, "three") == 1

                # A seed whose answer runs its whole max_tokens with this adapter.
                for seed in range(10, 40):
                    fields = {"adapter": "three", "seed": seed, "max_tokens": 300}
                    with paused(second):
                        result = await client.chat(PROMPT, **fields)  # type: ignore[arg-type]
                    if result.finish_reason == "length":
                        break
                else:
                    pytest.fail("no seed in 10-39 ran 300 tokens with adapter three")
                # The first worker's engine stops after the answer's first token, so the job
                # is mid-answer when its worker dies, however fast this machine runs it (it
                # once finished all 300 tokens before the SIGKILL landed).
                hold.arm(after_tokens=1)
                with paused(second):
                    job = await client.submit(PROMPT, **fields)  # type: ignore[arg-type]
                    stream = job.stream()
                    first_event = await anext(stream)
                    assert first_event.type == "delta"
                first.stop(signal.SIGKILL)
                final = [event async for event in stream][-1]
                assert final.type == "done", final
                assert final.continued == 1
                assert adapter_jobs(second, "three") == 2


def test_a_worker_with_lora_off_says_why_it_serves_no_adapter(
    worker: WorkerProcess, tiny_adapters: dict[str, Path]
) -> None:
    """The session's worker started with no adapter, so LoRA is off in its engine: ``load``
    reports it refused the adapter and how to serve it, instead of waiting in silence."""
    loaded = edgeq(worker, "adapters", "load", "one", str(tiny_adapters["one"]), "--wait", "5")
    try:
        assert loaded.returncode == 1
        assert "refused it: LoRA is off on this worker" in loaded.stdout
        assert "EDGEQ_ENABLE_LORA=true" in loaded.stdout
    finally:
        assert edgeq(worker, "adapters", "unload", "one").returncode == 0
