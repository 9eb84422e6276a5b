"""The edgeq wheel, built from a source checkout: what ``make wheel`` writes into ``dist/`` and
what ``edgeq bundle`` puts in a bundle's wheelhouse.

Standard library only, on purpose: ``make wheel`` runs this file with the system's Python
(``python3 deploy/wheel.py dist``) on a fresh clone, before any virtualenv exists, so a
service can install the client without the engine's gigabytes. ``edgeq.deploy.bundle`` imports
it like any other module.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: Files of the checkout's top level that go into the wheel besides the package folders:
#: the README is the wheel's long description; LICENSE is pyproject's license-files.
TOP_LEVEL_FILES = ("pyproject.toml", "README.md", "LICENSE")


class WheelError(RuntimeError):
    """The wheel cannot be built; the message says why, for a person."""


def build_wheel(dest: Path, *, source: Path, version_suffix: str = "") -> Path:
    """Build the edgeq wheel from a clean copy of the source tree (so nothing is written into
    it, and no stale ``build/`` of an earlier run leaks into the wheel), with ``+<suffix>``
    appended to the version when asked (a local version label)."""
    import tomllib  # here, not on top: on Python 3.10 main() says what it needs instead

    pyproject = (source / "pyproject.toml").read_text()
    folders = sorted(set(tomllib.loads(pyproject)["tool"]["setuptools"]["package-dir"].values()))
    with tempfile.TemporaryDirectory(prefix="edgeq-wheel-") as tmp:
        copy = Path(tmp) / "src"
        copy.mkdir()
        if version_suffix:
            if not re.fullmatch(r"[A-Za-z0-9.]+", version_suffix):
                raise WheelError("--version-suffix may hold only letters, digits and dots")
            pyproject, count = re.subn(
                r'(?m)^version = "([^"+]+)"',
                lambda match: f'version = "{match.group(1)}+{version_suffix}"',
                pyproject,
            )
            if count != 1:
                raise WheelError("could not find the version line in pyproject.toml")
        for name in TOP_LEVEL_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, copy / name)
        (copy / "pyproject.toml").write_text(pyproject)
        for folder in folders:
            shutil.copytree(
                source / folder,
                copy / folder,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )
        dest.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, str(copy)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise WheelError(
                f"building the edgeq wheel failed ({' '.join(command)}):\n{result.stderr[-4000:]}"
            )
        (wheel,) = Path(tmp).glob("edgeq-*.whl")
        target = dest / wheel.name
        shutil.move(wheel, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deploy/wheel.py", description="Build the edgeq wheel from this checkout."
    )
    parser.add_argument("dest", type=Path, help="the folder the wheel is written to (dist)")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    if sys.version_info < (3, 11):  # noqa: UP036 (run by the system's Python: see above)
        print(
            f"edgeq needs Python 3.11 or newer; {sys.executable} is "
            f"{'.'.join(map(str, sys.version_info[:3]))}: run make with PYTHON=python3.11",
            file=sys.stderr,
        )
        return 1
    if importlib.util.find_spec("pip") is None:
        print(
            f"edgeq: {sys.executable} has no pip: install python3-pip, or build with the "
            "virtualenv's Python (make wheel PYTHON=.venv/bin/python)",
            file=sys.stderr,
        )
        return 1
    try:
        wheel = build_wheel(args.dest, source=args.source)
    except WheelError as error:
        print(f"edgeq: {error}", file=sys.stderr)
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
