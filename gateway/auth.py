"""Who is calling: the API key check (EDGEQ_GATEWAY_API_KEYS, EDGEQ_GATEWAY_TENANT_KEYS), the
tenant a request's job runs as, and whose usage a caller may read (EDGEQ_GATEWAY_ADMIN_KEYS), as
FastAPI dependencies.

A job's tenant (edgeq.core.scheduling) is the one its API key fixes, else the one the
X-Edgeq-Tenant header names, else (None here) the client's EDGEQ_TENANT. With no keys set, auth
is off and every request is let in.

An admin key is the operator's: it is accepted on ADMIN_PATHS only, where it reads every
tenant's usage; a tenant key reads its own tenant's there, and a plain key none (it names any
tenant it likes with X-Edgeq-Tenant, so it proves no tenant).
"""

from __future__ import annotations

import re
import secrets
from typing import Annotated

from fastapi import Depends, Request

from edgeq.core.scheduling import TENANT_PATTERN
from edgeq.gateway.errors import ApiError
from edgeq.gateway.settings import GatewaySettings, JobKey
from edgeq.gateway.state import SettingsDep

#: The tenant of a request whose API key fixes none (EDGEQ_GATEWAY_API_KEYS, or no keys).
TENANT_HEADER = "X-Edgeq-Tenant"
#: The operator's routes: the only ones an admin key (EDGEQ_GATEWAY_ADMIN_KEYS) is accepted on.
ADMIN_PATHS = frozenset({"/v1/usage"})


def key_of(settings: GatewaySettings, authorization: str) -> tuple[bool, JobKey | None]:
    """Whether ``authorization`` (the header's value) carries an accepted job key, and which
    (its tenant, None for a plain key, and its name). With no keys configured every request
    is accepted, with no key."""
    job_keys = settings.job_keys
    if not job_keys:
        return True, None
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    # Compared with every key, so the time taken does not tell which one matched.
    matched = [job for job in job_keys if secrets.compare_digest(given, job.key.encode())]
    if scheme.lower() != "bearer" or not matched:
        return False, None
    return True, matched[0]


def key_tenant(settings: GatewaySettings, authorization: str) -> tuple[bool, str | None]:
    """Whether ``authorization`` carries an accepted job key, and the tenant that key fixes
    (None: a plain key, or no keys configured)."""
    accepted, job_key = key_of(settings, authorization)
    return accepted, job_key.tenant if job_key is not None else None


def is_admin_key(settings: GatewaySettings, authorization: str) -> bool:
    """Whether ``authorization`` carries one of EDGEQ_GATEWAY_ADMIN_KEYS (compared with each)."""
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    matched = [secrets.compare_digest(given, key.encode()) for key in settings.gateway_admin_keys]
    return scheme.lower() == "bearer" and any(matched)


def accepted_at(settings: GatewaySettings, path: str, authorization: str) -> bool:
    """Whether the door lets a request for ``path`` in: on ADMIN_PATHS an admin key or a job
    key (the route then decides what it may read), open only with no key configured at all;
    elsewhere a job key, open with none of those configured."""
    if path in ADMIN_PATHS:
        if not settings.any_keys or is_admin_key(settings, authorization):
            return True
        return settings.auth_required and key_tenant(settings, authorization)[0]
    return key_tenant(settings, authorization)[0]


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


async def require_job_key(request: Request, settings: SettingsDep) -> JobKey | None:
    """The caller's job key (None when auth is off), matched once per request: FastAPI
    shares this dependency's answer with every other that needs it. (The door, door.py, has
    refused a wrong key before the body was read; this is for the key's tenant and name, and
    for an app built without the door.)"""
    accepted, job_key = key_of(settings, request.headers.get("authorization", ""))
    if not accepted:
        raise unauthorized()
    return job_key


#: The caller's job key, for the dependencies below.
JobKeyDep = Annotated[JobKey | None, Depends(require_job_key)]


async def require_api_key(job_key: JobKeyDep) -> str | None:
    """The tenant the caller's key fixes; None for a plain key or when auth is off."""
    return job_key.tenant if job_key is not None else None


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


async def request_key_name(job_key: JobKeyDep) -> str | None:
    """The name of the caller's key, which its jobs carry (``key_name``: the key's own limits
    and ledger rows); None when auth is off."""
    return job_key.name if job_key is not None else None


#: For a route's signature: the name of the key its jobs are sent with (None: no keys).
KeyNameDep = Annotated[str | None, Depends(request_key_name)]


async def usage_readable_by(request: Request, settings: SettingsDep) -> str | None:
    """Whose usage the caller may read: None for every tenant's (an admin key, or no key
    configured at all), else the one tenant its tenant key fixes."""
    authorization = request.headers.get("authorization", "")
    if not settings.any_keys or is_admin_key(settings, authorization):
        return None
    accepted, tenant = key_tenant(settings, authorization)
    if not settings.auth_required or not accepted:
        raise unauthorized()
    if tenant is None:
        raise ApiError(
            403,
            "reading usage needs an admin key (EDGEQ_GATEWAY_ADMIN_KEYS) or a tenant key "
            "(EDGEQ_GATEWAY_TENANT_KEYS, its own tenant's usage); this key sends jobs only",
            type="permission_error",
            code="admin_key_required",
        )
    return tenant


#: For the usage route's signature: None (every tenant) or the caller's own tenant.
UsageReaderDep = Annotated[str | None, Depends(usage_readable_by)]
