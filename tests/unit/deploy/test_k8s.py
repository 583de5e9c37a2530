"""deploy/k8s: every manifest validates against the Kubernetes schemas (kubernetes-validate, offline), the
overlays resolve (`kubectl kustomize`, where kubectl is installed), KEDA ScaledObjects match the fields of
KEDA's CRD, and the manifests agree with the configs and the services (ports, stream keys, GPU counts)."""

from __future__ import annotations

import shutil

import jsonschema
import kubernetes_validate
import pytest
import yaml

from asyncrlhf import metrics as names
from asyncrlhf.config import load_config
from asyncrlhf.streams import REWARD_GROUP, ROLLOUTS, run_key
from asyncrlhf.weights.server import SERVICE
from tests.unit.deploy.helpers import (
    DATA_PORT,
    GRPC_PORT,
    K8S,
    ROOT,
    SERVICE_PORTS,
    manifest_files,
    render_kustomize,
)

pytestmark = pytest.mark.unit
KUBERNETES_VERSION = "1.30"  # the oldest release these manifests target (autoscaling/v2, sizeLimit, ...)
TARGETS = [".", "overlays/gpu", "overlays/cpu", "overlays/gpu-multinode"]
needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="needs kubectl (its built-in kustomize renders the overlays)"
)

# The ScaledObject fields of KEDA 2.x's CRD (keda.sh/v1alpha1; keda.sh/docs reference/scaledobject-spec),
# closed at every level we use so a misspelt field fails. Trigger metadata is a string map in the CRD.
_INT = {"type": "integer"}
_POLICIES = {
    "type": "array",
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["type", "value", "periodSeconds"],
        "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": _INT, "periodSeconds": _INT},
    },
}
_RULES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stabilizationWindowSeconds": _INT,
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": _POLICIES,
    },
}
SCALED_OBJECT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": _INT,
                "cooldownPeriod": _INT,
                "initialCooldownPeriod": _INT,
                "idleReplicaCount": _INT,
                "minReplicaCount": _INT,
                "maxReplicaCount": _INT,
                "fallback": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["failureThreshold", "replicas"],
                    "properties": {
                        "failureThreshold": _INT,
                        "replicas": _INT,
                        "behavior": {
                            "enum": [
                                "static",
                                "currentReplicas",
                                "currentReplicasIfHigher",
                                "currentReplicasIfLower",
                            ]
                        },
                    },
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {"scaleUp": _RULES, "scaleDown": _RULES},
                                },
                            },
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            "authenticationRef": {"type": "object", "required": ["name"]},
                        },
                    },
                },
            },
        },
    },
}
# Trigger metadata keys each scaler reads (keda.sh/docs scalers/redis-streams, scalers/prometheus).
TRIGGER_METADATA = {
    "redis-streams": {
        "required": {"stream"},
        "allowed": {
            "address",
            "host",
            "port",
            "addressFromEnv",
            "hostFromEnv",
            "portFromEnv",
            "username",
            "usernameFromEnv",
            "passwordFromEnv",
            "stream",
            "consumerGroup",
            "pendingEntriesCount",
            "streamLength",
            "lagCount",
            "activationLagCount",
            "activationValueTargetValue",
            "enableTLS",
            "unsafeSsl",
            "databaseIndex",
        },
    },
    "prometheus": {
        "required": {"serverAddress", "query", "threshold"},
        "allowed": {
            "serverAddress",
            "query",
            "threshold",
            "activationThreshold",
            "namespace",
            "customHeaders",
            "ignoreNullValues",
            "queryParameters",
            "unsafeSsl",
            "timeout",
            "authModes",
        },
    },
}


def validate(doc: dict, where: str) -> None:
    if doc["kind"] == "ScaledObject":
        errors = [e.message for e in jsonschema.Draft7Validator(SCALED_OBJECT).iter_errors(doc)]
        assert not errors, f"{where}: ScaledObject {doc['metadata']['name']}: {errors}"
        for trigger in doc["spec"]["triggers"]:
            rules, keys = TRIGGER_METADATA[trigger["type"]], set(trigger["metadata"])
            assert rules["required"] <= keys, f"{where}: {trigger['type']} needs {rules['required'] - keys}"
            assert keys <= rules["allowed"], (
                f"{where}: unknown {trigger['type']} keys {keys - rules['allowed']}"
            )
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        pytest.fail(
            f"{where}: {doc['kind']} {doc['metadata'].get('name')}: {err.message} at {list(err.path)}"
        )


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl (its built-in kustomize renders the overlays)")
    tmp = tmp_path_factory.mktemp("kustomize")
    return {target: render_kustomize(target, tmp) for target in TARGETS}


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def container(docs: list[dict], kind: str, name: str) -> dict:
    return find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


WORKLOADS = [
    ("Deployment", "generator"),
    ("Deployment", "reward"),
    ("StatefulSet", "learner"),
    ("Deployment", "evaluator"),
]


# -- every manifest, as written and as rendered --------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_file_validates(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path} holds no manifest"
    for doc in docs:
        validate(doc, str(path.relative_to(ROOT)))


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_overlay_renders_and_every_resource_validates(rendered, target):
    docs = rendered[target]
    kinds = {d["kind"] for d in docs}
    assert {
        "Namespace",
        "ConfigMap",
        "Secret",
        "StatefulSet",
        "Deployment",
        "Service",
        "NetworkPolicy",
    } <= kinds
    for doc in docs:
        if doc["kind"] != "Namespace":  # components' resources too: none may land in the default namespace
            assert doc["metadata"].get("namespace") == "asyncrlhf", (
                f"{target}: {doc['kind']} {doc['metadata']['name']} has no namespace: set `namespace:` in "
                f"the overlay's kustomization.yaml")
        validate(doc, f"kustomize {target}")


def test_a_broken_manifest_fails_validation():
    """The validator is not a rubber stamp: a misspelt field and a wrong type both fail."""
    doc = yaml.safe_load((K8S / "base" / "reward.yaml").read_text().split("---")[1])
    doc["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    scaled = next(yaml.safe_load_all((K8S / "components" / "keda" / "scaledobjects.yaml").read_text()))
    scaled["spec"]["minReplicas"] = 1  # HPA spelling; KEDA's is minReplicaCount
    assert list(jsonschema.Draft7Validator(SCALED_OBJECT).iter_errors(scaled))


# -- the overlays say what they should ------------------------------------------------------------------


@needs_kubectl
def test_top_level_kustomization_is_the_gpu_overlay(rendered):
    assert rendered["."] == rendered["overlays/gpu"]


@needs_kubectl
def test_gpu_overlay_gives_the_generator_one_gpu_and_the_learner_three_under_torchrun(rendered):
    docs = rendered["overlays/gpu"]
    assert container(docs, "Deployment", "generator")["resources"]["limits"]["nvidia.com/gpu"] == 1
    learner = container(docs, "StatefulSet", "learner")
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == 3
    cmd = learner["command"]
    assert (
        cmd[0] == "torchrun"
        and cmd[cmd.index("--nproc_per_node") + 1] == "3"
        and cmd[-1] == "services.learner"
    )
    assert all(c["image"] == "asyncrlhf:gpu" for k, n in WORKLOADS for c in [container(docs, k, n)])
    for doc in rendered["overlays/cpu"]:
        assert "nvidia.com/gpu" not in yaml.safe_dump(doc)


@needs_kubectl
def test_the_gpu_overlay_fits_one_4_gpu_node_with_the_evaluator_on_the_cpu(rendered):
    from asyncrlhf.planning import memory
    from asyncrlhf.planning.plan import make_plan

    docs = rendered["overlays/gpu"]
    gpus = {name: container(docs, kind, name)["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
            for kind, name in WORKLOADS}
    assert gpus == {"generator": 1, "reward": 0, "learner": 3, "evaluator": 0}  # 4 in all
    evaluator = container(docs, "Deployment", "evaluator")
    overrides = [a for a in evaluator["args"] if "=" in a and not a.startswith("redis.")]
    assert overrides == ["evaluator.device=cpu"]
    # the node's plan with the overlay's evaluator: every GPU within an 80 GiB node's memory
    cfg = load_config([K8S / "overlays" / "gpu" / "run.yaml"], overrides)
    plan = make_plan(cfg, gpus=4, gpu_bytes=80 * memory.GIB)
    assert plan.fits, plan.refusals()
    assert {p.service: p.devices for p in plan.processes}["evaluator"] == ("cpu",)


@needs_kubectl
@pytest.mark.parametrize("target", ["overlays/gpu", "overlays/cpu"])
def test_workloads_probe_and_expose_their_service_port(rendered, target):
    docs = rendered[target]
    for kind, name in WORKLOADS:
        pod = find(docs, kind, name)["spec"]["template"]
        c = pod["spec"]["containers"][0]
        port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
        assert port == SERVICE_PORTS[name]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        if name == "generator":  # the WeightSync server's standard gRPC health service
            assert c["livenessProbe"]["grpc"] == {"port": GRPC_PORT, "service": SERVICE}
        else:
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "asyncrlhf"
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        env = {e["name"]: e for e in c["env"]}
        assert env["ASYNCRLHF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"].startswith("asyncrlhf-secrets")
        service = find(docs, "Service", name)
        assert service["spec"]["clusterIP"] == "None", f"{name}: headless, one DNS record per pod"
    generator = container(docs, "Deployment", "generator")
    assert "generator.advertise_host=$(POD_IP)" in generator["args"]
    pod_ip = {e["name"]: e for e in generator["env"]}["POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert (
        find(docs, "StatefulSet", "learner")["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "runs"
    )


@needs_kubectl
@pytest.mark.parametrize("target, config", [("overlays/gpu", "node4gpu.yaml"), ("overlays/cpu", "tiny.yaml")])
def test_configmap_holds_the_run_config_and_it_loads_with_the_container_layer(
    rendered, target, config, tmp_path
):
    data = next(d for d in rendered[target] if d["kind"] == "ConfigMap")["data"]
    assert data["run.yaml"] == (ROOT / "configs" / config).read_text(), (
        f"deploy/k8s/{target}/run.yaml differs from configs/{config}: copy it over"
    )
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    cfg = load_config(
        [tmp_path / "run.yaml", tmp_path / "container.yaml"],
        ["generator.advertise_host=10.0.0.7", "redis.password=x", "run.token=t"],
    )
    ports = {s: getattr(cfg, s).http_port for s in SERVICE_PORTS}
    assert ports == SERVICE_PORTS and cfg.generator.grpc_port == GRPC_PORT
    assert cfg.generator.data_port == DATA_PORT
    assert cfg.generator.http_host == cfg.generator.grpc_host == "0.0.0.0"


@needs_kubectl
def test_only_the_learner_reaches_the_generators_weightsync_port(rendered):
    docs = rendered["overlays/gpu"]
    policy = find(docs, "NetworkPolicy", "generator-weightsync-from-learner")
    grpc = [r for r in policy["spec"]["ingress"] if any(p["port"] == GRPC_PORT for p in r.get("ports", []))]
    assert len(grpc) == 1 and grpc[0]["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "learner"}}}
    ]
    open_rules = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert all(p["port"] == SERVICE_PORTS["generator"] for r in open_rules for p in r["ports"])
    ports = {p["name"]: p["containerPort"] for p in container(docs, "Deployment", "generator")["ports"]}
    assert ports["grpc"] == GRPC_PORT and ports["weight-data"] == DATA_PORT
    data = [r for r in policy["spec"]["ingress"] if any(p["port"] == DATA_PORT for p in r.get("ports", []))]
    assert data == grpc  # the data channel: the learner only, as WeightSync
    service = {p["name"]: p["port"] for p in find(docs, "Service", "generator")["spec"]["ports"]}
    assert service["weight-data"] == DATA_PORT


@needs_kubectl
def test_autoscalers_target_existing_workloads_and_never_share_one(rendered):
    from services.learner.metrics import LearnerMetrics

    for target in ("overlays/gpu", "overlays/cpu"):
        docs = rendered[target]
        scaled = [
            (d["spec"]["scaleTargetRef"]["kind"], d["spec"]["scaleTargetRef"]["name"])
            for d in docs
            if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")
        ]
        assert scaled and len(scaled) == len(set(scaled)), f"{target}: two autoscalers on one workload"
        for kind, name in scaled:
            find(docs, kind, name)
    docs = rendered["overlays/gpu"]
    run_name = yaml.safe_load((K8S / "overlays" / "gpu" / "run.yaml").read_text())["run"]["name"]
    redis_trigger = find(docs, "ScaledObject", "reward")["spec"]["triggers"][0]["metadata"]
    assert redis_trigger["stream"] == run_key(run_name, ROLLOUTS.name)
    assert redis_trigger["consumerGroup"] == REWARD_GROUP
    env = {e["name"] for e in container(docs, "Deployment", "reward")["env"]}
    assert redis_trigger["passwordFromEnv"] in env, "KEDA reads the password from the target's environment"
    prom_trigger = find(docs, "ScaledObject", "generator")["spec"]["triggers"][0]["metadata"]
    exported = {
        f.name + "_total" if f.type == "counter" else f.name for f in LearnerMetrics().registry.collect()
    }
    assert names.LEARNER_WAIT_SECONDS_TOTAL in prom_trigger["query"]
    assert names.LEARNER_WAIT_SECONDS_TOTAL in exported
