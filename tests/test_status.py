"""`python -m raychat.status` against a run that is still training on the shared cluster: Ray Train's
record (through the dashboard's state API, with the cluster's token) and the run's storage."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import tiny_flags

from raychat.checkpoint.format import latest_valid_checkpoint
from raychat.run.metrics_log import METRICS_FILE, read_timeline
from raychat.storage import Storage

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
        # Ray Train's controller, a process on every run's start, loads no torch on a run without
        # failures (the workers do): raychat's process group is set up from a module without it
        # (raychat.run.process_group).
        loaded = {kind: torch_loaded_by(ray_session, kind) for kind in ("TrainController", "RayTrainWorker")}
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
    assert loaded == {"TrainController": [False], "RayTrainWorker": [True]}, loaded


def torch_loaded_by(ray_session, class_name: str) -> list[bool]:
    """For each live actor of `class_name` on the session's cluster (this machine): whether its
    process has torch's library mapped."""
    from ray.util.state import list_actors

    actors = list_actors(address=ray_session.dashboard_url, filters=[("class_name", "=", class_name),
                                                                     ("state", "=", "ALIVE")],
                         raise_on_missing_output=False)
    return [("libtorch" in Path(f"/proc/{actor.pid}/maps").read_text()) for actor in actors]


def test_a_dashboard_that_is_not_there_is_one_line(tmp_path, commands):
    command = ["raychat.status", "--run-name", "x", "--storage-path", str(tmp_path),
               "--address", "http://127.0.0.1:9"]
    result = commands.run(*command, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("raychat: error: no Ray dashboard at http://127.0.0.1:9")
    assert len(result.stderr.strip().splitlines()) == 1
