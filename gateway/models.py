"""``/v1/models`` (OpenAI's Models resource) and the model names the gateway accepts.

The names are EDGEQ_MODEL, its aliases (EDGEQ_GATEWAY_MODEL_ALIASES) and whatever the live
workers serve (read from their heartbeats, briefly cached); a chat completion naming any other
model is refused (chat.py). Not pydantic models: those are in openai_api.py.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from edgeq.core.connection import redis_errors
from edgeq.core.errors import RedisUnavailable
from edgeq.core.registry import live_workers
from edgeq.gateway.auth import require_api_key
from edgeq.gateway.errors import client_error
from edgeq.gateway.openai_api import now_s
from edgeq.gateway.settings import GatewaySettings
from edgeq.producer.client import ChatClient

#: How long the list of models the live workers serve is reused before Redis is asked again.
MODEL_NAMES_TTL_S = 2.0

router = APIRouter()


class ModelNames:
    """The model names the gateway accepts: EDGEQ_MODEL, its aliases, and what live workers
    serve (read from their heartbeats, briefly cached)."""

    def __init__(self, client: ChatClient, settings: GatewaySettings) -> None:
        self._client = client
        self._configured = [settings.model, *settings.gateway_model_aliases]
        self._served: list[str] = []
        self._read_at = float("-inf")

    async def names(self) -> list[str]:
        if time.monotonic() - self._read_at > MODEL_NAMES_TTL_S:
            settings = self._client.settings
            with redis_errors(settings.redis_url):
                workers = await live_workers(self._client.redis, settings.queue)
            self._served = [worker.model for worker in workers]
            self._read_at = time.monotonic()
        return list(dict.fromkeys([*self._configured, *self._served]))


async def model_names(request: Request) -> ModelNames:
    """The app's ModelNames (its lifespan makes one next to the ChatClient)."""
    names: ModelNames = request.app.state.models
    return names


ModelNamesDep = Annotated[ModelNames, Depends(model_names)]


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def models(names: ModelNamesDep) -> dict[str, Any]:
    try:
        served = await names.names()
    except RedisUnavailable as error:
        raise client_error(error) from None
    created = now_s()
    data = [{"id": name, "object": "model", "created": created, "owned_by": "edgeq"}
            for name in served]  # fmt: skip
    return {"object": "list", "data": data}
