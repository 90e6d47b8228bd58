"""moto's S3 server in its own process, optionally slowed to a real bucket's first-byte latency.

On loopback moto answers a request in about a millisecond; a real bucket takes 20-50 ms before the
first byte. The feed's read-ahead exists to hide that latency, so a bench that only ever talks to an
instant server cannot show whether it does: `--delay-ms` sleeps that long before answering every
request (threaded, so concurrent requests wait in parallel, as they do against a real bucket).
Its own process, so moto's Python does not share the bench's GIL. In testkit, beside the fault proxy
that goes in front of it: the benches (bench.loader, bench.checkpoint, bench.checkpoint_scale,
bench.lease_race) start it; the tests run moto's server in their own process (tests/conftest.py's
s3_endpoint) or through those benches' command lines. Nothing of raychat itself needs it.

    python -m testkit.s3_server --port 9000 [--delay-ms 30]
"""

import argparse
import os
import socket
import subprocess
import sys
import time

from raychat.common import RaychatError


def start_moto(bucket: str, delay_ms: float = 0.0) -> tuple[subprocess.Popen, str]:
    """The server on a free 127.0.0.1 port with `bucket` created; returns (process, "127.0.0.1:PORT").
    The caller terminates the process. Sets this process's S3 credentials to the server's fake ones
    (children inherit them), with no instance-metadata lookups: the only S3 here is this server."""
    import boto3

    os.environ.update(AWS_ACCESS_KEY_ID="raychat-bench", AWS_SECRET_ACCESS_KEY="raychat-bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server = subprocess.Popen([sys.executable, "-m", "testkit.s3_server", "--port", str(port),
                               "--delay-ms", str(delay_ms)], cwd=root,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket=bucket)
            return server, f"127.0.0.1:{port}"
        except Exception:  # not listening yet (botocore raises several kinds)
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RaychatError("the moto S3 server did not start; check "
                                   "`pip install 'moto[server]>=5.2.5'`") from None
            time.sleep(0.3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.s3_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="sleep before answering each request")
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))  # moto builds its own URLs from it
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    delay_s = args.delay_ms / 1000

    def delayed(environ, start_response):
        time.sleep(delay_s)
        return app(environ, start_response)

    run_simple("127.0.0.1", args.port, delayed if delay_s else app, threaded=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
