"""deploy/k8s/components/multinode-learner, as rendered in overlays/gpu-multinode: N learner pods, each one
torchrun node of G GPU processes, meeting at a static rendezvous on learner-0 (so global rank 0, which does
the I/O, is learner-0), with one ReadWriteMany run directory for all of them and the evaluator."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from asyncrlhf.config import load_config
from asyncrlhf.config_cli import split_config_args
from tests.unit.deploy.helpers import K8S, SERVICE_PORTS, render_kustomize
from tests.unit.deploy.test_k8s import container, find

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("kubectl") is None,
                       reason="needs kubectl (its built-in kustomize renders the overlays)"),
]
TARGET = "overlays/gpu-multinode"
COMPONENT = K8S / "components" / "multinode-learner"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[dict]:
    return render_kustomize(TARGET, tmp_path_factory.mktemp("kustomize"))


def torchrun_flags(learner: dict) -> dict[str, str]:
    """The learner container's torchrun flags, `$(VAR)` expanded from its literal env values (as the
    kubelet does); a variable from the downward API stays `$(VAR)`."""
    env = {e["name"]: e["value"] for e in learner["env"] if "value" in e}
    command = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg) for arg in learner["command"]]
    assert command[0] == "torchrun" and command[-2:] == ["-m", "services.learner"], command
    flags = command[1:-2]
    assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[::2]), f"flag value pairs: {flags}"
    return dict(zip(flags[::2], flags[1::2], strict=True))


def test_every_pod_is_a_node_of_one_static_rendezvous_on_learner_0(docs):
    statefulset = find(docs, "StatefulSet", "learner")["spec"]
    learner = container(docs, "StatefulSet", "learner")
    flags = torchrun_flags(learner)
    assert statefulset["podManagementPolicy"] == "Parallel", "the nodes must all start to meet"
    assert flags["--nnodes"] == str(statefulset["replicas"]) and statefulset["replicas"] >= 2
    assert flags["--nproc_per_node"] == str(learner["resources"]["limits"]["nvidia.com/gpu"])
    # static rendezvous: global rank = node_rank x G + local rank, so node rank 0 (learner-0) holds rank 0
    assert flags.get("--rdzv_backend", "static") == "static" and "--standalone" not in flags
    assert flags["--node_rank"] == "$(NODE_RANK)"
    node_rank = next(e for e in learner["env"] if e["name"] == "NODE_RANK")
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    service = statefulset["serviceName"]
    assert flags["--master_addr"] == f"learner-0.{service}"
    ports = {p["name"]: p["containerPort"] for p in learner["ports"]}
    assert flags["--master_port"] == str(ports["rendezvous"])
    assert ports["http"] == SERVICE_PORTS["learner"], "every node's probes ask the learner's HTTP port"


def test_the_service_resolves_learner_0_before_it_is_ready(docs):
    statefulset = find(docs, "StatefulSet", "learner")["spec"]
    service = find(docs, "Service", statefulset["serviceName"])["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    ports = {p["name"]: p for p in service["ports"]}
    rendezvous = int(torchrun_flags(container(docs, "StatefulSet", "learner"))["--master_port"])
    assert ports["rendezvous"]["port"] == rendezvous and ports["rendezvous"]["targetPort"] == "rendezvous"


def test_learner_pods_and_the_evaluator_share_one_read_write_many_run_directory(docs):
    run_dir = yaml.safe_load((K8S / "base" / "container.yaml").read_text())["run"]["dir"]
    statefulset = find(docs, "StatefulSet", "learner")["spec"]
    assert "volumeClaimTemplates" not in statefulset, "a volume per pod would split the checkpoints"
    claims = set()
    for kind, name in (("StatefulSet", "learner"), ("Deployment", "evaluator")):
        pod = find(docs, kind, name)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = [m for m in pod["containers"][0]["volumeMounts"]
                  if "persistentVolumeClaim" in volumes[m["name"]]]
        assert len(mounts) == 1 and run_dir.startswith(mounts[0]["mountPath"].rstrip("/") + "/"), (
            f"{name}: run.dir {run_dir} is not on its claim")
        claims.add(volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"])
        assert "podAffinity" not in pod.get("affinity", {}), f"{name}: ReadWriteMany needs no co-location"
    assert len(claims) == 1
    claim = find(docs, "PersistentVolumeClaim", claims.pop())["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"]
    assert "storageClassName" not in claim, "the storage class is the user's (runs-pvc.yaml says how)"


def test_the_learner_pods_get_a_config_that_loads(docs, tmp_path):
    pod = find(docs, "StatefulSet", "learner")["spec"]["template"]["spec"]
    config_map = next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "config")
    data = find(docs, "ConfigMap", config_map)["data"]
    learner = pod["containers"][0]
    mount = next(m["mountPath"] for m in learner["volumeMounts"] if m["name"] == "config")
    argv = [a.replace(mount, str(tmp_path)).replace("$(REDIS_PASSWORD)", "x") for a in learner["args"]]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    files, overrides = split_config_args(argv)
    assert [Path(f).name for f in files] == ["run.yaml", "container.yaml"]
    cfg = load_config(files, overrides)
    assert cfg.learner.http_port == SERVICE_PORTS["learner"] and cfg.learner.http_host == "0.0.0.0"
    assert cfg.redis.password == "x"


def test_nodes_and_gpus_are_set_in_one_place(tmp_path):
    """Editing `replicas` and the GPU limit in the component's learner.yaml is all it takes: the torchrun
    flags follow."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("secrets.env"))
    shutil.copy(copy / "base" / "secrets.env.example", copy / "base" / "secrets.env")
    patch = copy / "components" / "multinode-learner" / "learner.yaml"
    text = patch.read_text()
    edited = text.replace("replicas: 2", "replicas: 4").replace("nvidia.com/gpu: 3", "nvidia.com/gpu: 8")
    assert edited.count("4") > text.count("4") and edited.count("8") > text.count("8"), "edit found nothing"
    patch.write_text(edited)
    flags = torchrun_flags(container(render_kustomize(TARGET, tmp_path), "StatefulSet", "learner"))
    assert (flags["--nnodes"], flags["--nproc_per_node"]) == ("4", "8")
