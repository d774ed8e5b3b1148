"""compose.yaml and the Dockerfile agree with the CLI (#28).

Every command compose.yaml runs (and the `keys` commands its header tells users to run) parses with
`microturn`'s own argument parser; every `MT_` variable a service or the image sets is one that
command's settings read; each healthcheck probes the port its command serves on.

The CLI is reached through its public entry, pyproject's `[project.scripts] microturn` (what the
Dockerfile's ENTRYPOINT runs), not a module path, so this follows the CLI wherever it lives. The
parse is the real one; it stops there: `ArgumentParser.parse_args` hands its result back instead
of letting the command go on to load a model or bind a port.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pkgutil
import re
import shlex
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

import shared.settings
from shared.settings import ENV_PREFIX, GatewaySettings, WorkerSettings, from_sources
from tests.compose import ROOT, USER_MODEL, compose_config

COMPOSE_FILES = {"stack": ("compose.yaml",), "gpu": ("compose.yaml", "compose.gpu.yaml")}
DOCKERFILE = (ROOT / "Dockerfile").read_text()


class Parsed(Exception):
    """What the CLI's parser made of a command line: raised where the command would go on to run."""

    def __init__(self, prog: str, namespace: argparse.Namespace) -> None:
        super().__init__(prog)
        self.prog = prog
        self.namespace = namespace


def script_name_and_entry() -> tuple[str, Callable[[list[str]], int]]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    [(name, target)] = scripts.items()
    return name, pkgutil.resolve_name(target)  # type: ignore[no-any-return]


@pytest.fixture
def parse(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[[list[str]], Parsed]:
    """`parse(argv)`: the CLI's parse of `microturn ARGV`; a usage error fails with argparse's words."""
    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise Parsed(self.prog, real_parse_args(self, *args, **kwargs))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    _, entry = script_name_and_entry()

    def run(argv: list[str]) -> Parsed:
        try:
            status = entry(argv)
        except Parsed as parsed:
            return parsed
        except SystemExit as exc:
            pytest.fail(f"microturn {shlex.join(argv)}: exit {exc.code}: {capsys.readouterr().err}")
        pytest.fail(f"microturn {shlex.join(argv)}: returned {status} without parsing its arguments")

    return run


def settings_class(namespace: argparse.Namespace) -> type[Any]:
    """The settings dataclass whose fields are exactly the parsed flags (one per field)."""
    candidates = [
        cls
        for cls in vars(shared.settings).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == shared.settings.__name__
    ]
    matches = [cls for cls in candidates if {f.name for f in dataclasses.fields(cls)} == set(vars(namespace))]
    assert len(matches) == 1, f"no single settings class has the flags {sorted(vars(namespace))}"
    return matches[0]


def env_names(cls: type[Any]) -> set[str]:
    return {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(cls)}


def microturn_services(files: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The services built from this repository's Dockerfile (the rest, Valkey, is someone else's)."""
    env = USER_MODEL if "compose.gpu.yaml" in files else None
    for name, service in compose_config(*files, env=env)["services"].items():
        if "build" in service:
            yield name, service


@pytest.mark.parametrize("kind", sorted(COMPOSE_FILES))
def test_each_service_command_parses_and_its_mt_variables_are_settings(
    kind: str, parse: Callable[[list[str]], Parsed]
) -> None:
    services = dict(microturn_services(COMPOSE_FILES[kind]))
    assert services, f"{kind}: no service runs the microturn image"
    for name, spec in services.items():
        check_service(name, spec, parse(spec["command"]))


def check_service(name: str, spec: dict[str, Any], parsed: Parsed) -> None:
    cls = settings_class(parsed.namespace)
    environment: Mapping[str, str] = spec.get("environment") or {}
    unread = {key for key in environment if key.startswith(ENV_PREFIX)} - env_names(cls)
    assert not unread, f"{name}: {sorted(unread)} are read by no field of {cls.__name__}"
    # Flags and environment together make valid settings (types, choices, checks in __post_init__).
    settings = from_sources(cls, parsed.namespace, env=environment)
    # The healthcheck asks the very port the command serves on, from inside the container.
    assert f"//127.0.0.1:{settings.port}/readyz" in " ".join(spec["healthcheck"]["test"])


def test_the_stack_runs_a_worker_and_a_gateway(parse: Callable[[list[str]], Parsed]) -> None:
    services = microturn_services(COMPOSE_FILES["stack"])
    kinds = {settings_class(parse(spec["command"]).namespace) for _, spec in services}
    assert kinds == {WorkerSettings, GatewaySettings}


def keys_commands() -> list[tuple[str, list[str]]]:
    """The `docker compose run --rm SERVICE ARGS...` lines of compose.yaml's header."""
    text = (ROOT / "compose.yaml").read_text()
    found = re.findall(r"^#\s+docker compose run --rm (\S+) (.+)$", text, re.MULTILINE)
    return [(svc, shlex.split(args)) for svc, args in found]


def test_the_header_keys_commands_parse_in_a_microturn_service(parse: Callable[[list[str]], Parsed]) -> None:
    commands = keys_commands()
    assert {args[1] for _, args in commands} == {"create", "list", "revoke"}
    built = {name for name, _ in microturn_services(COMPOSE_FILES["stack"])}
    for svc, args in commands:
        assert svc in built, f"`docker compose run {svc}` does not run the microturn image"
        parsed = parse(args)
        assert parsed.namespace.action == args[1]


def test_what_the_cli_does_not_read_fails_the_check(parse: Callable[[list[str]], Parsed]) -> None:
    # The checks above can fail: a flag the parser lacks, a value the settings refuse, a misspelt
    # variable no setting reads, a healthcheck on the wrong port.
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --max-turns=4"):
        parse(["worker", "--port=8100", "--max-turns=4"])
    probe = {"test": ["CMD", "python", "-c", "urlopen('http://127.0.0.1:8000/readyz')"]}
    gateway = ["gateway", "--port=8000"]
    check_service("ok", {"command": gateway, "healthcheck": probe}, parse(gateway))
    with pytest.raises(ValueError, match="auth: 'maybe' is not one of on, off"):
        check_service("bad", {"command": gateway, "healthcheck": probe}, parse([*gateway, "--auth=maybe"]))
    misspelt = {"MT_REDIS_ULR": "redis://valkey:6379/0"}
    with pytest.raises(AssertionError, match="MT_REDIS_ULR"):
        check_service("bad", {"environment": misspelt, "healthcheck": probe}, parse(gateway))
    with pytest.raises(AssertionError, match="8000/readyz"):
        check_service("bad", {"healthcheck": probe}, parse(["gateway", "--port=8001"]))


def dockerfile_instruction(name: str) -> list[str]:
    return re.findall(rf"^{name} (.+)$", DOCKERFILE, re.MULTILINE)


def test_the_dockerfile_runs_the_cli_and_sets_only_settings_it_reads() -> None:
    script, entry = script_name_and_entry()
    [entrypoint] = dockerfile_instruction("ENTRYPOINT")
    assert json.loads(entrypoint) == [script]
    [cmd] = dockerfile_instruction("CMD")
    assert entry(json.loads(cmd)) == 0  # the image's default command: the CLI's help, not an error
    settings_env = env_names(WorkerSettings) | env_names(GatewaySettings)
    assigned = {pair.split("=", 1)[0] for line in dockerfile_instruction("ENV") for pair in shlex.split(line)}
    assert not {key for key in assigned if key.startswith(ENV_PREFIX)} - settings_env


def test_the_image_healthcheck_probes_both_kinds_on_their_default_ports() -> None:
    [healthcheck] = dockerfile_instruction("HEALTHCHECK")
    probe = json.loads(healthcheck.split(" CMD ", 1)[1])
    ports = {GatewaySettings.port, WorkerSettings.port}
    assert f"for port in ({GatewaySettings.port}, {WorkerSettings.port})" in probe[-1]
    [exposed] = dockerfile_instruction("EXPOSE")
    assert {int(port) for port in exposed.split()} == ports
