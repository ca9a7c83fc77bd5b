"""A throwaway PKI for tests and demos, made with the `openssl` command: a CA, a server certificate
for loopback, a client certificate, and a rogue CA with a client of its own."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    """`name.pem` and `name.key`: a self-signed CA valid for two days."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def make_leaf(d: Path, name: str, ca: str, san: str, usage: str) -> None:
    """`name.pem` and `name.key` signed by the CA `ca`, with subjectAltName `san` and
    extendedKeyUsage `usage` (serverAuth, clientAuth)."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
             cwd=d)


def make_pki(d: Path) -> Path:
    """In `d`: ca.pem/.key, server.pem/.key (127.0.0.1, localhost), client.pem/.key, and
    rogue_ca.pem/.key with rogue_client.pem/.key. Returns `d`."""
    make_ca(d, "ca")
    make_ca(d, "rogue_ca")
    make_leaf(d, "server", "ca", "IP:127.0.0.1,DNS:localhost", "serverAuth")
    make_leaf(d, "client", "ca", "DNS:trainer", "clientAuth")
    make_leaf(d, "rogue_client", "rogue_ca", "DNS:trainer", "clientAuth")
    return d
