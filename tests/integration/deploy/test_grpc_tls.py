"""docs/tls.md's openssl commands, run as written, make certificates that carry a real mutual-TLS weight
push under the `run.grpc_tls` settings of both deployments: deploy/compose/container-tls.yaml and the
overrides of deploy/k8s/components/tls (the mount directory replaced by where the commands ran)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.integration.weights.test_tls import push, serve_model, tls_config
from tests.unit.deploy.helpers import DEPLOY, ROOT

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")]
MOUNT = "/etc/asyncrlhf-tls"


def documented_commands() -> str:
    """The bash block that follows the `grpc-tls-certs` marker in docs/tls.md."""
    text = (ROOT / "docs" / "tls.md").read_text()
    found = re.search(r"<!-- grpc-tls-certs.*?-->\n```bash\n(.*?)```", text, re.S)
    assert found, "docs/tls.md lost its grpc-tls-certs block"
    return found.group(1)


def compose_settings() -> dict[str, str]:
    return yaml.safe_load((DEPLOY / "compose" / "container-tls.yaml").read_text())["run"]["grpc_tls"]


def k8s_settings() -> dict[str, str]:
    patch = DEPLOY / "k8s" / "components" / "tls" / "patches" / "grpc-tls-args.yaml"
    ops = yaml.safe_load(patch.read_text())
    pairs = [op["value"].removeprefix("run.grpc_tls.").split("=", 1) for op in ops]
    return dict(pairs)


@pytest.mark.parametrize("settings", [compose_settings, k8s_settings], ids=["compose", "k8s"])
def test_the_documented_certificates_carry_a_mutual_tls_push(tmp_path, settings):
    subprocess.run(["bash", "-euo", "pipefail", "-c", documented_commands()], cwd=tmp_path, check=True,
                   capture_output=True)
    files = tmp_path / "grpc-tls"
    tls = {k: v.replace(MOUNT, str(files)) for k, v in settings().items()}
    server_side = ("cert_file", "key_file", "client_ca_file")
    server, receiver, _, address = serve_model(tls_config(**{k: tls[k] for k in server_side}))
    try:
        client = {k: v for k, v in tls.items() if k not in server_side}
        assert push(client, address).status == "ok" and receiver.version.step == 1  # verified as server_name
        anonymous = {k: v for k, v in client.items() if not k.startswith("client_")}
        refused = push(anonymous, address, version=2)
        assert refused.status != "ok" and receiver.version.step == 1  # mTLS enforced
    finally:
        server.stop(0)
