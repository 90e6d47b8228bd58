"""A Google Cloud Storage JSON API on 127.0.0.1, in its own process: gcp-storage-emulator, made to
honour the one precondition raychat's lease needs.

The emulator serves what pyarrow's GcsFileSystem and google-cloud-storage ask of a bucket (listings,
resumable and multipart uploads, ranged reads, copies, deletes), but it ignores `ifGenerationMatch`:
an upload with `ifGenerationMatch=0` ("create, only if no live object has this name") succeeds over
an existing object, where GCS answers 412 Precondition Failed. raychat's run lease rests on exactly
that answer (raychat.checkpoint.fence), so here each upload that carries the precondition is checked
and stored as one step (requests are handled one at a time): two racing creates get one 200 and one
412, as from GCS. Everything else
is the emulator's own. A store that ignores the precondition (the emulator as shipped, or a proxy
that drops it: testkit.fault_proxy's "drop_conditions") is what raychat's storage probe must refuse.

    python -m testkit.gcs_server --port 9023        # what start_gcs() runs

Its own process, so the emulator's Python does not share a test's GIL, and a test can kill it.
"""

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path

from raychat.common import RaychatError


def start_gcs(bucket: str) -> tuple[subprocess.Popen, str]:
    """The server on a free 127.0.0.1 port with `bucket` created; returns (process, "127.0.0.1:PORT").
    The caller terminates the process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    server = subprocess.Popen([sys.executable, "-m", "testkit.gcs_server", "--port", str(port)], cwd=root,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            create_bucket(address, bucket)
            return server, address
        except OSError:  # not listening yet
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RaychatError("the GCS emulator did not start; check "
                                   "`pip install gcp-storage-emulator`") from None
            time.sleep(0.3)


def create_bucket(address: str, bucket: str) -> None:
    """Create `bucket` on the server at `address` (the JSON API's buckets.insert)."""
    request = urllib.request.Request(f"http://{address}/storage/v1/b?project=raychat-test",
                                     data=json.dumps({"name": bucket}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()


def honour_generation_preconditions() -> None:
    """Wrap the emulator's object insert so `ifGenerationMatch` decides, atomically, as on GCS: 0 means
    "only if no live object has this name", N "only if the live object's generation is N"."""
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    insert = objects.insert

    def object_name(request) -> str | None:
        if "name" in request.query:
            return request.query["name"][0]
        data = request.data if isinstance(request.data, dict) else {}
        return (data.get("meta") or data).get("name")

    def guarded_insert(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        if not wanted:
            return insert(request, response, storage, *args, **kwargs)
        # serve() handles one request at a time: no second create slips between the check and the store
        try:
            live = storage.get_file_obj(request.params["bucket_name"], object_name(request))
            generation = str(live.get("generation"))
        except NotFound:
            generation = "0"
        if generation != wanted[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you "
                                     "specified did not hold.", "errors": [
                                         {"reason": "conditionNotMet", "domain": "global"}]}})
            return None
        return insert(request, response, storage, *args, **kwargs)

    objects.insert = guarded_insert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.gcs_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    args = parser.parse_args(argv)
    honour_generation_preconditions()  # before the server module reads the handlers into its routes
    serve(args.port)
    return 0


def serve(port: int) -> None:
    """The emulator's handlers behind a threaded server. Its own server answers one connection at a
    time with a listen backlog of 5: a trainer's 32 parallel footer reads overflow that, and the
    dropped connections wait out TCP's retransmission backoff (seconds, growing) before pyarrow's
    client even retries. Here connections are accepted at once, and requests are still handled one
    at a time (the emulator's storage is not thread-safe), which also makes each precondition check
    and its store one step."""
    from functools import partial

    from gcp_storage_emulator.server import RequestHandler
    from gcp_storage_emulator.storage import Storage

    one_at_a_time = threading.Lock()

    class Handler(RequestHandler):
        def handle_one_request(self) -> None:
            # Read the request line and headers first (a client may hold an idle connection open),
            # then handle it alone.
            self.raw_requestline = self.rfile.readline(65537)
            if not self.raw_requestline or not self.parse_request():
                self.close_connection = True
                return
            method = getattr(self, f"do_{self.command}", None)
            if method is None:
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"unsupported method {self.command!r}")
                return
            with one_at_a_time:
                method()
            self.wfile.flush()

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256

    Server(("127.0.0.1", port), partial(Handler, Storage(use_memory_fs=True))).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
