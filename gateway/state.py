"""What every request shares, as FastAPI dependencies: the gateway's settings (set when the
app is made: the API key check needs no Redis) and one typed ``GatewayState``, built in the
app's lifespan around its one pooled ChatClient.

Routes ask for them with ``Depends(...)`` instead of closing over ``create_app``'s locals, so a
route module can be included in any app (a test's included) that sets the same state, and a
test can swap one for a fake with ``app.dependency_overrides``. They are ``async def`` though
they await nothing: FastAPI runs a plain ``def`` dependency in a worker thread, a hop per
request the hot path does not need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from edgeq.gateway.settings import GatewaySettings
from edgeq.producer.client import ChatClient
from edgeq.resources.batches.store import BatchStore
from edgeq.resources.model_names import ModelNames
from edgeq.resources.responses.follower import ResponseFollower
from edgeq.resources.responses.store import ResponseStore


@dataclass(frozen=True)
class GatewayState:
    """What the lifespan opens, once per process: the pooled ChatClient (design knob 6), the
    model names it reads, the resources' stores on its Redis, and the response follower."""

    client: ChatClient
    models: ModelNames
    batches: BatchStore
    responses: ResponseStore
    follower: ResponseFollower


def set_settings(app: FastAPI, settings: GatewaySettings) -> None:
    app.state.settings = settings


def set_state(app: FastAPI, state: GatewayState) -> None:
    app.state.gateway = state


async def gateway_settings(request: Request) -> GatewaySettings:
    """The settings ``create_app`` was given (set on ``app.state`` before any request)."""
    settings: GatewaySettings = request.app.state.settings
    return settings


async def gateway_state(request: Request) -> GatewayState:
    """The state the app's lifespan built."""
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(gateway_state)]


async def chat_client(state: StateDep) -> ChatClient:
    return state.client


async def model_names(state: StateDep) -> ModelNames:
    return state.models


async def batch_store(state: StateDep) -> BatchStore:
    return state.batches


async def response_store(state: StateDep) -> ResponseStore:
    return state.responses


async def response_follower(state: StateDep) -> ResponseFollower:
    return state.follower


# For a route's signature: ``settings: SettingsDep`` (Annotated keeps the defaults free).
SettingsDep = Annotated[GatewaySettings, Depends(gateway_settings)]
ClientDep = Annotated[ChatClient, Depends(chat_client)]
ModelNamesDep = Annotated[ModelNames, Depends(model_names)]
BatchStoreDep = Annotated[BatchStore, Depends(batch_store)]
ResponseStoreDep = Annotated[ResponseStore, Depends(response_store)]
FollowerDep = Annotated[ResponseFollower, Depends(response_follower)]
