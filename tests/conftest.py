"""Shared fixtures: an isolated RAYCHAT_HOME per test session, one local Ray cluster for all
integration tests (starting Ray costs seconds; tests share it and it is stopped at the end), and one
real S3 API (moto's standalone server on 127.0.0.1) for the tests that run on object storage.

The cluster is a real `ray start --head` with its dashboard on 127.0.0.1 (so `ray job submit` can be
tested against it), on free ports and its own temp dir, so parallel test runs never collide and
teardown stops exactly the processes this session started.
"""

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import pytest
from core_bundle import write_word_bundle
from helpers import hub_files, run_train, tiny_flags
from reused_processes import Commands, Ranks

from testkit.processes import stop_processes_under

# Tests never reach the internet: corpus preparation falls back to the offline sample corpus.
os.environ.setdefault("RAYCHAT_OFFLINE", "1")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train's controller polls its workers every 2 s, so a tiny run ends up to 2 s after its last step;
# the driver forwards RAY_TRAIN_* to the controller. A slower poll is only late, never an error: a poll
# counts as missed after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S. 1.9 s less per run (21.2 vs 23.1 s).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("WANDB_MODE", "offline")
# `ray start --head` turns on token authentication (token in ~/.ray/auth_token); every client of the
# session cluster (this process, driver subprocesses, `ray job submit`) must present it.
os.environ.setdefault("RAY_AUTH_MODE", "token")
if not os.path.exists(os.path.expanduser("~/.ray/auth_token")):
    # A fresh machine has no token yet, and `ray start` does not create one: use a session token.
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
# Credentials for the test S3 server, set before any Ray process starts so workers inherit them;
# no instance-metadata lookups (there is no cloud here).
os.environ.setdefault("AWS_ACCESS_KEY_ID", "raychat-test")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "raychat-test")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
# Where moto's request recorder (off unless a test starts it: tests/test_bucket.py counts range reads)
# would write, read by moto at import: a temp file, not the working directory.
os.environ.setdefault("MOTO_RECORDER_FILEPATH",
                      os.path.join(tempfile.gettempdir(), f"raychat_moto_recording_{os.getpid()}.jsonl"))


@pytest.fixture(scope="session", autouse=True)
def raychat_home(tmp_path_factory):
    """Keep every test away from the user's ~/.cache/raychat."""
    home = tmp_path_factory.mktemp("raychat_home")
    # Every training run scores CORE at its end by default (--core-metric-every), and the driver refuses
    # to start without an eval bundle: a tiny one in the default place (tests/core_bundle.py).
    write_word_bundle(home / "eval_bundle")
    old = os.environ.get("RAYCHAT_HOME")
    os.environ["RAYCHAT_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("RAYCHAT_HOME", None)
    else:
        os.environ["RAYCHAT_HOME"] = old


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    """Handle to the session's cluster: addresses for drivers, job submission and cleanup."""

    def __init__(self, gcs_address: str, dashboard_url: str, temp_dir: str, drivers: Commands):
        self.gcs_address = gcs_address
        self.dashboard_url = dashboard_url
        self.temp_dir = temp_dir
        # One reused interpreter for the drivers the tests launch one after another (helpers.run_train):
        # a driver imports torch, Ray Train and raychat first, 4 s of a 20 s tiny run on 2 cores.
        self.drivers = drivers

    def driver_env(self, **extra: str) -> dict[str, str]:
        """Environment for a `python -m raychat...` subprocess that joins this cluster."""
        env = dict(os.environ)
        env["RAY_ADDRESS"] = self.gcs_address
        env.update(extra)
        return env


# What the drivers' interpreter imports first (a driver imports them all, as does a sweep): their loggers
# are put back as they were after every command (tests/reused_processes.py).
DRIVER_IMPORTS = ("torch", "ray", "ray.train", "ray.data", "ray.tune")


@pytest.fixture(scope="session")
def ray_session(raychat_home, tmp_path_factory):
    """One local Ray cluster, shared by every integration test; the test process is connected."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    port, dashboard_port = free_port(), free_port()
    ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    # Logical CPUs: enough for 2 train workers, Ray Data tasks and a few Tune trials; the machine
    # has 2 cores, Ray only does the bookkeeping.
    subprocess.run(
        [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=8", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", f"--temp-dir={temp_dir}",
         "--disable-usage-stats", f"--ray-client-server-port={free_port()}",
         f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"],
        check=True, capture_output=True, timeout=120,
    )
    cluster = RayCluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}", temp_dir,
                         Commands(tmp_path_factory.mktemp("drivers"), preload=DRIVER_IMPORTS))
    try:
        ray.init(address=cluster.gcs_address, log_to_driver=True)
        yield cluster
    finally:
        cluster.drivers.close()
        ray.shutdown()
        stop_processes_under(temp_dir)
        # `ray start`'s Ray Client server names neither the temp dir nor a parent that is stopped:
        # only the GCS address it serves (`--address=<node ip>:<port> --host=...`).
        stop_processes_under(f":{port} --host=")
        time.sleep(0.5)
        shutil.rmtree(temp_dir, ignore_errors=True)


TEST_BUCKET = "raychat-test"


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's standalone S3 server (a real HTTP S3 API) on 127.0.0.1 and a free port, with a bucket;
    yields "127.0.0.1:PORT". Stopped at the end of the session."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket=TEST_BUCKET)
        yield f"{host}:{port}"
    finally:
        server.stop()


def s3_uri(endpoint: str, prefix: str, bucket: str = TEST_BUCKET) -> str:
    return f"s3://{bucket}/{prefix}?endpoint_override={endpoint}&scheme=http"


@pytest.fixture(scope="session")
def gcs_endpoint():
    """A GCS JSON API (gcp-storage-emulator, honouring generation preconditions: testkit.gcs_server)
    on 127.0.0.1 and a free port, with a bucket; yields "127.0.0.1:PORT". Stopped at the end."""
    from testkit.gcs_server import start_gcs

    server, address = start_gcs(TEST_BUCKET)
    try:
        yield address
    finally:
        server.terminate()
        server.wait(timeout=30)


def gcs_uri(endpoint: str, prefix: str, bucket: str = TEST_BUCKET) -> str:
    return f"gs://{bucket}/{prefix}?endpoint_override={endpoint}&scheme=http&anonymous=true"


@pytest.fixture(params=[pytest.param("local", marks=pytest.mark.unit),
                        pytest.param("s3", marks=pytest.mark.integration),
                        pytest.param("gcs", marks=pytest.mark.integration)])
def storage(request, tmp_path):
    """Where a test's runs live: on local disk, in the S3 bucket and in the GCS bucket (a fresh prefix
    per test): a local path or a bucket URI with its endpoint in the query, as a user passes it. They
    are tiered here (local: unit; s3, gcs: integration, a local server), so a test that takes them
    carries no tier of its own; one that picks one (`indirect=True`) carries its own."""
    if request.param == "local":
        return str(tmp_path / "storage")
    prefix = f"{request.node.name.replace('[', '-').rstrip(']')}-{time.time_ns()}"
    if request.param == "gcs":
        return gcs_uri(request.getfixturevalue("gcs_endpoint"), prefix)
    return s3_uri(request.getfixturevalue("s3_endpoint"), prefix)


def _stdlib_docs(min_chars: int = 120) -> list[str]:
    """Real English text that every Python install has: docstrings of a fixed set of modules."""
    import importlib
    import inspect

    docs, seen = [], set()
    for name in ["argparse", "collections", "json", "pathlib", "re", "textwrap", "functools", "itertools",
                 "typing", "datetime", "decimal", "fractions", "statistics", "string", "difflib", "email",
                 "http.client", "logging", "unittest", "subprocess", "shutil", "tarfile", "zipfile", "csv"]:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
            if doc and len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return docs


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small real-text corpus (shards of 40 docs = one row group each, last shard val) and a
    512-token tokenizer trained on it: what the trainer integration tests and sweeps run on."""
    from raychat.corpus.writer import CorpusWriter
    from raychat.tokenizer.train import train_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    docs = _stdlib_docs()
    with CorpusWriter(root / "data", docs_per_shard=40) as writer:
        writer.add_train(docs[:-40])
        writer.add_val(docs[-40:])
    train_tokenizer(root / "data", root / "tokenizer", vocab_size=512, log=lambda *_: None)
    return root / "data", root / "tokenizer"


@dataclass(frozen=True)
class RunAndRerun:
    """A run, launched and then launched again with a longer horizon (what `two_worker_run` made)."""

    storage: str
    name: str
    flags: list[str]  # the flags both launches share (--num-iterations aside)
    first: subprocess.CompletedProcess  # to step 16
    rerun: subprocess.CompletedProcess  # resumed, to step 20


@pytest.fixture(scope="session")
def two_worker_run(ray_session, tiny_corpus, s3_endpoint) -> RunAndRerun:
    """`python -m raychat.train` for 16 steps on 2 workers in the S3 bucket (the harder storage), then
    the same command with `--num-iterations 20`: the launches that tests/test_train.py checks as a user
    reads them and tests/test_report.py reports on (two Ray Train runs, shared by both)."""
    storage, name = s3_uri(s3_endpoint, f"two-worker-run-{time.time_ns()}"), "basic"
    flags = ["--num-workers", "2", "--total-batch-size", "1024", "--eval-every", "8", "--save-every", "4",
             "--keep-checkpoints", "2"]
    first = run_train(ray_session, tiny_flags(tiny_corpus, storage, name, *flags, "--num-iterations", "16"))
    assert first.returncode == 0, first.stderr[-3000:]
    rerun = run_train(ray_session, tiny_flags(tiny_corpus, storage, name, *flags, "--num-iterations", "20"))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    return RunAndRerun(storage, name, flags, first, rerun)


@pytest.fixture(scope="session")
def served_files(tmp_path_factory) -> Mapping[str, bytes]:
    """What the local Hub (helpers.HubServer) serves: ClimbMix-named shards (helpers.hub_files), made
    once for every module that serves them, read-only so that no test changes what the next one gets."""
    return MappingProxyType(hub_files(tmp_path_factory.mktemp("served")))


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """`commands.run(module, *args)`: `python -m module args` as a subprocess runs it, all of a test
    module's commands in one reused interpreter (tests/reused_processes.py)."""
    runner = Commands(tmp_path_factory.mktemp("commands"))
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def ranks(raychat_home):
    """`ranks.run(fn, world, *args)`: mp.spawn's fn(rank, *args) in `world` processes at once, on
    processes reused by every test that runs a gloo group (tests/reused_processes.py), started in
    the session's environment."""
    pool = Ranks()
    yield pool
    pool.close()


@pytest.fixture(scope="session", autouse=True)
def ranks_started_early(request):
    """When some test runs gloo ranks, their processes start with the session and import torch while
    the first tests run (3: the most ranks a test runs), not when the first of those tests needs them."""
    if any("ranks" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("ranks").start(3)


# Tiers (pyproject.toml declares them; README.md says how to run each): every test names its own, in
# its module (`pytestmark = pytest.mark.unit`) or on the test, and a test that names none is refused
# here, before `-m` selects anything, so no test lands unclassified. `unit` starts nothing: no
# process, no server, no Ray, no gloo ranks; `integration` starts servers, subprocesses or ranks but
# no Ray; `ray`, `cluster` and `slow` as declared. A test that uses one of the fixtures below starts
# what it says, so it is not a unit test: that is refused too, as is `unit` beside another tier.
TIERS = ("unit", "integration", "ray", "cluster", "slow")
STARTS = {"ray_session": "the shared Ray instance", "two_worker_run": "training runs on Ray",
          "s3_endpoint": "moto's S3 server", "gcs_endpoint": "the GCS emulator", "ranks": "gloo ranks",
          "commands": "a reused interpreter"}


def pytest_collection_modifyitems(config, items):
    refused = []
    for item in items:
        tiers = [name for name in TIERS if item.get_closest_marker(name) is not None]
        started = [f"{name} ({what})" for name, what in STARTS.items() if name in item.fixturenames]
        if not tiers:
            refused.append(f"{item.nodeid}: no tier marker; mark it, or its module, {' or '.join(TIERS)}")
        elif "unit" in tiers and len(tiers) > 1:
            refused.append(f"{item.nodeid}: marked unit and {', '.join(t for t in tiers if t != 'unit')}")
        elif tiers == ["unit"] and started:
            refused.append(f"{item.nodeid}: marked unit but uses {', '.join(started)}")
    if refused:
        raise pytest.UsageError("tests without a tier (tests/conftest.py, TIERS):\n  " + "\n  ".join(refused))
