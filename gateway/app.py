"""The OpenAI-compatible HTTP front, put together: each chat completion becomes one edgeq job.

The gateway is a producer like any other service: it holds one pooled ChatClient and no
model. Its parts each have a room of their own, and ``create_app`` only joins them:

    state.py    the settings and the state the lifespan builds, as FastAPI dependencies
    errors.py   every error answered in OpenAI's shape, and the handlers that make it so
    auth.py     the API key check and the tenant of a request
    door.py     the key checked and the body bounded (size, time) before any body is read
    jobs.py     waiting on a job while its client may leave; cancelling it
    sse.py      a job's events as OpenAI's streamed chunks
    probes.py   /health, /ready
    models.py   /v1/models
    chat.py     /v1/chat/completions
    files.py, batches.py  /v1/files, /v1/batches (OpenAI's Batch API on the queue, each line
                a job of the batch class: edgeq.resources.batches)
    responses.py /v1/responses (background responses, resumable streams, signed webhooks:
                edgeq.resources.responses, edgeq.resources.webhooks)
    usage.py    /v1/usage (the usage ledger, edgeq.core.ledger: the operator's admin key)

What a resource does without HTTP (its store, its runner, its wire format) lives in the
resources wing (edgeq.resources); a new OpenAI resource is one more module there and one
more module here with an APIRouter, included below.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from edgeq.gateway import batches, chat, files, models, probes, responses, usage
from edgeq.gateway.door import Door
from edgeq.gateway.errors import install_error_handlers
from edgeq.gateway.settings import GatewaySettings
from edgeq.gateway.state import GatewayState, set_settings, set_state
from edgeq.producer.client import ChatClient
from edgeq.resources.batches.runner import running_batches
from edgeq.resources.batches.store import BatchStore
from edgeq.resources.model_names import ModelNames
from edgeq.resources.responses.follower import follow_responses


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """One pooled ChatClient for the process's life, and the state built around it."""
    settings: GatewaySettings = app.state.settings
    async with ChatClient(settings) as client:
        async with follow_responses(client, settings) as follower, running_batches(settings):
            state = GatewayState(
                client=client,
                models=ModelNames(client, settings),
                batches=BatchStore(client.redis, settings),
                responses=follower.store,
                follower=follower,
            )
            set_state(app, state)
            yield


def create_app(settings: GatewaySettings) -> FastAPI:
    app = FastAPI(
        title="edgeq gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    # Set now, not in the lifespan: the API key check needs no Redis (state.py).
    set_settings(app, settings)
    install_error_handlers(app)
    app.add_middleware(Door, settings=settings)
    for room in (probes, models, chat, responses, files, batches, usage):
        app.include_router(room.router)
    return app
