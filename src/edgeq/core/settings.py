"""Connection settings shared by everything that talks to edgeq's Redis.

Read from the environment (prefix ``EDGEQ_``) and from ``.env`` in the working directory.
The worker's settings extend this class, so a producer and a worker configured from the
same environment always agree on where the queue is.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from edgeq.core.cluster import hash_tag, is_cluster_url, parse_cluster_url
from edgeq.core.errors import ConfigError
from edgeq.core.scheduling import DEFAULT_TENANT, TENANT_PATTERN
from edgeq.core.sentinel import is_sentinel_url, parse_sentinel_url

ENV_PREFIX = "EDGEQ_"

SettingsT = TypeVar("SettingsT", bound=BaseSettings)
# A password in a URL's query string (redis-py's ?password=, our ?sentinel_password=, and
# misspellings of them such as ?sentinel_pasword=).
QUERY_PASSWORD = re.compile(r"([?&][^=&#]*(?:pas|pw)[^=&#]*=)[^&#]*", re.IGNORECASE)


class ConnectionSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_default=True,
    )

    # Knob 6 (connection pooling, timeouts): one pooled client per process, bounded waits.
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description=(
            "Redis holding the queue and the streams (redis://, rediss:// or unix://), or the "
            "Sentinels of a highly available one: redis+sentinel://[[username]:password@]"
            "host1:port1[,host2:port2,...]/service_name[/db] (the password is the data nodes'; "
            "?sentinel_password= and &sentinel_username= for Sentinels with their own; "
            "rediss+sentinel:// for TLS to the data nodes)."
        ),
    )
    queue: str = Field("edgeq:queue", min_length=1, description="arq queue name (a sorted set).")
    redis_connect_timeout_s: float = Field(
        5.0, gt=0, description="Give up connecting to Redis after this long."
    )
    redis_socket_timeout_s: float = Field(
        10.0, gt=0, description="Give up on one Redis command after this long."
    )
    client_max_connections: int = Field(
        4,
        ge=2,
        description=(
            "Redis connections one ChatClient (and so the gateway) opens at most: one pub/sub "
            "connection carries all its streams, the rest its commands; a burst waits for a "
            "free one instead of opening more (not applied to redis+sentinel:// URLs)."
        ),
    )
    stream_timeout_s: float = Field(
        120.0,
        gt=0,
        description=(
            "A client gives up on a job when no event arrives for this long "
            "(covers queue wait and a worker that is still starting)."
        ),
    )

    # Reliability: limits and deadlines every job gets (see README, "Guarantees").
    max_queue: int = Field(
        1000, ge=0, description="Refuse new jobs while this many are queued or running (0: off)."
    )
    queue_deadline_s: float = Field(
        60.0, gt=0, description="A job not started within this long ends with `expired`."
    )
    replay_ttl_s: float = Field(
        600.0, gt=0, description="How long a job's events stay readable for attach/watch."
    )
    max_continuations: int = Field(
        2,
        ge=0,
        description=(
            "How often a chat whose worker died is continued by another worker (or the same "
            "one restarted) before it ends with `worker_lost`; 0: never continued."
        ),
    )
    continue_within_s: float = Field(
        100.0,
        gt=0,
        description=(
            "A chat whose worker died waits this long for a worker (another, or the same one "
            "restarted) to continue it, else it ends with `worker_lost`; keep it above a "
            "worker's restart time and below EDGEQ_STREAM_TIMEOUT_S - EDGEQ_LEASE_TTL_S."
        ),
    )
    dead_letter_ttl_s: float = Field(
        7 * 24 * 3600.0,
        gt=0,
        description=(
            "How long a quarantined job (one running at two engine failures: a poison job) "
            "stays in the dead-letter set for `edgeq dead-letter show|retry`."
        ),
    )
    poison_refuse_s: float = Field(
        3600.0,
        ge=0,
        description=(
            "How long, after a job was quarantined as a poison job, a submit of the same "
            "request (its fingerprint: model, adapter, messages, constraints, sampling) is "
            "refused at the door; `edgeq dead-letter retry|drop` lifts it sooner. 0: off (no "
            "fingerprint recorded or checked). Workers and clients read it."
        ),
    )
    idempotency_ttl_s: float = Field(
        600.0,
        gt=0,
        description=(
            "How long a submit's idempotency key holds: the same key (per tenant) within it "
            "returns the job it was first given instead of enqueueing another. Keep it at or "
            "below EDGEQ_REPLAY_TTL_S, so a retry can still read that job's events."
        ),
    )
    lease_ttl_s: float = Field(
        10.0,
        gt=0,
        description=(
            "A running job whose worker is silent this long is handed to another worker to "
            "continue (EDGEQ_MAX_CONTINUATIONS), else it ends with `worker_lost`."
        ),
    )
    tenant: str = Field(
        DEFAULT_TENANT,
        pattern=TENANT_PATTERN,
        description=(
            "The tenant a client's jobs count to when a call names none (fair shares and "
            "caps: the workers' EDGEQ_TENANT_WEIGHTS and EDGEQ_TENANT_MAX_QUEUED)."
        ),
    )
    max_request_bytes: int = Field(
        1_000_000, ge=1024, description="Largest request payload accepted, in bytes."
    )
    max_messages: int = Field(256, ge=1, description="Most messages in one request.")
    max_tokens_limit: int = Field(
        8192, ge=1, description="Largest max_tokens a request may ask for."
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if is_sentinel_url(value):
            parse_sentinel_url(value)  # its ValueError says what is wrong (no password in it)
            return value
        if is_cluster_url(value):
            parse_cluster_url(value)
            return value
        scheme = urlsplit(value).scheme
        if scheme not in {"redis", "rediss", "unix"}:
            raise ValueError(
                "must start with redis://, rediss://, unix://, redis+sentinel://, "
                "rediss+sentinel:// or redis+cluster://"
            )
        return value

    @model_validator(mode="after")
    def _queue_in_one_slot(self) -> Self:
        # Every key of a queue must hash to one slot; the queue's name carries the tag.
        if is_cluster_url(self.redis_url) and hash_tag(self.queue) is None:
            raise ValueError(
                f"EDGEQ_QUEUE: on a Redis Cluster the queue's name needs a hash tag, so all of "
                f"its keys live in one slot: write it in braces, e.g. {{{self.queue}}} "
                f"(got {self.queue!r})"
            )
        return self


def redacted_url(url: str) -> str:
    """The URL with any password replaced, for messages and logs: the one before the ``@``
    and any ``password=`` / ``sentinel_password=`` query parameter (or one spelt close to
    those). It never parses the hosts, so it works on sentinel URLs (``h1:1,h2:2``) and on
    malformed URLs too."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    elif at and (is_sentinel_url(url) or is_cluster_url(url)):  # refused: a password without ":"?
        netloc = f"***@{hosts}"
    return QUERY_PASSWORD.sub(r"\1***", f"{scheme}{sep}{netloc}{slash}{path}")


def describe_validation_error(
    error: ValidationError, prefix: str = ENV_PREFIX, *, secret: Collection[str] = ()
) -> str:
    """Every bad setting on one line (a unit's journal shows it whole), each naming the
    environment variable an operator has to fix. A value is shown only where it cannot be a
    secret: never for the ``secret`` fields, nor for a part of a structured one (a webhook's
    secret in EDGEQ_GATEWAY_WEBHOOKS: its path is named instead); URLs without passwords."""
    problems = []
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else ""
        variable = f"{prefix}{field.upper()}" if field else "settings"
        inner = ".".join(str(part) for part in item["loc"][1:])
        given = item.get("input")
        if isinstance(given, str) and field.endswith("url"):
            given = redacted_url(given)  # a URL may carry the Redis password
        hidden = isinstance(given, dict) or not field or field in secret or bool(inner)
        shown = "" if hidden else f" (got {given!r})"
        where = f"{variable}: {inner}: " if inner else f"{variable}: " if field else ""
        problems.append(f"{where}{item['msg'].removeprefix('Value error, ')}{shown}")
    return "invalid settings: " + "; ".join(problems)


def secret_fields(cls: type[BaseSettings]) -> frozenset[str]:
    """The settings whose values are never shown: those declared with ``repr=False``."""
    return frozenset(name for name, field in cls.model_fields.items() if not field.repr)


def load_settings(
    cls: type[SettingsT], *, env_file: Path | None = None, **overrides: Any
) -> SettingsT:
    """Build settings, turning pydantic's error into a ConfigError that names each variable.

    ``env_file`` replaces ``.env`` in the working directory (``--env-file`` of the commands).
    pydantic-settings skips a missing env file without a word; a mistyped path would start a
    worker on the defaults, so it is an error here.
    """
    if env_file is not None:
        if not env_file.is_file():
            raise ConfigError(f"--env-file: {env_file} is not a file")
        overrides["_env_file"] = env_file
    try:
        return cls(**overrides)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, secret=secret_fields(cls))) from None
    except SettingsError as error:  # a structured value (JSON) that does not even parse
        raise ConfigError(describe_settings_error(error)) from None


def describe_settings_error(error: SettingsError) -> str:
    """pydantic-settings' error for a value it could not decode, naming the variable and
    the decoder's reason (which never quotes the value) instead of a traceback."""
    named = re.search(r'field "([^"]+)"', str(error))
    variable = f"{ENV_PREFIX}{named.group(1).upper()}" if named else "settings"
    cause = error.__cause__
    reason = f"not valid JSON ({cause})" if isinstance(cause, ValueError) else "cannot be read"
    return f"invalid settings: {variable}: {reason}"
