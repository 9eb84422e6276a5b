"""Every worker setting in one flat class: the seed's seven knobs plus how the worker runs.

Flat on purpose: each field is one ``EDGEQ_<NAME>`` variable, the same name in ``.env.example``,
README and error messages. Grouped below by the seed article's knobs.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_settings import NoDecode

from edgeq.core.adapters import AdapterPaths, TenantAdapters
from edgeq.core.logs import LogLevel
from edgeq.core.scheduling import TENANT_PATTERN, Tenancy
from edgeq.core.settings import ConnectionSettings


def _tenant_map(value: Any) -> Any:
    """``support=3,nightly=0.5`` -> {"support": 3.0, "nightly": 0.5}; a dict passes through."""
    if not isinstance(value, str):
        return value
    entries: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        tenant, equals, number = (piece.strip() for piece in item.partition("="))
        if not equals or not re.fullmatch(TENANT_PATTERN, tenant):
            raise ValueError(f"{item!r} is not tenant=number (tenant: letters, digits, _ . -)")
        try:
            entries[tenant] = float(number)
        except ValueError:
            raise ValueError(f"{item!r}: {number!r} is not a number") from None
    return entries


#: A comma-separated tenant=number list, as EDGEQ_TENANT_WEIGHTS and EDGEQ_TENANT_MAX_QUEUED.
TenantMap = Annotated[dict[str, float], NoDecode, BeforeValidator(_tenant_map)]

#: The largest adapter ranks vLLM's engine can be built for (its LoRAConfig.max_lora_rank).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

Dtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
Profile = Literal["latency", "throughput", "edge-small"]

#: EDGEQ_PROFILE presets: field → value, applied only to fields not set explicitly (arguments,
#: environment, .env). The one place they live; README's "Profiles" paragraph lists them.
#: Left out on purpose: block_size (its valid values differ between GPU and CPU) and
#: temperature (answer quality, not speed: the seed picks it per task).
PROFILES: dict[str, dict[str, Any]] = {
    "latency": {
        # Seed knob 2: a smaller batch makes each decode step shorter, so tokens come sooner.
        "max_num_seqs": 32,
        # Seed knob 2: a small step budget, so a prefill never holds up running decodes for long.
        "max_num_batched_tokens": 2048,
        # Seed knob 2: with chunked prefill on, a long input does not block small requests.
        "enable_chunked_prefill": True,
        # Seed knob 5: streaming gives earlier first content; 10 ms pushes text almost per token.
        "stream_interval_ms": 10.0,
    },
    "throughput": {
        # Seed knob 2: the top of the seed's 64-128 range for chat: more chats per engine step.
        "max_num_seqs": 128,
        # Seed knob 2: a big budget prefills many prompts per step (seed: 4096; x2 for 128 seqs).
        "max_num_batched_tokens": 8192,
        # Seed knob 2: a long prompt is prefilled in chunks instead of stalling a full batch.
        "enable_chunked_prefill": True,
        # Seed knob 2: the seed's 8192 bounds each sequence, leaving KV cache for the batch.
        "max_model_len": 8192,
        # Seed knob 5: same total time; 50 ms sends fewer messages, more cycles go to the engine.
        "stream_interval_ms": 50.0,
        # Seed knob 5: an engine output per 4 tokens took a fifth to a third of the worker's CPU
        # off the seed's burst (24-26 -> 18-19 % of a core, the tiny model on a 2-vCPU machine,
        # 2026-12-02): a full batch is where per-output work adds up.
        "stream_tokens": 4,
    },
    "edge-small": {
        # Seed: constrained hardware; a small batch fits a small GPU or a few CPU cores.
        "max_num_seqs": 16,
        # Seed knob 2: a small step budget keeps each step short on slow hardware (>= 16 seqs).
        "max_num_batched_tokens": 1024,
        # Seed knob 2: needed with a budget below the context; long prompts do not block short ones.
        "enable_chunked_prefill": True,
        # Seed: uncontrolled sequence length is a latency source; 4096 tokens is plenty for chat.
        "max_model_len": 4096,
        # Seed knob 3: a lower memory share (seed 0.9) leaves headroom on a shared small device.
        "gpu_memory_utilization": 0.7,
        # Seed knob 3 on CPU: 2 GiB is ~18k tokens of Qwen3-0.6B KV (112 KiB each): 16 chats of 1k.
        "cpu_kv_cache_gib": 2.0,
        # Seed knob 4: the answer cap is the main lever on total latency on slow hardware.
        "max_tokens": 128,
        # Seed knob 5: fewer pub/sub messages, so a CPU-bound box spends its cycles on tokens.
        "stream_interval_ms": 50.0,
        # Seed knob 5: the same for the worker's Python: an engine output per 4 tokens.
        "stream_tokens": 4,
    },
}


class WorkerSettings(ConnectionSettings):
    # A preset for the knobs below (PROFILES); any knob set explicitly wins over it.
    profile: Profile | None = None

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
    poll_delay_ms: float = Field(250.0, gt=0, le=1000)

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

    # Knob 5: streaming. ``stream_tokens``: vLLM's stream_interval, the engine's own
    # coalescing (every Nth token after the first), which spares the worker the Python per
    # engine output; ``stream_interval_ms``: the publisher's, by time, before Redis.
    stream_interval_ms: float = Field(20.0, ge=0)
    stream_tokens: int = Field(1, ge=1, le=64)

    # Knob 7: thinking.
    enable_thinking: bool = False

    # Structured answers: JSON without whitespace between its tokens (fewer tokens, and no
    # answer padded with whitespace until max_tokens); true allows any, as vLLM's default.
    json_any_whitespace: bool = False

    # Who goes first (edgeq.core.scheduling; README, "Priorities and tenants"). Weights and
    # caps are published to Redis at start-up, where producers' enqueues read them.
    tenant_weights: TenantMap = Field(default_factory=dict)
    tenant_default_weight: float = Field(1.0, gt=0)
    tenant_max_queued: TenantMap = Field(default_factory=dict)
    priority_aging_s: float = Field(60.0, ge=0)
    # Rate limits and token budgets per tenant (docs/limits.md), tenant=number lists published
    # with the weights: requests and tokens per minute, tokens per UTC day and month.
    tenant_rpm: TenantMap = Field(default_factory=dict)
    tenant_tpm: TenantMap = Field(default_factory=dict)
    tenant_tokens_per_day: TenantMap = Field(default_factory=dict)
    tenant_tokens_per_month: TenantMap = Field(default_factory=dict)
    # The same per API key, name=number lists (a request's key_name: the gateway names each of
    # its keys, docs/limits.md): a key's limits hold within its tenant's.
    key_rpm: TenantMap = Field(default_factory=dict)
    key_tpm: TenantMap = Field(default_factory=dict)
    key_tokens_per_day: TenantMap = Field(default_factory=dict)
    key_tokens_per_month: TenantMap = Field(default_factory=dict)
    # Free slots (of EDGEQ_MAX_JOBS) batch jobs never take (None: a quarter of EDGEQ_MAX_JOBS),
    # so a chat arriving while batch work fills the box starts at once.
    reserved_slots: int | None = Field(None, ge=0)
    # "priority": the engine schedules by class too (vLLM's scheduling_policy); "fcfs": in
    # arrival order.
    engine_scheduling: Literal["priority", "fcfs"] = "priority"

    # LoRA adapters on the one base model (docs/adapters.md). EDGEQ_ADAPTERS: name=path entries
    # served from start-up, besides those registered for the queue (``edgeq adapters load``).
    # enable_lora: None turns LoRA on in the engine only when an adapter is set here or
    # registered when the worker starts (LoRA's kernels cost every step, adapter or not); true
    # also lets a worker started with none serve adapters loaded later.
    enable_lora: bool | None = None
    adapters: AdapterPaths = Field(default_factory=dict)
    # The most adapters held at once (vLLM's max_loras and max_cpu_loras), and the largest rank.
    max_adapters: int = Field(4, ge=1)
    max_adapter_rank: int = Field(16, ge=1, le=max(LORA_RANKS))
    # tenant=adapter: the adapter a tenant's requests answer with when they name none. Applied
    # by the worker, so every producer (any language, the gateway) gets it.
    tenant_adapters: TenantAdapters = Field(default_factory=dict)

    # How the worker runs.
    # How many steps nicer (lower CPU priority) the engine's processes run than the worker, so
    # the worker's event loop is not kept waiting for a core behind them (worker/vllm_plugin.py;
    # at 10 a burst's queue wait p50 fell from 128-165 to 77-88 ms with no tok/s lost, the tiny
    # model on a 2-vCPU machine, 2026-12-01); 0: the same priority.
    engine_nice: int = Field(10, ge=0, le=19)
    job_timeout_s: float = Field(300.0, gt=0)
    # How long a running chat rides out Redis being away (a restart, a failover) before the
    # worker stops generating it; its lease cannot run out meanwhile (core/leases.py).
    redis_outage_s: float = Field(60.0, gt=0)
    # How long a finished job's events and records are kept in the worker, to be written again
    # should Redis come back without them (worker/refill.py): longer than Redis may take to
    # have a write on disk (appendfsync everysec: about a second, two when a disk is slow) or
    # on a replica; 0 keeps nothing.
    refill_window_s: float = Field(3.0, ge=0)
    abandon_after_s: float = Field(30.0, ge=0)
    # Liveness by progress (worker/liveness.py): the engine holding work with no step for
    # engine_stall_s is stalled (no new jobs, no watchdog pings); stalled for engine_stall_exit_s
    # more, the worker hands its jobs over and exits. Far above the longest step measured
    # (docs/configuration.md, "Liveness"); 0 turns the watch off.
    engine_stall_s: float = Field(60.0, ge=0)
    engine_stall_exit_s: float = Field(30.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    keep_result_s: float = Field(60.0, ge=0)
    # Days a tenant's usage ledger of one UTC day is kept after its last write (core/ledger.py,
    # docs/usage.md); 0 writes no ledger.
    usage_keep_days: int = Field(90, ge=0, le=3660)
    warmup: bool = True
    log_level: LogLevel = "info"
    log_content: bool = False
    metrics_host: str = Field("127.0.0.1", min_length=1)
    metrics_port: int = Field(9400, ge=0, le=65535)

    @model_validator(mode="before")
    @classmethod
    def _apply_profile(cls, data: Any) -> Any:
        """Fill in the profile's presets for the fields no source (argument, env, .env) set.

        An unknown name is left alone: the ``profile`` field itself refuses it, naming
        EDGEQ_PROFILE and the allowed values.
        """
        if not isinstance(data, dict):
            return data
        presets = PROFILES.get(str(data.get("profile")))
        if presets is None:
            return data
        return {**presets, **data}

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

    @model_validator(mode="after")
    def _tenant_rules(self) -> WorkerSettings:
        for tenant, weight in self.tenant_weights.items():
            if weight <= 0:
                raise ValueError(f"EDGEQ_TENANT_WEIGHTS: {tenant}'s weight must be above 0")
        for name, limits in self._tenant_counts.items():
            for tenant, cap in limits.items():
                if cap != int(cap) or cap < 1:
                    raise ValueError(f"EDGEQ_{name.upper()}: {tenant}'s value is not a count > 0")
        if self.reserved_slots is not None and self.reserved_slots >= self.job_slots:
            raise ValueError(
                f"EDGEQ_RESERVED_SLOTS ({self.reserved_slots}) must be below "
                f"EDGEQ_MAX_JOBS ({self.job_slots}), or no batch job could ever run"
            )
        return self

    @model_validator(mode="after")
    def _adapter_rules(self) -> WorkerSettings:
        if self.max_adapter_rank not in LORA_RANKS:
            raise ValueError(
                f"EDGEQ_MAX_ADAPTER_RANK: vLLM takes one of {', '.join(map(str, LORA_RANKS))} "
                f"(got {self.max_adapter_rank})"
            )
        if len(self.adapters) > self.max_adapters:
            raise ValueError(
                f"EDGEQ_ADAPTERS names {len(self.adapters)} adapters, more than "
                f"EDGEQ_MAX_ADAPTERS ({self.max_adapters}) holds"
            )
        if self.adapters and self.enable_lora is False:
            raise ValueError("EDGEQ_ADAPTERS needs LoRA in the engine: EDGEQ_ENABLE_LORA is false")
        return self

    @property
    def usage_keep_s(self) -> int | None:
        """EDGEQ_USAGE_KEEP_DAYS in seconds; None: no ledger is written."""
        return self.usage_keep_days * 86_400 or None

    @property
    def lora(self) -> bool:
        """LoRA on in the engine: asked for, or adapters set here (app.start_engine also turns
        it on for adapters registered in Redis)."""
        return self.enable_lora if self.enable_lora is not None else bool(self.adapters)

    @property
    def _tenant_counts(self) -> dict[str, dict[str, float]]:
        """The tenant=count settings, by field name."""
        return {
            "tenant_max_queued": self.tenant_max_queued,
            "tenant_rpm": self.tenant_rpm,
            "tenant_tpm": self.tenant_tpm,
            "tenant_tokens_per_day": self.tenant_tokens_per_day,
            "tenant_tokens_per_month": self.tenant_tokens_per_month,
            "key_rpm": self.key_rpm,
            "key_tpm": self.key_tpm,
            "key_tokens_per_day": self.key_tokens_per_day,
            "key_tokens_per_month": self.key_tokens_per_month,
        }

    @property
    def tenancy(self) -> Tenancy:
        def counts(limits: dict[str, float]) -> dict[str, int]:
            return {tenant: int(value) for tenant, value in limits.items()}

        return Tenancy(
            weights=self.tenant_weights,
            max_queued=counts(self.tenant_max_queued),
            default_weight=self.tenant_default_weight,
            aging_s=self.priority_aging_s,
            rpm=counts(self.tenant_rpm),
            tpm=counts(self.tenant_tpm),
            tokens_per_day=counts(self.tenant_tokens_per_day),
            tokens_per_month=counts(self.tenant_tokens_per_month),
            key_rpm=counts(self.key_rpm),
            key_tpm=counts(self.key_tpm),
            key_tokens_per_day=counts(self.key_tokens_per_day),
            key_tokens_per_month=counts(self.key_tokens_per_month),
            max_tokens=self.max_tokens,
            model=self.model,
            usage_keep_s=self.usage_keep_s or 0,
        )

    @property
    def job_slots_reserved(self) -> int:
        """Of ``job_slots``, how many batch jobs never take (EDGEQ_RESERVED_SLOTS)."""
        if self.reserved_slots is not None:
            return self.reserved_slots
        return self.job_slots // 4

    @property
    def job_slots(self) -> int:
        """How many jobs the worker runs at once (EDGEQ_MAX_JOBS): by default the engine's batch,
        so the queue never starves it."""
        return self.max_jobs if self.max_jobs is not None else self.max_num_seqs
