"""`python -m raychat.status` against a run that is still training on the shared cluster: Ray Train's
record (through the dashboard's state API, with the cluster's token) and the run's storage."""

import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import one_error_line, tiny_flags

from raychat.checkpoint.catalog import latest_valid_checkpoint
from raychat.locations import redact
from raychat.status import TRAIN_RUNS_API
from raychat.storage import Storage
from raychat.telemetry.metrics_log import METRICS_FILE, read_timeline

pytestmark = pytest.mark.ray


def wait_for_steps(run: Storage, proc: subprocess.Popen, steps: int, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        timeline = read_timeline(run) if run.exists(METRICS_FILE) else None
        if timeline and len(timeline.steps) >= steps and latest_valid_checkpoint(run, deep=False):
            return
        time.sleep(1)
    raise AssertionError(f"the run did not reach {steps} steps and a checkpoint (exit code {proc.poll()})")


@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_status_of_a_running_run(ray_session, tiny_corpus, storage, commands):
    flags = tiny_flags(tiny_corpus, storage, "live", "--num-workers", "1", "--total-batch-size", "1024",
                       "--num-iterations", "5000", "--eval-every", "2", "--save-every", "2")
    proc = subprocess.Popen([sys.executable, "-m", "raychat.train", *flags], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ray_session.driver_env())
    try:
        wait_for_steps(Storage(storage).child("live"), proc, steps=3)
        command = ["raychat.status", "--run-name", "live", "--storage-path", storage,
                   "--address", ray_session.dashboard_url]
        result = commands.run(*command, env=ray_session.driver_env(), timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^Ray Train run \w+: RUNNING since \d{4}-", out, re.M), out
    assert re.search(r"^  attempt 1: RUNNING, 1 worker\(s\), ", out, re.M), out
    assert re.search(r"latest checkpoint checkpoint_\d{6}$", out, re.M), out
    assert re.search(r"^  last step \d+/5000: loss \d+\.\d{4}, [\d,]+ tok/s, 1 worker\(s\)$", out, re.M), out
    assert re.search(r"^  last eval at step \d+: val bpb \d+\.\d{4}$", out, re.M), out


def test_a_dashboard_that_is_not_there_is_one_line(tmp_path, commands):
    command = ["raychat.status", "--run-name", "x", "--storage-path", str(tmp_path),
               "--address", "http://127.0.0.1:9"]
    result = commands.run(*command, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("raychat: error: no Ray dashboard at http://127.0.0.1:9")
    assert len(result.stderr.strip().splitlines()) == 1


class _Dashboard(ThreadingHTTPServer):
    """A local stand-in for a dashboard's address: it records each request's Authorization header and
    answers with `reply(path)`: (status, headers, body)."""

    def __init__(self, reply):
        self.seen: list[str | None] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N805 (the handler is the request's, the server is self)
                self.seen.append(handler.headers.get("Authorization"))
                status, headers, body = reply(handler.path)
                handler.send_response(status)
                for name, value in headers:
                    handler.send_header(name, value)
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server_address[1]


def test_status_shows_no_password_and_sends_the_token_to_its_address_only(tmp_path, commands):
    """--address's user:password is never printed; the cluster's token goes to --address and to no
    address a redirect names (urllib would copy it there)."""
    elsewhere = _Dashboard(lambda path: (200, [("Content-Type", "application/json")], b'{"train_runs": []}'))
    # "localhost": another origin than 127.0.0.1, as a redirect to another machine would be.
    there = f"http://localhost:{elsewhere.port}"
    given = _Dashboard(lambda path: (302, [("Location", there + path)], b""))
    try:
        for address in (f"http://ray:hunter2@127.0.0.1:{given.port}", f"http://127.0.0.1:{given.port}"):
            result = commands.run("raychat.status", "--run-name", "x", "--storage-path", tmp_path,
                                  "--address", address, env={**os.environ, "RAY_AUTH_TOKEN": "t0ken"},
                                  timeout=120)
            line = one_error_line(result)
            assert "hunter2" not in result.stdout + result.stderr, line
            redirected = f"the dashboard at {redact(address)} redirected to another address ({there}"
            assert redirected + f"{TRAIN_RUNS_API})" in line, line
        assert given.seen == ["Bearer t0ken"] * 2 and elsewhere.seen == []
        # A raw '/', '?' or '#' in the password ends urllib's host early: "ray" on port "1", say,
        # would be sent the token. Refused in one line showing no part of the password.
        for cut in ("/", "?", "#"):
            address = f"http://ray:1{cut}hunter2@127.0.0.1:{elsewhere.port}"
            result = commands.run("raychat.status", "--run-name", "x", "--storage-path", tmp_path,
                                  "--address", address, env={**os.environ, "RAY_AUTH_TOKEN": "t0ken"},
                                  timeout=120)
            line = one_error_line(result)
            assert "raw '/', '?' or '#'" in line and "hunter2" not in result.stdout + result.stderr, line
        assert elsewhere.seen == []
    finally:
        for server in (given, elsewhere):
            server.shutdown()
            server.server_close()
