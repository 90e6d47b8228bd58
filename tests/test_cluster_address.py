"""RAY_ADDRESS pre-flight (raychat.ray_glue.cluster_address): what answers at an address is told apart by
the first bytes it sends back, against real servers on 127.0.0.1: gRPC's (a GCS speaks it), gRPC over
TLS (a cluster started with RAY_USE_TLS), an HTTP/1 server (the dashboard's kind), one that hangs up,
one that says nothing. Where the quick check cannot tell, Ray's GCS client is asked (15 s against a
server that is not a GCS): `gcs_asked` records that instead."""

import datetime
import socket
import threading
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers import HubServer

from raychat.common import RaychatError
from raychat.ray_glue import cluster_address
from raychat.ray_glue.cluster_address import check_cluster_answers, speaks_http2, speaks_tls

pytestmark = pytest.mark.integration  # a gRPC server, a local server


@pytest.fixture
def http1_server():
    """The port of an HTTP/1 server (the local Hub the download tests use, serving nothing here)."""
    with HubServer({}) as hub:
        yield int(hub.url.rsplit(":", 1)[1])


@pytest.fixture
def gcs_asked(monkeypatch) -> list[str]:
    """The addresses Ray's GCS client was asked about, which answers "not a GCS" for each; no
    RAY_USE_TLS from the environment."""
    asked: list[str] = []

    def gcs_refusal(address: str) -> str:
        asked.append(address)
        return "not a GCS"

    monkeypatch.setattr(cluster_address, "gcs_refusal", gcs_refusal)
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    return asked


def self_signed() -> tuple[bytes, bytes]:
    """(key, certificate) in PEM for localhost, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()), cert.public_bytes(serialization.Encoding.PEM))


@pytest.fixture
def listener():
    """A socket that accepts and then does what the test says with the connection."""
    sock = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept(close: bool) -> None:
        conn, _ = sock.accept()
        accepted.append(conn)
        if close:
            conn.close()

    try:
        yield sock.getsockname()[1], accept
    finally:
        for conn in accepted:
            conn.close()
        sock.close()


def test_a_grpc_server_speaks_http2():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert speaks_http2("127.0.0.1", port) is True
    finally:
        server.stop(grace=None)


def test_an_http1_server_does_not_and_is_named_at_once(http1_server, gcs_asked):
    assert speaks_http2("127.0.0.1", http1_server) is False
    assert speaks_tls("127.0.0.1", http1_server) is False
    with pytest.raises(RaychatError, match=rf"RAY_ADDRESS=127.0.0.1:{http1_server}: something answers there, "
                                           r"but not a Ray cluster: .*not the dashboard's \(8265\)"):
        check_cluster_answers(f"127.0.0.1:{http1_server}")
    assert gcs_asked == []


def test_with_ray_use_tls_the_gcs_client_is_asked(http1_server, gcs_asked, monkeypatch):
    monkeypatch.setenv("RAY_USE_TLS", "1")  # a plaintext preface would be refused by any TLS cluster
    with pytest.raises(RaychatError, match="but not a Ray cluster"):
        check_cluster_answers(f"127.0.0.1:{http1_server}")
    assert gcs_asked == [f"127.0.0.1:{http1_server}"]


@pytest.mark.parametrize("client_certificate", [False, True], ids=["tls", "mutual-tls"])
def test_a_tls_cluster_without_ray_use_tls_is_told_so(client_certificate, gcs_asked):
    key, cert = self_signed()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    credentials = grpc.ssl_server_credentials([(key, cert)], require_client_auth=client_certificate,
                                              root_certificates=cert if client_certificate else None)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        assert speaks_http2("127.0.0.1", port) is False  # it hangs up on plaintext
        told = rf"RAY_ADDRESS=127.0.0.1:{port}: the server there speaks TLS .*set RAY_USE_TLS=1 and RAY_TLS_"
        with pytest.raises(RaychatError, match=told):
            check_cluster_answers(f"127.0.0.1:{port}")
        assert gcs_asked == []
    finally:
        server.stop(grace=None)


def test_a_server_that_hangs_up_is_not_http2_and_a_silent_one_is_undecided(listener):
    port, accept = listener
    closing = threading.Thread(target=accept, args=(True,))
    closing.start()
    assert speaks_http2("127.0.0.1", port) is False
    closing.join()
    silent = threading.Thread(target=accept, args=(False,))
    silent.start()
    assert speaks_http2("127.0.0.1", port, timeout_s=0.3) is None  # left to the GCS client's check
    silent.join()


def test_a_silent_server_is_left_to_the_gcs_client(listener, gcs_asked):
    port, accept = listener
    for _ in range(2):  # the pre-flight's connect, then the preface's connection (2 s unanswered)
        threading.Thread(target=accept, args=(False,), daemon=True).start()
    with pytest.raises(RaychatError, match="but not a Ray cluster"):
        check_cluster_answers(f"127.0.0.1:{port}")
    assert gcs_asked == [f"127.0.0.1:{port}"]
