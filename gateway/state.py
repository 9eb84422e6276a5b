"""What every request shares, as FastAPI dependencies: the gateway's settings and its one
pooled ChatClient, both held on ``app.state``.

Routes ask for them with ``Depends(...)`` instead of closing over ``create_app``'s locals, so a
route module can be included in any app (a test's included) that sets the same state, and a
test can swap one for a fake with ``app.dependency_overrides``. They are ``async def`` though
they await nothing: FastAPI runs a plain ``def`` dependency in a worker thread, a hop per
request the hot path does not need.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from edgeq.gateway.settings import GatewaySettings
from edgeq.producer.client import ChatClient


async def gateway_settings(request: Request) -> GatewaySettings:
    """The settings ``create_app`` was given (set on ``app.state`` before any request)."""
    settings: GatewaySettings = request.app.state.settings
    return settings


async def chat_client(request: Request) -> ChatClient:
    """The pooled ChatClient the app's lifespan opened (one per process: design knob 6)."""
    client: ChatClient = request.app.state.client
    return client


# For a route's signature: ``settings: SettingsDep`` (Annotated keeps the defaults free).
SettingsDep = Annotated[GatewaySettings, Depends(gateway_settings)]
ClientDep = Annotated[ChatClient, Depends(chat_client)]
