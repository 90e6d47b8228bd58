"""What bench.goodput reads from code it does not own, and the arithmetic on it.

The trainer's driver logs the checkpoint cadence it chose ("Checkpoint cadence: every N steps (...)",
raychat.elastic.cadence) and the memory replicas' interval (raychat.elastic.replicas); the shipped
head config (cluster/h100.yaml) starts Ray with the health checks the bench must measure with; the
run's metrics log has each attempt's start record (raychat.worker.setup) and the time ledger
(raychat.telemetry.ledger) built from it. Each reader here turns one of those into the bound a
fault's redone steps are held to, the steady-state goodput, or the seconds a fault cost by phase
beside the least each phase can cost. In testkit, not bench/, because tests/test_bench_goodput.py checks every
reader against its writer (a changed log line must not leave the bench measuring nothing) and tests
import nothing from bench/.
"""

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from raychat.telemetry.ledger import COMPILE_PROBE, ledger

# What a restart costs, in the order its time passes (the ledger's restart causes and the steps redone).
PHASES = ("detect", "reschedule", "restore", "first_step", "compile", "redone")

CADENCE = re.compile(r"every (\d+) steps \(~[\d.]+s; step (\d+)ms, save stall \d+ms, written in ([\d.]+)s\)")
REPLICAS = re.compile(r"Memory replicas: every (\d+) step\(s\) \(copy \d+ms = ([\d.]+)% of training")


def shipped_health_checks(config: Path = Path("cluster/h100.yaml")) -> dict:
    """The `--system-config` JSON the shipped head starts Ray with."""
    found = re.search(r"--system-config='(\{[^']*\})'", config.read_text())
    if found is None:
        raise SystemExit(f"{config} starts Ray without --system-config: nothing to measure against")
    return json.loads(found.group(1))


def detection_window_s(health: dict) -> float:
    """The least time Ray can take to call a node dead under the health checks `health` starts it
    with: as many missed checks as the threshold, one a period. A run of several workers can hear of
    a lost node sooner, from a survivor whose collective with it failed."""
    return health["health_check_period_ms"] * health["health_check_failure_threshold"] / 1000


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


def steady_goodput(seconds: dict[str, float], wall_s: float, first_step_s: float = 0.0) -> float | None:
    """Goodput without the run's one-off costs: the first start-up, the first step's compile and wait
    for data (`first_step_s`: a cold compile, which the run's compile cache spares later attempts, and
    the loader's first fill) and the evaluation, which the bench's runs do once, at the end
    (--eval-every -1). A run many times longer than the bench's approaches it."""
    steady_wall = wall_s - seconds.get("startup", 0.0) - first_step_s - seconds.get("eval", 0.0)
    return seconds.get("training", 0.0) / steady_wall if steady_wall > 0 else None


def fault_bounds(run: dict) -> list[tuple[str, int | None]]:
    """Each fault's bound on the steps it may redo, by the tier it was restored from: the memory
    replicas' interval for a restore from peer memory (its note says so), else the storage cadence's."""
    replica_bounds = run.get("replica_bounds") or [None] * len(run["bounds"])
    return [("replica", replica) if "(peer memory)" in (f.get("note") or "") else ("cadence", durable)
            for f, durable, replica in zip(run["faults"], run["bounds"], replica_bounds, strict=True)]


def undisturbed_costs(records: list[dict[str, Any]]) -> dict[str, float]:
    """From an undisturbed run's metrics log (its records in file order): the phases of its one
    attempt's set-up that raychat.worker.setup times, the compile probe apart (the ledger counts it
    as compile: raychat.telemetry.ledger) (model, optimizer, loader: every restore does
    that much, and reads its state besides; the first attempt's set-up as a whole also pays first-time
    costs, the first collective and imports, that a restart need not), its wait from there to its first
    step, its first step's compile (from a cold cache) and its median steady step."""
    start = next(r for r in records if r["kind"] == "start")
    steps = [r for r in records if r["kind"] == "step"]
    first_start = steps[0]["time"] - steps[0].get("dt", 0.0)
    steady = [r["dt"] for r in steps if not r.get("compile_s")] or [r["dt"] for r in steps]
    phases = {k: v for k, v in (start.get("setup_phases") or {}).items() if k != COMPILE_PROBE}
    return {"restore": sum(phases.values()),
            "first_step": max(0.0, first_start - start["time"]),
            "cold_compile": steps[0].get("compile_s", 0.0), "step": statistics.median(steady)}


def phase_floors(kind: str, undisturbed: dict[str, float], window_s: float, group_start_s: float) -> dict:
    """The least each phase of one attempt of `kind` can cost: a failure ("restart") must be detected
    (the health checks' window), a planned resize ("resize") not; each starts one worker group and sets
    it up as the undisturbed run did; with the run's compile cache in hand nothing need compile (what
    remains is Dynamo tracing the model again, which no cache of PyTorch's skips); a failure redoes
    at least the step it interrupted, a planned resize saves first and redoes none."""
    failure = kind == "restart"
    return {"detect": window_s if failure else 0.0, "reschedule": group_start_s,
            "restore": undisturbed["restore"], "first_step": undisturbed["first_step"], "compile": 0.0,
            "redone": undisturbed["step"] if failure else 0.0}


def fault_phases(records: list[dict[str, Any]], injected_at: list[float]) -> list[dict[str, Any]]:
    """Per fault (the times it was injected, in order): the seconds its restarts and resizes cost by
    phase (PHASES) and their kinds. Each attempt after the first belongs to the last fault injected
    before it started; a restart no fault explains is left out (bench.chaos counts those)."""
    book = ledger(records)
    starts = [r["time"] for r in records if r["kind"] == "start"]  # one per ledger attempt, in order
    out = [{**dict.fromkeys(PHASES, 0.0), "attempts": []} for _ in injected_at]
    for i in range(1, len(book.attempts)):
        before, a = book.attempts[i - 1], book.attempts[i]
        owners = [k for k, at in enumerate(injected_at) if at <= starts[i]]
        if a.kind == "first" or not owners:
            continue
        fault = out[owners[-1]]
        for phase in PHASES[:-1]:
            fault[phase] += a.seconds[phase]
        # As Ledger.lines: the steps lost were trained in the attempt before (its "redone", less what it
        # lost itself) and those that never reached the log (this attempt's tail).
        fault["redone"] += before.seconds["redone"] - before.tail_s + a.tail_s
        fault["attempts"].append(a.kind)
    return out
