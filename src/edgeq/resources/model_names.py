"""The model names a request may ask for.

The names are EDGEQ_MODEL, its aliases (EDGEQ_GATEWAY_MODEL_ALIASES), whatever the live
workers serve (read from their heartbeats, briefly cached) and the LoRA adapters (registered
for the queue or served by a live worker), as vLLM's own server lists them; a request naming
any other model is refused (submit.py), one naming an adapter answers with it. Not pydantic
models: those are in openai_api.py.
"""

from __future__ import annotations

import time

from edgeq.core.adapters import registered
from edgeq.core.connection import redis_errors
from edgeq.core.registry import live_workers
from edgeq.producer.client import ChatClient
from edgeq.resources.settings import ResourceSettings

#: How long the list of models the live workers serve is reused before Redis is asked again.
MODEL_NAMES_TTL_S = 2.0


class ModelNames:
    """The model names the gateway accepts: EDGEQ_MODEL, its aliases, and what live workers
    serve (read from their heartbeats, briefly cached)."""

    def __init__(self, client: ChatClient, settings: ResourceSettings) -> None:
        self._client = client
        self._configured = [settings.model, *settings.gateway_model_aliases]
        self._served: list[str] = []
        self._adapters: list[str] = []
        self._read_at = float("-inf")

    async def names(self) -> list[str]:
        """Every name accepted as ``model``: the base model's, then the adapters'."""
        await self._refresh()
        return list(dict.fromkeys([*self._configured, *self._served, *self._adapters]))

    async def adapters(self) -> list[str]:
        """The LoRA adapters' names: registered for the queue, or served by a live worker
        from its own settings (core/adapters.py). A ``model`` naming one asks for it."""
        await self._refresh()
        return list(self._adapters)

    async def _refresh(self) -> None:
        if time.monotonic() - self._read_at > MODEL_NAMES_TTL_S:
            settings = self._client.settings
            with redis_errors(settings.redis_url):
                workers = await live_workers(self._client.redis, settings.queue)
                adapters = await registered(self._client.redis, settings.queue)
            self._served = [worker.model for worker in workers]
            served = (name for worker in workers for name in worker.adapters)
            self._adapters = sorted({*adapters, *served})
            self._read_at = time.monotonic()
