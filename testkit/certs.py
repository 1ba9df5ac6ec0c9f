"""Test certificates made with the openssl CLI: a CA, a server certificate for 127.0.0.1 and
localhost, client certificates, and a second CA whose client certificates the first one must refuse.

P-256 keys: quick to generate, and read by Python's ssl and by Go (Prometheus). Leaf certificates
carry the key identifiers and usages that strict verifiers (Python 3.13's default) ask for.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl")
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class PKI:
    ca: str  # the CA certificate (PEM) that signed ``server`` and ``client``
    server: Pair
    client: Pair
    rogue_client: Pair  # signed by another CA


def _run(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None, "openssl CLI not installed"
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[str, str]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _run(
        "req",
        "-x509",
        *_KEY,
        "-days",
        "2",
        "-subj",
        f"/CN=hpar test {name}",
        "-keyout",
        str(key),
        "-out",
        str(cert),
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )
    return str(cert), str(key)


def _leaf(d: Path, name: str, ca: tuple[str, str], usage: str, san: str) -> Pair:
    cert, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    ext.write_text(
        f"subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nsubjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _run("req", *_KEY, "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr), cwd=d)
    _run(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        ca[0],
        "-CAkey",
        ca[1],
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(ext),
        "-out",
        str(cert),
        cwd=d,
    )
    return Pair(str(cert), str(key))


def self_signed(d: Path) -> Pair:
    """One self-signed certificate for 127.0.0.1 and its key in ``d``: a server whose clients trust the
    certificate itself."""
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / "cert.pem", d / "key.pem"
    args = "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1"
    _run(*args.split(), "-keyout", str(key), "-out", str(cert), cwd=d)
    return Pair(str(cert), str(key))


def make_pki(d: Path) -> PKI:
    """Every file in ``d`` (created if missing)."""
    d.mkdir(parents=True, exist_ok=True)
    ca, rogue = _ca(d, "ca"), _ca(d, "rogue-ca")
    return PKI(
        ca=ca[0],
        server=_leaf(d, "server", ca, "serverAuth", "IP:127.0.0.1,DNS:localhost"),
        client=_leaf(d, "client", ca, "clientAuth", "DNS:prometheus"),
        rogue_client=_leaf(d, "rogue-client", rogue, "clientAuth", "DNS:prometheus"),
    )
