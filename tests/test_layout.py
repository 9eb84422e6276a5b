"""The architecture the layout promises, checked on the code itself.

Data flows one way (producer -> Redis -> worker -> Redis -> subscriber) through a shared core:
``edgeq.core`` imports neither side, the worker never imports the producer, the producer (what
a backend service installs) never imports the worker, vLLM or torch, and no two modules of the
core import each other, even for a type hint. OpenAI's resources (``edgeq.resources``, the
wing) hold no HTTP: they never import FastAPI, Starlette or the gateway, and the gateway is
HTTP only (each of its modules imports FastAPI or Starlette, but its settings, its state and
its command) and never imports the bench or the test launchers. No function of the gateway,
the wing or the worker is longer than 60 lines. The ``edgeq`` command is a registry: the command
modules never import the registry back, and a client's command loads nothing of the worker.
vLLM's general plugin, which vLLM loads in every vLLM process of the environment, acts only in
edgeq's own engine processes.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import subprocess
import sys
import tomllib
import typing
from collections.abc import Mapping, Set
from pathlib import Path

import pytest

import edgeq
from edgeq.cli import COMMAND_MODULES, COMMANDS, build_parser
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Where each part of the installed `edgeq` package lives in this tree: pyproject.toml's
# package-dir, and edgeq's own subpackages inside edgeq/.
_FOLDERS = PYPROJECT["tool"]["setuptools"]["package-dir"]
PARTS = {
    "edgeq.core": REPO / "src" / "edgeq" / "core",
    "edgeq.testing": REPO / "src" / "edgeq" / "testing",
    "edgeq.resources": REPO / "src" / "edgeq" / "resources",
    **{name: REPO / folder for name, folder in _FOLDERS.items() if name.count(".") == 1},
}
#: The HTTP framework: FastAPI, the Starlette it is built on, and its server-sent events.
HTTP = ("fastapi", "starlette", "sse_starlette", "uvicorn")
FORBIDDEN = {
    "edgeq.core": (
        "edgeq.producer", "edgeq.worker", "edgeq.resources", "edgeq.gateway", "edgeq.bench",
        "vllm",
    ),
    "edgeq.worker": (
        "edgeq.producer", "edgeq.resources", "edgeq.gateway", "edgeq.bench", "edgeq.testing",
    ),
    "edgeq.producer": (
        "edgeq.worker", "edgeq.resources", "edgeq.gateway", "edgeq.bench", "vllm", "torch",
    ),
    "edgeq.resources": (
        *HTTP, "edgeq.gateway", "edgeq.worker", "edgeq.bench", "edgeq.testing", "vllm", "torch",
    ),
    "edgeq.gateway": ("edgeq.worker", "edgeq.bench", "edgeq.testing", "vllm", "torch"),
}  # fmt: skip
#: The gateway's modules that need no HTTP framework: what its settings and state are, and its
#: ``edgeq gateway`` command (which imports the server only when it runs).
GATEWAY_WITHOUT_HTTP = {"__init__.py", "settings.py", "commands.py"}
#: The longest a function of the gateway, the wing or the worker may be, in lines (decorators
#: included).
LONGEST_FUNCTION = 60


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imported_by(part: str) -> dict[str, set[str]]:
    return {str(path.relative_to(REPO)): imports_of(path) for path in PARTS[part].rglob("*.py")}


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_each_part_imports_only_what_the_data_flow_allows(part: str) -> None:
    broken = {
        file: sorted(
            name
            for name in names
            if any(name == bad or name.startswith(f"{bad}.") for bad in FORBIDDEN[part])
        )
        for file, names in imported_by(part).items()
    }
    assert not {file: names for file, names in broken.items() if names}


#: The modules that import arq: its job records (arq_seam), its key prefixes (keys) and its
#: Redis client class (connection). Everything else goes through them (docs/development.md).
IMPORTS_ARQ = {
    "worker/arq_seam.py",
    "src/edgeq/core/keys.py",
    "src/edgeq/core/connection.py",
}


def test_only_three_modules_import_arq() -> None:
    importers = {
        file
        for part in PARTS
        for file, names in imported_by(part).items()
        if any(name == "arq" or name.startswith("arq.") for name in names)
    }
    assert importers == IMPORTS_ARQ


def circles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """The groups of nodes of ``graph`` (node -> the nodes it imports) that reach each other:
    each group is a circle of imports, or several that share modules."""

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for after in graph.get(todo.pop(), ()):
                if after not in seen:
                    seen.add(after)
                    todo.append(after)
        return seen

    reached = {node: reach(node) for node in graph}
    groups = {
        tuple(sorted(other for other in graph if node in reached[other] and other in reached[node]))
        for node in graph
        if node in reached[node]
    }
    return sorted(list(group) for group in groups)


def test_the_gateway_is_http_only() -> None:
    """Each module of the gateway imports FastAPI or Starlette; what needs neither belongs in
    the resources wing (or the core)."""
    without = {
        path.name
        for path in PARTS["edgeq.gateway"].glob("*.py")
        if not any(name.split(".")[0] in HTTP for name in imports_of(path))
    }
    assert "state.py" not in without  # the test reads the right folder: state is FastAPI's
    assert without <= GATEWAY_WITHOUT_HTTP, sorted(without - GATEWAY_WITHOUT_HTTP)


def functions_longer_than(limit: int, *paths: Path) -> list[str]:
    """``file:name (lines)`` of each function (method, nested function) in ``paths`` that is
    longer than ``limit`` lines, counting its decorators and docstring."""
    long = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                if length > limit:
                    long.append(f"{path.name}:{node.name} ({length})")
    return long


def test_functions_longer_than_finds_the_long_ones(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "@staticmethod\ndef f():\n    x = 0\n    x = 1\n    x = 2\n\n"
        "class C:\n    def g(self):\n        x = 0\n        x = 1\n        x = 2\n"
    )
    assert functions_longer_than(4, path) == ["m.py:f (5)"]
    assert functions_longer_than(3, path) == ["m.py:f (5)", "m.py:g (4)"]


def test_no_function_of_the_gateway_or_the_wing_is_long() -> None:
    paths = [*PARTS["edgeq.gateway"].rglob("*.py"), *PARTS["edgeq.resources"].rglob("*.py")]
    assert len(paths) > 20  # the test reads the right folders
    assert not functions_longer_than(LONGEST_FUNCTION, *paths)


def test_no_function_of_the_worker_is_long() -> None:
    paths = list(PARTS["edgeq.worker"].rglob("*.py"))
    assert any(path.name == "jobs.py" for path in paths)  # the test reads the right folder
    assert not functions_longer_than(LONGEST_FUNCTION, *paths)


def test_circles_finds_every_circle_and_nothing_else() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}, "b": set()}) == [["a"]]
    assert circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_two_core_modules_import_each_other() -> None:
    """Not through other core modules either, and not for a type hint (``TYPE_CHECKING``
    imports count): a circle means the two belong together or a piece sits in the wrong one."""
    modules = {
        f"edgeq.core.{path.stem}": path
        for path in PARTS["edgeq.core"].glob("*.py")
        if path.stem != "__init__"
    }
    assert "edgeq.core.protocol" in modules  # the test reads the right folder
    graph = {name: imports_of(path) & set(modules) for name, path in modules.items()}
    assert graph["edgeq.core.protocol"]  # and sees imports inside the core
    assert not circles(graph), circles(graph)


def test_the_command_modules_never_import_the_registry() -> None:
    for module in COMMAND_MODULES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        path = Path(spec.origin)
        assert "edgeq.cli" not in imports_of(path), f"{path} imports edgeq.cli: a circle"


def commands_of(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    (subcommands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return tuple(subcommands.choices)


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_the_registry_knows_which_module_registers_each_command(module: str) -> None:
    """``edgeq COMMAND`` imports only the module the registry names for COMMAND: that module
    must register it (and the registry must name all it registers)."""
    for command in COMMANDS[module]:
        assert commands_of(build_parser([command, "--help"])) == COMMANDS[module], command


def test_edgeq_help_lists_every_command() -> None:
    listed = tuple(name for names in COMMANDS.values() for name in names)
    assert commands_of(build_parser()) == commands_of(build_parser(["--help"])) == listed


def run_python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=REPO.parent,  # not the checkout: the installed edgeq, as a user imports it
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_the_client_loads_no_engine_and_the_worker_loads_no_client() -> None:
    # A backend service: the client, and the `edgeq` command lines it runs (what main builds).
    loaded = run_python(
        "import sys, edgeq\n"
        "from edgeq import ChatClient, SyncChatClient\n"
        "import edgeq.cli\n"
        f"for command in {COMMANDS['edgeq.producer.commands']!r}:\n"
        "    edgeq.cli.build_parser([command, '--help'])\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'vllm', 'torch', 'fastapi', 'matplotlib'} or m.split('.')[:2] == ['edgeq', 'worker'])))"
    )
    assert loaded == "", loaded
    loaded = run_python(
        "import sys, edgeq.worker.jobs, edgeq.worker.app\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('edgeq.producer'))))"
    )
    assert loaded == ""


def test_the_bench_loads_the_engine_only_for_a_mode_that_runs_one() -> None:
    # `edgeq bench` against a running worker, `edgeq capacity` and their subscriber processes
    # (edgeq[bench] without an engine extra) import these and nothing of vLLM.
    loaded = run_python(
        "import sys, edgeq.bench.cli, edgeq.bench.capacity, edgeq.bench.runners\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {'vllm', 'torch'})))"
    )
    assert loaded == ""


def test_the_public_api_is_at_the_package_root() -> None:
    # The version pyproject.toml states (a stale install's differs: reinstall, `make venv`).
    assert edgeq.__version__ == PYPROJECT["project"]["version"]
    assert sorted(edgeq.__all__) == sorted(["__version__", *edgeq._EXPORTS])
    for name, module in edgeq._EXPORTS.items():
        value = getattr(edgeq, name)
        assert value is getattr(importlib.import_module(module), name), name
        if name == "StreamEvent":  # a type alias: the union of the three events
            assert typing.get_origin(value) is typing.Annotated
            assert set(typing.get_args(typing.get_args(value)[0])) == {
                DeltaEvent,
                DoneEvent,
                ErrorEvent,
            }
        else:  # defined where _EXPORTS says, not re-exported from elsewhere
            assert inspect.isclass(value) or inspect.isfunction(value), name
            assert value.__module__ == module, name
    assert issubclass(edgeq.ConfigError, edgeq.EdgeqError)
    assert issubclass(edgeq.StreamClosed, edgeq.EdgeqError)
    assert issubclass(edgeq.InvalidRequest, ValueError)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = edgeq.Nope  # type: ignore[attr-defined]


PLUGIN_PROBE = (
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
    "print(getattr(GPUModelRunner._bookkeeping_sync, '_edgeq_patched', False))\n"
)


def test_the_vllm_plugin_leaves_other_vllm_processes_alone() -> None:
    """A user's own vLLM in the same venv loads our entry point and must stay unpatched;
    edgeq's engine (which sets the marker before importing vLLM) gets the CPU fix."""
    env = {name: value for name, value in os.environ.items() if name != "EDGEQ_VLLM_PLUGIN"}
    plain = subprocess.run(
        [sys.executable, "-c", PLUGIN_PROBE],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO.parent,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.strip().splitlines()[-1] == "False"
    ours = run_python("import edgeq.worker.engine\n" + PLUGIN_PROBE)
    assert ours.splitlines()[-1] == "True"
