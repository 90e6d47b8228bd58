"""RAY_ADDRESS pre-flight (raychat.run.cluster_address): what answers at an address is told apart by
the first bytes it sends back, against real servers on 127.0.0.1: gRPC's (a GCS speaks it), an HTTP/1
server (the dashboard's kind), one that hangs up, one that says nothing."""

import socket
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from raychat.common import RaychatError
from raychat.run import cluster_address
from raychat.run.cluster_address import check_cluster_answers, speaks_http2


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 -- http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def http1_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


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


def test_an_http1_server_does_not_and_is_named_at_once(http1_server, monkeypatch):
    assert speaks_http2("127.0.0.1", http1_server) is False

    def gcs_client_asked(address: str) -> None:  # its retries take 15 s against such a server
        pytest.fail(f"the GCS client was asked about {address}: the HTTP/2 check should have said")

    monkeypatch.setattr(cluster_address, "gcs_refusal", gcs_client_asked)
    with pytest.raises(RaychatError, match=rf"RAY_ADDRESS=127.0.0.1:{http1_server}: something answers there, "
                                           r"but not a Ray cluster: .*not the dashboard's \(8265\)"):
        check_cluster_answers(f"127.0.0.1:{http1_server}")


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
