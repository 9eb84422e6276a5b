"""The gateway's settings: where it listens and who may call it, on top of the connection
settings every edgeq process shares (same EDGEQ_* variables, same .env)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from edgeq.core.logs import LogLevel
from edgeq.core.settings import ConnectionSettings

CommaList = Annotated[list[str], NoDecode]


class GatewaySettings(ConnectionSettings):
    gateway_host: str = Field(
        "127.0.0.1", min_length=1, description="Address to listen on (loopback by default)."
    )
    gateway_port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    gateway_api_keys: CommaList = Field(
        default_factory=list,
        description="Comma-separated bearer tokens; when set, /v1/* needs one of them.",
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
    gateway_retry_after_s: int = Field(
        1, ge=1, description="Retry-After (seconds) sent with 429 when the queue is full."
    )
    gateway_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long open requests may still finish."
    )
    log_level: LogLevel = "info"

    @field_validator("gateway_api_keys", "gateway_model_aliases", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value
