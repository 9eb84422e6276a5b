"""The settings of OpenAI's resources on the queue (model names, responses, webhooks, files
and batches): read by the gateway (whose settings add where it listens and who may call it)
and by ``edgeq batch``, on top of the connection settings every edgeq process shares (same
EDGEQ_* variables, same .env)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import NoDecode

from edgeq.core.scheduling import TENANT_PATTERN
from edgeq.core.settings import ConnectionSettings

CommaList = Annotated[list[str], NoDecode]


class WebhookEndpoint(BaseModel):
    """One operator-configured webhook receiver (EDGEQ_GATEWAY_WEBHOOKS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://")
    #: The signing secret: OpenAI's ``whsec_<base64>``, or any other string used as it is.
    secret: str = Field(min_length=8, repr=False)
    #: Only this tenant's responses; None: every tenant's.
    tenant: str | None = Field(None, pattern=TENANT_PATTERN)


class ResourceSettings(ConnectionSettings):
    """What OpenAI's resources on the queue read: the model names a request may ask for, how
    long responses and files are kept, the webhooks, the limits of files and batches."""

    model: str = Field(
        "Qwen/Qwen3-0.6B",
        min_length=1,
        description="The model name clients ask for (the workers' EDGEQ_MODEL).",
    )
    gateway_model_aliases: CommaList = Field(
        default_factory=list,
        description="Other model names accepted for the same model, e.g. Qwen-0.6B.",
    )
    # OpenAI's Responses API and its webhooks (resources/responses/, docs/responses.md).
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
    # OpenAI's Files and Batches (resources/batches/store.py, docs/batches.md).
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

    @field_validator("gateway_model_aliases", mode="before")
    @classmethod
    def _split_aliases(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value
