"""TLS for WeightSync from `run.grpc_tls`, with a CA, server and client certificates made here: a push over
TLS lands; a client that does not trust the CA (or dials in plaintext) is refused; with a client CA on the
server (mutual TLS) a client without a certificate from it is refused; relays dial with the run's TLS
client settings."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import ssl

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from asyncrlhf.config import load_config
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import (
    ClientAccess,
    ServerAccess,
    TlsConfigError,
    channel_credentials,
    server_credentials,
    server_ssl_context,
)
from asyncrlhf.weights.channel import Outgoing, new_ticket
from asyncrlhf.weights.channel_read import DataListener
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import NO_VERSION, WeightReceiver
from asyncrlhf.weights.relay import Relay, TreePush
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.target import ModuleTarget
from asyncrlhf.weights.vocabulary import PushRejected, Route

pytestmark = pytest.mark.integration


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca=False, hosts=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        sans = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path, cert, key) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA; a server certificate for 127.0.0.1; a client certificate; and an unrelated CA."""
    d = tmp_path_factory.mktemp("pki")
    files = {}
    for ca_name in ("ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert(ca_name, ca_key, _name(ca_name), ca_key, ca=True)
        files[ca_name] = (ca_cert, ca_key, _write(d / ca_name, ca_cert, ca_key)[0])
    ca_cert, ca_key, _ = files["ca"]
    for leaf, hosts in (("server", ("127.0.0.1", "localhost")), ("client", ())):
        key = ec.generate_private_key(ec.SECP256R1())
        files[leaf] = _write(d / leaf, _cert(leaf, key, ca_cert.subject, ca_key, hosts=hosts), key)
    return {"ca": files["ca"][2], "other_ca": files["other-ca"][2], "server": files["server"],
            "client": files["client"]}


def tls_config(**fields):
    return load_config([], [f"run.grpc_tls.{k}={v}" for k, v in fields.items()]).run.grpc_tls


def serve_model(tls):
    model = torch.nn.Linear(4, 3)
    receiver = WeightReceiver(ModuleTarget(model))
    server, port = serve(receiver, "127.0.0.1", 0, ServerAccess(credentials=server_credentials(tls)))
    return server, receiver, model, f"127.0.0.1:{port}"


def push(pusher_tls, address, version=1, routes=None):
    """A push dialed as the learner's pusher is, from the config (`ClientAccess.from_config`)."""
    overrides = [f"run.grpc_tls.{k}={v}" for k, v in pusher_tls.items()]
    cfg = load_config([], overrides)
    with WeightPusher(ClientAccess.from_config(cfg), timeout_s=10, routes=routes) as pusher:
        weights = {"weight": torch.ones(3, 4), "bias": torch.zeros(3)}
        return pusher.push(weights, PolicyVersion(1, version), [PushTarget("g", address)])[0]


def test_a_push_over_tls_lands_and_a_client_without_the_ca_is_refused(pki):
    server_cert, server_key = pki["server"]
    server, receiver, model, address = serve_model(tls_config(cert_file=server_cert, key_file=server_key))
    try:
        ok = push({"ca_file": pki["ca"]}, address)
        assert ok.status == "ok" and receiver.version.step == 1
        assert torch.equal(model.weight, torch.ones(3, 4))
        for client in ({"ca_file": pki["other_ca"]}, {}):  # an unrelated CA; plaintext
            refused = push(client, address, version=2)
            assert refused.status != "ok", client
        assert receiver.version.step == 1  # nothing reached the receiver
    finally:
        server.stop(0)


def test_mutual_tls_refuses_a_client_without_a_certificate_from_the_client_ca(pki):
    server_cert, server_key = pki["server"]
    client_cert, client_key = pki["client"]
    tls = tls_config(cert_file=server_cert, key_file=server_key, client_ca_file=pki["ca"])
    server, receiver, _, address = serve_model(tls)
    try:
        assert push({"ca_file": pki["ca"]}, address).status != "ok"  # trusts the server, has no certificate
        assert receiver.version.step == 0
        mutual = {"ca_file": pki["ca"], "client_cert_file": client_cert, "client_key_file": client_key}
        ok = push(mutual, address)
        assert ok.status == "ok" and receiver.version.step == 1
    finally:
        server.stop(0)


def test_beside_tls_the_data_channel_is_tls_too(pki):
    """Mutual TLS: a push takes the data channel over TLS from the same files; a connection without the client
    certificate, or in plaintext, is never paired with a push; a plaintext channel beside TLS is refused."""
    (server_cert, server_key), (client_cert, client_key) = pki["server"], pki["client"]
    tls = tls_config(cert_file=server_cert, key_file=server_key, client_ca_file=pki["ca"])
    model = torch.nn.Linear(4, 3)
    plaintext = DataListener()
    with pytest.raises(ValueError, match="bypass"):
        serve(WeightReceiver(ModuleTarget(model), NO_VERSION, data=plaintext),
              access=ServerAccess(credentials=server_credentials(tls)))
    plaintext.close()
    data = DataListener(claim_timeout_s=1.0, tls=server_ssl_context(tls))
    receiver = WeightReceiver(ModuleTarget(model), NO_VERSION, data=data)
    server, port = serve(receiver, "127.0.0.1", 0, ServerAccess(credentials=server_credentials(tls)))
    try:
        mutual = {"ca_file": pki["ca"], "client_cert_file": client_cert, "client_key_file": client_key}
        ok = push(mutual, f"127.0.0.1:{port}", routes=(Route.DATA, Route.STREAM))  # as across hosts
        assert (ok.status, ok.route) == ("ok", Route.DATA) and torch.equal(model.weight, torch.ones(3, 4))
        no_certificate = ssl.create_default_context(cafile=pki["ca"])
        for context in (no_certificate, None):
            ticket = new_ticket()
            with contextlib.suppress(OSError):  # refused in the handshake, or right after it
                Outgoing("127.0.0.1", data.port, ticket, 5, tls=context).close()
            with pytest.raises(PushRejected, match="channel_unavailable"):
                data.claim(ticket)
    finally:
        server.stop(0)
        data.close()


def test_half_a_tls_config_fails_with_what_to_set(pki):
    with pytest.raises(TlsConfigError, match="set both cert_file and key_file"):
        server_credentials(tls_config(cert_file=pki["server"][0]))
    with pytest.raises(TlsConfigError, match="client_ca_file needs cert_file"):
        server_credentials(tls_config(client_ca_file=pki["ca"]))
    with pytest.raises(TlsConfigError, match="cannot read"):
        channel_credentials(tls_config(ca_file="/nonexistent/ca.pem"))


def test_relays_dial_with_the_runs_tls_client_settings(pki):
    """Three generators serving mutual TLS, in a chain (learner.relay_fanout=1): each relays with the
    certificate and CA of the run's config, as the generator service builds its relay, over the TLS data
    channels."""
    (server_cert, server_key), (client_cert, client_key) = pki["server"], pki["client"]
    mutual = {"cert_file": server_cert, "key_file": server_key, "client_ca_file": pki["ca"],
              "ca_file": pki["ca"], "client_cert_file": client_cert, "client_key_file": client_key}
    cfg = load_config([], [*(f"run.grpc_tls.{k}={v}" for k, v in mutual.items()), "run.token=t0k",
                           "learner.relay_fanout=1", "learner.push_timeout_s=10"])
    running = []
    try:
        for _ in range(3):
            model, access = torch.nn.Linear(4, 3), ServerAccess.from_config(cfg)  # as the generator service
            data = DataListener(tls=access.data_tls)
            receiver = WeightReceiver(ModuleTarget(model), NO_VERSION, data=data)
            relay = Relay.from_config(cfg)
            server, port = serve(receiver, "127.0.0.1", 0, access, relay=relay)
            running.append((server, relay, data, model, f"127.0.0.1:{port}"))
        weights = {"weight": torch.ones(3, 4), "bias": torch.zeros(3)}
        targets = [PushTarget(f"g{i}", r[4]) for i, r in enumerate(running)]
        across_hosts = (Route.DATA, Route.STREAM)
        with WeightPusher(ClientAccess.from_config(cfg), timeout_s=10, routes=across_hosts) as by:
            outcomes = TreePush(by, by.prepare(weights, PolicyVersion(1, 1)), 1).run(targets)
        assert [(o.status, o.relayed_by) for o in outcomes] == [("ok", ""), ("ok", "g0"), ("ok", "g1")]
        assert [o.route for o in outcomes] == [Route.DATA, Route.RELAY, Route.RELAY]  # over TLS data channels
        assert all(torch.equal(model.weight, torch.ones(3, 4)) for *_, model, _ in running)
    finally:
        for server, relay, data, *_ in running:
            server.stop(0)
            relay.close()
            data.close()
