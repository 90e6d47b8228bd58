"""Goodput against a fault rate: one training run with a fault of one kind every N minutes, beside the
same run undisturbed, on a multi-node Ray cluster on this machine.

Goodput is the share of a run's wall time spent on steps that advanced training (raychat.telemetry.ledger,
from the run's metrics log). What a fault costs is the restart (noticing it, a new worker group,
the restore) plus the steps redone since the last whole checkpoint, so goodput at one fault per N
minutes is the undisturbed run's less (time lost per fault) / N minutes. The bench measures both
runs with the user's defaults (the auto checkpoint cadence, --max-lost-minutes 1) and the failure
detection the shipped cluster configs set (cluster/h100.yaml's --system-config), then prints:

  - each run's goodput and its ledger by cause; each fault's step, recovery time and steps redone,
    beside the steps the tier it restored from bounds a loss to (the memory replicas' interval, or the
    storage cadence's);
  - the time lost per fault, and the goodput that loss gives at one fault every 10 minutes and
    every hour;
  - the exactly-once audit of the faulted run (testkit.chaos_audit): every epoch-1 document trained
    once by its final timeline.

Kinds: node_loss (a worker's node removed without notice and added back once the run shrank),
node_swap (a worker's node removed without notice with a spare node up: the run goes on at its size
from the copies peer nodes hold in memory, raychat.elastic.replicas),
spot_drain (the same after a spot notice: `ray drain-node` with a 5 s deadline), kill_worker (a
worker process SIGKILLed).

Per fault it also prints the seconds lost by phase (detect, reschedule, restore, first_step,
compile, redone: the time ledger's restart causes) beside the least each phase can cost: the
health checks' detection window, a worker group started on the idle cluster before the runs (the
faster of two bare Ray Train groups of the same size: from fit() to its train function's first
line), the undisturbed run's timed set-up phases and wait for its first step, no compile (the
run's compile cache is in hand), one step redone (none for a planned resize). Goodput at one fault
every 10 minutes and every hour is the undisturbed run's less the measured loss per fault. Each
run's ledger is also given in the categories of Google's ml-goodput-measurement, with Meta's
effective training time ratio (ETTR) beside goodput.

  python -m bench.goodput --fault node_loss --every-min 3 --steps 1500   # ~25 min on 2 cores
  python -m bench.goodput --gpu-like --every-min 3 --steps 350           # ~21 min on 2 cores

By default a tiny d2 model trains eagerly (a few hundred ms a step on 2 cores), so a restart's fixed
cost weighs more against its steps than it would at d24: goodput there is a floor for a real run's
at the same fault rate, not an estimate of it. --gpu-like trains a model sized so that a step takes
about a second on a 2-core host, as a GPU's does at nanochat's depths, and compiled, as raychat
runs on GPUs: restarts then pay a compile too, and a second of steps dilutes the per-step
bookkeeping as a GPU run's does. The lines are added to bench/RESULTS.md (--results) with the date
and the machine.
"""

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from bench.chaos import MAX_WORKERS, ChaosRun, Context, Fault, RunSpec
from bench.chaos_report import add_to_section, audit_run, machine, run_ledger
from bench.multinode import local_cluster, prepare_inputs, use_token_auth
from raychat.telemetry.ledger import CAUSES
from raychat.telemetry.metrics_log import parse_records, read_log
from testkit.chaos_audit import progress
from testkit.goodput_bounds import (
    PHASES,
    cadences,
    detection_window_s,
    fault_bounds,
    fault_phases,
    loss_bound,
    phase_floors,
    replica_bound,
    shipped_health_checks,
    steady_goodput,
    undisturbed_costs,
)

KINDS = ("node_loss", "node_swap", "spot_drain", "kill_worker")
RATES_S = {"10 min": 600.0, "1 h": 3600.0}  # one fault every ...
# --gpu-like: the flags that replace the tiny model's (bench.multinode.tiny_run_flags). Measured on a
# 2-core AMD EPYC (2026-12-06): eager, one thread, one process, a step over 2048
# tokens of T 256 took 0.94 s at d4, 1.79 s at d5 and 3.08 s at d6 (d8 over 1024 tokens: 7.4 s, most
# of it Muon's orthogonalisation); compiled in the 2-worker run, d4 at 4096 tokens a step (2048 a
# worker) stepped in 0.57 s, 0.6x its eager figure. So d5 (width 320, 5 heads of 64) at 4096 tokens.
GPU_LIKE = {"--depth": "5", "--aspect-ratio": "64", "--head-dim": "64", "--max-seq-len": "256",
            "--device-batch-size": "8", "--total-batch-size": "4096", "--compile": "on"}
# Documents of the synthetic corpus per step of the run, so that epoch 1 ends about halfway through
# it and the audit can check every epoch-1 document was trained once: ~50 fill a tiny run's 2048-token
# step of T 64 rows (each row starts a document), ~36 a --gpu-like step of T 256 rows.
DOCS_PER_STEP = {False: 30, True: 20}
# raychat's ledger causes in the categories of Google's ml-goodput-measurement (its BadputType enum,
# github.com/AI-Hypercomputer/ml-goodput-measurement, README "Badput Breakdown Details"): training is
# its productive time, the rest badput. The library puts checkpoint loading in TRAINING_PREP (its
# UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME needs Orbax's logger), tracing and compilation in
# PROGRAM_STARTUP, the infrastructure's time to restart the workload after a disruption in
# INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION and evaluations in CUSTOM_BADPUT_EVENTS. Its
# TPU_INITIALIZATION has no cause of its own here: devices and the process group are set up inside
# startup and reschedule.
ML_GOODPUT = {"training": "productive", "startup": "PROGRAM_STARTUP", "compile": "PROGRAM_STARTUP",
              "detect": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
              "reschedule": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION", "restore": "TRAINING_PREP",
              "first_step": "DATA_LOADING_SYNC", "data_wait": "DATA_LOADING_SYNC",
              "redone": "WASTED_PROGRESS_FROM_DISRUPTION", "checkpoint": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
              "eval": "CUSTOM_BADPUT_EVENTS", "other": "OTHER"}
if set(ML_GOODPUT) != set(CAUSES):  # a cause the ledger gained must be placed, not dropped
    raise RuntimeError(f"ML_GOODPUT places {sorted(ML_GOODPUT)}, the ledger's causes are {sorted(CAUSES)}")
# Meta's effective training time ratio (Kokolis et al., "Revisiting Reliability in Large-Scale Machine
# Learning Research Clusters", HPCA 2025): productive training time over the job's wall time. Its
# productive time is a job's time in training iterations that were kept; Meta accounts jobs, not
# steps, so a step's wait for data and the bookkeeping between steps count as productive there, where
# raychat's goodput (and Google's, through DATA_LOADING_SYNC and OTHER) counts them as lost. So
# ETTR >= goodput over the same wall time, by those two causes.
ETTR_PRODUCTIVE = ("training", "data_wait", "other")
SECTION = "## Goodput against a fault rate (bench/goodput.py)"
INTRO = ("`python -m bench.goodput` (see its --help): the same elastic run (`--num-workers 1:2`, tiny d2 "
         "model, the default auto checkpoint cadence) undisturbed and with one fault every N minutes, on a "
         "`ray.cluster_utils.Cluster` with the shipped configs' health checks; goodput from each run's "
         "ledger.")


class FaultEveryNMinutes(ChaosRun):
    """A ChaosRun whose faults come on a clock (every `every_s` from the launch, each once the run is
    back at full size with a checkpoint) rather than at drawn steps, with the default cadence."""

    save_every = None  # the auto cadence
    swap_needs_memory = False  # a swap's cost counts whichever tier it restores from (its note says which)

    def __init__(self, spec: RunSpec, ctx: Context, kind: str | None, every_s: float, rng: random.Random,
                 model: dict[str, str]):
        super().__init__(spec, ctx)
        self.kind, self.every_s, self.rng, self.model = kind, every_s, rng, model
        self.bounds: list[int | None] = []  # the storage cadence's bound when each fault landed
        self.replica_bounds: list[int | None] = []  # the memory replicas' bound then (replica_bound)

    def flags(self, steps: int | None = None) -> list[str]:
        flags = super().flags(steps)
        for pinned in ("--save-every", "--replicate-every"):  # the defaults: the auto cadences
            at = flags.index(pinned)
            flags = flags[:at] + flags[at + 2:]
        for flag, value in self.model.items():  # --gpu-like's model in place of the tiny one
            if flag in flags:
                flags[flags.index(flag) + 1] = value
            else:
                flags += [flag, value]
        return flags

    def inject_faults(self) -> None:
        """A fault every `every_s` (from the launch, then from each recovery) until the run nears its
        end; none for the undisturbed run."""
        if self.kind is None:
            return
        while True:
            due = time.monotonic() + self.every_s
            self.wait_for(lambda due=due: time.monotonic() >= due or self.driver.poll() is not None,
                          "the next fault", driver_may_exit=True)
            self.wait_for(lambda: self.healthy_at(0) or self.driver.poll() is not None,
                          "a healthy run", driver_may_exit=True)
            step = progress(self.trace).step
            # A fault in the last steps would land on a run that is ending (it finishes, or redoes its
            # final evaluation): no recovery to measure.
            if self.driver.poll() is not None or step >= self.spec.steps - max(10, self.spec.steps // 50):
                return
            fault = Fault(self.kind, step, self.rng.random())
            self.schedule.append(fault)
            log = self.drivers[-1].read_text()
            self.bounds.append(loss_bound(log))
            self.replica_bounds.append(replica_bound(log))
            self.inject(fault)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=KINDS, default="node_loss",
                        help="the kind of fault (default node_loss)")
    parser.add_argument("--every-min", type=float, default=10.0,
                        help="minutes between faults, from the launch, then from each recovery (default 10)")
    parser.add_argument("--steps", type=int, default=1500, help="steps of each run (default 1500)")
    parser.add_argument("--gpu-like", action="store_true",
                        help="train a model whose compiled step takes about a second on a 2-core host "
                             "(depth 5, 4096-token steps, --compile on) instead of the tiny eager d2")
    parser.add_argument("--seed", type=int, default=0, help="seeds which rank each fault hits (default 0)")
    parser.add_argument("--time-limit", type=float, default=3600,
                        help="seconds after which everything still running is stopped (default 3600)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"),
                        help="directory for goodput.json and the drivers' logs (default $OUT or bench/out)")
    parser.add_argument("--results", default="bench/RESULTS.md",
                        help="markdown file whose 'Goodput' section gets this run's lines ('' for none)")
    args = parser.parse_args()
    use_token_auth()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    temp_dir = tempfile.mkdtemp(prefix="rg", dir="/tmp")  # short: Ray's socket paths
    try:
        summary = measure(args, out, temp_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    (out / "goodput.json").write_text(json.dumps(summary, indent=1, default=str))
    print(report(summary), flush=True)
    if args.results:
        add_to_section(Path(args.results), SECTION, INTRO, report(summary, markdown=True))
    hit, calm = summary["faulted"], summary["undisturbed"]
    return 0 if hit["ok"] and hit["injected"] and calm["ok"] else 1


def measure(args: argparse.Namespace, out: Path, temp_dir: str) -> dict:
    """One worker group started bare, then the undisturbed run, then the faulted one, one after the
    other on one 2-node cluster."""
    started, deadline = time.time(), time.monotonic() + args.time_limit
    health = shipped_health_checks()
    model = GPU_LIKE if args.gpu_like else {}
    with tempfile.TemporaryDirectory(prefix="raychat-goodput-") as tmp:
        docs = DOCS_PER_STEP[args.gpu_like] * args.steps
        data, tok = prepare_inputs(Path(tmp), num_docs=docs, docs_per_shard=max(100, docs // 20))
        with local_cluster(2, system_config=dict(health), temp_dir=temp_dir) as (cluster, nodes):
            group_start = group_start_s(cluster.address, MAX_WORKERS, Path(tmp) / "bare")
            ctx = Context(cluster, nodes, data, tok, Path(tmp) / "runs", out, deadline, temp_dir)
            runs = {"undisturbed": FaultEveryNMinutes(RunSpec("undisturbed", (), 0, args.steps), ctx, None, 0,
                                                      random.Random(args.seed), model),
                    "faulted": FaultEveryNMinutes(RunSpec("faulted", (args.fault,), 0, args.steps), ctx,
                                                  args.fault, 60 * args.every_min, random.Random(args.seed),
                                                  model)}
            results = {}
            for name, run in runs.items():
                run.run()
                results[name] = audit_run(run, data, None)
                results[name]["bounds"] = run.bounds
                results[name]["replica_bounds"] = run.replica_bounds
                ledger = run_ledger(run.run_dir)
                text = read_log(run.run_dir)
                records = parse_records(text) if text is not None else []
                first = next((r for r in records if r["kind"] == "step"), {})
                one_off = first.get("compile_s", 0.0) + first.get("data_wait_s", 0.0)
                results[name]["wall_s"] = ledger.wall_s
                results[name]["seconds"] = ledger.seconds
                results[name]["steady"] = steady_goodput(ledger.seconds, ledger.wall_s, one_off)
                results[name]["cadences"] = cadences(run.drivers[-1].read_text())
                results[name]["records"] = records
    return {"started": started, "seconds": round(time.time() - started, 1), "machine": machine(),
            "fault": args.fault, "every_min": args.every_min, "steps": args.steps, "gpu_like": args.gpu_like,
            "model": model,
            "health_checks": health, "group_start_s": group_start, **results}


def group_start_s(address: str, workers: int, storage: Path) -> float:
    """Seconds a Ray Train worker group of `workers` takes to start on the idle cluster at `address`,
    the faster of two: from fit() to rank 0's train function running (its processes started, torch
    imported, the process group formed), what a restart must pay at least. A bare function, so none
    of raychat's set-up is in it; the controller's own start is, which a restart does not pay, and the
    first group pays for files not yet in the page cache, which the second does not."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage.mkdir(parents=True, exist_ok=True)
    note = storage / "rank0_started"
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        took = []
        for i in range(2):
            began = time.time()
            TorchTrainer(note_start, train_loop_config={"note": str(note)},
                         scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1},
                                                      placement_strategy="SPREAD"),
                         run_config=RunConfig(name=f"bare-group-{i}", storage_path=str(storage))).fit()
            took.append(float(note.read_text()) - began)
        return min(took)
    finally:
        ray.shutdown()


def note_start(config: dict) -> None:
    """The bare group's train function: rank 0 writes when it began."""
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        Path(config["note"]).write_text(repr(time.time()))


def lost_per_fault(summary: dict) -> float | None:
    """Seconds of training each fault cost: the goodput drop times the faulted run's wall time, per fault."""
    calm, hit = summary["undisturbed"], summary["faulted"]
    if not hit["injected"] or calm["goodput"] is None or hit["goodput"] is None:
        return None
    return (calm["goodput"] - hit["goodput"]) * hit["wall_s"] / hit["injected"]


def categories(seconds: dict[str, float], wall_s: float) -> str:
    """A run's ledger in ml-goodput-measurement's categories (ML_GOODPUT), with Meta's ETTR beside."""
    if wall_s <= 0:
        return "no ledger"
    by: dict[str, float] = {}
    for cause, category in ML_GOODPUT.items():
        by[category] = by.get(category, 0.0) + seconds.get(cause, 0.0)
    productive = by.pop("productive")
    badput = ", ".join(f"{name} {100 * x / wall_s:.1f}%" for name, x in by.items() if x > 0)
    ettr = sum(seconds.get(cause, 0.0) for cause in ETTR_PRODUCTIVE) / wall_s
    return f"productive {100 * productive / wall_s:.1f}%; badput {badput}; Meta's ETTR {100 * ettr:.1f}%"


def phase_lines(summary: dict) -> list[str]:
    """Each injected fault's seconds by phase beside their floors, their mean, and a restart's compile
    against the cold one."""
    calm, hit = summary["undisturbed"], summary["faulted"]
    if not any(r["kind"] == "step" for r in calm["records"]):
        return ["no phases: the undisturbed run logged no step"]
    costs = undisturbed_costs(calm["records"])
    window = detection_window_s(summary["health_checks"])
    injected = [f for f in hit["faults"] if f["injected_at"] is not None]
    phases = fault_phases(hit["records"], [f["injected_at"] for f in injected])
    lines = [f"floors: detection {window:g} s (the health checks' window; a survivor's failed collective can "
             f"report a lost node sooner), a worker group "
             f"{summary['group_start_s']:.1f} s (the faster of two bare ones started on the idle cluster), "
             f"set-up {costs['restore']:.1f} s (the undisturbed run's timed phases) and first step "
             f"{costs['first_step']:.1f} s (its wait), no compile, one step {costs['step']:.2f} s (the "
             f"undisturbed median) for a failure, none for a planned resize"]
    totals, least = [], []
    for i, (fault, lost) in enumerate(zip(injected, phases, strict=True), 1):
        floors = [phase_floors(kind, costs, window, summary["group_start_s"]) for kind in lost["attempts"]]
        floor = {p: sum(f[p] for f in floors) for p in PHASES}
        totals.append(sum(lost[p] for p in PHASES))
        least.append(sum(floor.values()))
        parts = ", ".join(f"{p} {lost[p]:.1f}/{floor[p]:.1f}" for p in PHASES)
        kinds = "+".join(lost["attempts"]) or "no restart"
        lines.append(f"  phases of fault {i} (step {fault['injected_step']}, {kinds}), seconds lost/floor: "
                     f"{parts}; total {totals[-1]:.1f} s, floor {least[-1]:.1f} s")
    steady = calm.get("steady")
    if injected:
        mean = sum(totals) / len(totals)
        rates = "" if steady is None else f" ({100 * steady:.1f}%): " + ", ".join(
            f"{100 * (steady - mean / every):.1f}% at one every {rate}" for rate, every in RATES_S.items())
        floor = sum(least) / len(least)
        lines.insert(1, f"per fault, mean: {mean:.1f} s lost by phase, floor {floor:.1f} s; taken off the "
                        f"undisturbed steady goodput{rates}")
    attempts = sum(len(lost["attempts"]) for lost in phases)
    if attempts and costs["cold_compile"] > 0:
        per = sum(lost["compile"] for lost in phases) / attempts
        lines.insert(2, f"compile: {costs['cold_compile']:.1f} s cold (the undisturbed run's first step), "
                        f"{per:.1f} s a restart or resize ({100 * per / costs['cold_compile']:.0f}% of cold; "
                        f"the nodes share this machine's disk, so a restarted worker's cache was not empty)")
    return lines


def report(summary: dict, markdown: bool = False) -> str:
    """The invocation's numbers as lines (or a markdown entry for RESULTS.md)."""
    calm, hit = summary["undisturbed"], summary["faulted"]
    lost = lost_per_fault(summary)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    def at(base: float | None) -> str:
        """Goodput from `base` at each rate of faults (RATES_S), the measured loss per fault taken off."""
        return ", ".join(f"{pct(None if lost is None or base is None else base - lost / every)} at one "
                         f"every {rate}" for rate, every in RATES_S.items())

    pairs = list(zip(hit["faults"], fault_bounds(hit), strict=True))
    faults = [f"step {f['injected_step']}: {f['recovery_s']} s to recover, {f['redone']} steps redone "
              f"({tier} bound {bound}); {f['note']}" for f, (tier, bound) in pairs]
    within = all(bound is not None and f["redone"] <= bound for f, (_, bound) in pairs)
    docs = "every epoch-1 document trained once" if hit["ok"] else "FAILED: " + "; ".join(hit["problems"])
    if not hit["injected"]:
        docs += "; FAILED: no fault was injected (the run ended first: more --steps or a shorter --every-min)"
    model = ("gpu-like model (" + " ".join(f"{k} {v}" for k, v in summary["model"].items()) + ")"
             if summary["gpu_like"] else "tiny d2 model, eager")
    lines = [f"{summary['fault']} every {summary['every_min']:g} min, {summary['steps']} steps, {model}, "
             f"health checks {json.dumps(summary['health_checks'])}",
             f"undisturbed: goodput {pct(calm['goodput'])} in {calm['wall_s'] / 60:.1f} min; "
             f"{calm.get('cadences', '-')}",
             f"faulted: goodput {pct(hit['goodput'])} in {hit['wall_s'] / 60:.1f} min, {hit['injected']} "
             f"faults, survived {hit['survived']}, steps redone {hit['redone']} (each within its tier's "
             f"bound: {within}); {hit.get('cadences', '-')}; {docs}",
             "time lost per fault (the goodput drop times the wall time): "
             + ("-" if lost is None else f"{lost:.1f} s") + f"; goodput {at(calm['goodput'])} "
             f"(the undisturbed run's less the loss)",
             f"steady state (the first start-up, the first step's compile and wait for data, and the final "
             f"evaluation apart: what a longer run with these flags approaches): undisturbed "
             f"{pct(calm.get('steady'))}, faulted {pct(hit.get('steady'))}; {at(calm.get('steady'))}",
             *phase_lines(summary),
             *[f"  fault {i}: {line}" for i, line in enumerate(faults, 1)],
             *[f"ml-goodput-measurement's categories, {name}: {categories(r['seconds'], r['wall_s'])}"
               for name, r in (("undisturbed", calm), ("faulted", hit))],
             "faulted run's ledger:", *hit["ledger"], "undisturbed run's ledger:", *calm["ledger"]]
    if not markdown:
        return "\n".join(lines)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(summary["started"]))
    command = (f"python -m bench.goodput{' --gpu-like' if summary['gpu_like'] else ''} --fault "
               f"{summary['fault']} --every-min {summary['every_min']:g} --steps {summary['steps']}")
    return (f"**{when}, `{command}`**, {summary['seconds']:.0f} s on {summary['machine']}.\n\n"
            + "\n".join(f"  {line}" if line.startswith("- ") else f"- {line.strip()}"  # a ledger's own
                        for line in lines) + "\n")  # bullets nest under their run


if __name__ == "__main__":
    raise SystemExit(main())
