"""TLS on the gateway's own port (#25): the flags and `MT_` variables, `microturn up` passing them on,
and a certificate that cannot serve stopping the gateway at start-up with a message naming the file.
The conversation over wss with a real SDK is tests/system/gateway/test_openai_sdks.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from gateway.main import tls_problem
from microturn.stack import Stack, StackOptions
from shared.settings import GatewaySettings, UpSettings, parse_settings
from tests.processes import REPO
from tests.shared.tls import Certificate, self_signed


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    made = self_signed(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.skip("openssl is not installed: no certificate to test with")
    return made


def settings(cert: Path | str, key: Path | str) -> GatewaySettings:
    return parse_settings(
        GatewaySettings, ["--tls-cert-file", str(cert), "--tls-key-file", str(key)], "microturn gateway"
    )


def test_a_good_pair_serves_and_each_bad_file_is_named(cert: Certificate, tmp_path: Path) -> None:
    assert tls_problem(settings(cert.cert, cert.key)) is None
    assert tls_problem(GatewaySettings()) is None  # no TLS asked
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    missing = tmp_path / "missing.pem"
    for problem_cert, problem_key, named in (
        (missing, cert.key, f"--tls-cert-file {missing}: cannot be read"),
        (cert.cert, missing, f"--tls-key-file {missing}: cannot be read"),
        (junk, cert.key, f"--tls-cert-file {junk}: not a PEM certificate"),
        (cert.cert, junk, f"--tls-key-file {junk}: not the PEM private key"),
    ):
        problem = tls_problem(settings(problem_cert, problem_key))
        assert problem is not None and problem.startswith(named), problem


def test_one_file_without_the_other_is_refused(monkeypatch: pytest.MonkeyPatch, cert: Certificate) -> None:
    with pytest.raises(ValueError, match="both --tls-cert-file and --tls-key-file"):
        GatewaySettings(tls_cert_file=str(cert.cert))
    monkeypatch.setenv("MT_TLS_CERT_FILE", str(cert.cert))
    monkeypatch.setenv("MT_TLS_KEY_FILE", str(cert.key))
    from_env = parse_settings(GatewaySettings, [], "microturn gateway")
    assert from_env.tls and from_env.tls_key_file == str(cert.key)


def test_the_gateway_exits_at_start_naming_an_unreadable_certificate(
    tmp_path: Path, cert: Certificate
) -> None:
    missing = tmp_path / "nowhere" / "cert.pem"
    args = ["gateway", "--auth", "off", "--port", "0", "--tls-cert-file", str(missing)]
    done = subprocess.run(
        [sys.executable, "-m", "microturn", *args, "--tls-key-file", str(cert.key)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert f"--tls-cert-file {missing}: cannot be read" in done.stderr


class _Recording(Stack):
    """`microturn up`'s stack, recording what it would start instead of starting it."""

    def __init__(self, options: StackOptions) -> None:
        super().__init__(options)
        self.started: list[Sequence[str]] = []

    def _spawn(self, name: str, argv: Sequence[str], stop_timeout_s: float) -> object:  # type: ignore[override]
        self.started.append(list(argv))
        return None

    def _wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        pass


def test_microturn_up_passes_the_pair_to_its_gateway(cert: Certificate) -> None:
    flags = ["--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key)]
    up = parse_settings(UpSettings, flags, "microturn up")
    stack = _Recording(StackOptions(tls_cert_file=up.tls_cert_file, tls_key_file=up.tls_key_file))
    stack.start_gateway()
    (argv,) = stack.started
    assert argv[argv.index("--tls-cert-file") + 1] == str(cert.cert)
    assert argv[argv.index("--tls-key-file") + 1] == str(cert.key)
    assert stack.local_url.startswith("https://")
