"""Throw-away TLS material for a test Redis: a CA and a server certificate it signed.

Made with the ``openssl`` command (Debian's ``openssl`` package), valid one day, for
127.0.0.1 and localhost, so clients can verify both the chain and the host name.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

VALID_DAYS = "1"
SERVER_NAMES = "subjectAltName=IP:127.0.0.1,DNS:localhost"


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    certificate: Path
    key: Path


def _openssl(*args: str | Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise FileNotFoundError("openssl is not installed (apt-get install openssl)")
    subprocess.run([binary, *map(str, args)], check=True, capture_output=True)


def _key(path: Path) -> Path:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", path)
    return path


def make_ca(directory: Path, name: str = "edgeq test CA") -> tuple[Path, Path]:
    """(certificate, key) of a new self-signed CA in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    key = _key(directory / "ca.key")
    certificate = directory / "ca.pem"
    _openssl("req", "-x509", "-new", "-key", key, "-out", certificate, "-days", VALID_DAYS,
             "-subj", f"/CN={name}")  # fmt: skip
    return certificate, key


def make_tls_files(directory: Path) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1 / localhost that it signed."""
    ca, ca_key = make_ca(directory)
    key = _key(directory / "server.key")
    request = directory / "server.csr"
    _openssl("req", "-new", "-key", key, "-out", request, "-subj", "/CN=localhost")
    names = directory / "server.ext"
    names.write_text(SERVER_NAMES + "\n")
    certificate = directory / "server.pem"
    _openssl("x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
             "-out", certificate, "-days", VALID_DAYS, "-extfile", names)  # fmt: skip
    return TlsFiles(ca=ca, certificate=certificate, key=key)


def rediss_url(port: int, ca: Path) -> str:
    """A ``rediss://`` URL that verifies the server's chain against ``ca`` and its name."""
    return (
        f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
        f"&ssl_check_hostname=true"
    )
