"""Who is calling: the API key check (EDGEQ_GATEWAY_API_KEYS, EDGEQ_GATEWAY_TENANT_KEYS) and the
tenant a request's job runs as, both as FastAPI dependencies.

A job's tenant (edgeq.core.scheduling) is the one its API key fixes, else the one the
X-Edgeq-Tenant header names, else (None here) the client's EDGEQ_TENANT. With no keys set, auth
is off and every request is let in.
"""

from __future__ import annotations

import re
import secrets
from typing import Annotated

from fastapi import Depends, Request

from edgeq.core.scheduling import TENANT_PATTERN
from edgeq.gateway.errors import ApiError
from edgeq.gateway.settings import GatewaySettings
from edgeq.gateway.state import SettingsDep

#: The tenant of a request whose API key fixes none (EDGEQ_GATEWAY_API_KEYS, or no keys).
TENANT_HEADER = "X-Edgeq-Tenant"


def accepted_keys(settings: GatewaySettings) -> list[tuple[bytes, str | None]]:
    """Every accepted key with the tenant it fixes (None: a plain EDGEQ_GATEWAY_API_KEYS key)."""
    return [
        *((key.encode(), None) for key in settings.gateway_api_keys),
        *((key.encode(), tenant) for tenant, key in settings.gateway_tenant_keys),
    ]


def key_tenant(settings: GatewaySettings, authorization: str) -> tuple[bool, str | None]:
    """Whether ``authorization`` (the header's value) carries an accepted key, and the tenant
    that key fixes (None: a plain key). With no keys configured every request is accepted."""
    api_keys = accepted_keys(settings)
    if not api_keys:
        return True, None
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    # Compared with every key, so the time taken does not tell which one matched.
    matched = [tenant for key, tenant in api_keys if secrets.compare_digest(given, key)]
    if scheme.lower() != "bearer" or not matched:
        return False, None
    return True, matched[0]


def unauthorized() -> ApiError:
    """The 401 for a missing or wrong key; ``WWW-Authenticate`` says which scheme to use."""
    return ApiError(
        401,
        "missing or wrong API key: send 'Authorization: Bearer <key>' with one of "
        "EDGEQ_GATEWAY_API_KEYS or EDGEQ_GATEWAY_TENANT_KEYS",
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


async def require_api_key(request: Request, settings: SettingsDep) -> str | None:
    """The tenant the caller's key fixes; None for a plain key or when auth is off. (The
    door, door.py, has refused a wrong key before the body was read; this is for the tenant,
    and for an app built without the door.)"""
    accepted, tenant = key_tenant(settings, request.headers.get("authorization", ""))
    if not accepted:
        raise unauthorized()
    return tenant


async def request_tenant(
    request: Request, key_tenant: Annotated[str | None, Depends(require_api_key)]
) -> str | None:
    """The job's tenant: the key's, else X-Edgeq-Tenant's; None leaves it to EDGEQ_TENANT."""
    named = request.headers.get(TENANT_HEADER)
    if named is not None and not re.fullmatch(TENANT_PATTERN, named):
        shown = repr(named) if len(named) <= 70 else f"{named[:67]!r}..."
        raise ApiError(
            400,
            f"{TENANT_HEADER}: {shown} is not a tenant name (up to 64 letters, digits, "
            f"'_', '.' or '-', starting with a letter or digit)",
            type="invalid_request_error",
            code="invalid_tenant",
        )
    # A tenant key speaks for its tenant only: naming another one is refused, not ignored.
    if key_tenant is not None and named is not None and named != key_tenant:
        raise ApiError(
            403,
            f"{TENANT_HEADER}: this API key sends tenant {key_tenant!r}'s requests "
            f"(EDGEQ_GATEWAY_TENANT_KEYS), not {named!r}'s; leave the header out or "
            f"use {named!r}'s key",
            type="permission_error",
            code="tenant_mismatch",
        )
    return key_tenant or named


#: For a route's signature: the tenant its job runs as (None: the client's EDGEQ_TENANT).
TenantDep = Annotated[str | None, Depends(request_tenant)]
