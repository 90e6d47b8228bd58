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
  - the time lost per fault, and the goodput that loss gives at one fault every 10 minutes;
  - the exactly-once audit of the faulted run (testkit.chaos_audit): every epoch-1 document trained
    once by its final timeline.

Kinds: node_loss (a worker's node removed without notice and added back once the run shrank),
node_swap (a worker's node removed without notice with a spare node up: the run goes on at its size
from the copies peer nodes hold in memory, raychat.elastic.replicas),
spot_drain (the same after a spot notice: `ray drain-node` with a 5 s deadline), kill_worker (a
worker process SIGKILLed).

  python -m bench.goodput --fault node_loss --every-min 3 --steps 1500   # ~25 min on 2 cores

A tiny d2 model trains (a few hundred ms a step on 2 cores), so a restart's fixed cost weighs more
against its steps than it would at d24: goodput here is a floor for a real run's at the same fault
rate, not an estimate of it. The table is added to bench/RESULTS.md (--results) with the date and
the machine.
"""

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from bench.chaos import ChaosRun, Context, Fault, RunSpec
from bench.chaos_report import add_to_section, audit_run, machine, run_ledger
from bench.multinode import local_cluster, prepare_inputs, use_token_auth
from testkit.chaos_audit import progress
from testkit.goodput_bounds import (
    cadences,
    fault_bounds,
    loss_bound,
    replica_bound,
    shipped_health_checks,
    steady_goodput,
)

KINDS = ("node_loss", "node_swap", "spot_drain", "kill_worker")
TEN_MINUTES_S = 600.0
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

    def __init__(self, spec: RunSpec, ctx: Context, kind: str | None, every_s: float, rng: random.Random):
        super().__init__(spec, ctx)
        self.kind, self.every_s, self.rng = kind, every_s, rng
        self.bounds: list[int | None] = []  # the storage cadence's bound when each fault landed
        self.replica_bounds: list[int | None] = []  # the memory replicas' bound then (replica_bound)

    def flags(self, steps: int | None = None) -> list[str]:
        flags = super().flags(steps)
        for pinned in ("--save-every", "--replicate-every"):  # the defaults: the auto cadences
            at = flags.index(pinned)
            flags = flags[:at] + flags[at + 2:]
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
    """The undisturbed run, then the faulted one, one after the other on one 2-node cluster."""
    started, deadline = time.time(), time.monotonic() + args.time_limit
    health = shipped_health_checks()
    with tempfile.TemporaryDirectory(prefix="raychat-goodput-") as tmp:
        # ~50 synthetic documents fill a 2048-token step: 30 a step ends epoch 1 ~60% into the run,
        # so the audit can check every epoch-1 document was trained once.
        data, tok = prepare_inputs(Path(tmp), num_docs=30 * args.steps,
                                   docs_per_shard=max(100, 3 * args.steps // 2))
        with local_cluster(2, system_config=dict(health), temp_dir=temp_dir) as (cluster, nodes):
            ctx = Context(cluster, nodes, data, tok, Path(tmp) / "runs", out, deadline, temp_dir)
            runs = {"undisturbed": FaultEveryNMinutes(RunSpec("undisturbed", (), 0, args.steps), ctx, None, 0,
                                                      random.Random(args.seed)),
                    "faulted": FaultEveryNMinutes(RunSpec("faulted", (args.fault,), 0, args.steps), ctx,
                                                  args.fault, 60 * args.every_min, random.Random(args.seed))}
            results = {}
            for name, run in runs.items():
                run.run()
                results[name] = audit_run(run, data, None)
                results[name]["bounds"] = run.bounds
                results[name]["replica_bounds"] = run.replica_bounds
                ledger = run_ledger(run.run_dir)
                results[name]["wall_s"] = ledger.wall_s
                results[name]["steady"] = steady_goodput(ledger.seconds, ledger.wall_s)
                results[name]["cadences"] = cadences(run.drivers[-1].read_text())
    return {"started": started, "seconds": round(time.time() - started, 1), "machine": machine(),
            "fault": args.fault, "every_min": args.every_min, "steps": args.steps, "health_checks": health,
            **results}


def lost_per_fault(summary: dict) -> float | None:
    """Seconds of training each fault cost: the goodput drop times the faulted run's wall time, per fault."""
    calm, hit = summary["undisturbed"], summary["faulted"]
    if not hit["injected"] or calm["goodput"] is None or hit["goodput"] is None:
        return None
    return (calm["goodput"] - hit["goodput"]) * hit["wall_s"] / hit["injected"]


def report(summary: dict, markdown: bool = False) -> str:
    """The invocation's numbers as lines (or a markdown entry for RESULTS.md)."""
    calm, hit = summary["undisturbed"], summary["faulted"]
    lost = lost_per_fault(summary)
    at_ten = None if lost is None or calm["goodput"] is None else calm["goodput"] - lost / TEN_MINUTES_S
    steady = calm.get("steady")
    steady_at_ten = None if lost is None or steady is None else steady - lost / TEN_MINUTES_S
    pairs = list(zip(hit["faults"], fault_bounds(hit), strict=True))
    faults = [f"step {f['injected_step']}: {f['recovery_s']} s to recover, {f['redone']} steps redone "
              f"({tier} bound {bound}); {f['note']}" for f, (tier, bound) in pairs]
    within = all(bound is not None and f["redone"] <= bound for f, (_, bound) in pairs)
    docs = "every epoch-1 document trained once" if hit["ok"] else "FAILED: " + "; ".join(hit["problems"])
    if not hit["injected"]:
        docs += "; FAILED: no fault was injected (the run ended first: more --steps or a shorter --every-min)"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [f"{summary['fault']} every {summary['every_min']:g} min, {summary['steps']} steps, "
             f"health checks {json.dumps(summary['health_checks'])}",
             f"undisturbed: goodput {pct(calm['goodput'])} in {calm['wall_s'] / 60:.1f} min; "
             f"{calm.get('cadences', '-')}",
             f"faulted: goodput {pct(hit['goodput'])} in {hit['wall_s'] / 60:.1f} min, {hit['injected']} "
             f"faults, survived {hit['survived']}, steps redone {hit['redone']} (each within its tier's "
             f"bound: {within}); {hit.get('cadences', '-')}; {docs}",
             "time lost per fault: " + ("-" if lost is None else f"{lost:.1f} s") + f"; at one fault every "
             f"10 min that is goodput {pct(at_ten)} (the undisturbed run's less the loss)",
             f"steady state (the first start-up and the final evaluation apart: what a longer run with "
             f"these flags approaches): undisturbed {pct(calm.get('steady'))}, faulted "
             f"{pct(hit.get('steady'))}; at one fault every 10 min {pct(steady_at_ten)}",
             *[f"  fault {i}: {line}" for i, line in enumerate(faults, 1)],
             "faulted run's ledger:", *hit["ledger"], "undisturbed run's ledger:", *calm["ledger"]]
    if not markdown:
        return "\n".join(lines)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(summary["started"]))
    command = (f"python -m bench.goodput --fault {summary['fault']} --every-min {summary['every_min']:g} "
               f"--steps {summary['steps']}")
    return (f"**{when}, `{command}`**, {summary['seconds']:.0f} s on {summary['machine']}.\n\n"
            + "\n".join(f"  {line}" if line.startswith("- ") else f"- {line.strip()}"  # a ledger's own
                        for line in lines) + "\n")  # bullets nest under their run


if __name__ == "__main__":
    raise SystemExit(main())
