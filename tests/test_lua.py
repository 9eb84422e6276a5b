"""Lua as Lua: every Redis script edgeq runs is made of ``.lua`` files shipped with the package
(core/scripts.py), each one compiles in a real Redis, and no Python module holds Lua text any
more, so it cannot creep back into Python strings."""

from __future__ import annotations

import re
from pathlib import Path

from redis.asyncio import Redis

from edgeq.core import events, leases
from edgeq.core.batching import combined
from edgeq.core.scheduling import BAND_SPAN
from edgeq.core.scripts import lua_file, lua_script, shipped_lua_files
from edgeq.producer import queue
from edgeq.resources.batches import runner as batch_runner
from edgeq.resources.batches import store as batch_store
from edgeq.worker import claim

REPO = Path(__file__).resolve().parents[1]
# What a Lua script calls Redis with; a Python module holding it holds a script.
LUA_MARK = "redis.call("


# The folders of edgeq's own Redis code: the core, the producer and the worker (bench's
# raw-socket floor keeps its own two stand-in scripts: it measures Redis, not edgeq's).
SCANNED = ("src", "producer", "worker")


def modules_holding_lua(paths: list[Path]) -> list[Path]:
    return [path for path in paths if LUA_MARK in path.read_text(encoding="utf-8")]


def test_no_python_module_holds_a_lua_script() -> None:
    modules = sorted(path for folder in SCANNED for path in (REPO / folder).rglob("*.py"))
    # The scan reaches the modules that held scripts before they moved to lua/.
    for former in ("src/edgeq/core/leases.py", "src/edgeq/core/events.py", "worker/claim.py",
                   "producer/queue.py", "src/edgeq/core/scheduling.py"):  # fmt: skip
        assert REPO / former in modules
    offenders = [str(path.relative_to(REPO)) for path in modules_holding_lua(modules)]
    assert offenders == [], f"Lua belongs in src/edgeq/core/lua/*.lua, not in {offenders}"


def test_the_scan_finds_a_script_in_a_python_string(tmp_path: Path) -> None:
    module = tmp_path / "sneaky.py"
    module.write_text("SCRIPT = \"return redis.call('GET', KEYS[1])\"\n")
    assert modules_holding_lua([module, Path(__file__).with_name("conftest.py")]) == [module]


def test_every_script_file_is_shipped_and_read_through_the_loader() -> None:
    in_tree = sorted(path.stem for path in (REPO / "src/edgeq/core/lua").glob("*.lua"))
    assert shipped_lua_files() == in_tree
    assert {"clock", "fair_queuing", "claim", "enqueue", "publish_event"} <= set(in_tree)
    for name in in_tree:
        source = lua_file(name)
        # batched.lua and usage.lua only call functions of the files put in front of them.
        assert LUA_MARK in source or name in ("batched", "usage"), name
        assert source.endswith("\n"), f"{name}.lua: the next file joined to it starts a line"
    assert lua_script("clock", "claim") == lua_file("clock") + "\n" + lua_file("claim")


async def test_every_script_file_and_every_script_as_sent_compiles(redis: Redis) -> None:
    for name in shipped_lua_files():
        await redis.script_load(lua_file(name))  # a syntax error raises here
    as_sent = [
        leases._RENEW,
        leases._HAND_OVER,
        claim._CLAIM,
        queue._DEQUEUE,
        combined(queue._ENQUEUE),
        combined(events._PUBLISH),
        batch_store._STORE_FILE,
        batch_store._START_BATCH,
        batch_store._USAGE,
        batch_runner._TAKE_LINE,
    ]
    for source in as_sent:
        await redis.script_load(source)


def test_the_scripts_band_span_is_core_scheduling_s() -> None:
    found = re.search(r"^local BAND_SPAN = (\d+)$", lua_file("fair_queuing"), re.MULTILINE)
    assert found is not None
    assert int(found.group(1)) == BAND_SPAN
