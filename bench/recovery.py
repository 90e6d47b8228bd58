"""How fast an elastic run recovers on a real multi-node Ray cluster, with Ray's cluster defaults and
with the cluster settings the README recommends.

A `ray.cluster_utils.Cluster` on this machine (a head without CPUs and two 1-CPU worker nodes, each
its own raylet and object store) runs `python -m raychat.train --num-workers 1:2` on a tiny model. At
step 20 one node is killed without notice (its raylet and every process on it killed at once, a spot reclaim);
after 10 steps on one worker it is added back. From the driver's output, timestamped as it arrives:

  loss -> step    seconds from the node's death to the next step line (the run shrank to 1)
  back -> grown   seconds from the node's return to the first step at 2 workers
  redone          steps trained again after the shrink / after the grow (the grow saves first: 0)

    python -m bench.recovery                      # both settings, ~5-8 minutes on 2 cores
    python -m bench.recovery --settings default
    python -m bench.recovery --settings recommended --timeline   # where the seconds of a recovery go

"recommended" = GCS health checks every 1 s, a node dead after 3 missed ones
(`health_check_period_ms`, `health_check_failure_threshold`: Ray's defaults are 3 s and 5). Both
run raychat's own elastic settings: RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=5 unless set, and the
cluster view refreshed at each restart (raychat.elastic.controller.FreshClusterView).
"""

import argparse
import json
import os
import queue
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.multinode import (
    STEP,
    add_node,
    follow,
    local_cluster,
    prepare_inputs,
    start_driver,
    tiny_run_flags,
    use_token_auth,
)
from testkit.processes import kill_node

SETTINGS = {
    "default": ({}, {}),
    "recommended": ({"health_check_period_ms": 1000, "health_check_failure_threshold": 3}, {}),
}


def measure(name: str, data: Path, tok: Path, storage: Path, show_timeline: bool = False) -> dict:
    system_config, env = SETTINGS[name]
    with local_cluster(2, system_config) as (cluster, nodes):
        flags = [*tiny_run_flags(data, tok, storage, name), "--num-iterations", "400", "--save-every", "10",
                 "--num-workers", "1:2", "--resize-check-every", "5", "--grow", "always"]
        proc = start_driver(flags, {**env, "RAY_ADDRESS": cluster.address}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
        return follow_recovery(name, cluster, nodes, proc, show_timeline)


def follow_recovery(name: str, cluster, nodes: list, proc, show_timeline: bool) -> dict:
    """Kill a node at step 20, add it back 10 steps after the shrink, time both from the driver's lines."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=follow, args=(proc, lines), daemon=True).start()
    events: dict[str, float] = {}
    result: dict = {"settings": name}
    workers, last_step = 2, -1
    timeline: list[str] = []  # the driver's other lines between the node's death and the next step
    try:
        while True:
            t, line = lines.get(timeout=600)
            if line is None:
                break
            if "loss" in events and "shrunk" not in events and not STEP.match(line):
                timeline.append(f"  +{t - events['loss']:5.1f}s {line[:200]}")
            if line.startswith("Lost "):
                workers = 1
                result["redone_after_loss"] = int(re.search(r"(\d+) steps redone", line).group(1))
            if line.startswith("Grew to"):
                workers = 2
                result["redone_after_grow"] = 0 if "no steps redone" in line else None
            match = STEP.match(line)
            if not match:
                continue
            last_step = int(match.group(1))
            if "loss" not in events and last_step >= 20:
                kill_node(cluster, nodes.pop())
                events["loss"] = time.monotonic()
            elif "loss" in events and "shrunk" not in events and workers == 1:
                events["shrunk"], events["shrunk_step"] = t, last_step
                result["loss_to_step_s"] = round(t - events["loss"], 1)
            elif "shrunk" in events and "back" not in events and last_step >= events["shrunk_step"] + 10:
                nodes.append(add_node(cluster))
                events["back"] = time.monotonic()
            elif "back" in events and workers == 2:
                result["back_to_grown_s"] = round(t - events["back"], 1)
                proc.terminate()  # measured: the rest of the run would only cost time
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if show_timeline:
        print(f"{name}: what the driver printed between the node's death and the next step", flush=True)
        print("\n".join(timeline), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="default,recommended",
                        help="comma-separated: default (Ray's) and/or recommended (see the module docstring)")
    parser.add_argument("--timeline", action="store_true",
                        help="also print the driver's lines between the node's death and the next step")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"),
                        help="directory for recovery.json")
    args = parser.parse_args()
    use_token_auth()
    results = []
    with tempfile.TemporaryDirectory(prefix="raychat-recovery-") as tmp:
        data, tok = prepare_inputs(Path(tmp))
        for name in args.settings.split(","):
            results.append(measure(name, data, tok, Path(tmp) / "runs", args.timeline))
            print(json.dumps(results[-1]), flush=True)
    header = ("settings", "loss -> step", "back -> grown", "redone (loss)", "redone (grow)")
    print(f"{header[0]:<12} {header[1]:>13} {header[2]:>14} {header[3]:>14} {header[4]:>14}")
    for r in results:
        print(f"{r['settings']:<12} {r.get('loss_to_step_s', '-'):>12}s {r.get('back_to_grown_s', '-'):>13}s "
              f"{r.get('redone_after_loss', '-'):>14} {r.get('redone_after_grow', '-'):>14}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "recovery.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
