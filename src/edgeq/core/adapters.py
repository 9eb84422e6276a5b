"""LoRA adapters: their names, what a directory must hold to be one, and the queue's registry.

An adapter is a PEFT LoRA directory (``adapter_config.json`` with ``peft_type: LORA`` and its
rank ``r``, next to ``adapter_model.safetensors``) served on one warm base model. A request
names one by its ``adapter`` field (the gateway: by ``model``); the worker generates with it.

The registry, ``{queue}:adapters`` (a hash, name -> path as the workers see it), holds the
adapters every worker on the queue serves: ``edgeq adapters load`` writes it, workers load
what it holds at start-up and follow it at run time (worker/adapters.py), and producers read
it to refuse an unknown name before enqueue. Adapters a worker serves from its own settings
(EDGEQ_ADAPTERS) are not in it: they are in that worker's heartbeat record, and producers
accept those names too.

Imported by both sides: nothing here imports vLLM or torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_settings import NoDecode
from redis.asyncio import Redis

from edgeq.core.keys import adapters_key
from edgeq.core.registry import live_workers

#: An adapter's name: also an OpenAI model name at the gateway, so no spaces, no slashes.
ADAPTER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def valid_name(name: str) -> bool:
    return re.fullmatch(ADAPTER_PATTERN, name) is not None  # re.match's $ passes "a\n"


def name_problem(name: str) -> str | None:
    if valid_name(name):
        return None
    return (
        f"adapter name {name!r}: letters, digits and _ . : - only, starting with a letter or "
        f"digit, at most 64 characters"
    )


def _pairs(setting: str, value: Any, right: str) -> Any:
    """``a=b,c=d`` -> {"a": "b", "c": "d"}; a dict passes through."""
    if not isinstance(value, str):
        return value
    entries: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        left, equals, target = (piece.strip() for piece in item.partition("="))
        if not equals or not left or not target:
            raise ValueError(f"{setting}: {item!r} is not NAME={right}")
        entries[left] = target
    return entries


def _adapter_paths(value: Any) -> Any:
    entries = _pairs("EDGEQ_ADAPTERS", value, "PATH")
    for name in entries:
        if problem := name_problem(name):
            raise ValueError(f"EDGEQ_ADAPTERS: {problem}")
    return entries


def _tenant_adapters(value: Any) -> Any:
    return _pairs("EDGEQ_TENANT_ADAPTERS", value, "ADAPTER")


#: EDGEQ_ADAPTERS: ``name=path,name=path``.
AdapterPaths = Annotated[dict[str, str], NoDecode, BeforeValidator(_adapter_paths)]
#: EDGEQ_TENANT_ADAPTERS: ``tenant=adapter,tenant=adapter``.
TenantAdapters = Annotated[dict[str, str], NoDecode, BeforeValidator(_tenant_adapters)]


def adapter_rank(path: str | Path) -> int:
    """The rank of the LoRA adapter in ``path``; raises ValueError naming what is wrong with it
    (no such directory, no adapter config, not LoRA, no weights)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{path} is not a directory")
    config_path = directory / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} holds no {CONFIG_FILE}: it is not a PEFT adapter") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{config_path} cannot be read as JSON: {error}") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ValueError(f"{path} is not a LoRA adapter (peft_type {kind!r}, not 'LORA')")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_path}: its rank r ({rank!r}) is not a whole number >= 1")
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{path} holds no {' or '.join(WEIGHT_FILES)}")
    return rank


def adapter_problem(path: str | Path, *, max_rank: int | None = None) -> str | None:
    """Why ``path`` cannot be served as an adapter (checked from its files alone), or None."""
    try:
        rank = adapter_rank(path)
    except ValueError as error:
        return str(error)
    if max_rank is not None and rank > max_rank:
        return (
            f"its rank {rank} is above the largest this worker holds, {max_rank} "
            f"(EDGEQ_MAX_ADAPTER_RANK)"
        )
    return None


# --- the registry ------------------------------------------------------------------------------


async def register(redis: Redis, queue: str, name: str, path: str) -> None:
    await redis.hset(adapters_key(queue), name, path)


async def unregister(redis: Redis, queue: str, name: str) -> bool:
    """Take ``name`` out of the registry; False if it was not in it."""
    return bool(await redis.hdel(adapters_key(queue), name))


async def registered(redis: Redis, queue: str) -> dict[str, str]:
    """The registry: adapter name -> path."""
    raw = await redis.hgetall(adapters_key(queue))
    return {name.decode(): path.decode() for name, path in raw.items()}


async def known_adapter(redis: Redis, queue: str, name: str) -> bool:
    """Whether some worker of the queue serves ``name`` or will: it is registered, or a live
    worker serves it from its own settings. One round trip for a registered name."""
    if await redis.hexists(adapters_key(queue), name):
        return True
    return any(name in worker.adapters for worker in await live_workers(redis, queue))
