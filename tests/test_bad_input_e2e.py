"""Bad input gets a clear error naming the problem, and the worker serves the next job."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

import pytest
from redis.asyncio import Redis

from edgeq.core.errors import InvalidRequest, JobFailed, RedisUnavailable
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import free_port
from helpers import EDGEQ, TEST_MAX_MODEL_LEN, arq_job_bytes, engine_env, run_raw_job

pytestmark = pytest.mark.engine

GOOD = [{"role": "user", "content": "hi"}]

# (request as a producer in any language might send it, field the error must name)
BAD_REQUESTS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": GOOD, "temperature": -0.1}, "temperature"),
    ({"messages": GOOD, "temperature": 2.5}, "temperature"),
    ({"messages": GOOD, "top_p": 0}, "top_p"),
    ({"messages": GOOD, "top_p": 1.01}, "top_p"),
    ({"messages": GOOD, "max_tokens": 0}, "max_tokens"),
    ({"messages": GOOD, "stop": [""]}, "stop.0"),
    ({"messages": GOOD, "colour": "blue"}, "colour"),
    (
        {
            "messages": GOOD,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "objekt"}},
            },
        },
        "response_format",
    ),
    ({"messages": GOOD, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": GOOD, "tool_choice": "required"}, "tool_choice"),
    (
        {
            "messages": GOOD,
            "tools": [{"type": "function", "function": {"name": "get_time"}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        "tool_choice",
    ),
    ({"messages": GOOD, "constraint": {"regex": "a", "choice": ["b"]}}, "constraint"),
    ({"messages": GOOD, "constraint": {"regex": "a"}, "enable_thinking": True}, "enable_thinking"),
    ({"messages": GOOD, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls"),
]
# ChatClient.submit takes a plain string as the prompt, so this one only exists on the wire.
BAD_ON_THE_WIRE_ONLY = [({"messages": "hi"}, "messages")]


async def assert_worker_still_serves(client: ChatClient) -> None:
    result = await client.chat("Still there?", max_tokens=4)
    assert result.usage.completion_tokens >= 1


@pytest.mark.parametrize(("request_body", "field"), BAD_REQUESTS)
async def test_the_client_refuses_a_bad_request_before_enqueueing(
    client: ChatClient, request_body: dict, field: str
) -> None:
    fields = dict(request_body)
    messages = fields.pop("messages")
    with pytest.raises(InvalidRequest, match=field.replace(".", r"\.")):
        await client.submit(messages, **fields)


@pytest.mark.parametrize(("request_body", "field"), BAD_REQUESTS + BAD_ON_THE_WIRE_ONLY)
async def test_the_worker_refuses_a_bad_request_sent_straight_to_redis(
    worker, redis: Redis, client: ChatClient, request_body: dict, field: str
) -> None:
    events = await run_raw_job(redis, worker.env["EDGEQ_QUEUE"], arq_job_bytes(request_body))
    assert [event["type"] for event in events] == ["error"]
    assert events[0]["code"] == "invalid_request"
    assert field in events[0]["message"]
    await assert_worker_still_serves(client)


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"   ", "not valid JSON"),
        (b'["f", "a"]', "not an arq job"),
        (b'{"f": "shutdown", "a": [], "k": {}, "t": 1, "et": 1}', "unknown job function"),
        (b'{"f": "chat", "a": [1, 2], "k": {}, "t": 1, "et": 1}', "exactly one"),
    ],
)
async def test_a_payload_that_is_not_a_chat_job_ends_with_a_clear_error(
    worker, redis: Redis, client: ChatClient, payload: bytes, says: str
) -> None:
    events = await run_raw_job(redis, worker.env["EDGEQ_QUEUE"], payload)
    assert [(event["type"], event["code"]) for event in events] == [("error", "invalid_request")]
    assert says in events[0]["message"]
    await assert_worker_still_serves(client)


class _WritesMarker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # what an attacker's pickle would do when loaded
        return (Path.write_text, (self.path, "pwned"))


async def test_a_pickled_payload_is_refused_and_never_executed(
    worker, redis: Redis, client: ChatClient, tmp_path: Path
) -> None:
    marker = tmp_path / "pickle-ran"
    job = {"f": "chat", "a": [_WritesMarker(marker)], "k": {}, "t": 1, "et": 1}
    events = await run_raw_job(redis, worker.env["EDGEQ_QUEUE"], pickle.dumps(job))
    assert events[0]["code"] == "invalid_request"
    assert "pickle is never accepted" in events[0]["message"]
    assert not marker.exists()
    await assert_worker_still_serves(client)


async def test_a_prompt_longer_than_the_context_is_refused(client: ChatClient) -> None:
    too_long = "word " * (TEST_MAX_MODEL_LEN * 2)
    with pytest.raises(JobFailed) as failure:
        await client.chat(too_long, max_tokens=8)
    assert failure.value.code == "prompt_too_long"
    assert str(TEST_MAX_MODEL_LEN) in failure.value.message
    assert "EDGEQ_MAX_MODEL_LEN" in failure.value.message
    await assert_worker_still_serves(client)


async def test_max_tokens_beyond_the_context_is_clipped_not_refused(client: ChatClient) -> None:
    result = await client.chat("hi", max_tokens=TEST_MAX_MODEL_LEN * 4, seed=8)
    total = result.usage.prompt_tokens + result.usage.completion_tokens
    assert total <= TEST_MAX_MODEL_LEN


async def test_submit_to_an_unreachable_redis_says_where_it_tried() -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    async with ChatClient(redis_url=url, redis_connect_timeout_s=1) as client:
        with pytest.raises(RedisUnavailable) as failure:
            await client.submit("hi")
    message = str(failure.value)
    assert "cannot reach Redis at redis://:***@127.0.0.1:" in message
    assert "hunter2" not in message


def test_edgeq_chat_reports_failures_on_stderr_with_a_nonzero_exit(
    cli_env: dict[str, str],
) -> None:
    unreachable = {**cli_env, "EDGEQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    cases = [
        (["--temperature", "3"], cli_env, 2, "temperature"),
        ([], unreachable, 69, "cannot reach Redis"),
        (["--max-tokens", "4"], {**cli_env, "EDGEQ_STREAM_TIMEOUT_S": "-1"}, 78,
         "EDGEQ_STREAM_TIMEOUT_S"),
    ]  # fmt: skip
    for extra, env, code, says in cases:
        finished = subprocess.run(
            [*EDGEQ, "chat", "hi", *extra], env=env, capture_output=True, text=True, timeout=60
        )
        assert finished.returncode == code, finished.stderr
        assert says in finished.stderr
        assert finished.stdout == ""

    too_long = "word " * (TEST_MAX_MODEL_LEN * 2)
    finished = subprocess.run(
        [*EDGEQ, "chat", too_long], env=cli_env, capture_output=True, text=True, timeout=60
    )
    assert finished.returncode == 1
    assert "failed (prompt_too_long)" in finished.stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("EDGEQ_MAX_NUM_SEQS", "0"),
        ("EDGEQ_TEMPERATURE", "5"),
        ("EDGEQ_GPU_MEMORY_UTILIZATION", "1.5"),
        ("EDGEQ_DTYPE", "int3"),
        ("EDGEQ_REDIS_URL", "http://127.0.0.1:6379"),
        ("EDGEQ_ENABLE_THINKING", "maybe"),
        ("EDGEQ_BLOCK_SIZE", "48"),  # a multiple of 16, but vLLM's CPU kernels need 32
    ],
)
def test_an_invalid_setting_stops_the_worker_at_start_up_naming_the_variable(
    tiny_model: Path, redis_server, variable: str, value: str
) -> None:
    import os

    env = {**os.environ, **engine_env(tiny_model, redis_server.url, "edgeq:never"), variable: value}
    finished = subprocess.run(
        [*EDGEQ, "worker"], env=env, capture_output=True, text=True, timeout=180
    )
    assert finished.returncode == 78, finished.stderr[-2000:]
    assert variable in finished.stderr
