"""A throwaway certificate authority for TLS tests: one self-signed certificate for 127.0.0.1.

Why openssl's command line: it is on every machine the suite runs on, and the `cryptography`
package is not a dependency. The test that asks for TLS skips, saying why, where openssl is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificate:
    cert: Path  # also the CA the client trusts: it is self-signed
    key: Path

    def query(self) -> str:
        """What a rediss:// URL adds so redis-py trusts this certificate."""
        return f"ssl_ca_certs={self.cert}"


def self_signed(workdir: Path) -> Certificate | None:
    """A certificate for 127.0.0.1 in `workdir`; None when openssl is not installed."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = workdir / "tls-cert.pem", workdir / "tls-key.pem"
    if not cert.exists():
        request = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        subject = ["-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
        subprocess.run(
            [openssl, *request, *subject],
            check=True,
            capture_output=True,
            timeout=60,
        )
    return Certificate(cert, key)
