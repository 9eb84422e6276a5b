"""LoRA adapters without an engine (docs/adapters.md): the settings, what makes a directory an
adapter, the tiny adapters tests use, the queue's registry, and the refusals a producer and
``edgeq adapters load`` make before anything reaches a worker. The engine's side is
tests/test_adapters.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from edgeq.core.adapters import adapter_problem, known_adapter, register, registered, unregister
from edgeq.core.errors import InvalidRequest
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer
from edgeq.testing.tiny_adapter import CONFIG_FILE, WEIGHTS_FILE, make_tiny_adapter
from edgeq.worker.settings import WorkerSettings
from helpers import EDGEQ


@pytest.mark.usefixtures("clean_edgeq_env")
def test_the_adapter_settings_read_name_path_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEQ_ADAPTERS", "support=/models/support, sql=/models/sql")
    monkeypatch.setenv("EDGEQ_TENANT_ADAPTERS", "helpdesk=support")
    settings = WorkerSettings()
    assert settings.adapters == {"support": "/models/support", "sql": "/models/sql"}
    assert settings.tenant_adapters == {"helpdesk": "support"}
    assert settings.lora  # adapters set: LoRA on in the engine
    assert not WorkerSettings(adapters={}).lora  # none: the default path is untouched


@pytest.mark.usefixtures("clean_edgeq_env")
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"adapters": "support"}, "EDGEQ_ADAPTERS: 'support' is not NAME=PATH"),
        ({"adapters": "a b=/x"}, "adapter name 'a b'"),
        ({"adapters": {"sql\n": "/x"}}, r"adapter name 'sql\\n'"),  # re.match's $ let it by
        ({"max_adapter_rank": 12}, "EDGEQ_MAX_ADAPTER_RANK: vLLM takes one of 1, 8, 16"),
        ({"adapters": "a=/x,b=/y", "max_adapters": 1}, r"more than EDGEQ_MAX_ADAPTERS \(1\)"),
        ({"adapters": "a=/x", "enable_lora": False}, "EDGEQ_ENABLE_LORA is false"),
    ],
)
def test_bad_adapter_settings_are_refused_by_name(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        WorkerSettings(**fields)


def test_a_tiny_adapter_is_a_lora_directory_and_reproducible(tmp_path: Path) -> None:
    first = make_tiny_adapter(tmp_path / "a", base_model="tiny", seed=3)
    second = make_tiny_adapter(tmp_path / "b", base_model="tiny", seed=3)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    config = json.loads((first / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert adapter_problem(first, max_rank=8) is None


def test_what_is_not_a_servable_adapter_is_named(tmp_path: Path) -> None:
    adapter = make_tiny_adapter(tmp_path / "rank16", base_model="tiny", rank=16)
    assert "its rank 16 is above the largest this worker holds, 8" in str(
        adapter_problem(adapter, max_rank=8)
    )
    assert "is not a directory" in str(adapter_problem(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    assert "holds no adapter_config.json" in str(adapter_problem(tmp_path / "empty"))
    config = json.loads((adapter / CONFIG_FILE).read_text())
    (adapter / CONFIG_FILE).write_text(json.dumps(config | {"peft_type": "PREFIX_TUNING"}))
    assert "is not a LoRA adapter (peft_type 'PREFIX_TUNING'" in str(adapter_problem(adapter))
    (adapter / CONFIG_FILE).write_text(json.dumps(config))
    (adapter / WEIGHTS_FILE).unlink()
    assert "holds no adapter_model.safetensors" in str(adapter_problem(adapter))


async def test_the_registry_holds_names_and_paths(redis: Redis, queue: str) -> None:
    await register(redis, queue, "support", "/models/support")
    assert await registered(redis, queue) == {"support": "/models/support"}
    assert await known_adapter(redis, queue, "support")
    assert not await known_adapter(redis, queue, "sql")
    assert await unregister(redis, queue, "support")
    assert not await unregister(redis, queue, "support")
    assert await registered(redis, queue) == {}


async def test_a_producer_refuses_an_adapter_nobody_serves(
    redis_server: RedisServer, redis: Redis, queue: str
) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        with pytest.raises(InvalidRequest, match=f"'sql' is not an adapter of queue {queue}"):
            await client.submit("Hello", adapter="sql")
        with pytest.raises(InvalidRequest, match="adapter"):  # not a name at all
            await client.submit("Hello", adapter="../etc")
        await register(redis, queue, "sql", "/models/sql")
        job = await client.submit("Hello", adapter="sql")  # registered: accepted
        assert await client.cancel(job.job_id)
        await job.aclose()


def test_load_refuses_a_directory_that_is_no_adapter_before_registering(
    redis_server: RedisServer, queue: str, tmp_path: Path
) -> None:
    env = {**os.environ, "EDGEQ_REDIS_URL": redis_server.url, "EDGEQ_QUEUE": queue}
    loaded = subprocess.run(
        [*EDGEQ, "adapters", "load", "notes", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert loaded.returncode == 2
    assert f"adapter 'notes': {tmp_path} holds no adapter_config.json" in loaded.stderr
    listed = subprocess.run(
        [*EDGEQ, "adapters", "list", "--json"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(listed.stdout) == {"registered": {}, "workers": {}}
