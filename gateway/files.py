"""``/v1/files``: OpenAI's Files resource, for batch input (purpose ``batch``) and the output
files batches write (``batch_output``). Kept in Redis by edgeq.resources.batches.store; a
tenant sees only its own files."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from edgeq.gateway.auth import TenantDep
from edgeq.gateway.errors import ApiError, batch_api_errors
from edgeq.gateway.state import BatchStoreDep, SettingsDep
from edgeq.resources.batches.store import FILES_LIMIT
from edgeq.resources.openai_api import list_json

router = APIRouter()


@router.post("/v1/files")
async def create_file(
    request: Request, tenant: TenantDep, settings: SettingsDep, store: BatchStoreDep
) -> dict[str, Any]:
    # Read here, not as FastAPI's File()/Form() parameters, so that one file part is all an
    # upload may carry: a second is refused before it is spooled. (The door, door.py, has
    # bounded the whole body already.)
    try:
        form = await request.form(max_files=1, max_fields=1)
    except HTTPException as error:
        raise ApiError(
            400,
            f"body: {error.detail} (an upload is one file part and a purpose field)",
            type="invalid_request_error",
            code="invalid_multipart",
            param="file",
        ) from None
    try:
        file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(file, UploadFile):
            raise _missing("file", "a file part named 'file'")
        if not isinstance(purpose, str):
            raise _missing("purpose", "a form field 'purpose' ('batch')")
        size = file.size if file.size is not None else 0
        if size > settings.gateway_file_max_bytes:
            raise ApiError(
                413,
                f"file: {size} bytes, more than the {settings.gateway_file_max_bytes} allowed "
                f"(EDGEQ_GATEWAY_FILE_MAX_BYTES)",
                type="invalid_request_error",
                code="file_too_large",
                param="file",
            )
        content = await file.read()
    finally:
        await form.close()  # the spooled file goes now, not at garbage collection
    with batch_api_errors():
        created = await store.create_file(tenant, file.filename or "upload.jsonl", purpose, content)
    return created.model_dump(mode="json")


def _missing(param: str, what: str) -> ApiError:
    return ApiError(
        400,
        f"{param}: missing; an upload is multipart/form-data with {what}",
        type="invalid_request_error",
        code="invalid_request",
        param=param,
    )


@router.get("/v1/files")
async def list_files(
    store: BatchStoreDep,
    tenant: TenantDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = FILES_LIMIT.default,
    order: str = "desc",
) -> dict[str, Any]:
    with batch_api_errors():
        files, more = await store.list_files(
            tenant,
            purpose,
            after=after,
            limit=limit,
            order=order,  # type: ignore[arg-type]
        )
    return list_json([file.model_dump(mode="json") for file in files], more)


@router.get("/v1/files/{file_id}")
async def get_file(store: BatchStoreDep, tenant: TenantDep, file_id: str) -> dict[str, Any]:
    with batch_api_errors():
        file = await store.get_file(tenant, file_id)
    return file.model_dump(mode="json")


@router.get("/v1/files/{file_id}/content")
async def file_content(store: BatchStoreDep, tenant: TenantDep, file_id: str) -> Response:
    with batch_api_errors():
        content = await store.file_content(tenant, file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(store: BatchStoreDep, tenant: TenantDep, file_id: str) -> dict[str, Any]:
    with batch_api_errors():
        await store.delete_file(tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
