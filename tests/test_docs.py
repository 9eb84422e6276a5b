"""Every example in the docs runs (issue #32; the rules: docs CONVENTIONS, "Every example runs").

One test per fenced block of docs/**/*.md and README.md that has something to check, named
``page.md:LINE`` (the line of its opening fence):

- ``python`` blocks run, each in a fresh Python process; ``sh``, ``bash`` and ``console``
  blocks run in ``bash -e``. Both get the environment of a test box: the session's real Redis
  and worker (tests/conftest.py: the tiny model) and a gateway in front of them, reached
  through EDGEQ_REDIS_URL, EDGEQ_QUEUE and EDGEQ_MODEL and through the text replacements of
  ``REPLACEMENTS`` (a page writes the box's defaults; the test points them at its own parts).
  The working directory is a fresh one whose entries link to the checkout's top level (so
  ``.venv/bin/edgeq`` and ``.env.example`` work, but a file an example writes stays there);
  ``edgeq`` and ``python3`` are this virtualenv's.
- ``json`` blocks must parse, and one that is a message of the wire contract (a stream event,
  arq's result record, a job's request) must be valid for its pydantic model
  (``edgeq.testing.docs.check_wire_json``).
- A block without a language tag fails; a block with ``<!-- docs-test: skip: REASON -->`` on
  the line before its fence is skipped with that reason. Blocks in other languages (``text``,
  ``ini``, ``toml``, ...) are shown, not run, and get no test.

The block extraction is ``edgeq.testing.docs.code_blocks`` (unit tests, the static checks and
the generated references' drift tests: tests/test_docs_blocks.py, no engine).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeq.testing.docs import CodeBlock, check_wire_json, code_blocks, doc_pages
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
#: Seconds one example may take ("well under a minute", says CONVENTIONS).
EXAMPLE_TIMEOUT_S = 90
#: The box's defaults as pages write them -> the test box's (filled in by ``box``).
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_GATEWAY_URL = "http://127.0.0.1:8000"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
#: Checkout entries an example's working directory does not get (a developer's own settings).
NOT_LINKED = {".env", ".git"}


def blocks_to_test() -> list[CodeBlock]:
    return [
        block
        for name, path in doc_pages(REPO)
        for block in code_blocks(path.read_text(), name)
        if block.kind != "shown" or block.marker_error
    ]


BLOCKS = blocks_to_test()


@pytest.fixture(scope="module")
def docs_gateway(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The box's gateway, in front of the session's worker."""
    env = {name: worker.env[name] for name in ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")}
    process = GatewayProcess(env, tmp_path_factory.mktemp("docs-gateway") / "gateway.log")
    yield process.start()
    process.stop()


@pytest.fixture(scope="module")
def box(
    worker: WorkerProcess, redis_server: RedisServer, docs_gateway: GatewayProcess
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The examples' environment and text replacements: the test box's Redis, worker and
    gateway in place of a real box's defaults."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("EDGEQ_")}
    env |= {name: worker.env[name] for name in ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")}
    env["HF_HUB_OFFLINE"] = "1"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    replacements = [
        (DEFAULT_REDIS_URL, redis_server.url),
        (DEFAULT_GATEWAY_URL, f"http://127.0.0.1:{docs_gateway.port}"),
        (DEFAULT_MODEL, worker.env["EDGEQ_MODEL"]),
    ]
    return env, replacements


def checkout_view(directory: Path) -> Path:
    """A working directory that looks like the checkout's root (links to its entries)."""
    for entry in REPO.iterdir():
        if entry.name not in NOT_LINKED:
            (directory / entry.name).symlink_to(entry)
    return directory


def run_example(
    block: CodeBlock, box: tuple[dict[str, str], list[tuple[str, str]]], directory: Path
) -> None:
    env, replacements = box
    code = block.code
    for default, test_value in replacements:
        code = code.replace(default, test_value)
    script = directory.parent / ("example.py" if block.kind == "python" else "example.sh")
    script.write_text(code)
    command = [sys.executable, str(script)] if block.kind == "python" else ["bash", "-e", script]
    # In a session of its own: whatever the example leaves running in the background (a
    # `cmd &`) is ended with it, and a timeout ends the whole example. Output goes to files, so
    # a background process holding it open does not hold up the test.
    out, err = directory.parent / "stdout", directory.parent / "stderr"
    with out.open("w") as stdout_file, err.open("w") as stderr_file:
        process = subprocess.Popen(
            command,
            cwd=checkout_view(directory),
            env=env,
            stdout=stdout_file,
            stderr=stderr_file,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        process.wait(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    stdout, stderr = out.read_text()[-4000:], err.read_text()[-4000:]
    if process.returncode == -signal.SIGKILL:
        pytest.fail(
            f"{block.id}: the example ran past {EXAMPLE_TIMEOUT_S} s (examples must finish "
            f"well under a minute)\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
            pytrace=False,
        )
    if process.returncode != 0:
        pytest.fail(
            f"{block.id}: the {block.language} example exited with {process.returncode}\n"
            f"--- as run\n{code}--- stdout\n{stdout}\n--- stderr\n{stderr}",
            pytrace=False,
        )


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_example(block: CodeBlock, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.marker_error:
        pytest.fail(f"{block.id}: {block.marker_error}", pytrace=False)
    if block.kind == "untagged":
        pytest.fail(
            f"{block.id}: a fenced block without a language tag: tag it (python, sh, text, "
            f"json, ...; see the docs conventions)",
            pytrace=False,
        )
    if block.skip:
        pytest.skip(block.skip)
    if block.kind == "json":
        try:
            check_wire_json(json.loads(block.code))
        except json.JSONDecodeError as error:
            pytest.fail(f"{block.id}: the json block does not parse: {error}", pytrace=False)
        except ValueError as error:  # pydantic's ValidationError is one
            pytest.fail(f"{block.id}: not what the wire contract sends: {error}", pytrace=False)
        return
    (tmp_path / "cwd").mkdir()
    run_example(block, request.getfixturevalue("box"), tmp_path / "cwd")
