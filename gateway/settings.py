"""The gateway's settings: where it listens and who may call it, on top of the settings of
OpenAI's resources (edgeq.resources.settings) and the connection settings every edgeq process
shares (same EDGEQ_* variables, same .env)."""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Annotated, Any, NamedTuple

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from edgeq.core.logs import LogLevel
from edgeq.core.scheduling import TENANT_PATTERN
from edgeq.resources.settings import CommaList, ResourceSettings

#: What a JSON body may hold beyond the job's payload (EDGEQ_MAX_REQUEST_BYTES): the fields
#: edgeq ignores and the framing its payload drops.
JSON_MARGIN_BYTES = 64 * 1024

#: (owner, key) pairs, from ``tenant=key,tenant:name=key``: the owner is the tenant, or the
#: tenant and the key's name; checked by the model validator, whose errors are the only ones
#: that never echo the raw value (it holds the keys).
TenantKeys = Annotated[list[tuple[str, str]], NoDecode]


@functools.lru_cache(maxsize=1024)  # the configured keys': job_keys runs once per request
def derived_key_name(key: str) -> str:
    """The name of a key given none (every EDGEQ_GATEWAY_API_KEYS key, and a tenant key
    without ``:name``): ``key-`` and 12 hex digits of its SHA-256. It tells keys apart in
    their limits and the usage ledger, and gives the key away to nobody."""
    return f"key-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


class JobKey(NamedTuple):
    """A key accepted on the job routes: the tenant it fixes (None: a plain key, whose caller
    names the tenant) and its name, which its jobs carry (``key_name``)."""

    key: str
    tenant: str | None
    name: str


class GatewaySettings(ResourceSettings):
    """What the HTTP front adds to the resources' settings: where it listens, who may call it."""

    gateway_host: str = Field(
        "127.0.0.1", min_length=1, description="Address to listen on (loopback by default)."
    )
    gateway_port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    gateway_api_keys: CommaList = Field(
        default_factory=list,
        repr=False,  # never shown, in an error either (core/settings.py)
        description="Comma-separated bearer tokens; when set, /v1/* needs one of them.",
    )
    gateway_tenant_keys: TenantKeys = Field(
        default_factory=list,
        repr=False,
        description=(
            "Comma-separated tenant=key or tenant:name=key entries: each key is accepted "
            "like one of EDGEQ_GATEWAY_API_KEYS and fixes the tenant of every request made "
            "with it; its name (default: key- and 12 hex digits of its SHA-256) is the one "
            "EDGEQ_KEY_RPM and the other key limits, and the usage ledger, know it by."
        ),
    )
    gateway_admin_keys: CommaList = Field(
        default_factory=list,
        repr=False,
        description=(
            "Comma-separated bearer tokens for the operator's route, GET /v1/usage (every "
            "tenant's usage); accepted nowhere else."
        ),
    )
    gateway_workers: int = Field(
        1, ge=1, le=64, description="Gateway processes serving the port (`--workers` wins)."
    )
    gateway_retry_after_s: int = Field(
        1, ge=1, description="Retry-After (seconds) sent with 429 when the queue is full."
    )
    gateway_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long open requests may still finish."
    )
    # The door (gateway/door.py): what a request may cost before its body is read.
    gateway_max_body_bytes: int | None = Field(
        None,
        ge=1024,
        description=(
            "Largest JSON request body, in bytes, as sent (\\u escapes count as sent); "
            "unset: EDGEQ_MAX_REQUEST_BYTES plus 64 KiB of JSON framing. Bigger bodies get 413 "
            "before they are read."
        ),
    )
    gateway_body_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "A request's body must have arrived this long after the request began (else 408)."
        ),
    )
    log_level: LogLevel = "info"

    @field_validator("gateway_api_keys", "gateway_admin_keys", mode="before")
    @classmethod
    def _split_api_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("gateway_tenant_keys", mode="before")
    @classmethod
    def _split_tenant_keys(cls, value: Any) -> Any:
        """``a=k1,b=k2`` -> [("a", "k1"), ("b", "k2")], split at each entry's first "=" (keys
        may end in base64 padding); a {tenant: key} mapping is taken too. Never raises: a
        field error would print the value, keys and all (see _check_tenant_keys)."""
        if isinstance(value, dict):
            return [(str(tenant), str(key)) for tenant, key in value.items()]
        if isinstance(value, str):
            entries = (item.strip() for item in value.split(","))
            return [tuple(part.strip() for part in item.partition("=")[::2]) for item in entries
                    if item]  # fmt: skip
        return value

    @model_validator(mode="after")
    def _check_tenant_keys(self) -> GatewaySettings:
        setting = "EDGEQ_GATEWAY_TENANT_KEYS"
        tenant_of: dict[str, str] = {}
        for number, (owner, key) in enumerate(self.gateway_tenant_keys, start=1):
            if not owner or not key:
                raise ValueError(f"{setting}: entry {number} is not tenant=key")
            tenant, colon, name = owner.partition(":")
            if not all(re.fullmatch(TENANT_PATTERN, part) for part in (tenant, name or tenant)):
                # Not echoed: with tenant and key swapped, it would be (most of) the key.
                raise ValueError(
                    f"{setting}: entry {number}: the part before its first '=' is not a tenant "
                    f"name, or tenant:name (each up to 64 letters, digits, '_', '.' or '-', "
                    f"starting with a letter or digit)"
                )
            if colon and not name:
                raise ValueError(f"{setting}: entry {number}: a ':' with no key name after it")
            if tenant_of.setdefault(key, tenant) != tenant:
                raise ValueError(
                    f"{setting}: entry {number} gives tenant {tenant!r} the key of tenant "
                    f"{tenant_of[key]!r}; each key may fix one tenant only"
                )
            if key in self.gateway_api_keys:
                raise ValueError(
                    f"{setting}: the key of entry {number} (tenant {tenant!r}) is also in "
                    f"EDGEQ_GATEWAY_API_KEYS; give it in one of the two"
                )
        return self

    @model_validator(mode="after")
    def _check_key_names(self) -> GatewaySettings:
        """A key's name stands for it alone in limits and the ledger: two keys, one name
        is refused (the same key given twice, as tenant=key entries, is one key)."""
        key_of: dict[str, str] = {}
        name_of: dict[str, str] = {}
        for key, _, name in self.job_keys:
            if key_of.setdefault(name, key) != key:
                raise ValueError(
                    f"EDGEQ_GATEWAY_TENANT_KEYS: the key name {name!r} is given to two keys; "
                    f"each key needs a name of its own"
                )
            if name_of.setdefault(key, name) != name:
                raise ValueError(
                    f"EDGEQ_GATEWAY_TENANT_KEYS: one key is named both {name_of[key]!r} and "
                    f"{name!r}; give each key one name"
                )
        return self

    @model_validator(mode="after")
    def _check_admin_keys(self) -> GatewaySettings:
        """An admin key is nobody's job key: it reads every tenant's usage and sends nothing."""
        job_keys = {*self.gateway_api_keys, *(key for _, key in self.gateway_tenant_keys)}
        for number, key in enumerate(self.gateway_admin_keys, start=1):
            if key in job_keys:
                raise ValueError(
                    f"EDGEQ_GATEWAY_ADMIN_KEYS: key {number} is also in EDGEQ_GATEWAY_API_KEYS "
                    f"or EDGEQ_GATEWAY_TENANT_KEYS; an admin key must be a key of its own"
                )
        return self

    @property
    def json_body_max_bytes(self) -> int:
        """The largest JSON body the door lets in (door.py)."""
        if self.gateway_max_body_bytes is not None:
            return self.gateway_max_body_bytes
        return self.max_request_bytes + JSON_MARGIN_BYTES

    @property
    def job_keys(self) -> list[JobKey]:
        """Every key accepted on the job routes, with its tenant and name."""
        keys = [JobKey(key, None, derived_key_name(key)) for key in self.gateway_api_keys]
        for owner, key in self.gateway_tenant_keys:
            tenant, _, name = owner.partition(":")
            keys.append(JobKey(key, tenant, name or derived_key_name(key)))
        return keys

    @property
    def auth_required(self) -> bool:
        """Whether the job routes need a key (EDGEQ_GATEWAY_API_KEYS or _TENANT_KEYS set)."""
        return bool(self.gateway_api_keys or self.gateway_tenant_keys)

    @property
    def any_keys(self) -> bool:
        """Whether any key is configured: then GET /v1/usage needs an admin or tenant key."""
        return self.auth_required or bool(self.gateway_admin_keys)
