"""Running the workload as N concurrent users against a target, one mode after another.

Each user sends its requests one after another (request i belongs to user i mod N), all users
start together: a closed loop that holds at most N requests in flight, like
``vllm bench serve --max-concurrency N`` with every request ready at the start. Before the
clock starts, one short warm-up request checks the target answers (like vLLM's "initial test
run", but with the shortest prompt).

Modes never overlap: a worker started for a queue mode is stopped before the next mode runs,
so on a small box no mode pays for another's engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from edgeq.bench.cpu import cpu_s_by_role
from edgeq.bench.gpu_rate import GpuRate, worker_process
from edgeq.bench.records import ModeRun, RequestRecord
from edgeq.bench.targets import ChunkClock, DirectTarget, OpenAITarget, QueueTarget, Target
from edgeq.bench.workload import BenchRequest, Workload
from edgeq.core.settings import ConnectionSettings, load_settings
from edgeq.testing.processes import RedisServer, WorkerProcess
from edgeq.worker.engine_processes import engine_pids

#: Long enough to check a target really generates, short enough to cost nothing.
WARMUP_MAX_TOKENS = 4
#: The queue a bench-started worker serves, so it never takes jobs meant for another worker.
BENCH_QUEUE = "edgeq:bench"
#: A failed request's error is kept in the report up to this many characters.
ERROR_CHARS = 500


class Progress(Protocol):
    """Told when the measured requests start, as each one ends, and when the mode is over."""

    def start(self, total: int) -> None: ...

    def advance(self) -> None: ...

    def close(self) -> None: ...


class ModeKind(StrEnum):
    QUEUE = "queue"
    DIRECT = "direct"
    OPENAI = "openai"


@dataclass(frozen=True)
class ModePlan:
    """One mode of a run: what to send the workload to, and how to set it up first."""

    name: str
    kind: ModeKind
    #: Queue: start a private Redis and worker with these settings; None = use a running one.
    worker_env: Mapping[str, str] | None = None
    #: OpenAI: the server's base URL.
    url: str | None = None
    #: A worker or engine started here makes tokens at this rate instead of running the model
    #: (edgeq.bench.simulate): what the queue costs when the engine leaves the cores free.
    gpu: GpuRate | None = None


def user_schedule(num_requests: int, users: int) -> list[list[int]]:
    """Request indices per user: user u sends u, u+N, u+2N, … in that order."""
    return [list(range(user, num_requests, users)) for user in range(min(users, num_requests))]


def _failed(
    index: int, user: int, start_s: float, request: BenchRequest, error: str
) -> RequestRecord:
    return RequestRecord(
        index=index,
        user=user,
        success=False,
        start_s=start_s,
        prompt_tokens=request.prompt_tokens,
        error=error[:ERROR_CHARS],
    )


async def measure(
    target: Target, workload: Workload, request: BenchRequest, user: int, run_start: float
) -> RequestRecord:
    """Send one request and record it; any failure becomes a failed record, never a raise."""
    clock = ChunkClock()
    start_s = clock.sent - run_start
    try:
        outcome = await target.send(request, workload.sampling_fields(request), clock)
        ttft_s, e2el_s = clock.ttft_s, clock.e2el_s
    except Exception as error:  # a failed request is a result, not a crash
        return _failed(request.index, user, start_s, request, f"{type(error).__name__}: {error}")
    return RequestRecord(
        index=request.index,
        user=user,
        success=True,
        start_s=start_s,
        ttft_s=ttft_s,
        e2el_s=e2el_s,
        itl_s=tuple(clock.gaps),
        output_tokens=outcome.output_tokens,
        prompt_tokens=request.prompt_tokens,
        reported_prompt_tokens=outcome.reported_prompt_tokens,
        finish_reason=outcome.finish_reason,
        queued_ms=outcome.queued_ms,
        worker_ttft_ms=outcome.worker_ttft_ms,
        worker_total_ms=outcome.worker_total_ms,
    )


async def warm_up(target: Target, workload: Workload) -> str | None:
    """One short request outside the measurement; returns why it failed, or None.

    It uses the workload's shortest prompt: the question is whether the target answers at all,
    not whether the longest prompt fits (that is the workload's to find out, per request).
    """
    shortest = min(workload.requests, key=lambda request: request.prompt_tokens)
    fields = workload.sampling_fields(shortest) | {"max_tokens": WARMUP_MAX_TOKENS}
    try:
        await target.send(shortest, fields, ChunkClock())
    except Exception as error:  # reported as the mode's error
        return f"the warm-up request failed: {type(error).__name__}: {error}"
    return None


#: The pids of a mode's processes by role, asked for once its target is up.
WatchedPids = Callable[[], Mapping[str, Sequence[int]]]


async def run_users(
    target: Target,
    workload: Workload,
    users: int,
    progress: Progress | None = None,
    watched: WatchedPids | None = None,
) -> ModeRun:
    """The whole workload through ``target`` with ``users`` concurrent users; with
    ``watched``, what those processes' CPU did meanwhile goes in the run too."""
    run = ModeRun(name=target.name, target=target.description)
    run.error = await warm_up(target, workload)
    if run.error is not None:
        return run
    schedule = user_schedule(len(workload.requests), users)
    # Everything alive now (the tokenizer, vLLM's modules, a direct engine) outlives the run:
    # frozen, no full collection walks it during the measurement. Unfrozen, this process's
    # full collections took 150-680 ms (the client of every mode, on a 2-vCPU machine,
    # 2026-12-05).
    gc.collect()
    gc.freeze()
    if progress is not None:
        progress.start(len(workload.requests))
    pids = watched() if watched is not None else {}
    others_start = cpu_s_by_role(pids)
    run_start = time.perf_counter()
    cpu_start = time.process_time()

    async def user_loop(user: int, indices: Sequence[int]) -> None:
        for index in indices:
            record = await measure(target, workload, workload.requests[index], user, run_start)
            run.records.append(record)
            if progress is not None:
                progress.advance()

    try:
        await asyncio.gather(*(user_loop(user, indices) for user, indices in enumerate(schedule)))
    finally:
        gc.unfreeze()  # the next mode's engine and records may be collected again
        if progress is not None:
            progress.close()
    run.duration_s = time.perf_counter() - run_start
    run.client_cpu_s = time.process_time() - cpu_start
    others_end = cpu_s_by_role(pids)
    run.cpu_s = {role: others_end[role] - others_start[role] for role in pids}
    run.records.sort(key=lambda record: record.index)
    return run


async def run_target(
    target: AbstractAsyncContextManager[Any],
    workload: Workload,
    users: int,
    progress: Progress | None,
    watched: WatchedPids | None = None,
) -> ModeRun:
    async with target as entered:
        return await run_users(entered, workload, users, progress, watched)


# --- modes that need their own Redis and worker ---------------------------------------------


@contextmanager
def local_worker(
    env: Mapping[str, str], log_dir: Path, gpu: GpuRate | None = None
) -> Iterator[tuple[WorkerProcess, RedisServer]]:
    """A private redis-server and one ``edgeq worker`` with ``env`` (``edgeq simulate-box`` at
    ``gpu``'s rate if given); both stopped on exit."""
    redis = RedisServer().start()
    try:
        worker_env = {**env, "EDGEQ_REDIS_URL": redis.url, "EDGEQ_QUEUE": BENCH_QUEUE}
        worker = worker_process(worker_env, log_dir / "worker.log", gpu).start()
        try:
            worker.wait_ready()
            yield worker, redis
        finally:
            worker.stop()
    finally:
        redis.stop()


def _pid(process: subprocess.Popen[bytes] | None) -> list[int]:
    return [] if process is None else [process.pid]


def run_plan(
    plan: ModePlan,
    workload: Workload,
    users: int,
    *,
    count_tokens: Callable[[str], int],
    progress: Progress | None = None,
    log_dir: Path | None = None,
) -> ModeRun:
    """Set up one mode, run the workload through it, tear it down; errors end up in the run."""
    try:
        if plan.kind is ModeKind.QUEUE and plan.worker_env is not None:
            log_dir = log_dir or Path(tempfile.mkdtemp(prefix="edgeq-bench-"))
            # Every mode runs the workload's model, whose tokenizer sized the prompts; an env
            # file may name its own (same tokenizer assumed): its values win.
            env = {"EDGEQ_MODEL": workload.model, **plan.worker_env}
            with local_worker(env, log_dir / plan.name, plan.gpu) as (worker, redis):
                settings = load_settings(
                    ConnectionSettings,
                    redis_url=worker.env["EDGEQ_REDIS_URL"],
                    queue=worker.env["EDGEQ_QUEUE"],
                )
                worker_pids = _pid(worker.process)
                pids = {
                    "worker": worker_pids,
                    "engine": [pid for root in worker_pids for pid in engine_pids(root)],
                    "redis": _pid(redis.process),
                }
                target = QueueTarget(settings, plan.name)
                run = asyncio.run(run_target(target, workload, users, progress, lambda: pids))
                simulated = f" on a {plan.gpu.describe()}" if plan.gpu is not None else ""
                return dataclasses.replace(
                    run,
                    target=f"{run.target}{simulated} (worker log {worker.log_path})",
                    worker={"settings": dict(env), "ready": worker.ready_event},
                )
        if plan.kind is ModeKind.QUEUE:
            settings = load_settings(ConnectionSettings)
            return asyncio.run(
                run_target(QueueTarget(settings, plan.name), workload, users, progress)
            )
        if plan.kind is ModeKind.DIRECT:
            from edgeq.worker.settings import WorkerSettings

            direct = DirectTarget(load_settings(WorkerSettings, model=workload.model), plan.gpu)
            # Its engine's processes exist once the target is up: looked up then.
            return asyncio.run(
                run_target(
                    direct, workload, users, progress, lambda: {"engine": engine_pids(os.getpid())}
                )
            )
        if plan.url is None:
            raise ValueError("an OpenAI mode needs the server's URL")
        openai = OpenAITarget(
            plan.url, users=users, model=workload.model, count_tokens=count_tokens, name=plan.name
        )
        return asyncio.run(run_target(openai, workload, users, progress))
    except Exception as error:  # one failed mode must not lose the others
        return ModeRun(
            name=plan.name, target=plan.kind.value, error=f"{type(error).__name__}: {error}"
        )
