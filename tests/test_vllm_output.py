"""The simulated box with vLLM's own output processing (edgeq.bench.vllm_output): its tokens
go through AsyncLLM's real OutputProcessor with the tiny model's tokenizer, one per running
request per decode step. No engine process starts: AsyncLLM is built around the simulated
core, and the tokenizer loads in a second."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.outputs import RequestOutput
from vllm.v1.metrics.stats import RequestStateStats

from edgeq.bench.capacity import MARK, delta_tokens
from edgeq.bench.gpu_rate import GpuRate
from edgeq.bench.vllm_output import ProcessedEngine, SimulatedCore, mark, sentence_token_ids
from edgeq.core.protocol import ChatMessage, ChatRequest
from edgeq.worker.settings import WorkerSettings

TOKENS = 30
CHATS = 3


async def _chat(engine: ProcessedEngine, request_id: str) -> list[RequestOutput]:
    request = ChatRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=TOKENS)
    prompt = await engine.render(request.messages, enable_thinking=False)
    params = engine.rules.sampling_params(request, len(prompt))
    return [output async for output in engine.generate(prompt, params, request_id)]


async def _serve(tiny_model: Path) -> tuple[list[list[RequestOutput]], Any, list[int]]:
    settings = WorkerSettings(model=str(tiny_model), stream_tokens=1)
    engine = await ProcessedEngine.start(settings, gpu=GpuRate(step_ms=2, prefill_ms=5))
    try:
        chats = await asyncio.gather(*(_chat(engine, f"chat-{n}") for n in range(CHATS)))
        return chats, engine._tokenizer, list(engine.core.token_ids)
    finally:
        engine.shutdown()


def test_outputs_are_vllms_own_detokenized_request_outputs(tiny_model: Path) -> None:
    chats, tokenizer, cycle = asyncio.run(_serve(tiny_model))
    assert cycle == sentence_token_ids(tokenizer)
    for outputs in chats:
        # Built by vLLM's OutputProcessor, with its per-request stats (the job reads them).
        assert all(type(output) is RequestOutput for output in outputs)
        assert isinstance(outputs[-1].metrics, RequestStateStats)
        assert outputs[-1].metrics.num_generation_tokens == TOKENS
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        ids = [token for output in outputs for token in output.outputs[0].token_ids]
        assert ids == [cycle[n % len(cycle)] for n in range(TOKENS)]
        # The text is the detokenizer's, one mark after each output's (edgeq.bench.capacity).
        text = "".join(output.outputs[0].text for output in outputs)
        assert MARK.sub("", text) == tokenizer.decode(ids)
        assert delta_tokens(text)[0] == TOKENS


def _request(request_id: str, max_tokens: int) -> Any:
    """The fields of an EngineCoreRequest the simulated core reads."""
    return SimpleNamespace(
        request_id=f"{request_id}-internal",
        external_req_id=request_id,
        sampling_params=SimpleNamespace(max_tokens=max_tokens),
    )


def test_each_step_makes_one_token_per_running_request_after_its_prefill() -> None:
    core = SimulatedCore(GpuRate(step_ms=10, prefill_ms=20), token_ids=[5, 6, 7])
    core.admit(_request("a", 4), now_s=0.0)  # first token due at 0.02
    core.admit(_request("b", 2), now_s=0.01)  # at 0.03
    steps = [core.step(now_s) for now_s in (0.01, 0.02, 0.03, 0.04, 0.05, 0.06)]
    made = [
        {output.request_id: (output.new_token_ids, output.finish_reason) for output in step.outputs}
        for step in steps
    ]
    assert made[0] == {}
    assert made[1] == {"a-internal": ([5], None)}
    assert made[2] == {"a-internal": ([6], None), "b-internal": ([5], None)}
    assert made[3]["a-internal"] == ([7], None) and made[3]["b-internal"][0] == [6]
    assert made[3]["b-internal"][1] is not None  # b's max_tokens: it finishes
    assert made[4]["a-internal"][0] == [5] and made[4]["a-internal"][1] is not None
    assert made[5] == {}
    # One make time per token, by external id, for the marks.
    assert [len(core.made_s[name]) for name in ("a", "b")] == [4, 2]


def test_a_delta_of_several_outputs_counts_their_marks() -> None:
    text = "The" + mark(1, 1764639000.1) + " sea was" + mark(2, 1764639000.25)
    assert delta_tokens(text) == (3, 1764639000.25)
    assert delta_tokens("x 1764639000.1000 x 1764639000.2500 ") == (4, 1764639000.25)
