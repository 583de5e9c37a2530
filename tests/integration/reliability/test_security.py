"""Who may talk to the services: a non-loopback bind needs a token (or an explicit opt-out), Redis passwords
and TLS work end to end, and a refused Redis password fails at once instead of retrying forever.

The token on gRPC and on mutating HTTP routes of a running generator is in test_weight_push.py."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from asyncrlhf._proto.rollout_pb2 import FINISH_REASON_STOP, PromptGroup, RolloutGroup, Sample
from asyncrlhf.config import RedisConfig
from asyncrlhf.redis_server import EmbeddedRedis, find_redis_server, free_port
from asyncrlhf.streams import (
    LEARNER_GROUP,
    PAYLOAD_FIELD,
    REWARD_GROUP,
    ROLLOUTS,
    SCORED,
    RunStreams,
    connect,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


def service(kind: str, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            f"services.{kind}",
            "--config",
            "configs/tiny.yaml",
            "generator.device=cpu",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


@pytest.mark.parametrize(
    "kind, override",
    [
        ("reward", "reward.http_host=0.0.0.0"),
        ("generator", "generator.http_host=0.0.0.0"),
        ("generator", "generator.grpc_host=0.0.0.0"),
    ],
)
def test_a_non_loopback_bind_without_a_token_refuses_to_start(redis_url, run_name, kind, override):
    code, out = finish(service(kind, f"redis.url={redis_url}", f"run.name={run_name}", override))
    assert code == 2, out[-3000:]
    assert "with no auth token" in out and "run.allow_insecure_bind=true" in out, out[-3000:]


@pytest.mark.parametrize("permission", ["run.allow_insecure_bind=true", "run.token=s3cret"])
def test_the_same_bind_starts_with_a_token_or_explicit_permission(redis_url, run_name, permission):
    port = free_port()
    proc = service(
        "reward",
        f"redis.url={redis_url}",
        f"run.name={run_name}",
        "reward.http_host=0.0.0.0",
        f"reward.http_port={port}",
        permission,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the reward service did not become ready"
            time.sleep(0.2)
    finally:
        proc.terminate()
        finish(proc, 30)


def test_a_refused_redis_password_fails_at_once_instead_of_retrying_forever():
    with EmbeddedRedis(password="right") as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        assert connect(RedisConfig(url=url, password="right")).ping()
        for cfg in (RedisConfig(url=url, password="wrong"), RedisConfig(url=url)):
            started = time.monotonic()
            with pytest.raises(redis.AuthenticationError):
                connect(cfg).ping()  # retries=-1, as every service connects
            assert time.monotonic() - started < 5


# ---------------------------------------------------------------------------------------------------------
# TLS


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncrlhf-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@pytest.fixture
def tls_redis(tmp_path):
    """redis-server on a TLS-only port with a password; yields (rediss:// URL, no password in it; CA file)."""
    pytest.importorskip(
        "cryptography", reason="needs the cryptography package (the dev extra) for a test cert"
    )
    cert, key = self_signed(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            "tls-pw",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"rediss://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, password="tls-pw", ssl_ca_certs=str(cert))
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            out = proc.communicate()[0]
            if any(s in out.lower() for s in ("not supported", "unrecognized", "bad directive")):
                pytest.skip(f"this redis-server has no TLS support: {out.strip()[-300:]}")
            raise AssertionError(f"redis-server with TLS exited: {out[-2000:]}")
        try:
            if client.ping():
                break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server with TLS did not answer"
            time.sleep(0.05)
    yield url, cert
    proc.terminate()
    proc.wait(10)


def test_rediss_with_a_ca_file_and_a_password_carries_the_streams(tls_redis, run_name):
    url, ca = tls_redis
    cfg = RedisConfig(url=url, password="tls-pw", tls_ca_certs=str(ca), block_ms=100)
    streams = RunStreams(connect(cfg), run_name, cfg)
    streams.producer(ROLLOUTS).add(RolloutGroup(group_id="g1"))
    (delivery,) = streams.consumer(ROLLOUTS, REWARD_GROUP, "r0").read(10)
    assert delivery.identity == "g1"
    with pytest.raises(redis.ConnectionError):  # without the CA the self-signed certificate is refused
        connect(RedisConfig(url=url, password="tls-pw"), retries=0).ping()


def test_a_reward_service_scores_over_tls(tls_redis, run_name):
    url, ca = tls_redis
    cfg = RedisConfig(url=url, password="tls-pw", tls_ca_certs=str(ca), block_ms=100)
    streams = RunStreams(connect(cfg), run_name, cfg)
    prompt = PromptGroup(group_id="g-tls", prompt="Say something", k=1)
    streams.producer(ROLLOUTS).add(
        RolloutGroup(
            group_id="g-tls",
            prompt=prompt,
            policy_version=1,
            samples=[
                Sample(
                    completion_token_ids=[5],
                    logprobs=[-1.0],
                    finish_reason=FINISH_REASON_STOP,
                    text="I love it",
                )
            ],
        )
    )
    proc = service(
        "reward",
        f"redis.url={url}",
        "redis.password=tls-pw",
        f"redis.tls_ca_certs={ca}",
        f"run.name={run_name}",
        "redis.block_ms=100",
    )
    try:
        deadline = time.monotonic() + 120
        while not streams.stats(SCORED, LEARNER_GROUP).length:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the reward service did not score over TLS"
            time.sleep(0.2)
    finally:
        proc.terminate()
        finish(proc, 30)
    (entry,) = streams.client.xrange(streams.key(SCORED.name))
    scored = RolloutGroup.FromString(entry[1][PAYLOAD_FIELD])
    assert scored.group_id == "g-tls" and scored.samples[0].reward > 0
