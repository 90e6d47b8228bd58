"""gs:// as a user on GCP keeps runs: corpus, tokenizer and runs in a bucket, a run resumed from it,
the lease's atomic create (a generation precondition) raced (a store that ignores it is refused:
tests/test_faults.py), GCS's faults sorted as S3's are, and credentials (a service-account key,
found as Application Default Credentials) used and never shown. Against a GCS JSON API on
127.0.0.1 (testkit.gcs_server: gcp-storage-emulator, made to honour ifGenerationMatch) and, for the
faults, testkit.fault_proxy in front of it."""

import json
import random
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import TEST_BUCKET, gcs_uri
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from helpers import (
    STEP_LINE,
    copy_to_bucket,
    final_model_state,
    log_lines,
    one_error_line,
    run_train,
    tiny_flags,
)
from test_faults import BACKSTOP, refused_at_start

from raychat.checkpoint import fence
from raychat.checkpoint.format import read_meta
from raychat.common import RaychatError
from raychat.faults import is_missing, is_transient, retry_transient
from raychat.storage import Storage
from testkit.fault_proxy import FaultProxy
from testkit.lease_race import race

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.ray
def test_a_run_in_gcs_trains_what_local_disk_does_and_resumes_from_its_checkpoint(ray_session, tiny_corpus,
                                                                                  tmp_path, gcs_endpoint,
                                                                                  commands):
    """Corpus, tokenizer and run in the bucket: 6 steps, then the same command to step 9 resumes at 6;
    its losses and final weights are those of the same two commands on local disk, run beside it."""
    data_dir, tokenizer_dir = tiny_corpus
    prefix = f"gcs-run-{time.time_ns()}"
    corpus = gcs_uri(gcs_endpoint, f"{prefix}/corpus")
    tokenizer = gcs_uri(gcs_endpoint, f"{prefix}/tokenizer")
    copy_to_bucket(data_dir, corpus)
    copy_to_bucket(tokenizer_dir, tokenizer)
    runs = gcs_uri(gcs_endpoint, f"{prefix}/runs")
    flags = ["--num-workers", "1", "--total-batch-size", "512", "--eval-every", "-1", "--save-every", "3"]
    outputs: dict[str, list[str]] = {"gcs": [], "local": []}
    for steps in ("6", "9"):
        local_flags = tiny_flags(tiny_corpus, tmp_path / "runs", "run", *flags, "--num-iterations", steps)
        gcs_flags = tiny_flags((corpus, tokenizer), runs, "run", *flags, "--num-iterations", steps)
        local = subprocess.Popen([sys.executable, "-m", "raychat.train", *local_flags],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=ray_session.driver_env())
        try:
            in_gcs = run_train(ray_session, gcs_flags)
            local_out, _ = local.communicate(timeout=400)
        finally:
            if local.poll() is None:
                local.kill()
                local.wait()
        assert in_gcs.returncode == 0, in_gcs.stdout[-2000:] + in_gcs.stderr[-3000:]
        assert local.returncode == 0, local_out[-3000:]
        outputs["gcs"].append(in_gcs.stdout)
        outputs["local"].append(local_out)
    run = Storage(runs).child("run")
    saved = {"checkpoint_000003", "checkpoint_000006", "checkpoint_000009"}
    assert saved | {fence.LEASE_DIR} <= set(run.subdirs())
    assert read_meta(run.child("checkpoint_000006")).corpus.location == corpus.split("?")[0]
    resumed = outputs["gcs"][1]
    assert re.search(r"^Resumed from gs://\S+/run/checkpoint_000006\S* at step 6 ", resumed, re.M), resumed
    losses = {where: [m.group(4) for out in outs for m in log_lines(out, STEP_LINE)]
              for where, outs in outputs.items()}
    assert len(losses["gcs"]) == 9 and losses["gcs"] == losses["local"]
    gcs_state = final_model_state(run)
    local_state = final_model_state(Storage(str(tmp_path / "runs")).child("run"))
    assert all((gcs_state[k] == local_state[k]).all() for k in local_state)
    assert fence.epochs(run) == [1, 2]  # one lease epoch per driver, each created exclusively

    # The checkpoint reads back for sampling, from the bucket, as from local disk.
    sample = commands.run("raychat.sample", "--run-name", "run", "--storage-path", runs, "--tokenizer-dir",
                          tokenizer, "--prompt", "The", "--max-tokens", "4", timeout=120)
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert "checkpoint_000009" in sample.stdout + sample.stderr


@pytest.mark.integration  # the GCS emulator, the fault proxy, a subprocess
def test_racing_drivers_on_gcs_exactly_one_trains_whoever_is_slower(gcs_endpoint):
    """Each trial races a direct driver against one whose lease creates the proxy delays: exactly one
    wins and one epoch is ever created; the bench counts the same, run as its users run it."""
    held_back = 0
    with FaultProxy(gcs_endpoint, seed=0, api="gcs") as proxy:
        for trial in range(3):
            rng = random.Random(trial)
            prefix = f"race-{trial}-{time.time_ns()}"
            direct = Storage(gcs_uri(gcs_endpoint, prefix)).child("run")
            slowed = Storage(gcs_uri(proxy.address, prefix)).child("run")
            delay = proxy.inject("delay", method="POST", match="ifGenerationMatch=0",
                                 delay_s=rng.choice([0.3, 1.3]))
            outcomes = race([slowed, direct], rng)
            delay.ended.set()
            assert outcomes.count("won") == 1, (trial, outcomes)
            assert fence.epochs(direct) == [1], trial
            held_back += delay.hits
    assert held_back >= 1  # a slowed driver's create was held back (one that finds epoch 1 sends none)
    done = subprocess.run([sys.executable, "-m", "bench.lease_race", "--storage", "gcs", "--trials", "3",
                           "--seed", "1", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    counted = json.loads(done.stdout.splitlines()[-1])
    assert (counted["storage"], counted["trials"], counted["double_writers"]) == ("gcs", 3, 0), done.stdout


@pytest.mark.integration  # the GCS emulator
def test_an_exclusive_create_has_one_winner_among_racing_threads(gcs_endpoint):
    run = Storage(gcs_uri(gcs_endpoint, f"create-race-{time.time_ns()}"))
    start, won = threading.Barrier(8), []

    def create(i: int) -> None:
        start.wait()
        if run.create_exclusive("epoch_000001.json", f"writer {i}".encode()):
            won.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and run.read_replaceable("epoch_000001.json") == f"writer {won[0]}".encode()


@pytest.mark.integration  # the GCS emulator behind the fault proxy
def test_gcs_faults_are_sorted_as_s3_faults_and_ridden_out(gcs_endpoint):
    """Throttling, 5xx, resets and cut bodies are transient on every path (pyarrow's reads and
    writes, google-cloud-storage's listing, whole reads and creates), ridden out within the budget;
    403 and 501 are the user's at once; a missing object is missing."""
    with FaultProxy(gcs_endpoint, seed=0, api="gcs") as proxy:
        # pyarrow's client retries for retry_limit_seconds itself: 10 ms here, so the faults reach us
        store = Storage(gcs_uri(proxy.address, f"faults-{time.time_ns()}") + "&retry_limit_seconds=0.01")
        store.write_bytes("a.json", b"{}")
        store.child("checkpoint_000001").write_bytes("meta.json", b"{}")
        paths = {"read": lambda: store.read_bytes("a.json"), "write": lambda: store.write_bytes("b", b"x"),
                 "list": store.files, "whole read": lambda: store.read_replaceable("a.json"),
                 "create": lambda: store.create_exclusive(f"c{time.time_ns()}", b"1"),
                 # a directory without a marker: pyarrow's lookup took a failed listing for "not there"
                 "lookup": lambda: store.is_dir("checkpoint_000001")}
        sorted_faults = 0
        for kind in ("slowdown", "error500", "cut", "forbidden", "notimplemented"):
            for name, path in paths.items():
                fault = proxy.inject(kind, seconds=0.2)  # longer than pyarrow's own retries
                try:
                    path()
                    error = None
                except OSError as e:
                    error = e
                proxy.clear()
                if fault.hits == 0:
                    continue  # (a cut of a request with no body to cut)
                assert error is not None, (kind, name)
                assert is_transient(error) == (kind in ("slowdown", "error500", "cut")), (kind, name, error)
                sorted_faults += 1
        assert sorted_faults >= 20  # a cut of a request with no body to cut is the only one left out
        # Ridden out: 1.5 s of 503s on a whole read, of 500s on a create, in one incident each.
        lines: list[str] = []
        proxy.inject("slowdown", seconds=1.5)
        read = retry_transient(lambda: store.read_replaceable("a.json"), "reading a.json", log=lines.append)
        assert read == b"{}"
        proxy.inject("error500", seconds=1.5)
        assert retry_transient(lambda: store.create_exclusive("d.json", b"1"), "creating d.json",
                               log=lines.append)
        assert len(lines) == 4 and all("recovered" in line for line in lines[1::2]), lines
        missing = None
        try:
            store.read_replaceable("nothing.json")
        except OSError as e:
            missing = e
        assert isinstance(missing, FileNotFoundError) and is_missing(missing) and not is_transient(missing)


# The loader's read of one row group, in its own interpreter: pyarrow's GCS file holds the GIL while
# `size()` starts the object's download, so a proxy in the test's own process could never answer it
# (the client and the proxy deadlock; a real endpoint is always another process).
READ_ROW_GROUP = """
import sys
from raychat.common import RaychatError
from raychat.corpus.files import read_row_group
try:
    texts = read_row_group(sys.argv[1], "shard_00000.parquet", 1).to_pylist()
    print(len(texts), texts[0])
except RaychatError as e:
    print("refused:", e)
"""


@pytest.mark.integration  # the GCS emulator behind the fault proxy, a subprocess per read
def test_a_row_group_read_from_gcs_rides_out_stalls_resets_and_cut_bodies(gcs_endpoint):
    """The loader's range reads (a footer, then a column chunk) of a shard in GCS, through a
    stalled endpoint, a reset connection and a cut body, return the row group's documents; a
    refused read is one line naming the shard."""
    prefix = f"reads-{time.time_ns()}"
    table = pa.table({"text": [f"doc {i}" for i in range(40)]})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, row_group_size=10)
    Storage(gcs_uri(gcs_endpoint, prefix)).write_bytes("shard_00000.parquet", buffer.getvalue().to_pybytes())
    with FaultProxy(gcs_endpoint, seed=0, api="gcs") as proxy:
        for kind, window in (("stall", {"seconds": 2.0}), ("reset", {"count": 2}), ("cut", {"count": 2}),
                             ("forbidden", {"seconds": 60.0})):
            fault = proxy.inject(kind, method="GET", **window)
            # pyarrow's client retries for retry_limit_seconds itself: 10 ms here, so the faults reach raychat
            corpus = gcs_uri(proxy.address, prefix) + "&retry_limit_seconds=0.01"
            done = subprocess.run([sys.executable, "-c", READ_ROW_GROUP, corpus],
                                  capture_output=True, text=True, timeout=120, cwd=ROOT)
            proxy.clear()
            assert done.returncode == 0 and fault.hits >= 1, (kind, fault.hits, done.stderr[-2000:])
            if kind == "forbidden":
                line = done.stdout.strip()
                assert line.startswith("refused:") and "\n" not in line, line
                assert f"gs://{TEST_BUCKET}/{prefix}/shard_00000.parquet: row group 1" in line, line
            else:
                assert done.stdout.strip() == "10 doc 10", (kind, done.stdout, done.stderr[-2000:])


@pytest.fixture
def service_account(tmp_path):
    """A service-account key file (a fresh RSA key) whose token endpoint is a server on 127.0.0.1,
    as GOOGLE_APPLICATION_CREDENTIALS names one: yields (key path, private key text, access token,
    the token requests' bodies, the endpoint's handler class: set its `refuse` to refuse them)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    token, seen = f"ya29.secret-{time.time_ns()}", []

    class TokenEndpoint(BaseHTTPRequestHandler):
        refuse = False  # answer as Google does a bad assertion, quoting (as Google does not) what was sent

        def do_POST(self):  # noqa: N802 (http.server's name)
            sent = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            seen.append(sent)
            if self.refuse:
                answer = {"error": "invalid_grant", "error_description": f"bad assertion: {sent}"}
            else:
                answer = {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}
            body = json.dumps(answer).encode()
            self.send_response(400 if self.refuse else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), TokenEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    path = tmp_path / "trainer-key.json"
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "raychat-test", "private_key_id": "k1", "private_key": pem,
        "client_email": "trainer@raychat-test.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": f"http://127.0.0.1:{server.server_port}/token"}))
    try:
        yield path, pem, token, seen, TokenEndpoint
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.integration  # the GCS emulator, a token server, commands in a reused interpreter
def test_gcs_credentials_come_from_a_key_file_and_are_never_shown(gcs_endpoint, service_account, commands,
                                                                  tmp_path):
    key_path, pem, token, seen, endpoint = service_account
    secret_lines = [line for line in pem.splitlines() if "PRIVATE KEY" not in line]
    uri = f"gs://{TEST_BUCKET}/keyed-{time.time_ns()}?endpoint_override={gcs_endpoint}&scheme=http"
    # With the key: the driver's checks pass (the probe, the exclusive create) on its token.
    line = refused_at_start(commands, tmp_path, "--storage-path", uri,
                            GOOGLE_APPLICATION_CREDENTIALS=str(key_path))
    assert BACKSTOP in line and seen, line
    # Denied (a policy, through the proxy): one line that says how to give credentials, naming none.
    with FaultProxy(gcs_endpoint, seed=0, api="gcs") as proxy:
        proxy.inject("forbidden")
        denied = uri.replace(gcs_endpoint, proxy.address)
        env = {"RAYCHAT_OFFLINE": "1", "GOOGLE_APPLICATION_CREDENTIALS": str(key_path)}
        result = commands.run("raychat.train", "--run-name", "r", "--storage-path", denied, "--eval-bundle",
                              str(tmp_path / "no-bundle"), env=env, timeout=120)
    lines = [one_error_line(result)]
    assert "is not writable: access denied" in lines[0], lines
    assert "GOOGLE_APPLICATION_CREDENTIALS" in lines[0], lines
    # Credentials that may write but not list: refused at start too, not at the lease's first listing.
    with FaultProxy(gcs_endpoint, seed=0, api="gcs") as proxy:
        proxy.inject("forbidden", method="GET", match="delimiter=")
        write_only = uri.replace(gcs_endpoint, proxy.address)
        lines.append(refused_at_start(commands, tmp_path, "--storage-path", write_only,
                                      GOOGLE_APPLICATION_CREDENTIALS=str(key_path)))
        assert proxy.injected["forbidden"] >= 1
    assert "is not writable: access denied" in lines[-1], lines
    # The key refused by the token endpoint, which quotes the signed assertion back: access denied,
    # with the advice, and nothing of what was sent.
    endpoint.refuse = True
    refused_uri = uri.replace("keyed-", "refused-")
    lines.append(refused_at_start(commands, tmp_path, "--storage-path", refused_uri,
                                  GOOGLE_APPLICATION_CREDENTIALS=str(key_path)))
    assert "access denied" in lines[-1] and "GOOGLE_APPLICATION_CREDENTIALS" in lines[-1], lines
    assertions = [body.split("assertion=")[-1][:40] for body in seen if "assertion=" in body]
    assert assertions and not any(a in line for a in assertions for line in lines)
    # No key file where the variable points, or a directory (a secret's mount point): one line naming it.
    for wrong in (tmp_path / "absent.json", tmp_path):
        lines.append(refused_at_start(commands, tmp_path, "--storage-path", uri,
                                      GOOGLE_APPLICATION_CREDENTIALS=str(wrong)))
        assert lines[-1].startswith(f"raychat: error: --storage-path {uri}: GOOGLE_APPLICATION_CREDENTIALS="
                                    f"{wrong} is "), lines[-1]
    for output in (result.stdout, result.stderr, *lines):
        assert token not in output and not any(s in output for s in secret_lines)


@pytest.mark.unit
@pytest.mark.parametrize(("uri", "words"), [
    ("gs://b/runs?endpoint=127.0.0.1:1", "unknown query parameter 'endpoint'"),
    ("gs://user:pass@b/runs", "carries no credentials"),
    ("gs://b/runs?scheme=ftp", "scheme='ftp' must be http or https"),
    ("gs://b/runs?anonymous=maybe", "anonymous='maybe' must be true or false"),
    ("gs://b/runs?retry_limit_seconds=-1", "retry_limit_seconds='-1'"),
    ("gs://b/runs?retry_limit_seconds=nan", "retry_limit_seconds='nan' must be a number of seconds from 0"),
])
def test_a_malformed_gs_uri_is_refused_in_one_line(uri, words):
    with pytest.raises(RaychatError) as refused:
        Storage(uri)
    message = str(refused.value)
    assert words in message and "\n" not in message and "pass" not in message.replace("password", "")


@pytest.mark.unit
def test_a_gs_path_is_percent_decoded_as_an_s3_path_is():
    """A '#' or a space in a prefix is written %23 or %20 in a URI (raychat.locations.check_uri says
    so); both stores name the object with the character, not the escape."""
    gs = Storage("gs://b/pct%20x%23y?anonymous=true").root
    s3 = Storage("s3://b/pct%20x%23y?endpoint_override=127.0.0.1:1&scheme=http").root
    assert gs == s3 == "b/pct x#y"
