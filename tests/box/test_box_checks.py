"""install.sh on a real box refuses a GPU bundle whose CUDA needs a newer NVIDIA driver than
the box has, in one line, and installs nothing (issue #44): a booted systemd-nspawn container
of its own (no bundle with wheels is needed to be refused, so no wheelhouse either), the real
install.sh run as root with the real paths (/opt/edgeq, /etc/edgeq, the edgeq user, the
units), a GPU bundle's manifest.json as `edgeq bundle` writes it, and a fake ``nvidia-smi`` in
the container's /usr/local/bin reporting the driver each test chooses. The checks' other cases
(no nvidia-smi, another Python, disk) run outside a container in tests/test_install_checks.py.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from nspawn_box import Box, BoxError
from test_install_checks import GPU_CUDA, make_bundle

pytestmark = [pytest.mark.box, pytest.mark.engine, pytest.mark.timeout(300)]

BOXES = Path("/var/tmp")
BOX_PREFIX = "edgeq-box-"  # tests/box/conftest.py's: its sweep removes what a killed run left
BUNDLE_INSIDE = "/root/gpu-bundle"
#: What an install would have made; none of it may exist after a refusal or a --check.
INSTALLED_PATHS = (
    "/opt/edgeq",
    "/etc/edgeq",
    "/var/lib/edgeq",
    "/var/cache/edgeq",
    "/usr/lib/sysusers.d/edgeq.conf",
    "/etc/systemd/system/edgeq-worker@.service",
    "/etc/systemd/system/edgeq.target",
    "/etc/redis/redis-edgeq.conf",
)


@pytest.fixture(scope="module")
def bare_box() -> Iterator[Box]:
    """A booted container with a GPU bundle (install.sh and its manifest) in /root."""
    directory = BOXES / f"{BOX_PREFIX}{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True)
    try:
        machine = Box.boot(directory)
    except BoxError as error:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(f"no booted systemd container: {error}")
    try:
        machine.wait_running()
        python = machine.run(
            "python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'"
        ).stdout.strip()
        staging = directory / "staging"
        staging.mkdir()
        bundle = make_bundle(staging, cuda=GPU_CUDA, python=python)
        shutil.copytree(bundle, machine.root / BUNDLE_INSIDE.lstrip("/"))
        yield machine
    finally:
        machine.poweroff()


def with_driver(box: Box, driver: str) -> None:
    script = box.root / "usr/local/bin/nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *driver_version*) echo "{driver}" ;;\n'
        '  *-L*) echo "GPU 0: Fake GPU (UUID: GPU-0)" ;;\n'
        "esac\n"
    )
    script.chmod(0o755)


def nothing_installed(box: Box) -> None:
    there = [path for path in INSTALLED_PATHS if (box.root / path.lstrip("/")).exists()]
    assert there == []
    assert box.run("getent passwd edgeq", check=False).returncode == 2  # no such user


def test_an_old_driver_is_refused_in_one_line_and_nothing_is_installed(bare_box: Box) -> None:
    nothing_installed(bare_box)  # the container starts clean
    with_driver(bare_box, "570.133.20")
    result = bare_box.run(f"cd {BUNDLE_INSIDE} && bash install.sh", check=False, timeout=120)
    assert result.returncode == 78, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(
        "edgeq install: refused: this box's NVIDIA driver is 570.133.20; "
        "this bundle's CUDA 13.0 needs driver 580 or newer: update the driver"
    )
    nothing_installed(bare_box)


def test_a_new_driver_passes_the_checks(bare_box: Box) -> None:
    with_driver(bare_box, "580.65.06")
    result = bare_box.run(f"cd {BUNDLE_INSIDE} && bash install.sh --check", timeout=120)
    assert "NVIDIA driver 580.65.06 >= 580 (CUDA 13.0)" in result.stdout
    assert "nothing installed (--check)" in result.stdout
    nothing_installed(bare_box)

