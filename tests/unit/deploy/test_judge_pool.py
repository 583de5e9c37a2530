"""The judge's own pool (docs/judges.md): in Compose, `reward-judge` under the `judge` profile on GPU 0 (the
CPU override drops the GPU and judges with the tiny model); in Kubernetes, the `judge` component on top of
the GPU overlay: a `reward-judge` Deployment with one GPU, scaled by KEDA on the rollouts stream's lag, in
place of the plain reward pool."""

from __future__ import annotations

import shutil

import pytest
import yaml

from asyncrlhf.config import load_config
from asyncrlhf.streams import REWARD_GROUP, ROLLOUTS, run_key
from tests.unit.deploy.helpers import (
    DEPLOY,
    K8S,
    ROOT,
    SERVICE_PORTS,
    load_compose,
    merge_compose,
    render_kustomize,
)
from tests.unit.deploy.test_compose import devices, schema_errors
from tests.unit.deploy.test_k8s import container, find, validate

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def compose() -> tuple[dict, dict]:
    gpu = load_compose(ROOT / "docker-compose.yml")
    return gpu, merge_compose(gpu, load_compose(DEPLOY / "compose" / "cpu.yml"))


def test_the_compose_judge_pool_is_a_reward_replica_on_gpu_zero_under_its_profile(compose):
    gpu, cpu = compose
    judge, reward = gpu["services"]["reward-judge"], gpu["services"]["reward"]
    assert judge["profiles"] == ["judge"] and "profiles" not in reward  # off unless asked for
    assert judge["command"][:1] == ["reward"] and judge["command"][1:5] == reward["command"][1:5]
    assert [d["device_ids"] for d in devices(judge)] == [["0"]]  # beside the generator
    assert judge["environment"]["ASYNCRLHF_HEALTH_PORT"] == str(SERVICE_PORTS["reward"])
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    reward_job = next(c for c in scrape if c["job_name"] == "asyncrlhf-reward")
    assert "reward-judge:8002" in reward_job["static_configs"][0]["targets"]
    assert schema_errors(gpu) == [] and schema_errors(cpu) == []


def test_the_cpu_judge_pool_has_no_gpu_and_its_judge_override_loads(compose):
    _, cpu = compose
    judge = cpu["services"]["reward-judge"]
    assert devices(judge) == [] and judge["image"] == "asyncrlhf:cpu"
    overrides = [a for a in judge["command"] if "=" in a]
    cfg = load_config([ROOT / "configs" / "tiny.yaml", DEPLOY / "compose" / "container.yaml"], overrides)
    (scorer,) = cfg.reward.scorers
    assert scorer.kind == "judge" and scorer.model.name_or_path == "tiny" and scorer.engine.backend == "hf"


@pytest.fixture(scope="module")
def judged(tmp_path_factory) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl (its built-in kustomize renders the overlays)")
    return render_kustomize("overlays/gpu", tmp_path_factory.mktemp("judge"), ("components/judge",))


def test_the_k8s_judge_component_replaces_the_reward_pool_with_one_scaled_on_rollouts_lag(judged):
    for doc in judged:
        validate(doc, "kustomize overlays/gpu + components/judge")
    names = {(d["kind"], d["metadata"]["name"]) for d in judged}
    assert ("Deployment", "reward") not in names and ("ScaledObject", "reward") not in names
    judge = container(judged, "Deployment", "reward-judge")
    assert judge["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert judge["args"][0] == "reward" and "reward.device=cpu" not in judge["args"]
    scaled = find(judged, "ScaledObject", "reward-judge")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "reward-judge"
    trigger = scaled["triggers"][0]["metadata"]
    run_name = yaml.safe_load((K8S / "overlays" / "gpu" / "run.yaml").read_text())["run"]["name"]
    assert (trigger["stream"], trigger["consumerGroup"]) == (run_key(run_name, ROLLOUTS.name), REWARD_GROUP)
    assert trigger["passwordFromEnv"] in {e["name"] for e in judge["env"]}
    service = find(judged, "Service", "reward")["spec"]
    pod = find(judged, "Deployment", "reward-judge")["spec"]["template"]["metadata"]["labels"]
    assert all(pod[k] == v for k, v in service["selector"].items())  # the Service finds the judge's pods
    assert pod["app.kubernetes.io/component"] == "reward"
