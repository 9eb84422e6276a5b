"""``/v1/batches``: OpenAI's Batches resource. A batch is validated when it is created (a bad
line fails it, naming the line, and nothing runs) and then run by whichever gateway's
BatchRunner takes it (resources/batches/runner.py); a tenant sees only its own batches."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ConfigDict

from edgeq.gateway.auth import KeyNameDep, TenantDep
from edgeq.gateway.errors import batch_api_errors
from edgeq.gateway.state import BatchStoreDep, ModelNamesDep
from edgeq.resources.batches.store import BATCHES_LIMIT, COMPLETION_WINDOW, ENDPOINT
from edgeq.resources.openai_api import Metadata, RequestBody, list_json

router = APIRouter()


class CreateBatch(RequestBody):
    model_config = ConfigDict(extra="allow")  # output_expires_after and what SDKs add

    input_file_id: str
    endpoint: str = ENDPOINT
    completion_window: str = COMPLETION_WINDOW
    metadata: Metadata | None = None


@router.post("/v1/batches")
async def create_batch(
    store: BatchStoreDep,
    body: CreateBatch,
    tenant: TenantDep,
    key_name: KeyNameDep,
    models: ModelNamesDep,
) -> dict[str, Any]:
    with batch_api_errors():
        batch = await store.create_batch(
            tenant,
            body.input_file_id,
            key_name=key_name,
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            metadata=body.metadata,
            models=await models.names(),
        )
    return batch.model_dump(mode="json")


@router.get("/v1/batches")
async def list_batches(
    store: BatchStoreDep,
    tenant: TenantDep,
    after: str | None = None,
    limit: int = BATCHES_LIMIT.default,
    order: str = "desc",
) -> dict[str, Any]:
    with batch_api_errors():
        batches, more = await store.list_batches(
            tenant,
            after=after,
            limit=limit,
            order=order,  # type: ignore[arg-type]
        )
    return list_json([batch.model_dump(mode="json") for batch in batches], more)


@router.get("/v1/batches/{batch_id}")
async def get_batch(store: BatchStoreDep, tenant: TenantDep, batch_id: str) -> dict[str, Any]:
    with batch_api_errors():
        batch = await store.get_batch(tenant, batch_id)
    return batch.model_dump(mode="json")


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(store: BatchStoreDep, tenant: TenantDep, batch_id: str) -> dict[str, Any]:
    with batch_api_errors():
        batch = await store.cancel_batch(tenant, batch_id)
    return batch.model_dump(mode="json")
