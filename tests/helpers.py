"""What several test modules share, in one place (no test module imports another): launching
`python -m raychat.train` and reading its log, comparing nested state bit for bit, the corpus CLI,
a local stand-in for the Hugging Face Hub, the S3 server's request recorder, the pinned Ray, a rank's
train-step components built without Ray, and a gloo group of spawned processes.

Fixtures live in conftest.py; the other helper modules here each serve one concern
(run_output: what a driver may print; trace_audit: exactly-once accounting from a trace;
core_bundle: tiny CORE bundles; tiny_training: a few AdamW steps)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlparse

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from raychat.checkpoint.catalog import latest_valid_checkpoint
from raychat.checkpoint.reader import load_checkpoint
from raychat.config import TrainConfig
from raychat.corpus.download import MAX_SHARD, REPO_ID
from raychat.corpus.fixture import write_synthetic_corpus
from raychat.corpus.index import list_shards, shard_filename
from raychat.model.gpt import GPT, GPTConfig, build_model
from raychat.optim.base import ShardedOptimizer
from raychat.optim.registry import optimizer_spec
from raychat.scaling import Plan, rank_rows, resolve_plan
from raychat.storage import Storage
from raychat.worker.step import micro_slices

if TYPE_CHECKING:  # conftest imports this module; the types only
    from conftest import RayCluster
    from reused_processes import Commands

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# Training runs as a user launches them, and their log

STEP_LINE = re.compile(
    r"step (\d{5})/(\d{5}) \((\d+\.\d{2})%\) \| loss: (\d+\.\d{6}) \| lrm: (\d\.\d{2}) \| "
    r"dt: (\d+\.\d{2})ms \| "
    r"tok/sec: ([\d,]+) \| bf16_mfu: n/a \| epoch: (\d+) pq: (\d+) rg: (\d+) \| total time: (\d+\.\d{2})m"
    r"( \| eta: \d+\.\dm)?$"
)
VAL_LINE = re.compile(r"Step (\d{5}) \| Validation bpb: (\d+\.\d{6})$")

# d2, width 64 (2 heads of 32), T 64: a few ms per step, still the full architecture.
TINY = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--window-pattern", "L", "--device-batch-size", "4", "--eval-tokens", "2048",
        "--warmup-steps", "2", "--sample-every", "-1"]


def tiny_flags(tiny_corpus: tuple[Path, Path], storage: str | Path, run_name: str, *extra: str) -> list[str]:
    """`python -m raychat.train` flags for a TINY run of the session's corpus, stored at `storage`."""
    data_dir, tokenizer_dir = tiny_corpus
    return [*TINY, "--data-dir", str(data_dir), "--tokenizer-dir", str(tokenizer_dir),
            "--storage-path", str(storage), "--run-name", run_name, *extra]


def run_train(cluster: "RayCluster", flags: list[str], timeout: int = 400,
              **env: str) -> subprocess.CompletedProcess:
    """`python -m raychat.train` as a user runs it, joined to `cluster`, with extra environment, in the
    session's reused driver interpreter (tests/reused_processes.py: what it keeps between commands, and
    what it gives each one afresh). A test that signals, pauses or races drivers starts real processes."""
    return cluster.drivers.run("raychat.train", *flags, env=cluster.driver_env(**env), timeout=timeout)


def modules_loaded_by(code: str, *modules: str) -> set[str]:
    """Which of `modules` a fresh interpreter has loaded once it has run `code` (from tests/, so
    `helpers` imports): what a process of the run pays for at its start, seen from outside."""
    check = f"\nimport sys\nprint(*(m for m in {modules!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code + check], cwd=REPO / "tests", env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(done.stdout.strip().splitlines()[-1].split()) if done.stdout.strip() else set()


@contextmanager
def gone_cluster_recorded() -> Iterator[str]:
    """A private RAY_TMPDIR whose ray_current_cluster names a cluster that is gone (127.0.0.1:1), as
    a machine's last `ray start` leaves it: a command that lets ray.init() find "the machine's cluster"
    there fails. Whatever Ray started under it is stopped at the end."""
    from testkit.processes import stop_processes_under

    ray_tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths stay < 108 chars
    os.makedirs(os.path.join(ray_tmp, "ray"))
    with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write("127.0.0.1:1")  # nothing listens there
    try:
        yield ray_tmp
    finally:
        stop_processes_under(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def log_lines(output: str, pattern: re.Pattern) -> list[re.Match]:
    """Matches of a pattern in driver output; Ray prefixes worker lines with '(RayTrainWorker ...) '."""
    found = []
    for line in output.splitlines():
        match = pattern.search(line)
        if match:
            found.append(match)
    return found


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The one `raychat: error:` line of a command a user's mistake stopped (exit code 2)."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("raychat: error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def refusal(commands: "Commands", flags: list[str], cluster: "RayCluster") -> str:
    """The one error line of a `python -m raychat.train` that its driver, joined to `cluster`, refuses
    before it joins Ray (a user's mistake, exit 2), run in the test module's reused interpreter
    (tests/reused_processes.py): a refusal takes about a second there, against the 4-6 s of a fresh
    interpreter's imports."""
    return one_error_line(commands.run("raychat.train", *flags, env=cluster.driver_env(), timeout=180))


def final_model_state(run: Storage) -> dict[str, torch.Tensor]:
    """The weights of a run's newest whole checkpoint."""
    model_state, _, _ = load_checkpoint(latest_valid_checkpoint(run))
    return model_state


def all_files(run: Storage) -> dict[str, bytes]:
    """Every file below a run directory and its bytes (local or in the bucket)."""
    infos = run.fs.get_file_info(pafs.FileSelector(run.root, recursive=True))
    files = {}
    for info in infos:
        if info.type == pafs.FileType.File:
            with run.fs.open_input_stream(info.path) as f:
                files[info.path] = f.read()
    return files


def copy_tree(source: Storage, target: Storage) -> None:
    """Every file below `source` to the same place below `target` (local or in a bucket)."""
    for f in source.files():
        target.write_bytes(f.base_name, source.read_bytes(f.base_name))
    for sub in source.subdirs():
        copy_tree(source.child(sub), target.child(sub))


def submit_job(ray_session: "RayCluster", train_flags: list[str],
               runtime_env: dict | None = None) -> tuple[str, str]:
    """`ray job submit` of a raychat.train run to the shared cluster; its final status and its logs."""
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    env = ray_session.driver_env()
    env.pop("RAY_ADDRESS")
    address = ["--address", ray_session.dashboard_url]
    extra = ["--runtime-env-json", json.dumps(runtime_env)] if runtime_env else []
    submit = subprocess.run([ray_bin, "job", "submit", *address, "--no-wait", *extra, "--",
                             sys.executable, "-m", "raychat.train", *train_flags],
                            capture_output=True, text=True, timeout=120, env=env)
    assert submit.returncode == 0, submit.stderr
    job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
    status = ""
    deadline = time.time() + 300
    while time.time() < deadline:
        status = subprocess.run([ray_bin, "job", "status", *address, job_id],
                                capture_output=True, text=True, timeout=60, env=env).stdout
        if any(s in status.upper() for s in ("SUCCEEDED", "FAILED", "STOPPED")):
            break
        time.sleep(2)
    # The CLI colours its own header line unless told not to; the job's log is what follows it.
    logs = subprocess.run([ray_bin, "job", "logs", "--log-color", "false", *address, job_id],
                          capture_output=True, text=True, timeout=60, env=env).stdout
    return status, logs


# ------------------------------------------------------------------------------------------------
# Nested state compared bit for bit

def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: equal bits, not just equal values (NaN, -0.0)."""
    return t.detach().contiguous().flatten().view(torch.uint8)


def assert_bitwise_equal(a: Any, b: Any) -> None:
    """Nested dicts, lists and tuples of tensors and plain values, equal bit for bit: tensors by dtype,
    shape and raw bytes (so NaN and -0.0 count), plain values by type and value. Lists and tuples
    compare alike: a state that went through JSON keeps no tuples."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(bits(a), bits(b))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_bitwise_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise_equal(x, y)
    else:
        assert type(a) is type(b) and a == b, (a, b)


# ------------------------------------------------------------------------------------------------
# The corpus CLI, and a Hugging Face Hub on 127.0.0.1

def run_corpus_cli(commands: "Commands", *args: object) -> subprocess.CompletedProcess:
    """`python -m raychat.corpus ARGS` as a user runs it (in the test module's reused interpreter,
    conftest.py's `commands`)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return commands.run("raychat.corpus", *args, env=env, timeout=120)


NUM_TRAIN = 3
VAL_DOCS = 10_000
CUT = 1000  # a dropped or stalled transfer stops this many bytes before the end
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_files(root: Path) -> dict[str, bytes]:
    """ClimbMix-named files: train shards 0..2 and the val shard 6542, from a synthetic corpus written
    under `root`. The val shard is ~15 MB, larger than the chunks huggingface_hub writes (10 MiB), so
    a transfer cut near its end leaves bytes on disk to resume from."""
    write_synthetic_corpus(root, num_docs=3 * 1100 + VAL_DOCS, seed=9, docs_per_shard=1100, val_docs=VAL_DOCS)
    paths = [path for _, path in list_shards(root)]
    names = [shard_filename(i) for i in range(NUM_TRAIN)] + [shard_filename(MAX_SHARD)]
    return {name: path.read_bytes() for name, path in zip(names, paths, strict=True)}


class HubServer:
    """A Hub for one dataset at one commit (`main` points to it). `misbehave(name, n)` picks what the
    n-th GET of a file gets: "corrupt" (same length, other bytes), "truncate" (half, with a matching
    Content-Length), "drop" (the full Content-Length, all but the last CUT bytes, then the connection
    closes) or "stall" (all but CUT bytes, then nothing until `release` is set). Records every request."""

    def __init__(self, files: Mapping[str, bytes],
                 misbehave: Callable[[str, int], str | None] = lambda name, n: None):
        self.files, self.misbehave = files, misbehave
        self.requests: list[tuple[str, str, str | None, str | None]] = []  # method, path, Range, auth
        self.lock = threading.Lock()
        self.stalled, self.release = threading.Event(), threading.Event()
        server = self

        def entry(name: str) -> dict:
            data = server.files[name]
            return {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                    "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def send_json(self, value) -> None:
                body = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def record(self) -> str:
                path = unquote(urlparse(self.path).path)
                with server.lock:
                    server.requests.append((self.command, path, self.headers.get("Range"),
                                            self.headers.get("Authorization")))
                return path

            def do_POST(self):
                path = self.record()
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                if path == f"/api/datasets/{REPO_ID}/paths-info/{COMMIT}":
                    asked = parse_qs(body).get("paths", [])
                    return self.send_json([entry(name) for name in asked if name in server.files])
                self.send_error(404)

            def do_HEAD(self):
                self.resolve(self.record(), body=False)

            def do_GET(self):
                path = self.record()
                if path in (f"/api/datasets/{REPO_ID}/revision/{rev}" for rev in ("main", COMMIT)):
                    return self.send_json({"id": REPO_ID, "sha": COMMIT,
                                           "siblings": [{"rfilename": name} for name in server.files]})
                if path == f"/api/datasets/{REPO_ID}/tree/{COMMIT}":
                    return self.send_json([entry(name) for name in server.files])
                self.resolve(path, body=True)

            def resolve(self, path: str, body: bool):
                prefix = f"/datasets/{REPO_ID}/resolve/"
                revision, _, name = path.removeprefix(prefix).partition("/")
                if not path.startswith(prefix) or revision not in ("main", COMMIT)\
                        or name not in server.files:
                    self.send_error(404)
                    return
                data = server.files[name]
                action = None
                if body:
                    with server.lock:
                        number = sum(1 for m, p, _, _ in server.requests if m == "GET" and p == path)
                    action = server.misbehave(name, number)
                if action == "corrupt":
                    data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
                start = 0
                if body and self.headers.get("Range"):
                    start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                payload = data[start:]
                if action == "truncate":
                    payload = payload[:len(payload) // 2]
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("ETag", f'"{hashlib.sha256(server.files[name]).hexdigest()}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                if not body:
                    return
                if action in ("drop", "stall"):
                    self.wfile.write(payload[:-CUT])
                    self.wfile.flush()
                    if action == "stall":
                        server.stalled.set()
                        server.release.wait(60)
                    self.close_connection = True
                    return
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def gets(self, name: str) -> list[str | None]:
        """The Range header of every GET of a file (None: from the start)."""
        return [rng for method, path, rng, _ in self.requests
                if method == "GET" and path.endswith("/" + name)]


# ------------------------------------------------------------------------------------------------
# The S3 server's (moto's) request recorder, and a local directory copied into the bucket

def _recorder(endpoint: str, action: str) -> str:
    method = "GET" if action == "download-recording" else "POST"
    request = urllib.request.Request(f"http://{endpoint}/moto-api/recorder/{action}", method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


@contextmanager
def recorded_requests(endpoint: str) -> Iterator[list[dict]]:
    """The requests the S3 server answered meanwhile (moto's request recorder), filled in on exit."""
    requests: list[dict] = []
    _recorder(endpoint, "reset-recording")
    _recorder(endpoint, "start-recording")
    try:
        yield requests
    finally:
        _recorder(endpoint, "stop-recording")
        recording = _recorder(endpoint, "download-recording")
        requests += [json.loads(line) for line in recording.splitlines() if line]


def copy_to_bucket(local_dir: str | Path, uri: str) -> Storage:
    """A local directory's files, copied to `uri` in the bucket; the bucket's Storage there."""
    bucket = Storage(uri)
    bucket.make_dir()
    pafs.copy_files(str(local_dir), bucket.root, destination_filesystem=bucket.fs)
    return bucket


# ------------------------------------------------------------------------------------------------
# The project's own pins and settings

# Failure detection tuned for training (bench/RESULTS.md, "Recovery"): every shipped head starts with it
# (tests/test_cluster.py), and the multi-node tests' heads do too: a lost node is noticed in ~3 s, not
# the ~30 s of Ray's defaults (a 3 s period, 5 misses, a 10 s timeout).
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def pyproject_ray_pin() -> str:
    """The one `ray[...]==X` requirement pyproject.toml pins: what every cluster config must install."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in deps if d.startswith("ray[")]
    assert len(pins) == 1, pins
    return pins[0]


# The memory tests' model (tests/test_memory.py, tests/test_optim_seam.py): 1,000 AdamW parameters
# (embeddings, lm_head, scalars) and 3,000 Muon ones; depth 2, width 8 (2 heads of 4), vocabulary 50
# (padded to 64), 16 tokens per row.
MEMORY_PARAMS = {"wte": 400, "value_embeds": 200, "lm_head": 390, "transformer_matrices": 3000, "scalars": 10,
                 "total": 4000}
MEMORY_CONFIG = GPTConfig(sequence_len=16, vocab_size=50, n_layer=2, n_head=2, n_kv_head=2, n_embd=8)


# ------------------------------------------------------------------------------------------------
# One rank's train step without Ray (tests/test_step.py, tests/test_optim_seam.py), and a gloo group
# of spawned processes to run it, or a checkpoint, at two ranks (also tests/test_checkpoint_sharded.py)

class StepRows:
    """A loader over a seeded stream of rows: step s gets `stream(s)` (the step's rows of all ranks,
    T + 1 tokens each), of which this rank takes `rows`."""

    def __init__(self, stream: Callable[[int], torch.Tensor], rows: slice = slice(None), step: int = 0):
        self.stream, self.rows, self.step = stream, rows, step

    def next_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.stream(self.step)[self.rows]
        assert tokens.shape[0] == n
        self.step += 1
        return tokens[:, :-1], tokens[:, 1:]


@dataclass
class StepComponents:
    """What raychat.worker.step.train_step computes with (raychat.worker.setup.Worker has the same)."""

    cfg: TrainConfig
    plan: Plan
    device: torch.device
    model: torch.nn.Module
    optimizer: ShardedOptimizer
    loader: StepRows
    micro_slices: list[slice]


def step_components(cfg: TrainConfig, vocab: int, stream: Callable[[int], torch.Tensor], world: int = 1,
                    rank: int = 0, step: int = 0,
                    build: Callable[[GPT, TrainConfig, Plan], ShardedOptimizer] | None = None
                    ) -> StepComponents:
    """A rank's model, optimizer and rows as the worker builds them (raychat.worker.setup), on the
    CPU: the model from the plan of `cfg` (seeded by cfg.seed), the optimizer by `build` (default: the
    spec --optimizer names), this rank's share of the plan's rows per step of `stream` from `step` on,
    cut into micro-batches of --device-batch-size."""
    plan = resolve_plan(cfg, vocab, world)
    torch.manual_seed(cfg.seed)
    model = build_model(plan.model, "cpu")
    optimizer = (build or optimizer_spec(cfg.optimizer).build)(model, cfg, plan)
    mine = rank_rows(plan.rows_per_step, world, rank)
    first = sum(rank_rows(plan.rows_per_step, world, r) for r in range(rank))
    return StepComponents(cfg, plan, torch.device("cpu"), model, optimizer,
                          StepRows(stream, slice(first, first + mine), step),
                          micro_slices(mine, plan.device_batch_size))


@contextmanager
def gloo_group(rank: int, tmp: str | Path, world: int = 2) -> Iterator[Callable[[Any], list]]:
    """This process as rank `rank` of a gloo group of `world` processes (mp.spawn's), one CPU thread
    each, meeting at a file store in `tmp`; yields all_gather_object as a function of the object,
    and ends the group on exit."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))

    def gather(obj: Any) -> list:
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    try:
        yield gather
    finally:
        dist.destroy_process_group()
