"""The OpenAI-compatible HTTP front, put together: each chat completion becomes one edgeq job.

The gateway is a producer like any other service: it holds one pooled ChatClient and no
model. Its parts each have a room of their own, and ``create_app`` only joins them:

    state.py    the settings and the pooled ChatClient, as FastAPI dependencies
    errors.py   every error answered in OpenAI's shape, and the handlers that make it so
    auth.py     the API key check and the tenant of a request
    door.py     the key checked and the body bounded (size, time) before any body is read
    jobs.py     waiting on a job while its client may leave; cancelling it
    sse.py      a job's events as OpenAI's streamed chunks
    probes.py   /health, /ready
    models.py   /v1/models, and the model names a request may ask for
    chat.py     /v1/chat/completions
    files.py, batches.py  /v1/files, /v1/batches (batch_store.py, batch_runner.py: OpenAI's
                Batch API on the queue, each line a job of the batch class)
    responses.py /v1/responses (response_events.py, response_store.py, response_follower.py,
                webhooks.py: background responses, resumable streams, signed webhooks)

A new OpenAI resource (/v1/files, /v1/batches, /v1/responses) is one more module with an
APIRouter, included below.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from edgeq.gateway import batches, chat, files, models, probes, responses
from edgeq.gateway.batch_runner import running_batches
from edgeq.gateway.door import Door
from edgeq.gateway.errors import install_error_handlers
from edgeq.gateway.models import ModelNames
from edgeq.gateway.response_follower import follow_responses
from edgeq.gateway.settings import GatewaySettings
from edgeq.producer.client import ChatClient


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """One pooled ChatClient for the process's life (and the model names it reads)."""
    settings: GatewaySettings = app.state.settings
    async with ChatClient(settings) as client:
        app.state.client = client
        app.state.models = ModelNames(client, settings)
        async with follow_responses(app, client), running_batches(settings):
            yield


def create_app(settings: GatewaySettings) -> FastAPI:
    app = FastAPI(
        title="edgeq gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    # Set now, not in the lifespan: the API key check needs no Redis (state.py).
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(Door, settings=settings)
    for room in (probes, models, chat, responses, files, batches):
        app.include_router(room.router)
    return app
