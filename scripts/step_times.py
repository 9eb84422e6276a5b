"""How long one engine step takes, the figure EDGEQ_ENGINE_STALL_S is chosen from
(docs/configuration.md, "Liveness"): the worker calls its engine stalled when it holds work
and makes no step for that long, so the setting must stay well above the longest step.

Builds the engine as the worker does (EDGEQ_* settings from the environment, or the tiny model
in a temporary directory when EDGEQ_MODEL is unset) and times the gaps between the steps vLLM
reports (a stat logger's ``record``, the same signal the worker watches), in three cases:

- ``prefill-chunked``: one prompt of max_model_len - 1 tokens, prefilled in chunks of
  EDGEQ_MAX_NUM_BATCHED_TOKENS, one answer token;
- ``prefill-whole``: the same prompt in one step (max_num_batched_tokens = max_model_len);
- ``decode-batch``: EDGEQ_MAX_NUM_SEQS short chats decoding together.

For each: the longest gap between two steps (the first counted from the request's add), the
median, and the number of steps. Run from the checkout:

    .venv/bin/python scripts/step_times.py            # the tiny model, 2048 tokens of context
    EDGEQ_MODEL=Qwen/Qwen3-0.6B .venv/bin/python scripts/step_times.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from edgeq.core.settings import load_settings
from edgeq.testing.tiny_model import make_tiny_model
from edgeq.worker.settings import WorkerSettings

DECODE_TOKENS = 64


def settings_from_env(scratch: Path) -> WorkerSettings:
    if not os.environ.get("EDGEQ_MODEL"):
        os.environ["EDGEQ_MODEL"] = str(make_tiny_model(scratch / "tiny").directory)
        os.environ.setdefault("EDGEQ_CPU_KV_CACHE_GIB", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return load_settings(WorkerSettings, env_file=None)


async def timed(settings: WorkerSettings, case: str) -> None:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    from edgeq.worker.engine import engine_args

    steps: list[float] = []

    class Steps(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, *args: Any, **kwargs: Any) -> None:
            steps.append(time.monotonic())

        def log_engine_initialized(self) -> None:
            pass

    llm = AsyncLLM.from_engine_args(engine_args(settings), stat_loggers=[Steps])
    try:
        context = llm.model_config.max_model_len
        if case == "decode-batch":
            prompts = [[100 + i % 50] * 32 for i in range(settings.max_num_seqs)]
            params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
        else:
            prompts = [[100 + i % 50 for i in range(context - 1)]]
            params = SamplingParams(max_tokens=1)
        await run(llm, prompts, params)  # once unmeasured: lazy set-up is not a step
        prompts = [[token + 1 for token in prompt] for prompt in prompts]  # no prefix cache hit
        steps.clear()
        added = time.monotonic()
        await run(llm, prompts, params)
        gaps = [b - a for a, b in zip([added, *steps], steps, strict=False)]
        print(
            f"{case}: context {context}, batched tokens "
            f"{llm.vllm_config.scheduler_config.max_num_batched_tokens}, {len(steps)} steps, "
            f"longest {max(gaps) * 1000:.0f} ms, median {statistics.median(gaps) * 1000:.1f} ms",
            flush=True,
        )
    finally:
        llm.shutdown()


async def run(llm: Any, prompts: list[list[int]], params: Any) -> None:
    async def one(prompt: list[int]) -> None:
        async for _ in llm.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex):
            pass

    await asyncio.gather(*(one(prompt) for prompt in prompts))


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        settings = settings_from_env(Path(scratch))
        asyncio.run(timed(settings, "prefill-chunked"))
        whole = settings.max_model_len or 2048
        one_step = settings.model_copy(update={"max_num_batched_tokens": whole})
        asyncio.run(timed(one_step, "prefill-whole"))
        asyncio.run(timed(settings, "decode-batch"))


if __name__ == "__main__":
    main()
