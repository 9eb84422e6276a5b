"""``/v1/models`` (OpenAI's Models resource): the model names the gateway accepts
(edgeq.resources.model_names, which says where the names come from)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from edgeq.core.errors import RedisUnavailable
from edgeq.gateway.auth import require_api_key
from edgeq.gateway.errors import client_error
from edgeq.gateway.state import ModelNamesDep
from edgeq.resources.openai_api import now_s

router = APIRouter()


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
