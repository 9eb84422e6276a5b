"""The one warm vLLM engine a worker holds, and the two things done before each generation:
rendering the chat with the model's own template, and turning a request into SamplingParams.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq

from edgeq.core.errors import ConfigError
from edgeq.core.protocol import ChatMessage, ChatRequest
from edgeq.core.scheduling import Priority, band_of
from edgeq.core.structured import Tool
from edgeq.worker.engine_processes import (
    ProcessId,
    engine_pids,
    identify,
    kill_and_wait,
    wait_until_gone,
)
from edgeq.worker.reasoning import THINK_CLOSE, THINK_OPEN
from edgeq.worker.settings import WorkerSettings
from edgeq.worker.vllm_plugin import ENABLE_ENV, NICE_ENV, OWNER_ENV

# When thinking is off the think tags are banned from sampling, so a model that ignores the
# pre-closed think block of Qwen3's template still cannot open one.
BANNED_LOGIT_BIAS = -100.0

# The CPU attention kernel works on blocks that are a multiple of this many tokens.
CPU_BLOCK_MULTIPLE = 32

# The directory of an engine's sockets: this prefix, the worker's pid, a random part.
IPC_DIR_PREFIX = "edgeq-engine-"

# Stopping: how long vLLM's engine processes get to exit on SIGTERM before vLLM kills them
# (vLLM's own default is 5 s, too short for a process holding gigabytes on a busy machine),
# then how long their exit is waited for before and after a SIGKILL of whatever is left.
ENGINE_STOP_TIMEOUT_S = 20.0
ENGINE_EXIT_WAIT_S = 10.0

WARMUP_MESSAGES = (ChatMessage(role="user", content="Hello"),)
WARMUP_TOKENS = 4

# Before vllm is imported: no phoning home from an appliance, and edgeq's vLLM plugin acts in
# this process and the engine processes it spawns (which inherit the environment).
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ[ENABLE_ENV] = "1"
os.environ[OWNER_ENV] = str(os.getpid())

from vllm import AsyncEngineArgs, RequestOutput, SamplingParams, envs  # noqa: E402
from vllm.config import StructuredOutputsConfig  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

from edgeq.worker.liveness import StepWatch  # noqa: E402
from edgeq.worker.structured import AnswerReader, structured_outputs  # noqa: E402


class PromptTooLong(Exception):
    """The rendered prompt leaves no room for even one generated token."""


def engine_args(settings: WorkerSettings) -> AsyncEngineArgs:
    """Map EDGEQ_* settings to vLLM's engine arguments, with the CPU platform's rules applied."""
    on_cpu = current_platform.is_cpu()
    if on_cpu and settings.block_size is not None and settings.block_size % CPU_BLOCK_MULTIPLE:
        raise ConfigError(
            f"EDGEQ_BLOCK_SIZE: vLLM's CPU backend needs a multiple of {CPU_BLOCK_MULTIPLE} "
            f"(got {settings.block_size})"
        )
    return AsyncEngineArgs(
        model=settings.model,
        tensor_parallel_size=settings.tensor_parallel_size,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        # Jobs carry their class's band as vLLM's priority (edgeq.core.scheduling).
        scheduling_policy=settings.engine_scheduling,
        block_size=settings.block_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        # On CPU vLLM would otherwise reserve ~92 % of RAM; on a GPU the utilization rules.
        kv_cache_memory_bytes=int(settings.cpu_kv_cache_gib * 2**30) if on_cpu else None,
        enable_prefix_caching=settings.enable_prefix_caching,
        # Eager mode skips inductor's C++ compile at start-up, which costs minutes on a CPU.
        enforce_eager=settings.enforce_eager if settings.enforce_eager is not None else on_cpu,
        enable_log_requests=settings.log_content,
        # vLLM sends the first and the final output at once, whatever the interval.
        stream_interval=settings.stream_tokens,
        # Per-request stats give the exact generated-token count (worker/jobs.py).
        disable_log_stats=False,
        # vLLM's "auto" backend may fall back to guidance per schema; compact JSON needs the
        # backend named, and xgrammar is the one the CPU build ships with every feature.
        structured_outputs_config=StructuredOutputsConfig()
        if settings.json_any_whitespace
        else StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
        **lora_args(settings),
    )


def lora_args(settings: WorkerSettings) -> dict[str, Any]:
    """vLLM's LoRA arguments, only when LoRA is on: its kernels cost every step otherwise."""
    if not settings.lora:
        return {}
    # One number for both: every adapter held can be in a batch at once, so a job never waits
    # for a slot behind another adapter's (and the worker never holds more than it can batch).
    return {
        "enable_lora": True,
        "max_loras": settings.max_adapters,
        "max_cpu_loras": settings.max_adapters,
        "max_lora_rank": settings.max_adapter_rank,
    }


def describe_device(settings: WorkerSettings) -> str:
    """What the engine runs on, for ``edgeq status``: "cpu", or the GPUs' names and indexes
    (read through NVML, which does not initialise CUDA in this process before vLLM does)."""
    if current_platform.is_cpu():
        return "cpu"
    names = [
        current_platform.get_device_name(index) for index in range(settings.tensor_parallel_size)
    ]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    return f"{' + '.join(names)} (CUDA_VISIBLE_DEVICES={visible})"


def remove_dead_workers_ipc_dirs(parent: str) -> None:
    """Remove the socket directories (``private_ipc_dir``) of this user's workers that are
    gone: a worker killed with SIGKILL never got to its engine's ``shutdown``."""
    for directory in Path(parent).glob(f"{IPC_DIR_PREFIX}*-*"):
        pid = directory.name.removeprefix(IPC_DIR_PREFIX).split("-", 1)[0]
        with contextlib.suppress(OSError):
            if pid.isdigit() and not identify([int(pid)]):  # no process with that pid
                if directory.stat().st_uid == os.getuid():
                    shutil.rmtree(directory)


@contextlib.contextmanager
def private_ipc_dir() -> Iterator[str | None]:
    """A directory of its own for the ZeroMQ sockets of the engine built inside the block.

    vLLM names them in VLLM_RPC_BASE_PATH, the temp directory by default, and never removes
    them: every engine start left seven socket files in /tmp. The directory is returned for the
    engine's ``shutdown`` to remove; those of workers killed before that go at the next start.
    None, and vLLM left to its default, when the operator chose a path, when a socket's path
    in the directory would be too long for a socket address, or when vLLM's settings still
    answer with another path (a guard: the cache an earlier engine left is dropped first)."""
    # An engine built before in this process left vLLM's settings cached (ChatEngine.start):
    # they would answer with that engine's directory, gone since. Read from the environment.
    envs.disable_envs_cache()
    if "VLLM_RPC_BASE_PATH" in os.environ:
        yield None
        return
    remove_dead_workers_ipc_dirs(tempfile.gettempdir())
    ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
    if len(f"{ipc_dir}/{uuid.uuid4()}") > zmq.IPC_PATH_MAX_LEN:
        os.rmdir(ipc_dir)
        yield None
        return
    os.environ["VLLM_RPC_BASE_PATH"] = ipc_dir
    try:
        if envs.VLLM_RPC_BASE_PATH != ipc_dir:
            os.rmdir(ipc_dir)
            yield None
        else:
            yield ipc_dir
    except BaseException:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    finally:
        del os.environ["VLLM_RPC_BASE_PATH"]


class RequestRules:
    """How a request becomes SamplingParams on an engine: its own fields, else the box's
    defaults; max_tokens within the context left; thinking on or off, and the think tags
    banned from sampling when it is off. Both engines (worker/engine_api.py) hold one."""

    def __init__(
        self, settings: WorkerSettings, *, max_model_len: int, think_token_ids: Sequence[int] = ()
    ) -> None:
        self.settings = settings
        self.max_model_len = max_model_len
        self._think_ids = list(think_token_ids)

    def thinking_enabled(self, request: ChatRequest) -> bool:
        # A grammar holds the answer from its first token, so there is no room to think.
        if request.constrained:
            return False
        if request.enable_thinking is None:
            return self.settings.enable_thinking
        return request.enable_thinking

    def max_tokens(self, request: ChatRequest) -> int:
        return request.max_tokens if request.max_tokens is not None else self.settings.max_tokens

    def sampling_params(
        self, request: ChatRequest, prompt_tokens: int, *, already: int = 0
    ) -> SamplingParams:
        """SamplingParams for one request: its own fields, else the box-wide defaults;
        ``already`` tokens of the answer exist (a continued job) and count against max_tokens."""
        room = self.max_model_len - prompt_tokens
        if room < 1:
            raise PromptTooLong(
                f"the prompt is {prompt_tokens} tokens, but this worker's context holds "
                f"{self.max_model_len} (EDGEQ_MAX_MODEL_LEN) including at least one "
                f"generated token"
            )
        defaults = self.settings
        max_tokens = self.max_tokens(request) - already
        banned = None
        if not self.thinking_enabled(request) and self._think_ids:
            banned = dict.fromkeys(self._think_ids, BANNED_LOGIT_BIAS)
        return SamplingParams(
            temperature=request.temperature
            if request.temperature is not None
            else defaults.temperature,
            top_p=request.top_p if request.top_p is not None else defaults.top_p,
            max_tokens=min(max_tokens, room),
            stop=request.stop,
            seed=request.seed,
            logit_bias=banned,
            structured_outputs=structured_outputs(request),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            output_kind=RequestOutputKind.DELTA,
        )


class StepSignal(StatLoggerBase):
    """A vLLM stat logger that only notes each engine step in a StepWatch (worker/liveness.py).

    With stats on, the engine core sends its scheduler stats after every step, a chunk of a
    prefill that yields no token included, and AsyncLLM hands them to its stat loggers on the
    worker's event loop: one call per step, whatever the requests' outputs."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, *, watch: StepWatch) -> None:
        self.watch = watch

    def record(self, *args: Any, **kwargs: Any) -> None:
        self.watch.stepped()

    def log_engine_initialized(self) -> None:
        pass


class ChatEngine:
    """One AsyncLLM for the life of the worker, plus its tokenizer and the box's defaults."""

    def __init__(
        self,
        llm: AsyncLLM,
        tokenizer: Any,
        settings: WorkerSettings,
        processes: Sequence[ProcessId] = (),
        ipc_dir: str | None = None,
        steps: StepWatch | None = None,
    ) -> None:
        self.llm = llm
        self.steps = steps or StepWatch()  # fed by StepSignal, from the engine's stats
        self._processes = list(processes)  # the engine's own VLLM:: processes
        self._ipc_dir = ipc_dir  # its sockets' directory, removed once it stopped
        self.settings = settings
        self.max_model_len: int = llm.model_config.max_model_len
        self._by_priority = settings.engine_scheduling == "priority"
        self._tokenizer = tokenizer
        # Fast tokenizers are not safe to share between threads; one thread keeps rendering
        # off the event loop without ever running two encodes at once.
        self._render_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")
        vocab = tokenizer.get_vocab()
        self.rules = RequestRules(
            settings,
            max_model_len=self.max_model_len,
            think_token_ids=[vocab[tag] for tag in (THINK_OPEN, THINK_CLOSE) if tag in vocab],
        )

    @classmethod
    async def start(cls, settings: WorkerSettings) -> ChatEngine:
        """Build the engine (blocking: model load and KV allocation happen in its processes)."""
        os.environ[NICE_ENV] = str(settings.engine_nice)  # read by the processes it spawns
        others = set(engine_pids(os.getpid(), own=True))  # engines this process already runs
        steps = StepWatch()
        with private_ipc_dir() as ipc_dir:
            llm = AsyncLLM.from_engine_args(
                engine_args(settings),
                stat_loggers=[functools.partial(StepSignal, watch=steps)],
            )
        # vLLM reads some of its VLLM_* settings for every engine output (its iteration stats:
        # two os.getenv each, ~6 % of a worker's samples at 256 streams, docs/performance.md);
        # its engine processes cache them once built, its front end only when told. Cached
        # after the build: private_ipc_dir drops the cache before the next one.
        envs.enable_envs_cache()
        processes = identify(pid for pid in engine_pids(os.getpid(), own=True) if pid not in others)
        tokenizer = llm.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # older vLLM releases
            tokenizer = await tokenizer
        return cls(llm, tokenizer, settings, processes, ipc_dir, steps)

    async def warm_up(self) -> None:
        """One short generation, so the first real job does not pay for lazy initialisation."""
        request = ChatRequest(messages=list(WARMUP_MESSAGES), max_tokens=WARMUP_TOKENS)
        prompt = await self.render(request.messages, enable_thinking=False)
        params = self.rules.sampling_params(request, len(prompt))
        async for _ in self.generate(prompt, params, f"warmup-{uuid.uuid4().hex}"):
            pass

    @property
    def device(self) -> str:
        """What the engine runs on, for ``edgeq status``."""
        return describe_device(self.settings)

    def shutdown(self) -> None:
        """Stop the engine and return only once its processes have exited. vLLM kills what
        outlasts its timeout without waiting for it to die, and a process with gigabytes mapped
        takes seconds to: a worker returning before that would leave its supervisor to kill
        the engine (systemd's KillMode=mixed SIGKILLs whatever is left once the worker exits)
        and a restarted worker beside a dying engine's memory."""
        self.llm.shutdown(timeout=ENGINE_STOP_TIMEOUT_S)
        self._render_thread.shutdown(wait=False, cancel_futures=True)
        if left := wait_until_gone(self._processes, ENGINE_EXIT_WAIT_S):
            kill_and_wait(left, ENGINE_EXIT_WAIT_S)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def kill(self) -> None:
        """Kill the engine's processes (a stalled engine answers no shutdown), returning once
        they are gone, so a restarted worker does not find their memory still held."""
        kill_and_wait(self._processes, ENGINE_EXIT_WAIT_S)

    def answer_reader(self, request: ChatRequest) -> AnswerReader:
        return AnswerReader(request, self._tokenizer)

    def unfinished_requests(self) -> int:
        return int(self.llm.get_num_unfinished_requests())

    def without_step_s(self) -> float:
        return self.steps.without_step_s(busy=self.unfinished_requests() > 0)

    async def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        enable_thinking: bool,
        tools: Sequence[Tool] | None = None,
    ) -> list[int]:
        """Token ids of the chat, rendered with the model's own chat template (which also
        lists the tools the model may call)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._render_thread, self._render_sync, messages, enable_thinking, tools
        )

    def _render_sync(
        self,
        messages: Sequence[ChatMessage],
        enable_thinking: bool,
        tools: Sequence[Tool] | None,
    ) -> list[int]:
        text = self._tokenizer.apply_chat_template(
            [message.model_dump(exclude_none=True) for message in messages],
            tools=[tool.model_dump(exclude_none=True) for tool in tools] if tools else None,
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        # The template already emits every special token the model expects.
        return self._tokenizer.encode(text, add_special_tokens=False)

    async def encode(self, text: str) -> list[int]:
        """Token ids of plain text (an answer's part already streamed), on the render thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._render_thread,
            lambda: self._tokenizer.encode(text, add_special_tokens=False),
        )

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: Priority | None = None,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream DELTA outputs; closing the generator early (break, cancel) aborts the
        request in the engine (AsyncLLM's own generator does, on GeneratorExit). Under
        EDGEQ_ENGINE_SCHEDULING=priority the engine schedules a higher class first.
        ``lora_request``: an adapter already loaded (worker/adapters.py); one that is not
        would be loaded from disk inside the engine, which dies of a bad one.

        AsyncLLM's generator itself, not one wrapped around it: a generator of ours in
        between cost every output a resume and a yield (with one output per token, ~1 µs of
        the worker's ~31 per token)."""
        self.steps.work_added(idle=self.unfinished_requests() == 0)
        return self.llm.generate(
            {"prompt_token_ids": prompt_token_ids},
            params,
            request_id,
            priority=band_of(priority) if self._by_priority else 0,
            lora_request=lora_request,
        )
