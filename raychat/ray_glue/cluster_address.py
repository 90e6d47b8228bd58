"""Which Ray a command runs on: the cluster RAY_ADDRESS names (what `ray job submit` sets), checked
before Ray's own connect, else a local instance of the command's own.

Ray's connect waits minutes on a dead address or on a server that is not a Ray cluster, and retries a
missing token for ~13 s, printing as it goes, before a traceback; `check_cluster_answers` makes each
one line within seconds. With no RAY_ADDRESS, `ray.init()` would join the cluster the machine's last
`ray start` recorded (/tmp/ray/ray_current_cluster), which may be gone or refuse the command's
num_cpus: LOCAL asks for a new instance instead.
"""

import os
import re
import socket
import ssl

from raychat.common import RaychatError, unreachable
from raychat.ray_glue.ray_internals import gcs_refusal

HOST_PORT = re.compile(r"[^\s/:]+:\d+")
LOCAL = "local"  # ray.init's address for "a new instance, never the recorded cluster"
# What an HTTP/2 client sends first (RFC 9113 3.4): the preface and an empty SETTINGS frame.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_FRAME = 4


def speaks_http2(host: str, port: int, timeout_s: float = 2.0) -> bool | None:
    """Whether the server at host:port answers HTTP/2's connection preface with a SETTINGS frame, as
    every gRPC server does (a GCS is one): True; False when it answers with anything else or hangs up
    (an HTTP/1 server such as the dashboard says "400 Bad Request"); None when it says nothing within
    `timeout_s`. A check of milliseconds that spares a user who typed the dashboard's port the GCS
    client's 15 s of retries (`gcs_refusal`); only a plaintext GCS can be told so (RAY_USE_TLS: not
    asked)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(HTTP2_PREFACE)
            head = b""
            while len(head) < 9:  # a frame's header: length (3 bytes), type, flags, stream (4)
                chunk = conn.recv(9 - len(head))
                if not chunk:
                    return False
                head += chunk
    except (ConnectionResetError, BrokenPipeError):  # hung up on the preface: no gRPC server does
        return False
    except OSError:  # a timeout included: undecided, the GCS client's check says
        return None
    return head[3] == SETTINGS_FRAME and head[5:] == bytes(4)


def speaks_tls(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether the server at host:port is a TLS server: it completes a handshake, or answers one with
    a TLS alert (a cluster with RAY_USE_TLS asks for a client certificate). Only the protocol is
    asked, no certificate is checked; asked once a plaintext HTTP/2 preface was refused, to say why."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])  # gRPC's
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn, context.wrap_socket(conn):
            return True
    except ssl.SSLError as e:
        return "ALERT" in (e.reason or "")  # the peer spoke TLS to refuse us
    except OSError:
        return False


def tls_on() -> bool:
    """Whether Ray's gRPC channels use TLS here (Ray reads RAY_USE_TLS as 1/true)."""
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true")


def check_cluster_answers(address: str) -> None:
    """A RAY_ADDRESS of host:port (what `ray start` prints and `ray job submit` sets) must be a Ray
    cluster that answers and takes this driver, or one RaychatError line says which it is not. Other
    forms ("auto", "ray://...", an IPv6 [host]:port) are left to Ray."""
    address = address.strip()
    if not HOST_PORT.fullmatch(address):
        return
    host, port_text = address.rsplit(":", 1)
    port = int(port_text)
    if (reason := unreachable(host, port)) is not None:
        raise RaychatError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({reason}): start one "
                           "(`ray start --head`), fix the address, or unset RAY_ADDRESS to run on a local "
                           "Ray instance")
    plaintext = not tls_on()  # (a TLS cluster refuses any plaintext probe)
    refusal = "not a GCS" if plaintext and speaks_http2(host, port) is False else gcs_refusal(address)
    if refusal == "not a GCS" and plaintext and speaks_tls(host, port):
        raise RaychatError(f"RAY_ADDRESS={address}: the server there speaks TLS (a Ray cluster started with "
                           "RAY_USE_TLS=1, or an HTTPS server): for such a cluster set RAY_USE_TLS=1 and "
                           "RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY and RAY_TLS_CA_CERT as on its nodes")
    if refusal == "token":
        raise RaychatError(f"RAY_ADDRESS={address}: the cluster refuses this driver's token (none, or "
                           "another): set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or "
                           "~/.ray/auth_token; `ray get-auth-token` on the head prints it")
    if refusal == "not a GCS":
        raise RaychatError(f"RAY_ADDRESS={address}: something answers there, but not a Ray cluster: use the "
                           "address `ray start --head` printed (port 6379 by default), not the dashboard's "
                           "(8265)")
