"""A multi-node Ray cluster on this one machine, for the benchmarks that kill things (bench.recovery,
bench.chaos): `ray.cluster_utils.Cluster` with a head without CPUs and 1-CPU worker nodes (each its
own raylet and object store), the inputs of a tiny run, and drivers of `python -m raychat.train`
that join it. Everything it starts it stops, including the dashboard agents that outlive
`Cluster.shutdown()`.
"""

import contextlib
import os
import queue
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from testkit.processes import stop_processes_under

NODE = {"num_cpus": 1, "object_store_memory": 150 * 2**20}
STEP = re.compile(r"^step (\d{5})/")
TRAIN = [sys.executable, "-m", "raychat.train"]


def use_token_auth() -> None:
    """A local Ray cluster turns on token authentication; its drivers must present the token."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if not Path("~/.ray/auth_token").expanduser().exists():
        os.environ.setdefault("RAY_AUTH_TOKEN", os.urandom(16).hex())


def prepare_inputs(root: Path, num_docs: int = 20_000, docs_per_shard: int = 2_000) -> tuple[Path, Path]:
    """A seeded synthetic corpus and a 512-token tokenizer under `root`: (data dir, tokenizer dir)."""
    from raychat.corpus.fixture import write_synthetic_corpus
    from raychat.tokenizer.train import train_tokenizer

    data, tok = root / "data", root / "tokenizer"
    write_synthetic_corpus(data, num_docs=num_docs, docs_per_shard=docs_per_shard)
    train_tokenizer(data, tok, vocab_size=512, log=lambda *_: None)
    return data, tok


def tiny_run_flags(data: Path, tok: Path, storage: Path, run_name: str) -> list[str]:
    """The d2 model (width 64, T 64) in 2048-token steps: a few hundred ms a step on 2 cores."""
    return ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
            "--window-pattern", "L", "--device-batch-size", "8", "--total-batch-size", "2048",
            "--eval-every", "-1", "--sample-every", "-1", "--core-metric-every", "-1",
            "--cpus-per-worker", "1",
            "--placement-strategy", "SPREAD", "--data-dir", str(data), "--tokenizer-dir", str(tok),
            "--storage-path", str(storage), "--run-name", run_name]


def start_driver(flags: list[str], env: dict[str, str], **popen) -> subprocess.Popen:
    """`python -m raychat.train FLAGS` with `env` added to this process's environment."""
    return subprocess.Popen([*TRAIN, *flags], env={**os.environ, **env}, **popen)


def follow(proc: subprocess.Popen, lines: "queue.Queue[tuple[float, str | None]]") -> None:
    """Put each line of `proc`'s stdout in `lines` with its arrival time; None at the end."""
    for line in proc.stdout:
        lines.put((time.monotonic(), line.rstrip("\n")))
    lines.put((time.monotonic(), None))


@contextlib.contextmanager
def local_cluster(num_nodes: int, system_config: dict | None = None,
                  temp_dir: str | None = None) -> Iterator[tuple["Cluster", list]]:  # noqa: F821
    """A head without CPUs and `num_nodes` 1-CPU nodes; yields (cluster, worker nodes). `temp_dir`
    (short: Ray's socket paths must stay under 108 characters) lets a caller find its processes."""
    from ray.cluster_utils import Cluster

    where = {"temp_dir": temp_dir} if temp_dir else {}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 150 * 2**20, "_system_config": system_config or {}, **where})
    session_dir = cluster.head_node.get_session_dir_path()
    try:
        yield cluster, [cluster.add_node(**NODE, **where) for _ in range(num_nodes)]
    finally:
        cluster.shutdown()
        stop_processes_under(session_dir)  # agents that outlive their raylet


def add_node(cluster, temp_dir: str | None = None):
    """One more 1-CPU node (a node back after a loss)."""
    return cluster.add_node(**NODE, **({"temp_dir": temp_dir} if temp_dir else {}))
