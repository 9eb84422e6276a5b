"""The gateway's settings: where it listens and who may call it, on top of the connection
settings every edgeq process shares (same EDGEQ_* variables, same .env)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from edgeq.core.logs import LogLevel
from edgeq.core.scheduling import TENANT_PATTERN
from edgeq.core.settings import ConnectionSettings

#: What a JSON body may hold beyond the job's payload (EDGEQ_MAX_REQUEST_BYTES): the fields
#: edgeq ignores and the framing its payload drops.
JSON_MARGIN_BYTES = 64 * 1024

CommaList = Annotated[list[str], NoDecode]
#: (tenant, key) pairs, from ``tenant=key,tenant=key``; checked by the model validator, whose
#: errors are the only ones that never echo the raw value (it holds the keys).
TenantKeys = Annotated[list[tuple[str, str]], NoDecode]


class WebhookEndpoint(BaseModel):
    """One operator-configured webhook receiver (EDGEQ_GATEWAY_WEBHOOKS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://")
    #: The signing secret: OpenAI's ``whsec_<base64>``, or any other string used as it is.
    secret: str = Field(min_length=8, repr=False)
    #: Only this tenant's responses; None: every tenant's.
    tenant: str | None = Field(None, pattern=TENANT_PATTERN)


class GatewaySettings(ConnectionSettings):
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
            "Comma-separated tenant=key entries: each key is accepted like one of "
            "EDGEQ_GATEWAY_API_KEYS and fixes the tenant of every request made with it."
        ),
    )
    model: str = Field(
        "Qwen/Qwen3-0.6B",
        min_length=1,
        description="The model name clients ask for (the workers' EDGEQ_MODEL).",
    )
    gateway_model_aliases: CommaList = Field(
        default_factory=list,
        description="Other model names accepted for the same model, e.g. Qwen-0.6B.",
    )
    # OpenAI's Responses API and its webhooks (gateway/responses.py, docs/responses.md).
    gateway_workers: int = Field(
        1, ge=1, le=64, description="Gateway processes serving the port (`--workers` wins)."
    )
    gateway_response_ttl_s: float = Field(
        86400.0, gt=0, description="How long a stored response (/v1/responses) is kept."
    )
    gateway_response_lease_s: float = Field(
        10.0,
        gt=0,
        description=(
            "A stored response whose follower (a gateway) is silent this long is followed by "
            "another, which sends its webhooks."
        ),
    )
    gateway_webhooks: list[WebhookEndpoint] = Field(
        default_factory=list,
        repr=False,  # their secrets
        description=(
            'JSON list of webhook endpoints, [{"url": ..., "secret": "whsec_...", "tenant": '
            "...}]: each gets every ended response (or only its tenant's), signed with its secret."
        ),
    )
    gateway_webhook_retry_s: float = Field(
        259200.0, gt=0, description="How long a webhook is retried before it is given up (72 h)."
    )
    gateway_webhook_backoff_s: float = Field(
        5.0, gt=0, description="Wait before a webhook's first retry; doubled after each failure."
    )
    gateway_webhook_timeout_s: float = Field(
        10.0, gt=0, description="How long one webhook attempt may take."
    )
    gateway_webhook_concurrency: int = Field(
        4, ge=1, description="Attempts in flight to one endpoint, per gateway process."
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
    # OpenAI's Files and Batches (gateway/batch_store.py, docs/batches.md).
    gateway_file_max_bytes: int = Field(
        32_000_000, ge=1024, description="Largest file /v1/files accepts, in bytes (else 413)."
    )
    gateway_file_max_lines: int = Field(
        50_000, ge=1, description="Most lines (requests) in one batch input file."
    )
    gateway_files_per_tenant: int = Field(
        20,
        ge=1,
        description=(
            "Most files one tenant may keep at once, uploads and batch output together (an "
            "upload at the cap is refused; a batch's output is always written and counted)."
        ),
    )
    gateway_bytes_per_tenant: int = Field(
        128_000_000,
        ge=1024,
        description=(
            "Most bytes one tenant may keep in Redis: its files' contents and its running "
            "batches' validated lines (an upload or a batch that would pass it is refused)."
        ),
    )
    gateway_batches_per_tenant: int = Field(
        4, ge=1, description="Most batches of one tenant not finished yet (in progress)."
    )
    gateway_file_retention_s: float = Field(
        7 * 86400.0,
        gt=0,
        description=(
            "How long files (uploads, batch output) and finished batches are kept in Redis."
        ),
    )
    gateway_batch_window: int = Field(
        64,
        ge=1,
        description=(
            "Most lines of one batch queued or running at once (the rest wait in the batch, "
            "not in the queue)."
        ),
    )
    gateway_batch_queued_max: int = Field(
        256,
        ge=1,
        description=(
            "Most lines of all batches together queued or running at once. A chat's admission "
            "(EDGEQ_MAX_QUEUE) does not count them, so batches never get a chat refused."
        ),
    )
    gateway_batch_completion_window_s: float = Field(
        86400.0,
        gt=0,
        description=(
            "How long a batch may run before it ends `expired` (the `24h` of its "
            "completion_window; shorter for tests)."
        ),
    )
    gateway_batch_runner: bool = Field(
        True, description="Run batches in this gateway process (any gateway may take one)."
    )
    gateway_batch_lease_s: float = Field(
        10.0,
        gt=0,
        description=(
            "A batch whose runner (a gateway) is silent this long is taken over by another."
        ),
    )
    log_level: LogLevel = "info"

    @field_validator("gateway_api_keys", "gateway_model_aliases", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
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
        for number, (tenant, key) in enumerate(self.gateway_tenant_keys, start=1):
            if not tenant or not key:
                raise ValueError(f"{setting}: entry {number} is not tenant=key")
            if not re.fullmatch(TENANT_PATTERN, tenant):
                # Not echoed: with tenant and key swapped, it would be (most of) the key.
                raise ValueError(
                    f"{setting}: entry {number}: the part before its first '=' is not a tenant "
                    f"name (up to 64 letters, digits, '_', '.' or '-', starting with a letter "
                    f"or digit)"
                )
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

    @property
    def json_body_max_bytes(self) -> int:
        """The largest JSON body the door lets in (door.py)."""
        if self.gateway_max_body_bytes is not None:
            return self.gateway_max_body_bytes
        return self.max_request_bytes + JSON_MARGIN_BYTES

    @property
    def auth_required(self) -> bool:
        return bool(self.gateway_api_keys or self.gateway_tenant_keys)
