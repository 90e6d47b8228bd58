"""`python -m bench.chaos --short` in the suite: a seeded schedule of faults (a worker killed, a node
lost with a spare up, the driver killed and the run launched again, a rerun with a shorter horizon,
a second driver) on a multi-node `ray.cluster_utils.Cluster`, every one survived or refused in one
line; every epoch-1 document trained once, the checkpoints whole and the newest kept, the final
weights bit-identical to a run with no faults. The bench runs in its own process group on its own
Ray temp dir, so whatever it leaves running is found and stopped here, and counted as a failure."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from testkit.processes import stop_processes_under

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(800)]

REPO_ROOT = Path(__file__).resolve().parent.parent
STEADY = {"kill_worker", "node_swap", "kill_driver", "short_horizon", "second_driver"}


def left_running(temp_dir: str, group: int, grace_s: float = 15.0) -> list[str]:
    """Processes of the bench's process group or of its Ray cluster still alive `grace_s` after the
    bench exited (a stopped raylet's agents and a dashboard's forkserver take a few seconds to go;
    zombies, already dead, do not count)."""
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if p.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                if temp_dir in " ".join(p.info["cmdline"] or []) or os.getpgid(p.pid) == group:
                    found.append(" ".join(p.info["cmdline"] or [])[:120])
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_short_chaos_run_survives_every_fault(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths stay < 108 chars
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    bench = subprocess.Popen([sys.executable, "-m", "bench.chaos", "--short", "--seed", "1", "--time-limit",
                              "600", "--out", str(tmp_path), "--results", str(tmp_path / "RESULTS.md"),
                              "--temp-dir", temp_dir], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = bench.communicate(timeout=700)
        leftovers = left_running(temp_dir, bench.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the bench, or what it left in its group
            os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()
        stop_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert bench.returncode == 0, output[-5000:]
    assert not leftovers, leftovers

    summary = json.loads((tmp_path / "chaos.json").read_text())
    (run,) = summary["runs"]
    assert {f["kind"] for f in run["faults"]} == STEADY
    assert run["injected"] == run["survived"] == 5, run["faults"]
    assert run["lost"] == 0 and run["repeated"] == 0 and run["documents"] > 0
    assert set(run["world_sizes"]) == {2} and len(run["world_sizes"]) >= 3  # a worker and a driver restart
    assert run["weights"] == "bit-identical" and not run["problems"]
    # Its time ledger (raychat.telemetry.ledger): goodput below the whole, the worker's restart by cause.
    assert 0 < run["goodput"] < 1 and any(" at step " in line for line in run["ledger"]), run["ledger"]
    # The operator's mistakes were refused in one line each, saying why.
    notes = {f["kind"]: f["note"] for f in run["faults"]}
    assert "past this plan's horizon" in notes["short_horizon"]
    assert "being trained by another driver" in notes["second_driver"]
    # A node lost at full size (a spare up): the lost rank came back from the copy a peer node held in
    # memory, so the weights above are bit-identical after a restore from memory, with nothing read
    # from storage.
    assert re.search(r"continued on 2 from step \d+ \(peer memory\), 0 bytes read from storage$",
                     notes["node_swap"]), notes["node_swap"]
    # The relaunched driver freed what the killed driver's controller still had reserved with Ray's
    # autoscaling coordinator (else it waits for the reservation to expire, up to 180 s).
    assert notes["kill_driver"] == "lease taken over, the killed controller's reservation released"
    # The table went to the results file, under its section.
    results = (tmp_path / "RESULTS.md").read_text()
    assert "## Chaos: faults on a multi-node cluster (bench/chaos.py)" in results
    assert "| steady | 5/5 | 5 |" in results
