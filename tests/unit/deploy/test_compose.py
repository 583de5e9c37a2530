"""docker-compose.yml and its CPU override: valid against the compose specification's JSON schema (as
vendored by `check-jsonschema`), GPUs reserved as the 4-GPU node plan says, the config mounted and the token
kept out of the file, and ports that agree with the configs, the health checks and Prometheus."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

from asyncrlhf.config import load_config
from tests.unit.deploy.helpers import (
    DATA_PORT,
    DEPLOY,
    GRPC_PORT,
    ROOT,
    SERVICE_PORTS,
    compose_schema,
    load_compose,
    merge_compose,
)

pytestmark = pytest.mark.unit
COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = DEPLOY / "compose" / "cpu.yml"
ASYNCRLHF = ("generator", "reward", "learner", "evaluator")


@pytest.fixture(scope="module")
def gpu() -> dict:
    return load_compose(COMPOSE)


@pytest.fixture(scope="module")
def cpu(gpu) -> dict:
    return merge_compose(gpu, load_compose(CPU_OVERRIDE))


def schema_errors(doc: dict) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_compose_file_and_cpu_stack_validate_against_the_compose_spec(gpu, cpu):
    assert schema_errors(gpu) == []
    assert schema_errors(cpu) == []


def test_the_schema_rejects_a_broken_compose_file(gpu):
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["learner"]["deploy"]["resources"]["reservations"]["devices"][0]["gpus"] = 3
    broken["services"]["redis"]["restart"] = ["always"]
    assert len(schema_errors(broken)) >= 2


def devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_gpu_zero_generates_and_gpus_one_to_three_train_with_three_processes(gpu):
    s = gpu["services"]
    assert [d["device_ids"] for d in devices(s["generator"])] == [["0"]]
    assert [d["device_ids"] for d in devices(s["learner"])] == [["1", "2", "3"]]
    assert all(
        d["driver"] == "nvidia" and d["capabilities"] == ["gpu"]
        for name in ASYNCRLHF
        for d in devices(s[name])
    )
    assert devices(s["reward"]) == [], "the rule scorer runs on the CPU"
    entry = s["learner"]["entrypoint"]
    assert entry[:2] == ["torchrun", "--standalone"] and entry[entry.index("--nproc_per_node") + 1] == "3"
    assert entry[-2:] == ["-m", "services.learner"]


def test_cpu_override_drops_every_gpu_and_uses_the_cpu_image_and_tiny_config(cpu):
    for name in ASYNCRLHF:
        service = cpu["services"][name]
        assert devices(service) == [], name
        assert service["image"] == "asyncrlhf:cpu" and service["build"]["target"] == "cpu"
        assert "./configs/tiny.yaml:/etc/asyncrlhf/run.yaml:ro" in service["volumes"]
    assert cpu["services"]["learner"]["entrypoint"] == ["asyncrlhf", "learner"]
    assert "generator.backend=hf" in cpu["services"]["generator"]["command"]


def test_config_is_mounted_read_only_and_the_token_comes_from_an_env_file(gpu):
    assert "ASYNCRLHF_TOKEN" not in COMPOSE.read_text()
    for name in ASYNCRLHF:
        service = gpu["services"][name]
        assert service["env_file"] == ["deploy/compose/asyncrlhf.env"]
        mounts = [v for v in service["volumes"] if "/etc/asyncrlhf/" in v]
        assert mounts and all(v.endswith(":ro") for v in mounts)
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    example = (DEPLOY / "compose" / "asyncrlhf.env.example").read_text()
    assert "ASYNCRLHF_TOKEN=" in example
    assert "*.env" in (DEPLOY / "compose" / ".gitignore").read_text()
    assert "--appendonly" in gpu["services"]["redis"]["command"]
    grafana = gpu["services"]["grafana"]["environment"]
    assert (
        grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    )


@pytest.mark.parametrize("run_config", ["configs/node4gpu.yaml", "configs/tiny.yaml"])
def test_container_layer_loads_on_each_run_config_with_the_fixed_ports(run_config):
    cfg = load_config([ROOT / run_config, DEPLOY / "compose" / "container.yaml"], ["run.token=t"])
    assert {s: getattr(cfg, s).http_port for s in SERVICE_PORTS} == SERVICE_PORTS
    assert cfg.generator.grpc_port == GRPC_PORT and cfg.generator.advertise_host == "generator"
    assert cfg.generator.data_channel and cfg.generator.data_port == DATA_PORT
    assert cfg.redis.url == "redis://redis:6379/0"


def test_node4gpu_config_is_the_plan_the_compose_file_runs(gpu):
    from asyncrlhf.planning.memory import GIB
    from asyncrlhf.planning.plan import make_plan

    cfg = load_config([ROOT / "configs" / "node4gpu.yaml"])
    assert cfg.generator.backend == "vllm"
    assert cfg.learner.deepspeed.zero_stage == 2 and cfg.learner.deepspeed.bf16
    assert {s: getattr(cfg, s).http_port for s in SERVICE_PORTS} == SERVICE_PORTS
    # one 4-GPU node: the evaluator shares GPU 0 with the generator, in what vLLM's share leaves
    reserved = {name: [i for d in devices(gpu["services"][name]) for i in d["device_ids"]]
                for name in ASYNCRLHF}
    assert {name: ",".join(ids) for name, ids in reserved.items() if ids} == cfg.launch.gpus
    assert sorted({i for ids in reserved.values() for i in ids}) == ["0", "1", "2", "3"]
    plan = make_plan(cfg, gpus=4, gpu_bytes=80 * GIB)
    assert plan.fits, plan.refusals()
    assert {p.service: p.devices for p in plan.processes}["evaluator"] == ("gpu 0",)


def test_health_checks_and_prometheus_targets_use_each_service_port(gpu):
    for name, port in SERVICE_PORTS.items():
        service = gpu["services"][name]
        assert f"127.0.0.1:{port}/healthz" in " ".join(service["healthcheck"]["test"])
        assert service["environment"]["ASYNCRLHF_HEALTH_PORT"] == str(port)
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    targets = {
        c["static_configs"][0].get("labels", {}).get("service"): c["static_configs"][0]["targets"]
        for c in scrape
    }
    assert {name: targets[name][0] for name in SERVICE_PORTS} == {  # and the judge's pool beside reward
        n: f"{n}:{p}" for n, p in SERVICE_PORTS.items()
    }


def test_prometheus_and_grafana_mounts_point_at_the_files(gpu):
    for service in ("prometheus", "grafana"):
        for volume in gpu["services"][service]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{service} mounts {source}, which does not exist"
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "asyncrlhf.yml").read_text()
    )
    dash_mount = next(
        v for v in gpu["services"]["grafana"]["volumes"] if v.startswith("./deploy/grafana/dashboards")
    )
    assert dash_mount.split(":")[1] == provider["providers"][0]["options"]["path"]
