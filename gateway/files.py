"""``/v1/files``: OpenAI's Files resource, for batch input (purpose ``batch``) and the output
files batches write (``batch_output``). Kept in Redis by batch_store.py; a tenant sees only its
own files."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response

from edgeq.core.errors import EdgeqError
from edgeq.gateway.auth import TenantDep
from edgeq.gateway.batch_store import FILES_LIMIT, BatchApiError, BatchStore
from edgeq.gateway.errors import ApiError, client_error
from edgeq.gateway.state import SettingsDep

router = APIRouter()


@contextmanager
def batch_api_errors() -> Iterator[None]:
    """What the Files/Batches API refuses (and Redis being away) as OpenAI's errors."""
    try:
        yield
    except BatchApiError as error:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            error.status, "invalid_request_error"
        )
        raise ApiError(
            error.status,
            str(error),
            type=kind,
            code=error.code,  # type: ignore[arg-type]
            param=error.param,
        ) from None
    except EdgeqError as error:
        raise client_error(error) from None


async def batch_store(request: Request) -> BatchStore:
    """One BatchStore per app, on the pooled ChatClient's Redis (made at the first use)."""
    store: BatchStore | None = getattr(request.app.state, "batch_store", None)
    if store is None:
        store = BatchStore(request.app.state.client.redis, request.app.state.settings)
        request.app.state.batch_store = store
    return store


def _list(data: list[Any], has_more: bool = False) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


@router.post("/v1/files")
async def create_file(
    request: Request,
    tenant: TenantDep,
    settings: SettingsDep,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
) -> dict[str, Any]:
    # One byte over the limit is enough to refuse it: the rest is never read.
    content = await file.read(settings.gateway_file_max_bytes + 1)
    if len(content) > settings.gateway_file_max_bytes:
        content += b"x"  # "more than the limit" is all the message can say of its size
    with batch_api_errors():
        store = await batch_store(request)
        created = await store.create_file(tenant, file.filename or "upload.jsonl", purpose, content)
    return created.model_dump(mode="json")


@router.get("/v1/files")
async def list_files(
    request: Request,
    tenant: TenantDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = FILES_LIMIT.default,
    order: str = "desc",
) -> dict[str, Any]:
    with batch_api_errors():
        files, more = await (await batch_store(request)).list_files(
            tenant,
            purpose,
            after=after,
            limit=limit,
            order=order,  # type: ignore[arg-type]
        )
    return _list([file.model_dump(mode="json") for file in files], more)


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, tenant: TenantDep, file_id: str) -> dict[str, Any]:
    with batch_api_errors():
        file = await (await batch_store(request)).get_file(tenant, file_id)
    return file.model_dump(mode="json")


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, tenant: TenantDep, file_id: str) -> Response:
    with batch_api_errors():
        content = await (await batch_store(request)).file_content(tenant, file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, tenant: TenantDep, file_id: str) -> dict[str, Any]:
    with batch_api_errors():
        await (await batch_store(request)).delete_file(tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
