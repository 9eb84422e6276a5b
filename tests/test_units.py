"""The systemd units, checked offline: `systemd-analyze verify` must say nothing at all (it
only warns, with status 0, on an unknown key or a bad value), and `systemd-analyze security`
must rate the worker 2.5 or better. No systemd manager runs here (see README)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edgeq.deploy.bundle import UNIT_SUFFIXES  # systemd/ also holds an __init__.py
from helpers import FIGURES

UNITS = Path(__file__).resolve().parents[1] / "systemd"
WORKER = "edgeq-worker@.service"
GATEWAY_UNIT = "edgeq-gateway.service"
EXEC = "/opt/edgeq/current/bin/edgeq"
MAX_EXPOSURE = 2.5
# The gateway needs no devices and no JIT: it can be locked down further than the worker.
MAX_GATEWAY_EXPOSURE = 2.0
# One per GPU, the CPU box's, and one spanning two GPUs (tensor parallel: "0,1", escaped).
INSTANCES = ["edgeq-worker@0.service", "edgeq-worker@cpu.service", r"edgeq-worker@0\x2c1.service"]


def unit_files() -> list[Path]:
    return [path for path in UNITS.iterdir() if path.suffix in UNIT_SUFFIXES]


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """The units as shipped, except that ExecStart points at an executable that exists here
    (verify refuses a missing binary; the real one exists only after install.sh)."""
    stub = tmp_path / "bin" / "edgeq"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    for unit in unit_files():
        text = unit.read_text()
        if unit.name.endswith(".service"):
            assert text.count(f"ExecStart={EXEC} ") == 1
            text = text.replace(f"ExecStart={EXEC} ", f"ExecStart={stub} ")
        (units / unit.name).write_text(text)
    for instance in INSTANCES:
        (units / instance).write_text((units / WORKER).read_text())
    return units


def analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: scripts/install-system-deps.sh installs it")
    return subprocess.run(
        ["systemd-analyze", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_the_units_are_what_the_installer_expects() -> None:
    assert sorted(p.name for p in unit_files()) == [
        "edgeq-gateway.service",
        "edgeq-worker@.service",
        "edgeq.target",
    ]


def test_systemd_analyze_verify_says_nothing(unit_dir: Path) -> None:
    names = [f"./{name}" for name in ["edgeq.target", WORKER, *INSTANCES]]
    result = analyze("verify", "--man=no", *names, cwd=unit_dir)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and output == "", output


def test_worker_unit_security_exposure(unit_dir: Path) -> None:
    result = analyze("security", "--offline=true", "./edgeq-worker@0.service", cwd=unit_dir)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", result.stdout)
    assert match, result.stdout + result.stderr
    score = float(match.group(1))
    print(f"systemd-analyze security: edgeq-worker@0.service exposure {score} {match.group(2)}")
    assert score <= MAX_EXPOSURE, result.stdout


def test_worker_unit_keeps_the_gpu_and_the_drain() -> None:
    """What hardening must not take away, and the lifecycle settings the worker relies on."""
    text = (UNITS / WORKER).read_text()
    settings = re.findall(r"(?m)^(\w+)=(.*)$", text)
    keys = {key for key, _ in settings}

    def values(key: str) -> list[str]:
        return [value for k, value in settings if k == key]

    assert values("Type") == ["notify"] and values("KillMode") == ["mixed"]
    assert values("RestartPreventExitStatus") == ["78"] and values("Restart") == ["on-failure"]
    assert "MemoryDenyWriteExecute" not in keys
    assert values("PrivateDevices") == ["no"] and values("DevicePolicy") == ["closed"]
    allowed = " ".join(values("DeviceAllow"))
    for device in ("/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend", "char-nvidia-caps"):
        assert device in allowed
    families = values("RestrictAddressFamilies")[0].split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)
    assert "redis-server.service" in values("Wants")[0] and "Requires" not in keys
    stop_s = int(values("TimeoutStopSec")[0].rstrip("s"))
    assert stop_s > 30 + 60  # EDGEQ_DRAIN_TIMEOUT_S's default plus engine shutdown
    assert values("EnvironmentFile") == ["/etc/edgeq/edgeq.env", "-/etc/edgeq/edgeq-%I.env"]


def test_gateway_unit_passes_systemd_analyze_verify(unit_dir: Path) -> None:
    names = ["./edgeq.target", f"./{GATEWAY_UNIT}", f"./{WORKER}", "./edgeq-worker@0.service"]
    (unit_dir / "edgeq-worker@0.service").write_text((unit_dir / WORKER).read_text())
    result = analyze("verify", "--man=no", *names, cwd=unit_dir)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and output == "", output


def test_gateway_unit_security_exposure(unit_dir: Path) -> None:
    result = analyze("security", "--offline=true", f"./{GATEWAY_UNIT}", cwd=unit_dir)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", result.stdout)
    assert match, result.stdout + result.stderr
    score = float(match.group(1))
    print(f"systemd-analyze security: {GATEWAY_UNIT} exposure {score} {match.group(2)}")
    FIGURES[f"systemd-analyze security {GATEWAY_UNIT}"] = f"{score} {match.group(2)}"
    assert score <= MAX_GATEWAY_EXPOSURE, result.stdout


def test_gateway_unit_settings() -> None:
    settings = re.findall(r"(?m)^(\w+)=(.*)$", (UNITS / GATEWAY_UNIT).read_text())

    def values(key: str) -> list[str]:
        return [value for k, value in settings if k == key]

    assert values("ExecStart") == ["/opt/edgeq/current/bin/edgeq gateway"]
    assert values("User") == ["edgeq"] and values("Type") == ["exec"]
    assert values("EnvironmentFile") == ["/etc/edgeq/edgeq.env", "-/etc/edgeq/edgeq-gateway.env"]
    assert values("Restart") == ["on-failure"] and values("RestartPreventExitStatus") == ["78"]
    assert values("StartLimitBurst") and values("StartLimitIntervalSec")
    assert values("PartOf") == ["edgeq.target"] and values("WantedBy") == ["edgeq.target"]
    assert "redis-server.service" in values("Wants")[0] and not values("Requires")
    assert values("KillSignal") == ["SIGTERM"]
    assert int(values("TimeoutStopSec")[0].rstrip("s")) > 30  # EDGEQ_GATEWAY_SHUTDOWN_TIMEOUT_S
    assert values("PrivateDevices") == ["yes"]
    assert values("RestrictAddressFamilies") == ["AF_UNIX AF_INET AF_INET6"]
