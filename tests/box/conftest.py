"""Fixtures of the box tests: one booted container per module, with the bundles bound in.

Booting needs root, ``systemd-nspawn`` (Debian: systemd-container, which
scripts/install-system-deps.sh installs) and the overlay file system; without them every box
test is skipped at collection, before the wheelhouse is built, with the reason, which the run's
short summary prints (``-rfEs`` in pyproject.toml's addopts): a CI run that lost the box tests
says so. ``EDGEQ_BOX_TESTS=0`` skips them on purpose.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from nspawn_box import Box, BoxError, why_not

from edgeq.testing.tiny_model import make_tiny_model
from helpers import FIGURES

BOXES = Path("/var/tmp")
BOX_PREFIX = "edgeq-box-"
BUNDLES_INSIDE = "/root/bundles"
UPGRADE_SUFFIX = "b2"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "box: boots systemd in a systemd-nspawn container (root; skipped where it cannot)",
    )


def why_no_box() -> str | None:
    """Why the box tests cannot (or must not) run here, or None."""
    return "EDGEQ_BOX_TESTS=0" if os.environ.get("EDGEQ_BOX_TESTS") == "0" else why_not()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    box_tests = [item for item in items if item.path.is_relative_to(here)]
    reason = why_no_box() if box_tests else None
    if reason:
        skip = pytest.mark.skip(reason=f"box tests skipped, no booted systemd container: {reason}")
        for item in box_tests:
            item.add_marker(skip)


def _sweep_stale_boxes() -> None:
    """Remove what an earlier run killed before its teardown left behind (its nspawn gone)."""
    for directory in BOXES.glob(f"{BOX_PREFIX}*"):
        pid_file = directory / "nspawn.pid"
        try:
            os.kill(int(pid_file.read_text()), 0)
            continue  # still running: another run's
        except (OSError, ValueError):
            pass
        root = str(directory / "root")
        with open("/proc/self/mounts") as mounts:
            if any(line.split()[1] == root for line in mounts):
                subprocess.run(["umount", "--lazy", root], capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def box(wheelhouse: Path) -> Iterator[Box]:
    """A booted container with ``box.bundles``: the v1 and v2 (``+b2``) CPU bundles with the
    tiny model, unpacked, as paths inside it. Powered off and unmounted at the end, also when a
    test or the boot fails."""
    # (Where why_no_box() gives a reason, the box tests are skipped before this runs.)
    from test_packaging import build_bundle  # the bundle exactly as the packaging tests build

    _sweep_stale_boxes()
    directory = BOXES / f"{BOX_PREFIX}{uuid.uuid4().hex[:8]}"
    bundles = directory / "bundles"
    bundles.mkdir(parents=True)
    started = time.monotonic()
    try:
        machine = Box.boot(directory, binds={bundles: BUNDLES_INSIDE})
    except BoxError as error:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(f"no booted systemd container: {error}")
    try:
        # Built while the container boots.
        model = make_tiny_model(directory / "model" / "tiny-qwen3").directory
        built = {}
        for name, suffix in (("v1", ()), ("v2", ("--version-suffix", UPGRADE_SUFFIX))):
            top = build_bundle(bundles / name, model, wheelhouse, *suffix)
            built[name] = f"{BUNDLES_INSIDE}/{top.relative_to(bundles)}"
        boot_s = machine.wait_running()
        FIGURES["box: container booted, bundles built (s)"] = round(time.monotonic() - started, 1)
        FIGURES["box: systemd in the container running after (s)"] = round(boot_s, 1)
        version = machine.run("systemctl --version").stdout.split("\n", 1)[0]
        FIGURES["box: systemd in the container"] = re.sub(r"\s*\(.*", "", version)
        machine.bundles = built
        yield machine
    finally:
        stopped = time.monotonic()
        machine.poweroff()
        FIGURES["box: powered off and unmounted in (s)"] = round(time.monotonic() - stopped, 1)
