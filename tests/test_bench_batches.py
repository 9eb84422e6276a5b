"""The batch benchmark's input and its reading of output files (no engine: the bench itself
runs by hand, docs/performance.md): every line it writes is one the gateway accepts, with the
seed's prompt lengths, and completed lines and tokens are counted from the output file alone."""

from __future__ import annotations

import json
from pathlib import Path

from edgeq.bench.batches import batch_file, output_figures
from edgeq.bench.workload import PromptMeter, load_tokenizer
from edgeq.core.protocol import ChatMessage
from edgeq.gateway.settings import GatewaySettings
from edgeq.resources.batches.store import BatchLine, parse_line


def test_every_bench_line_is_accepted_by_the_gateway_with_the_seeds_prompt_lengths(
    tiny_model: Path,
) -> None:
    model = str(tiny_model)
    lines = batch_file(model, 40, max_tokens=128, seed=0)
    settings = GatewaySettings(model=model)
    parsed = [
        parse_line(n, json.dumps(line).encode(), tenant="t", models=[model], settings=settings)
        for n, line in enumerate(lines, start=1)
    ]
    assert all(isinstance(item, BatchLine) for item in parsed), parsed
    assert len({line["custom_id"] for line in lines}) == len(lines)
    meter = PromptMeter(load_tokenizer(model))  # as the worker renders a prompt
    lengths = [
        meter.count([ChatMessage.model_validate(m) for m in line["body"]["messages"]])
        for line in lines
    ]
    assert min(lengths) >= 64 and max(lengths) <= 256
    assert len(set(lengths)) > 10  # spread over the range, not one length
    assert {line["body"]["max_tokens"] for line in lines} == {128}


def test_output_figures_count_completed_lines_and_their_tokens_only() -> None:
    def entry(status: int, tokens: int) -> str:
        body = {"usage": {"completion_tokens": tokens}}
        return json.dumps({"response": {"status_code": status, "body": body}, "error": None})

    failed = json.dumps({"response": None, "error": {"code": "batch_expired", "message": "x"}})
    text = "\n".join([entry(200, 7), entry(200, 5), entry(400, 0), failed])
    assert output_figures(text) == {"completed": 2, "tokens": 12}
