"""gRPC TLS in the deployments: the compose override deploy/compose/tls.yaml (with container-tls.yaml) and the
kustomize component deploy/k8s/components/tls. Both stacks still validate, the generator and the learner get
the certificate files and `run.grpc_tls` settings that load as real config fields and point at those files,
and the generator's liveness probe no longer uses Kubernetes' gRPC probe, which cannot speak TLS."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from asyncrlhf.config import load_config
from asyncrlhf.config_cli import split_config_args
from tests.unit.deploy.helpers import (
    DEPLOY,
    ROOT,
    load_compose,
    merge_compose,
    render_kustomize,
    volume_target,
)
from tests.unit.deploy.test_compose import COMPOSE, CPU_OVERRIDE, schema_errors
from tests.unit.deploy.test_k8s import container, find, validate

pytestmark = pytest.mark.unit
TLS_OVERRIDE = DEPLOY / "compose" / "tls.yaml"
CONTAINER, CONTAINER_TLS = DEPLOY / "compose" / "container.yaml", DEPLOY / "compose" / "container-tls.yaml"
TLS_DIR = "/etc/asyncrlhf-tls"
SECRET, SECRET_KEYS = "asyncrlhf-grpc-tls", {"tls.crt", "tls.key", "ca.crt"}
WITH_TLS, WITHOUT_TLS = ("generator", "learner"), ("reward", "evaluator")
needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="needs kubectl (its built-in kustomize renders the overlays)"
)


def check_grpc_tls(tls, directory: str, files: set[str]) -> None:
    """Both sides of mutual TLS are set, each path a file of `directory` among `files`."""
    assert tls.serves_tls and tls.dials_tls and tls.client_ca_file and tls.client_cert_file
    paths = [tls.cert_file, tls.key_file, tls.client_ca_file, tls.ca_file, tls.client_cert_file,
             tls.client_key_file]
    for path in paths:
        assert str(Path(path).parent) == directory and Path(path).name in files, path


# -- compose ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", [[], [CPU_OVERRIDE]], ids=["gpu", "cpu"])
def test_the_compose_override_mounts_the_certificates_and_the_tls_layer_on_generator_and_learner(stack):
    merged = load_compose(COMPOSE)
    for override in [*stack, TLS_OVERRIDE]:
        merged = merge_compose(merged, load_compose(override))
    assert schema_errors(merged) == []
    for name in (*WITH_TLS, *WITHOUT_TLS):
        volumes = merged["services"][name]["volumes"]
        assert len({volume_target(v) for v in volumes}) == len(volumes), f"{name}: a path mounted twice"
        layer = next(v for v in volumes if volume_target(v) == "/etc/asyncrlhf/container.yaml")
        tls = [v for v in volumes if volume_target(v) == TLS_DIR]
        if name in WITH_TLS:
            assert layer == "./deploy/compose/container-tls.yaml:/etc/asyncrlhf/container.yaml:ro", name
            assert tls == [f"./deploy/compose/tls:{TLS_DIR}:ro"], name
            assert (ROOT / "deploy" / "compose" / "tls" / ".gitignore").read_text().splitlines()[1] == "*"
        else:
            assert layer.startswith("./deploy/compose/container.yaml:") and tls == [], name
    run_config = "./configs/tiny.yaml" if stack else "${ASYNCRLHF_CONFIG:-./configs/node4gpu.yaml}"
    assert f"{run_config}:/etc/asyncrlhf/run.yaml:ro" in merged["services"]["generator"]["volumes"]


def test_the_tls_layer_is_the_container_layer_plus_grpc_tls():
    plain, tls = yaml.safe_load(CONTAINER.read_text()), yaml.safe_load(CONTAINER_TLS.read_text())
    assert tls["run"].pop("grpc_tls") and tls == plain, "container-tls.yaml drifted from container.yaml"


@pytest.mark.parametrize("run_config", ["configs/node4gpu.yaml", "configs/tiny.yaml"])
def test_the_tls_layer_loads_and_points_at_the_mounted_files(run_config):
    cfg = load_config([ROOT / run_config, CONTAINER_TLS], ["run.token=t"])
    check_grpc_tls(cfg.run.grpc_tls, TLS_DIR, SECRET_KEYS)
    assert cfg.run.grpc_tls.server_name == cfg.generator.advertise_host  # the name the learner dials


# -- kubernetes -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered_tls(tmp_path_factory) -> dict[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl (its built-in kustomize renders the overlays)")
    tmp = tmp_path_factory.mktemp("kustomize-tls")
    return {target: render_kustomize(target, tmp, ("components/tls",)) for target in ("overlays/gpu",
                                                                                     "overlays/cpu")}


def pod_config(docs: list[dict], kind: str, name: str, tmp_path: Path):
    """The config the workload's container loads: its args, with the rendered ConfigMap's files in place of
    /etc/asyncrlhf and the pod's environment variables filled in."""
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    for file, text in configmap.items():
        (tmp_path / file).write_text(text)
    args = container(docs, kind, name)["args"]
    args = args[1:] if args[0] == name else args  # `generator --config ...`; torchrun's `--config ...`
    args = [a.replace("/etc/asyncrlhf/", f"{tmp_path}/").replace("$(POD_IP)", "10.0.0.7")
            .replace("$(REDIS_PASSWORD)", "pw") for a in args]
    files, overrides = split_config_args(args)
    return load_config(files, [*overrides, "run.token=t"])


@needs_kubectl
@pytest.mark.parametrize("target", ["overlays/gpu", "overlays/cpu"])
def test_the_component_mounts_the_secret_and_sets_grpc_tls_as_real_config(rendered_tls, target, tmp_path):
    docs = rendered_tls[target]
    for doc in docs:
        validate(doc, f"kustomize {target} + components/tls")
    namespace = next(d for d in docs if d["kind"] == "Namespace")["metadata"]["name"]
    for kind, name in (("Deployment", "generator"), ("StatefulSet", "learner")):
        pod = find(docs, kind, name)["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == SECRET)
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
        assert mount["mountPath"] == TLS_DIR and mount["readOnly"] is True
        assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 1000
        cfg = pod_config(docs, kind, name, tmp_path)
        check_grpc_tls(cfg.run.grpc_tls, mount["mountPath"], SECRET_KEYS)
        assert cfg.run.grpc_tls.server_name == f"generator.{namespace}.svc"
    for kind, name in (("Deployment", "reward"), ("Deployment", "evaluator")):
        assert not any("grpc_tls" in a for a in container(docs, kind, name)["args"]), name


@needs_kubectl
def test_with_tls_no_grpc_probe_is_left_and_the_generator_is_probed_over_http(rendered_tls):
    for docs in rendered_tls.values():
        generator = container(docs, "Deployment", "generator")
        assert "grpc" not in yaml.safe_dump(generator["livenessProbe"])
        assert generator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert generator["readinessProbe"]["httpGet"]["path"] == "/readyz"
        for doc in docs:
            if doc["kind"] in ("Deployment", "StatefulSet"):
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    probes = [c.get(p, {}) for p in ("livenessProbe", "readinessProbe", "startupProbe")]
                    assert not any("grpc" in p for p in probes), doc["metadata"]["name"]
