"""The bench's seeded workload with the tiny model's real tokenizer, and the command's refusals
(no engine needed: these stop before anything is started)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from edgeq.bench.workload import (
    PromptMeter,
    WorkloadError,
    WorkloadSpec,
    build_workload,
    load_tokenizer,
)
from helpers import EDGEQ

NUM_REQUESTS = 40
# Room for the tiny model's 19-token template plus a message.
INPUT_LEN_MIN = 30
INPUT_LEN_MAX = 90
EXIT_USAGE = 2


def spec(seed: int, **changes: int) -> WorkloadSpec:
    fields = {
        "num_requests": NUM_REQUESTS,
        "input_len_min": INPUT_LEN_MIN,
        "input_len_max": INPUT_LEN_MAX,
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": seed,
    } | changes
    return WorkloadSpec(**fields)  # type: ignore[arg-type]


def test_prompt_lengths_are_exact_and_spread_over_the_range(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    workload = build_workload(spec(0), tokenizer, str(tiny_model))
    meter = PromptMeter(tokenizer)
    lengths = [request.prompt_tokens for request in workload.requests]
    assert [meter.count(request.messages) for request in workload.requests] == lengths
    assert all(INPUT_LEN_MIN <= length <= INPUT_LEN_MAX for length in lengths)
    assert len(set(lengths)) > NUM_REQUESTS // 2  # drawn, not constant
    assert min(lengths) < INPUT_LEN_MIN + 15 and max(lengths) > INPUT_LEN_MAX - 15
    assert len({request.seed for request in workload.requests}) == NUM_REQUESTS


def test_same_seed_same_workload_other_seed_another(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    first = build_workload(spec(3), tokenizer, str(tiny_model))
    again = build_workload(spec(3), tokenizer, str(tiny_model))
    other = build_workload(spec(4), tokenizer, str(tiny_model))
    assert first.requests == again.requests
    assert first.requests != other.requests


def test_a_length_shorter_than_the_template_is_refused(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    with pytest.raises(WorkloadError, match="chat template alone is 19 tokens"):
        build_workload(spec(0, input_len_min=16), tokenizer, str(tiny_model))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--queue", "--start-worker"], "pick one"),
        (["--users", "0"], "--users"),
        (["--goodput", "itl:5"], "goodput SLO"),
        (["--input-len-min", "10", "--input-len-max", "20"], "chat template alone"),
        (["--compare", "missing-a.env", "missing-b.env"], "is not a file"),
    ],
)
def test_bench_refuses_bad_arguments_before_running(
    tiny_model: Path, arguments: list[str], message: str
) -> None:
    completed = subprocess.run(
        [*EDGEQ, "bench", "--model", str(tiny_model), *arguments],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == EXIT_USAGE, completed.stderr
    assert message in completed.stderr
