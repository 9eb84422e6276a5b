"""Every worker setting in one flat class: the seed's seven knobs plus how the worker runs.

Flat on purpose: each field is one ``EDGEQ_<NAME>`` variable, the same name in ``.env.example``,
README and error messages. Grouped below by the seed article's knobs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from producer.settings import ConnectionSettings

Dtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
LogLevel = Literal["debug", "info", "warning", "error"]


class WorkerSettings(ConnectionSettings):
    # Knob 1: the model and how it is split over GPUs.
    model: str = Field("Qwen/Qwen3-0.6B", min_length=1)
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: Dtype = "auto"

    # Knob 2: batch size and chunked prefill.
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    enable_chunked_prefill: bool = True
    max_jobs: int | None = Field(None, ge=1)
    poll_delay_ms: float = Field(10.0, gt=0, le=1000)
    fast_pickup: bool = True

    # Knob 3: paged KV cache.
    block_size: int | None = Field(None, ge=16, multiple_of=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    cpu_kv_cache_gib: float = Field(4.0, gt=0)
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None

    # Knob 4: sampling defaults for requests that leave a field out.
    temperature: float = Field(0.5, ge=0, le=2)
    top_p: float = Field(0.9, gt=0, le=1)
    max_tokens: int = Field(256, ge=1)

    # Knob 5: streaming.
    stream_interval_ms: float = Field(20.0, ge=0)

    # Knob 7: thinking.
    enable_thinking: bool = False

    # How the worker runs.
    job_timeout_s: float = Field(300.0, gt=0)
    abandon_after_s: float = Field(30.0, ge=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    keep_result_s: float = Field(60.0, ge=0)
    warmup: bool = True
    log_level: LogLevel = "info"
    log_content: bool = False

    @model_validator(mode="after")
    def _batch_fits_budget(self) -> WorkerSettings:
        if (
            self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise ValueError(
                "EDGEQ_MAX_NUM_BATCHED_TOKENS must be at least EDGEQ_MAX_NUM_SEQS "
                "(every running sequence needs one token per step)"
            )
        return self

    @property
    def arq_max_jobs(self) -> int:
        """arq's concurrency: by default the engine's batch, so the queue never starves it."""
        return self.max_jobs if self.max_jobs is not None else self.max_num_seqs
