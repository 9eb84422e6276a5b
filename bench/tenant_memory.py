"""What one tenant at its caps costs Redis (issue #40): the figures of docs/batches.md's sizing.

    .venv/bin/python -m edgeq.bench.tenant_memory

On a private ``redis-server``, with the gateway's settings as they are (the environment and
``.env``: the defaults unless set), a tenant is filled through ``BatchStore`` (what
``/v1/files`` and ``/v1/batches`` run) until its caps refuse, in two shapes:

- ``files``: uploads of the largest file (``EDGEQ_GATEWAY_FILE_MAX_BYTES`` of ~1 KB lines)
  until refused;
- ``batches``: one such file, then batches of it in progress until refused (no worker: their
  lines stay in Redis, as while a batch runs).

Printed per shape: what the caps count (``edgeq batch usage``'s bytes) and how much Redis's
``used_memory`` grew meanwhile, less its clients' buffers (``mem_clients_normal``: an upload in
flight holds its size there too, for as long as it is sent), and their ratio. The answers of
batches in progress are not part of it (no engine runs them): docs/batches.md sizes them
apart.
"""

from __future__ import annotations

import asyncio
import json

from redis.asyncio import Redis

from edgeq.core.settings import load_settings
from edgeq.gateway.settings import GatewaySettings
from edgeq.resources.batches.store import BatchApiError, BatchStore
from edgeq.testing.processes import RedisServer

TENANT = "bench"
MODEL = "bench-model"
#: A ~1 KB line, as docs/batches.md's per-line table measures (a ~150-token prompt).
PROMPT = "word " * 180


def line(number: int) -> str:
    return json.dumps({
        "custom_id": f"q{number}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": 128,
                 "messages": [{"role": "user", "content": PROMPT}]},
    })  # fmt: skip


def largest_file(settings: GatewaySettings) -> bytes:
    """As many lines as fit EDGEQ_GATEWAY_FILE_MAX_BYTES (and EDGEQ_GATEWAY_FILE_MAX_LINES)."""
    per_line = len(line(10**6)) + 1
    count = min(settings.gateway_file_max_bytes // per_line, settings.gateway_file_max_lines)
    return "".join(line(number) + "\n" for number in range(count)).encode()


async def stored_memory(redis: Redis) -> int:
    """Redis's used_memory less its clients' buffers (a refused 32 MB upload's arguments sit
    in its connection's query buffer until Redis trims it: memory, but not what is kept)."""
    memory = await redis.info("memory")
    return int(memory["used_memory"]) - int(memory["mem_clients_normal"])


async def fill(redis_url: str, shape: str) -> tuple[int, int, str]:
    """Fill a tenant in the ``shape``: (bytes counted, stored memory's growth, what refused)."""
    settings = load_settings(
        GatewaySettings, redis_url=redis_url, queue=f"edgeq:bench-{shape}", model=MODEL
    )
    async with Redis.from_url(redis_url) as redis:
        store = BatchStore(redis, settings)
        before = await stored_memory(redis)
        content = largest_file(settings)
        refused = ""
        try:
            file = await store.create_file(TENANT, "in.jsonl", "batch", content)
            while shape == "files":
                await store.create_file(TENANT, "in.jsonl", "batch", content)
            while True:
                await store.create_batch(TENANT, file.id, models=[MODEL])
        except BatchApiError as error:
            refused = str(error)
        usage = await store.usage(TENANT)
        after = await stored_memory(redis)
    return usage.bytes, after - before, refused


def main() -> None:
    redis = RedisServer().start()
    try:
        for shape in ("files", "batches"):
            counted, grew, refused = asyncio.run(fill(redis.url, shape))
            print(f"{shape}: counted {counted:,} B, Redis's memory grew {grew:,} B "
                  f"({grew / counted:.2f} x counted)")  # fmt: skip
            print(f"  refused: {refused}")
    finally:
        redis.stop()


if __name__ == "__main__":
    main()
