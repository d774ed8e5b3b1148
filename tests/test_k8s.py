"""deploy/k8s: every manifest valid against Kubernetes' own schemas (`kubernetes-validate --strict`,
whose schemas ship in the wheel: nothing is fetched), and the properties a production rollout relies
on, read from the YAML and checked against the code's own constants."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.settings import REDIS_MODES, CommonSettings, WorkerSettings
from worker.server.main import EXIT_WATCHDOG_S

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
# Seconds between the worker's watchdog exit and the kubelet's SIGKILL, at the least.
GRACE_MARGIN_S = 10


def manifests() -> dict[str, dict[str, Any]]:
    return {
        p.name: yaml.safe_load(p.read_text())
        for p in sorted(K8S.glob("*.yaml"))
        if p.name != "kustomization.yaml"
    }


def by_kind(kind: str, name: str) -> dict[str, Any]:
    found = [m for m in manifests().values() if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def test_every_manifest_passes_strict_schema_validation() -> None:
    if not VALIDATE.exists():
        pytest.skip("kubernetes-validate (a dev dependency) is not installed")
    files = [str(K8S / name) for name in manifests()]
    done = subprocess.run([str(VALIDATE), "--strict", *files], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed for resource ") == len(files), done.stdout


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(manifests())
    assert [image["name"] for image in kustomization["images"]] == ["microturn"]


def test_gateways_are_replicated_probed_scaled_and_budgeted() -> None:
    gateway = by_kind("Deployment", "gateway")
    assert gateway["spec"]["replicas"] >= 2
    c = container(gateway)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--auth=on" in c["args"]
    hpa = by_kind("HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "gateway" and hpa["spec"]["minReplicas"] >= 2
    assert by_kind("PodDisruptionBudget", "gateway")["spec"]["minAvailable"] >= 1
    assert by_kind("Service", "gateway")["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]


def test_workers_take_a_gpu_advertise_their_pod_ip_and_outlast_their_drain() -> None:
    worker = by_kind("StatefulSet", "worker")
    spec = worker["spec"]["template"]["spec"]
    c = container(worker)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "--advertise-url=ws://$(POD_IP):8100" in c["args"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"  # unready while draining
    drain = [a for a in c["args"] if a.startswith("--drain-timeout-s=")]
    drain_s = float(drain[0].split("=")[1]) if drain else WorkerSettings.drain_timeout_s
    # The worker exits by drain + EXIT_WATCHDOG_S at the latest; the kubelet must not kill it first.
    assert spec["terminationGracePeriodSeconds"] >= drain_s + EXIT_WATCHDOG_S + GRACE_MARGIN_S
    assert by_kind("PodDisruptionBudget", "worker")["spec"]["maxUnavailable"] == 1


def test_the_link_secret_comes_from_a_secret_in_every_process() -> None:
    for workload in (by_kind("Deployment", "gateway"), by_kind("StatefulSet", "worker")):
        env = {e["name"]: e for e in container(workload)["env"]}
        ref = env["MT_LINK_SECRET"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("microturn-link", "MT_LINK_SECRET")
        assert "value" not in env["MT_LINK_SECRET"]
        assert container(workload)["envFrom"] == [{"configMapRef": {"name": "microturn"}}]
    config = by_kind("ConfigMap", "microturn")["data"]
    assert "MT_REDIS_URL" in config
    # The mode the settings parser accepts, pointed at an external Redis Cluster.
    assert config["MT_REDIS_MODE"] == "cluster" and "cluster" in REDIS_MODES


def test_the_ingress_terminates_tls_from_a_secret_and_outwaits_the_idle_timeout() -> None:
    ingress = by_kind("Ingress", "gateway")
    spec = ingress["spec"]
    (tls,) = spec["tls"]
    assert tls["secretName"] and tls["hosts"]
    hosts = {rule["host"] for rule in spec["rules"]}
    assert set(tls["hosts"]) == hosts  # every host it serves is covered by the certificate
    service = by_kind("Service", "gateway")
    ports = {p["name"] for p in service["spec"]["ports"]}
    for rule in spec["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == "gateway" and backend["port"]["name"] in ports
    # nginx must not cut a quiet realtime socket before the session's idle timeout does.
    config = by_kind("ConfigMap", "microturn")["data"]
    idle_s = float(config.get("MT_IDLE_TIMEOUT_S", CommonSettings.idle_timeout_s))
    annotations = ingress["metadata"]["annotations"]
    for name in ("proxy-read-timeout", "proxy-send-timeout"):
        assert float(annotations[f"nginx.ingress.kubernetes.io/{name}"]) > idle_s, name
