"""edgeq's Lua scripts, kept as ``.lua`` files shipped with the package (``edgeq/core/lua/``).

A Redis script cannot include another, so the functions several scripts share live in files of
their own (``clock.lua``, ``fair_queuing.lua``) that are put in front of the script that uses
them: a script is whole files joined in order, never Lua built by formatting. Whatever varies
between calls reaches a script through its KEYS and ARGV, so each script's text, and so its
SHA, is fixed: it is registered once and run with EVALSHA.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any
from weakref import WeakKeyDictionary

#: Where the scripts are, inside the ``edgeq.core`` package.
LUA_FOLDER = "lua"


@cache
def lua_file(name: str) -> str:
    """The text of ``lua/<name>.lua``, read once per process."""
    return files("edgeq.core").joinpath(LUA_FOLDER, f"{name}.lua").read_text(encoding="utf-8")


def lua_script(*names: str) -> str:
    """The script made of these files, in this order (shared functions first)."""
    return "\n".join(lua_file(name) for name in names)


#: Each Redis client's registered scripts, by text: registering hashes the text (SHA1) and
#: makes an object, so a script run on every claim or hand-over is registered once per client.
_REGISTERED: WeakKeyDictionary[Any, dict[str, Any]] = WeakKeyDictionary()


def registered(redis: Any, script: str) -> Any:
    """``script`` registered on ``redis`` (a Redis client: plain, Sentinel's or a cluster's),
    once per client; call it like ``redis.register_script``'s answer."""
    scripts = _REGISTERED.setdefault(redis, {})
    if script not in scripts:
        scripts[script] = redis.register_script(script)
    return scripts[script]


def shipped_lua_files() -> list[str]:
    """The names (without ``.lua``) of every script file shipped with the package."""
    folder = files("edgeq.core").joinpath(LUA_FOLDER)
    return sorted(
        entry.name.removesuffix(".lua") for entry in folder.iterdir() if entry.name.endswith(".lua")
    )
