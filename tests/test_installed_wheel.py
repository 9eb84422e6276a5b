"""edgeq as a user gets it: the wheel built from this tree, installed with ``edgeq[cpu]`` into a
fresh virtualenv, used from a directory outside the checkout. Its only top-level import name
is ``edgeq``; ``edgeq --version``, ``python -m edgeq``, the public API at the package root,
``edgeq worker`` on the tiny model, ``edgeq chat`` against it, and ``edgeq bundle`` (which
needs the units, the installer and the settings template shipped as package data) all work
without the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeq.deploy.bundle import CPU_EXCLUDED, build_edgeq_wheel
from edgeq.testing.processes import RedisServer, WorkerProcess
from helpers import FIGURES, engine_env

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = REPO / "src/edgeq/core/schemas"
PACKAGE_DATA = (
    "edgeq/py.typed",
    "edgeq/deploy/install.sh",
    "edgeq/deploy/redis-edgeq.conf",
    "edgeq/deploy/edgeq.sysusers",
    "edgeq/deploy/edgeq.env.example",
    "edgeq/deploy/units/edgeq-worker@.service",
    "edgeq/deploy/units/edgeq-gateway.service",
    "edgeq/deploy/units/edgeq.target",
    # The Redis scripts (core/scripts.py reads them from the installed package).
    *(f"edgeq/core/lua/{lua.name}" for lua in sorted((REPO / "src/edgeq/core/lua").glob("*.lua"))),
    # The wire contract's JSON Schemas (docs/reference/schemas.md: readable from the package).
    *(f"edgeq/core/schemas/{schema.name}" for schema in sorted(SCHEMAS.glob("*.json"))),
)


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 600):
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_edgeq_wheel(tmp_path_factory.mktemp("wheel"), source=REPO)


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory with no checkout in it (``python -m`` imports from the cwd first)."""
    return tmp_path_factory.mktemp("elsewhere")


@pytest.fixture(scope="module")
def clean_env() -> dict[str, str]:
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("EDGEQ_") and name not in {"PYTHONPATH", "VIRTUAL_ENV"}
    }


@pytest.fixture(scope="module")
def venv(
    wheel: Path, wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory, clean_env: dict
) -> Path:
    """A fresh venv with ``edgeq[cpu]`` from the wheel, its dependencies from the wheelhouse."""
    directory = tmp_path_factory.mktemp("venv")
    started = time.monotonic()
    run([sys.executable, "-m", "venv", str(directory)], directory, clean_env)
    pip = [str(directory / "bin" / "python"), "-m", "pip"]
    run(
        [*pip, "install", "-q", "--no-index", "--find-links", str(wheelhouse),
         f"{wheel}[cpu]"],
        directory, clean_env, timeout=1200,
    )  # fmt: skip
    run([*pip, "uninstall", "-y", "-q", *CPU_EXCLUDED], directory, clean_env)
    FIGURES["installed wheel: fresh venv with edgeq[cpu]"] = f"{time.monotonic() - started:.0f} s"
    return directory


def test_the_wheel_installs_one_import_name_and_ships_its_package_data(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"edgeq", wheel.name.split("-py3")[0] + ".dist-info"}, top_level
    for data in PACKAGE_DATA:
        assert data in names, f"{data} is missing from {wheel.name}"
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_version_public_api_and_python_m(venv: Path, outside: Path, clean_env: dict) -> None:
    python = str(venv / "bin" / "python")
    version = run([str(venv / "bin" / "edgeq"), "--version"], outside, clean_env).stdout
    assert version.strip() == "edgeq 0.1.0"
    assert run([python, "-m", "edgeq", "--version"], outside, clean_env).stdout == version
    probe = (
        "import edgeq\n"
        "from edgeq import ChatClient, SyncChatClient, ChatResult, EdgeqError, JobFailed\n"
        "assert issubclass(JobFailed, EdgeqError)\n"
        "missing = [name for name in edgeq.__all__ if not hasattr(edgeq, name)]\n"
        "assert not missing, missing\n"
        "print(edgeq.__file__)\n"
    )
    where = run([python, "-c", probe], outside, clean_env).stdout.strip()
    assert where.startswith(str(venv)), f"edgeq imported from {where}, not the venv"


@pytest.fixture(scope="module")
def installed_worker(
    venv: Path, outside: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    redis = RedisServer().start()
    worker = WorkerProcess(
        engine_env(tiny_model, redis.url, "edgeq:installed"),
        tmp_path_factory.mktemp("installed-worker") / "worker.log",
        python=str(venv / "bin" / "python"),
        cwd=outside,
    ).start()
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()
        redis.stop()


def test_worker_and_chat_run_from_the_installed_wheel(
    installed_worker: WorkerProcess, venv: Path, outside: Path, clean_env: dict
) -> None:
    env = {**clean_env, **installed_worker.env}
    result = run(
        [str(venv / "bin" / "edgeq"), "chat", "Say something", "--max-tokens", "16",
         "--seed", "1", "--json"],
        outside, env, timeout=120,
    )  # fmt: skip
    assert '"finish_reason"' in result.stdout and '"completion_tokens"' in result.stdout


def test_bundle_builds_from_the_installed_wheel(
    venv: Path,
    wheel: Path,
    wheelhouse: Path,
    tiny_model: Path,
    outside: Path,
    clean_env: dict,
    tmp_path: Path,
) -> None:
    result = run(
        [str(venv / "bin" / "edgeq"), "bundle", "--variant", "cpu",
         "--model-dir", str(tiny_model), "--out", str(tmp_path),
         "--wheelhouse-from", str(wheelhouse), "--edgeq-wheel", str(wheel)],
        outside, clean_env,
    )  # fmt: skip
    tar_path = Path(result.stdout.strip().splitlines()[-1])
    with tarfile.open(tar_path) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        readme = tar.extractfile(f"{tar_path.stem}/README.md")
        assert readme is not None and b"make demo" in readme.read()  # the package's own
    for expected in (
        "install.sh",
        "edgeq.env",
        "README.md",
        "manifest.json",
        "systemd/edgeq-worker@.service",
        "systemd/edgeq-gateway.service",
        "systemd/edgeq.target",
        "deploy/redis-edgeq.conf",
        "deploy/edgeq.sysusers",
        f"wheelhouse/{wheel.name}",
    ):
        assert expected in names, f"{expected} is missing from the bundle"
    assert not [name for name in names if name.startswith("systemd/__init__")]
