"""A fault-injecting front for a bucket's endpoint (moto's S3 server, or testkit.gcs_server's GCS):
storage faults on demand.

A bucket in production throttles (503 SlowDown), fails (500), resets connections, freezes for a
while and cuts responses short. Tests and `bench.chaos` need those faults against real clients
(pyarrow's, boto3, google-cloud-storage) and a real bucket API, with no mock in between. Clients use
the proxy's address as their endpoint (`s3://bucket/x?endpoint_override=127.0.0.1:PORT&scheme=http`,
the same for gs://); it forwards each request verbatim, Host header included, so the request the
server receives is the one the client signed (SigV4 signs the Host header; moto accepts any
signature, and a server that checks them would find this one consistent). `api="gcs"` words its
errors as GCS's JSON API does and drops GCS's preconditions (query parameters) where "s3" drops
S3's (headers).

    proxy = FaultProxy("127.0.0.1:9000", seed=0).start()
    proxy.inject("slowdown", count=5)                       # the next 5 requests get 503 SlowDown
    proxy.inject("stall", seconds=20)                       # frozen for 20 s, then answers again
    proxy.inject("reset", method="PUT", match="rank_0000")  # every PUT of that file: connection reset
    proxy.inject("error500", seconds=60, probability=0.3)   # a minute of intermittent 500s (seeded)
    proxy.inject("drop_conditions")                         # a store that ignores If-None-Match/If-Match

Kinds: "delay" (answer after `delay_s`), "slowdown" (503 SlowDown), "error500" (500 InternalError),
"notimplemented" (501 NotImplemented, what a store answers a request it does not implement),
"forbidden" (403 AccessDenied: a policy that denies some keys),
"reset" (TCP reset after reading the request), "lost_reply" (forwarded, then a TCP reset instead of
the answer: the store did it, the client never heard), "stall" (hold each request until the fault's window
ends, then forward it: a frozen endpoint that thaws), "cut" (forward, then send half the body and
close), "drop_conditions" (forward without the If-None-Match and If-Match headers, or GCS's
ifGenerationMatch-style parameters: the stores and proxies that ignore conditional writes). A fault
applies to requests matching `method` and `match` (a substring of the path, i.e. /bucket/key), while
its window (`seconds` from now) lasts and until it has hit `count` requests. `probability` faults
draw from the proxy's seeded generator: the same seed and the same sequence of requests meet the
same faults.

In testkit, not bench/, because the tests (tests/test_faults.py, test_lease.py, ...) and the benches
(bench.lease_race) both put it in front of a bucket; raychat itself never imports it.
"""

import http.client
import json
import random
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlencode

KINDS = ("delay", "slowdown", "error500", "notimplemented", "forbidden", "reset", "lost_reply", "stall",
         "cut", "drop_conditions")
# What a store that ignores conditional writes drops: the preconditions of S3's PUT (headers) and of
# GCS's uploads (query parameters).
CONDITION_HEADERS = {"if-none-match", "if-match"}
GCS_CONDITIONS = ("ifGenerationMatch", "ifGenerationNotMatch", "ifMetagenerationMatch",
                  "ifMetagenerationNotMatch")

# Hop-by-hop headers: they describe one connection, so the proxy sets its own on each side.
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "expect", "te", "trailer", "upgrade",
               "proxy-connection"}

S3_ERRORS = {  # kind -> (status, S3 error code, message), as AWS S3 words them
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "notimplemented": (501, "NotImplemented", "A header you provided implies functionality that is not "
                       "implemented."),
    "forbidden": (403, "AccessDenied", "Access Denied"),
}


@dataclass
class Fault:
    """One injected fault; `hits` counts the requests it has affected."""
    kind: str
    until: float | None = None          # monotonic end of its window, None: no end
    count: int | None = None            # requests it may still affect, None: no limit
    method: str | None = None
    match: str | None = None
    probability: float = 1.0
    delay_s: float = 1.0
    hits: int = 0
    ended: threading.Event = field(default_factory=threading.Event)   # set by clear() or stop()

    def active(self, now: float) -> bool:
        return not self.ended.is_set() and (self.until is None or now < self.until) \
            and (self.count is None or self.count > 0)

    def end(self) -> None:
        """Stop this fault now (a request it stalls goes through at once)."""
        self.ended.set()

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or method == self.method.upper()) and \
            (self.match is None or self.match in path)


class FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 in front of `upstream` ("host:port"), injecting faults."""

    def __init__(self, upstream: str, seed: int = 0, port: int = 0, api: str = "s3"):
        if api not in ("s3", "gcs"):
            raise ValueError(f"unknown api {api!r}: 's3' or 'gcs'")
        self.upstream, self.api = upstream, api
        self._rng = random.Random(seed)   # decides `probability` faults: one seed, one schedule
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self.requests = 0                 # requests seen, faulted or not
        self.injected: dict[str, int] = {kind: 0 for kind in KINDS}
        self._server = _Server(("127.0.0.1", port), _handler_class(self))
        # A short poll interval: stop() returns in 50 ms, not 500 (tests start a proxy each).
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fault-proxy", daemon=True)

    @property
    def address(self) -> str:
        """"127.0.0.1:PORT": what clients use as their endpoint_override."""
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.clear()   # releases stalled requests, so their threads end
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def inject(self, kind: str, seconds: float | None = None, count: int | None = None,
               match: str | None = None, method: str | None = None, probability: float = 1.0,
               delay_s: float = 1.0) -> Fault:
        """Start a fault now (the kinds: see the module docstring); returns it, for `hits` and `end()`."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}: one of {', '.join(KINDS)}")
        if kind == "stall" and seconds is None:
            raise ValueError("a stall needs seconds=: how long the endpoint stays frozen")
        fault = Fault(kind, None if seconds is None else time.monotonic() + seconds, count, method, match,
                      probability, delay_s)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """End every fault now (stalled requests are forwarded at once)."""
        with self._lock:
            faults, self._faults = self._faults, []
        for fault in faults:
            fault.end()

    def _pick(self, method: str, path: str) -> Fault | None:
        """The fault this request meets (the first active one that matches), counted; None if none."""
        now = time.monotonic()
        with self._lock:
            self.requests += 1
            self._faults = [f for f in self._faults if f.active(now)]
            for fault in self._faults:
                if fault.matches(method, path) and self._rng.random() < fault.probability:
                    fault.hits += 1
                    if fault.count is not None:
                        fault.count -= 1
                    self.injected[fault.kind] += 1
                    return fault
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # A client that hung up (it timed out, or a fault closed the connection) is not news.
        if not isinstance(sys.exc_info()[1], (OSError, ValueError)):
            super().handle_error(request, client_address)


def _error(api: str, status: int, code: str, message: str, path: str) -> tuple[list[tuple[str, str]], bytes]:
    """The headers and body of an error answer, as the store's API words it."""
    if api == "gcs":
        body = {"error": {"code": status, "message": message,
                          "errors": [{"reason": code, "message": message}]}}
        return [("Content-Type", "application/json")], json.dumps(body).encode()
    return [("Content-Type", "application/xml")], _xml_error_body(code, message, path)


def _without_gcs_conditions(path: str) -> str:
    """`path` with GCS's precondition parameters taken out of its query."""
    base, _, query = path.partition("?")
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k not in GCS_CONDITIONS]
    return f"{base}?{urlencode(kept)}" if kept else base


def _xml_error_body(code: str, message: str, path: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{path}</Resource><RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
            ).encode()


def _handler_class(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive, and 100-continue answered for large PUTs

        def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
            pass

        def _body(self) -> bytes:
            """The request's body, de-chunked if the client streamed it."""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):   # trailers
                    pass
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _handle(self) -> None:
            body = self._body()
            fault = proxy._pick(self.command, self.path)
            kind = fault.kind if fault else None
            if kind == "reset":
                self._reset()
                return
            if kind in S3_ERRORS:
                status, code, message = S3_ERRORS[kind]
                self._answer(status, *_error(proxy.api, status, code, message, self.path.split("?")[0]))
                return
            if kind == "delay":
                fault.ended.wait(fault.delay_s)
            elif kind == "stall":
                fault.ended.wait(max(0.0, fault.until - time.monotonic()))
            status, headers, payload = self._forward(body, drop=kind == "drop_conditions")
            if kind == "lost_reply":
                self._reset()
                return
            if kind == "cut" and len(payload) > 1:
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload[:len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self._answer(status, headers, payload)

        def _reset(self) -> None:
            # SO_LINGER 0: close() sends RST, what a load balancer dropping a connection does.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        def _forward(self, body: bytes, drop: bool) -> tuple[int, list[tuple[str, str]], bytes]:
            """The upstream's answer to this request, sent with the client's own headers (Host kept),
            without its preconditions if `drop`."""
            connection = http.client.HTTPConnection(proxy.upstream, timeout=300)
            dropped = CONDITION_HEADERS if drop and proxy.api == "s3" else set()
            path = _without_gcs_conditions(self.path) if drop and proxy.api == "gcs" else self.path
            try:
                connection.putrequest(self.command, path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP_HEADERS | dropped and name.lower() != "content-length":
                        connection.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    connection.putheader("Content-Length", str(len(body)))
                connection.endheaders(body)
                response = connection.getresponse()
                payload = response.read()
                headers = [(n, v) for n, v in response.getheaders() if n.lower() not in HOP_HEADERS
                           and n.lower() != "content-length"]
                if self.command == "HEAD":   # no body, but the object's length is the client's to see
                    headers.append(("Content-Length", response.getheader("Content-Length", "0")))
                return response.status, headers, payload
            finally:
                connection.close()

        def _answer(self, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
            """Send a whole answer; a HEAD's carries its length but no body (as S3's errors do)."""
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            if not any(name.lower() == "content-length" for name, _ in headers):
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

    return Handler
