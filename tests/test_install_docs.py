"""The install story as the docs tell it (issue #44): edgeq is on no package index, so a service
builds the wheel with ``make wheel`` and installs that file, or the clone itself.

- ``scripts/setup-venv.sh`` (``make demo``, ``make test``) stops with one line on a Python
  older than 3.11, before it creates or installs anything (no engine, no network).
- Every ``sh`` block of README and docs/ that installs from ``/path/to/edgeq`` (the clone, as
  the pages write it) runs as written in a fresh virtualenv: ``/path/to/edgeq`` is a copy of
  this checkout in which the documented ``make wheel`` ran first. pip gets no index
  (PIP_NO_INDEX): every package comes from the test wheelhouse (tests/conftest.py), plus
  setuptools for the commands that build from the clone, so a command that needed a package
  edgeq does not declare, or the engine, fails here. Marked ``engine``: it builds wheels.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from edgeq.testing.docs import CodeBlock, code_blocks, doc_pages

REPO = Path(__file__).resolve().parents[1]
CLONE = "/path/to/edgeq"  # how the pages write the reader's clone


def install_blocks() -> list[CodeBlock]:
    return [
        block
        for name, path in doc_pages(REPO)
        for block in code_blocks(path.read_text(), name)
        if block.kind == "shell" and CLONE in block.code and "pip install" in block.code
    ]


def wheel_block() -> CodeBlock:
    """The Python client page's ``make wheel``: the one the install commands follow."""
    path = REPO / "docs/python-client.md"
    (block,) = (
        block
        for block in code_blocks(path.read_text(), "python-client.md")
        if block.kind == "shell" and re.search(r"(?m)^make wheel\b", block.code)
    )
    return block


INSTALL_BLOCKS = install_blocks()


def test_setup_venv_stops_in_one_line_on_python_3_10(tmp_path: Path) -> None:
    fake = tmp_path / "python3.10"
    fake.write_text("#!/bin/sh\necho 3.10.12\n")  # what `python -c 'print(version)'` prints
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["bash", str(REPO / "scripts/setup-venv.sh")],
        cwd=REPO,
        env={**os.environ, "VENV": str(venv), "PYTHON": str(fake)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "needs Python 3.11 or newer" in result.stderr
    assert f"{fake} is 3.10.12" in result.stderr
    assert "PYTHON=python3.11" in result.stderr
    assert not venv.exists()


def test_setup_venv_names_a_python_that_does_not_run(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(REPO / "scripts/setup-venv.sh")],
        cwd=REPO,
        env={**os.environ, "VENV": str(tmp_path / "venv"), "PYTHON": str(tmp_path / "none")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "cannot run" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_the_docs_install_from_the_clone_and_never_from_an_index() -> None:
    """README, the quick start, the Python client and gateway pages: no ``pip install edgeq``
    (a name on no index), and the install commands are there for the test below to run."""
    by_name = re.compile(r"pip install\s+(?:-\S+\s+)*(['\"]?)edgeq(\[[^\]]*\])?\1(?=[\s`)]|$)")
    found = [
        f"{name}: {match[0]}"
        for name, path in doc_pages(REPO)
        for match in by_name.finditer(path.read_text())
    ]
    assert found == []
    pages = {block.page for block in INSTALL_BLOCKS}
    assert {"README.md", "python-client.md"} <= pages
    assert wheel_block().code.startswith("make wheel")


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout (its tracked and untracked, not ignored, files) in which the
    documented ``make wheel`` ran, with this Python (the Makefile's PYTHON)."""
    root = tmp_path_factory.mktemp("clone") / "edgeq"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    block = wheel_block()
    result = subprocess.run(
        ["bash", "-e", "-c", block.code],
        cwd=root,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{block.id}:\n{result.stdout}\n{result.stderr}"
    (wheel,) = (root / "dist").glob("edgeq-*.whl")
    assert wheel.name in block.code, f"{block.id} names another file than {wheel.name}"
    with zipfile.ZipFile(wheel) as archive:  # pyproject's license-files
        license_text = archive.read(f"{wheel.name.split('-py3')[0]}.dist-info/licenses/LICENSE")
    assert license_text == (REPO / "LICENSE").read_bytes()
    return root


@pytest.fixture(scope="module")
def find_links(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The wheelhouse, and setuptools for a build from the clone (its build-system needs it;
    the wheelhouse holds what edgeq needs at run time)."""
    build = tmp_path_factory.mktemp("build-deps")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "--no-deps",
         "-d", str(build), "setuptools>=77"],
        check=True,
        timeout=300,
    )  # fmt: skip
    return f"{wheelhouse} {build}"


@pytest.mark.engine
@pytest.mark.parametrize("block", INSTALL_BLOCKS, ids=[block.id for block in INSTALL_BLOCKS])
def test_a_documented_install_command_works_in_a_fresh_venv(
    block: CodeBlock, clone: Path, find_links: str, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("EDGEQ_", "PIP_")) and name not in {"PYTHONPATH", "VIRTUAL_ENV"}
    }
    env |= {
        "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": find_links,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    code = block.code.replace(CLONE, str(clone))
    result = subprocess.run(
        ["bash", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"{block.id}:\n{code}\n{result.stdout}\n{result.stderr}"
    python = str(venv / "bin/python")
    probe = (
        "import importlib.util, edgeq; from edgeq import ChatClient, SyncChatClient; "
        "print(edgeq.__version__, *(importlib.util.find_spec(m) is not None "
        "for m in ('fastapi', 'vllm', 'torch')))"
    )
    version, fastapi, vllm, torch = subprocess.run(
        [python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert (vllm, torch) == ("False", "False"), "the client must not bring an engine"
    assert fastapi == str("[gateway]" in block.code)
    assert version in block.code or "dist/" not in block.code
    if "[gateway]" in block.code:
        subprocess.run(
            [str(venv / "bin/edgeq"), "gateway", "--help"], env=env, check=True,
            capture_output=True, timeout=60,
        )  # fmt: skip


def test_license_changelog_and_security_policy_are_there() -> None:
    """pyproject declares Apache-2.0: the text ships beside it and in the wheel (license-files;
    the clone fixture above checks the built wheel), with a changelog and a security policy."""
    import tomllib

    license_text = (REPO / "LICENSE").read_text()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in license_text
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "## [Unreleased]" in (REPO / "CHANGELOG.md").read_text()
    assert "docs/security.md" in (REPO / "SECURITY.md").read_text()
