"""A booted systemd in a ``systemd-nspawn`` container, for the box tests.

The container's root is an overlay of this machine's own root (same OS, Python and packages, as
on a box installed from the same image): every write lands in the overlay's upper directory
under /var/tmp, never in this machine's files. ``--private-network`` gives it a loopback of its
own, so its Redis, worker metrics and gateway bind nothing here. systemd runs as PID 1 *of the
container* only: never boot systemd on this machine itself (the packaging note, section 6).

    box = Box.boot(Path("/var/tmp/edgeq-box-x"), binds={host_dir: "/root/bundles"})
    box.run("systemctl is-system-running")
    box.poweroff()   # and unmounts everything; also after a failed boot

Commands run inside with ``nsenter`` into every namespace of the container's systemd, with
a clean environment (a service's, not the test runner's).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

BOOT_TIMEOUT_S = 300.0  # two containers may boot at once beside engines on 2 cores
POWEROFF_TIMEOUT_S = 120.0
# The PATH a systemd service gets.
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NSPAWN_PROPAGATION = Path("/run/systemd/nspawn")
# Services of this machine's own image that a box test has no use for (the image here has a
# PostgreSQL cluster enabled): masked in the container only, to spare CPU and memory.
MASKED = ("postgresql.service", "postgresql@.service")
CLONE_NEWNET = 0x40000000


class BoxError(RuntimeError):
    """The container did not boot or a command in it failed; the message says why."""


def why_not() -> str | None:
    """Why no container can be booted here, or None when it can."""
    if os.geteuid() != 0:
        return "the box tests boot a systemd-nspawn container: they need root"
    for tool in ("systemd-nspawn", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            package = "systemd-container" if tool == "systemd-nspawn" else "util-linux"
            return f"{tool} is not installed (apt-get install {package}; make system-deps)"
    if not Path("/proc/filesystems").read_text().count("overlay"):
        return "the kernel has no overlay file system (the container's root is an overlay)"
    return None


def _mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts)


def _umount(path: Path) -> None:
    for _ in range(10):
        if not _mounted(path):
            return
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True)


@dataclass
class Box:
    directory: Path
    nspawn: subprocess.Popen[bytes]
    pid: int = 0  # the container's systemd, as this machine numbers it
    mounted: list[Path] = field(default_factory=list)
    bundles: dict[str, str] = field(default_factory=dict)  # name -> unpacked bundle, inside
    started_at: float = field(default_factory=time.monotonic)

    # --- boot and power off ----------------------------------------------------------------

    @classmethod
    def boot(cls, directory: Path, *, binds: Mapping[Path, str] = {}) -> Box:
        """Mount the overlay, start the container; ``wait_running`` waits for the boot."""
        for sub in ("upper", "work", "root"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        root = directory / "root"
        mounted: list[Path] = []
        try:
            subprocess.run(
                ["mount", "-t", "overlay", "overlay", "-o",
                 f"lowerdir=/,upperdir={directory}/upper,workdir={directory}/work", str(root)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            mounted.append(root)
            # nspawn removes its propagation directory on exit and refuses to do that on a
            # disk file system: give it a tmpfs (stacked on any there is, removed after).
            NSPAWN_PROPAGATION.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["mount", "-t", "tmpfs", "tmpfs", str(NSPAWN_PROPAGATION)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            mounted.append(NSPAWN_PROPAGATION)
        except subprocess.CalledProcessError as error:
            for path in reversed(mounted):
                _umount(path)
            raise BoxError(f"{' '.join(error.cmd)}: {error.stderr.strip()}") from None
        units = root / "etc/systemd/system"
        for name in MASKED:
            if (root / "lib/systemd/system" / name).exists():
                target = units / name
                target.unlink(missing_ok=True)
                target.symlink_to("/dev/null")
        command = [
            "systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--link-journal=no",
            "--private-network", "-D", str(root), f"--machine=edgeq-box-{os.getpid()}",
        ]  # fmt: skip
        for source, target in binds.items():
            command.append(f"--bind-ro={source}:{target}")
        command.append("--boot")
        console = (directory / "console.log").open("wb")
        nspawn = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        console.close()
        (directory / "nspawn.pid").write_text(str(nspawn.pid))
        return cls(directory, nspawn, mounted=mounted)

    def wait_running(self, timeout_s: float = BOOT_TIMEOUT_S) -> float:
        """Until the container's systemd says ``running``; the seconds since the boot began."""
        started = self.started_at
        state = ""
        while time.monotonic() - started < timeout_s:
            if self.nspawn.poll() is not None:
                raise BoxError(
                    f"systemd-nspawn exited ({self.nspawn.returncode}):\n{self.console()}"
                )
            if not self.pid:
                children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children")
                pids = children.read_text().split() if children.exists() else []
                self.pid = int(pids[0]) if pids else 0
            if self.pid:
                state = self.run("systemctl is-system-running", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return time.monotonic() - started
            time.sleep(0.5)
        raise BoxError(f"the container is {state or 'not up'} after {timeout_s:g} s")

    def poweroff(self) -> None:
        """Power the container off (SIGKILL to nspawn if it hangs), unmount, remove it all."""
        try:
            if self.nspawn.poll() is None and self.pid:
                self.run("systemctl poweroff --no-block", check=False, timeout=30)
            try:
                self.nspawn.wait(POWEROFF_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # The container's PID 1 dies with it, and its whole PID namespace with that.
                os.killpg(self.nspawn.pid, signal.SIGKILL)
                self.nspawn.wait(30)
        finally:
            for path in reversed(self.mounted):
                _umount(path)
            self.mounted.clear()
            if not _mounted(self.directory / "root"):
                shutil.rmtree(self.directory, ignore_errors=True)

    def console(self) -> str:
        path = self.directory / "console.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    # --- inside ---------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The container's file system as its processes see it (its /run and /dev too)."""
        return Path(f"/proc/{self.pid}/root")

    def nsenter(self, *, net_only: bool = False) -> list[str]:
        """The command prefix that runs a command inside (``net_only``: only on its network,
        with this machine's files: this machine's Python reaching the container's loopback)."""
        if net_only:
            return ["nsenter", f"--net=/proc/{self.pid}/ns/net"]
        return ["nsenter", "--target", str(self.pid), "--all", "--root", "--wd"]

    def run(
        self, command: str | list[str], *, check: bool = True, timeout: float = 120,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """A shell command (or an argv) inside, as root with a service's clean environment."""
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        environment = ["env", "-i", f"PATH={PATH}", "LANG=C.UTF-8"]
        environment += [f"{key}={value}" for key, value in (env or {}).items()]
        result = subprocess.run(
            [*self.nsenter(), *environment, *argv],
            capture_output=True, text=True, timeout=timeout,
            # Not the test process's own environment: once vLLM was imported in it, it holds
            # an LD_PRELOAD of the venv's libgomp, which the loader of `env` inside the box
            # cannot find, and says so on stderr (a run where the checks' test came after an
            # engine test failed on that line).
            env={"PATH": os.environ.get("PATH", PATH)},
        )  # fmt: skip
        if check and result.returncode != 0:
            shown = command if isinstance(command, str) else shlex.join(command)
            raise BoxError(
                f"in the box: {shown} -> {result.returncode}\n{result.stdout[-3000:]}"
                f"\n{result.stderr[-3000:]}"
            )
        return result

    def socket_inside(self) -> socket.socket:
        """A TCP socket in the container's network namespace (made by a thread that joins the
        namespace and ends: a socket keeps the namespace it was made in)."""
        made: dict[str, object] = {}

        def make() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            try:
                with open(f"/proc/{self.pid}/ns/net") as namespace:
                    if libc.setns(namespace.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns into the container's network")
                made["socket"] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError as error:
                made["error"] = error

        thread = threading.Thread(target=make, name="box-netns")
        thread.start()
        thread.join()
        if "error" in made:
            raise made["error"]  # type: ignore[misc]
        return made["socket"]  # type: ignore[return-value]

    @contextlib.asynccontextmanager
    async def forward(self, port: int) -> AsyncIterator[int]:
        """A loopback port here, forwarded to ``port`` on the container's own loopback: a
        client in this process reaches the box's Redis (or gateway) as one on the box would."""
        loop = asyncio.get_running_loop()

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            inside = self.socket_inside()
            inside.setblocking(False)
            try:
                await loop.sock_connect(inside, ("127.0.0.1", port))
            except OSError:
                inside.close()
                writer.close()
                return
            inner_reader, inner_writer = await asyncio.open_connection(sock=inside)
            await asyncio.gather(pipe(reader, inner_writer), pipe(inner_reader, writer))

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        """``systemctl show`` of a unit's properties."""
        args = " ".join(f"-p {p}" for p in properties)
        out = self.run(f"systemctl show {args} {shlex.quote(unit)}").stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def state(self, unit: str) -> str:
        """ActiveState/SubState, as ``systemctl status`` prints them: ``active/running``."""
        shown = self.show(unit, "ActiveState", "SubState")
        return f"{shown['ActiveState']}/{shown['SubState']}"

    def wait_state(self, unit: str, *states: str, timeout_s: float = 300) -> str:
        """Until the unit is in one of ``states`` (``active/running`` or just ``failed``)."""
        deadline = time.monotonic() + timeout_s
        seen = ""
        while time.monotonic() < deadline:
            seen = self.state(unit)
            if seen in states or seen.split("/")[0] in states:
                return seen
            time.sleep(0.5)
        raise BoxError(
            f"{unit} is {seen}, not {' or '.join(states)} after {timeout_s:g} s:\n"
            + self.run(f"journalctl -u {shlex.quote(unit)} -n 40 --no-pager", check=False).stdout
        )

    def journal(self, unit: str, *, since_monotonic_us: int = 0) -> list[dict[str, str]]:
        """The unit's journal entries (``journalctl -o json``), systemd's own lines about it
        included, with ``__MONOTONIC_TIMESTAMP`` at or after ``since_monotonic_us``."""
        out = self.run(
            f"journalctl -u {shlex.quote(unit)} -o json --no-pager --output-fields="
            "MESSAGE,_PID,_COMM,SYSLOG_IDENTIFIER,PRIORITY,__MONOTONIC_TIMESTAMP",
            timeout=60,
        ).stdout
        entries = []
        for line in out.splitlines():
            entry = json.loads(line)
            if isinstance(entry.get("MESSAGE"), list):  # non-UTF-8 bytes
                entry["MESSAGE"] = bytes(entry["MESSAGE"]).decode(errors="replace")
            if int(entry["__MONOTONIC_TIMESTAMP"]) >= since_monotonic_us:
                entries.append(entry)
        return entries

    def cgroup_processes(self, unit: str) -> dict[int, str]:
        """Every process in the unit's cgroup (container pids): their command lines (vLLM's
        processes name themselves ``VLLM::EngineCore``, ``VLLM::Worker``)."""
        group = self.show(unit, "ControlGroup")["ControlGroup"]
        if not group:
            return {}
        script = (
            "import json, os, sys\n"
            "found = {}\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n"
            "        lines = open(f'/proc/{pid}/cgroup').read().splitlines()\n"
            "        argv = open(f'/proc/{pid}/cmdline').read().split('\\0')\n"
            "    except OSError:\n"
            "        continue\n"
            "    if any(line.split(':', 2)[2] == sys.argv[1] for line in lines):\n"
            "        vllm = argv[0].startswith('VLLM::')\n"
            "        found[pid] = argv[0].split()[0] if vllm else ' '.join(argv).strip()\n"
            "print(json.dumps(found))\n"
        )
        out = self.run(["python3", "-c", script, group]).stdout
        return {int(pid): comm for pid, comm in json.loads(out).items()}


def monotonic_us() -> int:
    """CLOCK_MONOTONIC in µs: the container shares this machine's clock, so this compares
    with the container's ``*TimestampMonotonic`` properties and journal timestamps."""
    return time.monotonic_ns() // 1000
