"""What a bundle needs of the box it is installed on, read from its own wheels when it is built
and written to its manifest.json, so that install.sh can check the box before it installs
anything (docs/install.md, "What the installer checks first"):

- ``cuda``: the CUDA runtime the GPU wheels were built for and the oldest NVIDIA driver that
  runs it. A box on an older driver would install cleanly, then fail at every engine start.
- ``disk``: the bytes the release's virtualenv and the model take once installed.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

#: The oldest NVIDIA Linux driver branch for each CUDA runtime (major.minor), from NVIDIA's
#: "CUDA Toolkit and Corresponding Driver Versions" table in the CUDA Toolkit release notes
#: (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/, table 3: the driver each
#: toolkit's release ships with). Minor-version compatibility would let an older driver of the
#: same major run some of it, without PTX JIT, which vLLM's kernels may need: the table is the
#: rule. A runtime missing here stops `edgeq bundle`: add its row from that table.
MIN_DRIVER: dict[str, str] = {
    "12.8": "570",
    "12.9": "575",
    "13.0": "580",
}

#: What a virtualenv takes beyond its wheels' files. Bytecode: pip compiles one .pyc per .py,
#: 1.25 times the .py's size in a measured release (tests' CPU release, 2026-12); 1.5 here.
#: A fresh venv (pip, setuptools) measured 23 MB; 64 MB here. Generous on purpose: the check
#: must not pass a disk that the install then fills.
PYC_PER_PY = 1.5
VENV_BASE_BYTES = 64_000_000

_TORCH_CUDA = re.compile(r"^torch-[^-]+\+cu(\d+)(\d)-", re.IGNORECASE)
_CUDA_RUNTIME = re.compile(r"^nvidia_cuda_runtime(?:_cu\d+)?-(\d+)\.(\d+)[.-]", re.IGNORECASE)


class BundleNeedsError(ValueError):
    """The wheels' CUDA runtime is not one this module knows the driver for."""


class CudaNeeds(BaseModel):
    """manifest.json's ``cuda``: what install.sh compares with ``nvidia-smi``'s driver."""

    model_config = ConfigDict(frozen=True)

    runtime: str  # "13.0"
    min_driver: str  # "580": the driver branch, compared with nvidia-smi's driver_version
    read_from: str  # the wheel it was read from


class DiskNeeds(BaseModel):
    """manifest.json's ``disk``: bytes install.sh wants free where each part lands."""

    model_config = ConfigDict(frozen=True)

    release_bytes: int  # /opt/edgeq/releases/<version>: the virtualenv
    model_bytes: int  # /var/lib/edgeq/models/<name>


def cuda_runtime(wheel_names: Iterable[str]) -> tuple[str, str] | None:
    """(the CUDA runtime "13.0", the wheel it came from) that these wheels were built for, or
    None (a CPU wheelhouse). torch's local version says it (``+cu130``); PyPI's torch has
    none, and then the NVIDIA runtime wheel it depends on does (``nvidia_cuda_runtime_cu12``)."""
    names = sorted(wheel_names)
    for name in names:
        if match := _TORCH_CUDA.match(name):
            return f"{match[1]}.{match[2]}", name
    for name in names:
        if match := _CUDA_RUNTIME.match(name):
            return f"{match[1]}.{match[2]}", name
    return None


def cuda_needs(wheel_names: Iterable[str]) -> CudaNeeds | None:
    """The manifest's ``cuda`` for these wheels; None for a CPU wheelhouse."""
    found = cuda_runtime(wheel_names)
    if found is None:
        return None
    runtime, wheel = found
    if runtime not in MIN_DRIVER:
        known = ", ".join(sorted(MIN_DRIVER))
        raise BundleNeedsError(
            f"{wheel} needs CUDA {runtime}, whose minimum NVIDIA driver edgeq does not know "
            f"(it knows {known}): add it to MIN_DRIVER in edgeq/deploy/box_needs.py from "
            "NVIDIA's CUDA toolkit release notes, or build with a torch for a CUDA listed there"
        )
    return CudaNeeds(runtime=runtime, min_driver=MIN_DRIVER[runtime], read_from=wheel)


def unpacked_bytes(wheel: Path) -> tuple[int, int]:
    """(all its files, its .py files): what a wheel takes once installed, in bytes."""
    with zipfile.ZipFile(wheel) as archive:
        members = archive.infolist()
    return (
        sum(member.file_size for member in members),
        sum(member.file_size for member in members if member.filename.endswith(".py")),
    )


def disk_needs(wheels: Iterable[Path], model_bytes: int) -> DiskNeeds:
    sizes = [unpacked_bytes(wheel) for wheel in wheels]
    files = sum(size for size, _ in sizes)
    python = sum(py for _, py in sizes)
    release = files + int(python * PYC_PER_PY) + VENV_BASE_BYTES
    return DiskNeeds(release_bytes=release, model_bytes=model_bytes)
