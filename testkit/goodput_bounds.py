"""What bench.goodput reads from code it does not own, and the arithmetic on it.

The trainer's driver logs the checkpoint cadence it chose ("Checkpoint cadence: every N steps (...)",
raychat.elastic.cadence) and the memory replicas' interval (raychat.elastic.replicas); the shipped
head config (cluster/h100.yaml) starts Ray with the health checks the bench must measure with. Each
reader here turns one of those into the bound a fault's redone steps are held to, or into the
steady-state goodput. In testkit, not bench/, because tests/test_bench_goodput.py checks every
reader against its writer (a changed log line must not leave the bench measuring nothing) and tests
import nothing from bench/.
"""

import json
import math
import re
from pathlib import Path

CADENCE = re.compile(r"every (\d+) steps \(~[\d.]+s; step (\d+)ms, save stall \d+ms, written in ([\d.]+)s\)")
REPLICAS = re.compile(r"Memory replicas: every (\d+) step\(s\) \(copy \d+ms = ([\d.]+)% of training")


def shipped_health_checks(config: Path = Path("cluster/h100.yaml")) -> dict:
    """The `--system-config` JSON the shipped head starts Ray with."""
    found = re.search(r"--system-config='(\{[^']*\})'", config.read_text())
    if found is None:
        raise SystemExit(f"{config} starts Ray without --system-config: nothing to measure against")
    return json.loads(found.group(1))


def loss_bound(log: str) -> int | None:
    """The most steps a loss may redo under the cadence last logged in `log`: the interval plus the
    steps trained while the save was written, plus the step in flight."""
    found = CADENCE.findall(log)
    if not found:
        return None
    every, step_ms, write_s = found[-1]
    return int(every) + math.ceil(1000 * float(write_s) / max(int(step_ms), 1)) + 1


def replica_bound(log: str) -> int | None:
    """The most steps a loss restored from peer memory may redo under the replica interval last logged
    in `log`: the interval, twice when the newest replica was still being sent as the node went (its
    holders keep the one before), plus the step in flight."""
    found = REPLICAS.findall(log)
    return 2 * int(found[-1][0]) + 1 if found else None


def cadences(log: str) -> str:
    """The intervals the auto cadences last chose in a driver's log: storage saves and memory replicas."""
    saves, replicas = CADENCE.findall(log), REPLICAS.findall(log)
    said = [f"storage saves every {saves[-1][0]} steps" if saves else "no storage cadence logged"]
    if replicas:
        said.append(f"memory replicas every {replicas[-1][0]} step(s) (copy {replicas[-1][1]}% of training)")
    return ", ".join(said)


def steady_goodput(seconds: dict[str, float], wall_s: float) -> float | None:
    """Goodput without the run's one-off costs: the first start-up and the evaluation, which the bench's
    runs do once, at the end (--eval-every -1). A run many times longer than the bench's approaches it."""
    steady_wall = wall_s - seconds.get("startup", 0.0) - seconds.get("eval", 0.0)
    return seconds.get("training", 0.0) / steady_wall if steady_wall > 0 else None


def fault_bounds(run: dict) -> list[tuple[str, int | None]]:
    """Each fault's bound on the steps it may redo, by the tier it was restored from: the memory
    replicas' interval for a restore from peer memory (its note says so), else the storage cadence's."""
    replica_bounds = run.get("replica_bounds") or [None] * len(run["bounds"])
    return [("replica", replica) if "(peer memory)" in (f.get("note") or "") else ("cadence", durable)
            for f, durable, replica in zip(run["faults"], run["bounds"], replica_bounds, strict=True)]
