"""edgeq: chat jobs through Redis to one warm vLLM engine, tokens streamed back over pub/sub.

The public API of a backend service that enqueues chats:

    from edgeq import ChatClient

    async with ChatClient() as client:          # settings from EDGEQ_* / .env
        print((await client.chat("Why is the sky blue?")).text)

Everything listed in ``__all__`` is importable from here; the modules behind it
(``edgeq.producer``, ``edgeq.core``) may move. The names are loaded on first use, so that
``import edgeq.worker`` in a worker process does not load the client, and ``import edgeq``
costs nothing until a name is used.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("edgeq")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "ChatClient": "edgeq.producer.client",
    "ChatJob": "edgeq.producer.client",
    "SyncChatClient": "edgeq.producer.sync_client",
    "SyncChatJob": "edgeq.producer.sync_client",
    "ConnectionSettings": "edgeq.core.settings",
    "ChatMessage": "edgeq.core.protocol",
    "ChatRequest": "edgeq.core.protocol",
    "ChatResult": "edgeq.core.protocol",
    "DeltaEvent": "edgeq.core.protocol",
    "DoneEvent": "edgeq.core.protocol",
    "ErrorCode": "edgeq.core.protocol",
    "ErrorEvent": "edgeq.core.protocol",
    "StreamEvent": "edgeq.core.protocol",
    "Timings": "edgeq.core.protocol",
    "Usage": "edgeq.core.protocol",
    "Tool": "edgeq.core.structured",
    "ToolCall": "edgeq.core.structured",
    "Constraint": "edgeq.core.structured",
    "json_schema_format": "edgeq.core.structured",
    "EdgeqError": "edgeq.core.errors",
    "ConfigError": "edgeq.core.errors",
    "InvalidRequest": "edgeq.core.errors",
    "JobFailed": "edgeq.core.errors",
    "InvalidAnswer": "edgeq.core.errors",
    "JobTimeout": "edgeq.core.errors",
    "QueueFull": "edgeq.core.errors",
    "RateLimited": "edgeq.core.errors",
    "PoisonRefused": "edgeq.core.errors",
    "IdempotencyConflict": "edgeq.core.errors",
    "RedisUnavailable": "edgeq.core.errors",
    "StreamBroken": "edgeq.core.errors",
    "StreamClosed": "edgeq.core.errors",
}

# Spelt out (not built from _EXPORTS) so linters and type checkers can read it.
__all__ = [
    "ChatClient",
    "ChatJob",
    "ChatMessage",
    "ChatRequest",
    "ChatResult",
    "ConfigError",
    "ConnectionSettings",
    "Constraint",
    "DeltaEvent",
    "DoneEvent",
    "EdgeqError",
    "ErrorCode",
    "ErrorEvent",
    "IdempotencyConflict",
    "InvalidAnswer",
    "InvalidRequest",
    "JobFailed",
    "JobTimeout",
    "PoisonRefused",
    "QueueFull",
    "RateLimited",
    "RedisUnavailable",
    "StreamBroken",
    "StreamClosed",
    "StreamEvent",
    "SyncChatClient",
    "SyncChatJob",
    "Timings",
    "Tool",
    "ToolCall",
    "Usage",
    "__version__",
    "json_schema_format",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'edgeq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from edgeq.core.errors import (
        ConfigError,
        EdgeqError,
        IdempotencyConflict,
        InvalidAnswer,
        InvalidRequest,
        JobFailed,
        JobTimeout,
        PoisonRefused,
        QueueFull,
        RedisUnavailable,
        StreamBroken,
        StreamClosed,
    )
    from edgeq.core.protocol import (
        ChatMessage,
        ChatRequest,
        ChatResult,
        DeltaEvent,
        DoneEvent,
        ErrorCode,
        ErrorEvent,
        StreamEvent,
        Timings,
        Usage,
    )
    from edgeq.core.settings import ConnectionSettings
    from edgeq.core.structured import Constraint, Tool, ToolCall, json_schema_format
    from edgeq.producer.client import ChatClient, ChatJob
    from edgeq.producer.sync_client import SyncChatClient, SyncChatJob
