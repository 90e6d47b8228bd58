"""Faults on a real multi-node Ray cluster: does an elastic run survive them with every document
trained once and every checkpoint it needs kept?

A `ray.cluster_utils.Cluster` on this machine (a head without CPUs, 1-CPU worker nodes) runs
`python -m raychat.train --num-workers 1:2` on a tiny model. A seeded random schedule injects, one
at a time and each once the run is healthy again:

  kill_worker    a training worker process killed with SIGKILL
  node_loss      the node of a worker removed without notice, added back once the run shrank
  node_swap      the node of a worker removed without notice with a spare node already up: the run
                 restarts at its size, the lost rank's state from a peer node's memory, nothing
                 read from storage
  spot_drain     that node drained as a spot reclaim (ray drain-node --reason
                 DRAIN_NODE_REASON_PREEMPTION, 5 s deadline), removed at the deadline, added back
  kill_driver    the driver killed with SIGKILL and the same command launched again (the new driver
                 takes over the dead one's lease after ~15 s)
  short_horizon  operator mistake: the same run re-launched with --num-iterations below its latest
                 checkpoint's step: must exit 2 with one error line, touching nothing
  second_driver  operator mistake: the same command launched while the run trains: must exit 2 with
                 one error line naming the other driver

Then it checks: the run finished (exit 0); every epoch-1 document was trained exactly once by the
final timeline (the trainer's trace: testkit.trace); the final checkpoint is whole and its
hashes verified; the newest whole checkpoint never went back and the kept ones are the newest saved
(nothing pruned that a restart needed); and where the world size never changed, the final weights
equal, bit for bit, those of a reference run with no faults at 2 workers.

  python -m bench.chaos                   # "steady" (faults that keep 2 workers) and "elastic"
                                          # (all kinds) runs: ~10-15 min on 2 cores
  python -m bench.chaos --short --seed 3  # one steady run, 5 faults: ~4 min on a quiet 2-core machine

It stops by itself after --time-limit seconds (whatever is left is killed and reported), prints a
table and adds it, with the date and the machine, to bench/RESULTS.md (--results). Exit 0 when
every fault was survived and every check passed.
"""

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from bench.chaos_report import audit_run, machine, print_table, run_ledger, write_results
from bench.multinode import (
    TRAIN,
    add_node,
    local_cluster,
    prepare_inputs,
    start_driver,
    tiny_run_flags,
    use_token_auth,
)
from raychat.storage import Storage
from raychat.telemetry.metrics_log import parse_records, read_log
from testkit.chaos_audit import CheckpointWatch, progress, replicas_cover
from testkit.processes import kill_node, node_of_pid
from testkit.trace import trace_env

ALL_KINDS = ("kill_worker", "node_loss", "node_swap", "spot_drain", "kill_driver", "short_horizon",
             "second_driver")
# 2 workers throughout
STEADY_KINDS = ("kill_worker", "node_swap", "kill_driver", "short_horizon", "second_driver")
SAVE_EVERY, KEEP = 10, 3
# Replicas every other step: a node swap tests the memory tier, which must then hold a newer state than
# the checkpoints every 10 steps. The auto interval (Young's, from the copies' cost on these CPUs) comes
# to tens of steps here, which storage saves every 10 would leave unread (bench.goodput runs auto).
REPLICATE_EVERY = 2
MAX_WORKERS = 2
DRAIN_DEADLINE_S = 5
COVER_WAIT_S = 60  # a node swap waits at most this long for peer memory to cover the state


@dataclass
class RunSpec:
    name: str
    kinds: tuple[str, ...]
    faults: int
    steps: int


MODES = {"short": [RunSpec("steady", STEADY_KINDS, 5, 150)],
         "full": [RunSpec("steady", STEADY_KINDS, 6, 170), RunSpec("elastic", ALL_KINDS, 7, 260)]}


@dataclass
class Fault:
    kind: str
    at_step: int
    pick: float  # chooses the rank (and the shorter horizon), drawn with the schedule
    injected_step: int | None = None
    injected_at: float | None = None
    survived: bool | None = None
    recovery_s: float | None = None
    redone: int = 0
    note: str = ""


def draw_schedule(rng: random.Random, kinds: tuple[str, ...], count: int, steps: int) -> list[Fault]:
    """`count` faults, every kind at least once, in random order, spread over the first 70% of the run
    (after the first checkpoint)."""
    drawn = list(kinds) + rng.choices(kinds, k=max(0, count - len(kinds)))
    rng.shuffle(drawn)
    first, last = SAVE_EVERY + 2, int(steps * 0.7)
    slot = max(1, (last - first) // len(drawn))
    return [Fault(kind, first + i * slot + rng.randrange(max(1, slot // 2)), rng.random())
            for i, kind in enumerate(drawn)]


class TimeUp(Exception):
    pass


class RunEnded(Exception):
    pass


@dataclass
class Context:
    """What every run of one invocation shares."""

    cluster: object
    nodes: list
    data: Path
    tok: Path
    storage: Path
    out: Path
    deadline: float
    temp_dir: str


@dataclass
class ChaosRun:
    spec: RunSpec
    ctx: Context
    schedule: list[Fault] = field(default_factory=list)
    drivers: list[Path] = field(default_factory=list)  # each launch's log
    exit_code: int | None = None
    stopped: str = ""  # why the run was cut short, if it was

    # The save interval the run's flags set (None: the auto cadence), and whether a node swap must
    # continue from peer memory to count as survived (bench.goodput measures what a swap costs,
    # whichever tier it restores from).
    save_every: ClassVar[int | None] = SAVE_EVERY
    swap_needs_memory: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.trace = self.ctx.out / f"trace_{self.spec.name}"
        self.trace.mkdir(parents=True, exist_ok=True)
        self.run_dir = Storage(str(self.ctx.storage)).child(self.spec.name)
        self.watch = CheckpointWatch(self.run_dir, KEEP)
        self.driver: subprocess.Popen | None = None
        self.settled_after = 0.0  # a healthy step must come from an attempt started after this

    def flags(self, steps: int | None = None) -> list[str]:
        c = self.ctx
        return [*tiny_run_flags(c.data, c.tok, c.storage, self.spec.name),
                "--num-iterations", str(steps or self.spec.steps), "--save-every", str(SAVE_EVERY),
                "--replicate-every", str(REPLICATE_EVERY), "--keep-checkpoints", str(KEEP),
                "--num-workers", f"1:{MAX_WORKERS}", "--resize-check-every", "5", "--max-failures", "-1",
                "--grow", "always"]  # the faults' recoveries are the subject: a grow, paying or not

    def env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self.ctx.cluster.address, **trace_env(self.trace)}

    def launch(self) -> None:
        log = self.ctx.out / f"{self.spec.name}_driver{len(self.drivers)}.log"
        self.drivers.append(log)
        with log.open("w") as f:
            self.driver = start_driver(self.flags(), self.env(), stdout=f, stderr=subprocess.STDOUT)

    def wait_for(self, done, what: str, driver_may_exit: bool = False) -> None:
        while True:
            if time.monotonic() > self.ctx.deadline:
                raise TimeUp(f"time limit reached waiting for {what}")
            self.watch.poll()
            if self.driver.poll() is not None and not driver_may_exit:
                raise RunEnded(f"the driver exited ({self.driver.returncode}) while waiting for {what}")
            if done():
                return
            time.sleep(0.5)

    def healthy_at(self, step: int) -> bool:
        now = progress(self.trace)
        return (now.attempt > self.settled_after and now.world_size == MAX_WORKERS and now.step >= step
                and self.watch.newest >= 0)

    def memory_covers(self) -> bool:
        """Whether a node swap may land now (testkit.chaos_audit.replicas_cover): peer memory holds
        every rank's state at or past the newest checkpoint, with none due in the next three steps."""
        return replicas_cover(progress(self.trace), self.watch.newest, self.save_every)

    def recovered(self, world_size: int | None = None) -> bool:
        now = progress(self.trace)
        return now.attempt > self.settled_after and now.step >= 0 and world_size in (None, now.world_size)

    def say(self, message: str) -> None:
        print(f"[chaos {self.spec.name} {time.strftime('%H:%M:%S')}] {message}", flush=True)

    def run(self) -> None:
        if time.monotonic() > self.ctx.deadline:
            self.stopped = "time limit reached before the run started"
            return
        self.launch()
        try:
            self.inject_faults()
            self.wait_for(lambda: self.driver.poll() is not None, "the end of the run",
                          driver_may_exit=True)
        except (TimeUp, RunEnded) as e:
            self.stopped = str(e)
        finally:
            if self.driver.poll() is None:
                self.driver.kill()
            self.exit_code = self.driver.wait()

    def inject_faults(self) -> None:
        """The schedule's faults, each at its step once the run is healthy there."""
        for fault in self.schedule:
            # Recoveries redo steps and take time, so a run can reach its horizon before the last
            # faults: those stay "not injected", and the audit says so.
            self.wait_for(lambda f=fault: self.healthy_at(f.at_step) or self.driver.poll() is not None,
                          f"step {fault.at_step}", driver_may_exit=True)
            if self.driver.poll() is not None:
                return
            self.inject(fault)

    def inject(self, fault: Fault) -> None:
        """Inject `fault` now and wait until the run has recovered from it (or could not)."""
        fault.injected_step, fault.injected_at = progress(self.trace).step, time.time()
        self.say(f"step {fault.injected_step}: {fault.kind}")
        getattr(self, fault.kind)(fault)
        if fault.injected_at is None:  # the run ended before the fault could land (a node swap's wait)
            self.say(f"{fault.kind}: not injected ({fault.note})")
            return
        fault.recovery_s = round(time.time() - fault.injected_at, 1)
        self.say(f"{fault.kind}: {'survived' if fault.survived else 'NOT SURVIVED'} in "
                 f"{fault.recovery_s} s ({fault.note})")

    def target(self, fault: Fault) -> tuple[int, int]:
        pids = progress(self.trace).pids
        rank = sorted(pids)[int(fault.pick * len(pids))]
        return rank, pids[rank]

    def disrupted(self, fault: Fault) -> None:
        self.settled_after = fault.injected_at

    def kill_worker(self, fault: Fault) -> None:
        rank, pid = self.target(fault)
        os.kill(pid, signal.SIGKILL)
        fault.note = f"rank {rank} (pid {pid})"
        self.disrupted(fault)
        self.wait_for(self.recovered, "a restart after a killed worker")
        fault.survived = True

    def kill_driver(self, fault: Fault) -> None:
        self.driver.kill()
        self.driver.wait()
        self.disrupted(fault)
        self.launch()
        self.wait_for(self.recovered, "the relaunched driver's first step")
        log = self.drivers[-1].read_text()
        fault.survived = "taking it over" in log
        fault.note = "lease taken over" if fault.survived else "the new driver did not say it took the lease"
        if "Released the resources Ray still reserved" in log:  # else the relaunch waits up to 180 s
            fault.note += ", the killed controller's reservation released"

    def lose_node(self, fault: Fault, drain: bool) -> None:
        rank, pid = self.target(fault)
        node = node_of_pid(self.ctx.nodes, pid)
        if drain:
            subprocess.run(["ray", "drain-node", "--address", self.ctx.cluster.address, "--node-id",
                            node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                            "chaos spot reclaim", "--deadline-remaining-seconds", str(DRAIN_DEADLINE_S)],
                           check=True, capture_output=True, text=True, timeout=60)
            reclaim_at = time.monotonic() + DRAIN_DEADLINE_S
            self.wait_for(lambda: time.monotonic() > reclaim_at, "the drain deadline")
        kill_node(self.ctx.cluster, node)
        self.ctx.nodes.remove(node)
        self.disrupted(fault)
        self.wait_for(self.recovered, "a step after the node loss")
        shrunk = progress(self.trace).world_size
        self.ctx.nodes.append(add_node(self.ctx.cluster, self.ctx.temp_dir))
        self.settled_after = time.time()
        # The grow needs Ray's resize check and a new worker group (~30 s here); a shrunk run near its
        # horizon finishes first, which survives the loss as well (the audit checks that finish).
        self.wait_for(lambda: self.recovered(MAX_WORKERS) or self.driver.poll() is not None,
                      "the grow back to 2 workers", driver_may_exit=True)
        grew = self.recovered(MAX_WORKERS)
        fault.note = f"rank {rank}'s node; shrank to {shrunk}, " + ("grew back" if grew else
                                                                   "finished before the grow")
        fault.survived = grew or self.driver.returncode == 0

    def node_loss(self, fault: Fault) -> None:
        self.lose_node(fault, drain=False)

    def spot_drain(self, fault: Fault) -> None:
        self.lose_node(fault, drain=True)

    def node_swap(self, fault: Fault) -> None:
        """A node lost without notice while a spare is up (added first, so that the restart never
        races its arrival), once peer memory covers the run's state (memory_covers: the node goes at
        once then): the group restarts at its size from the copies peer nodes hold in memory
        (raychat.elastic.replicas), which the driver's line says and the attempt's start record
        confirms (no byte of a checkpoint read from storage)."""
        self.ctx.nodes.append(add_node(self.ctx.cluster, self.ctx.temp_dir))
        waited = time.monotonic()
        while not self.memory_covers():
            if self.driver.poll() is not None:
                fault.injected_step = fault.injected_at = None
                fault.note = "the run ended while the swap waited for peer memory to cover its state"
                return
            if time.monotonic() - waited > COVER_WAIT_S:
                if self.swap_needs_memory:
                    fault.note = (f"peer memory did not cover the run's state within {COVER_WAIT_S} s "
                                  f"(replicas held at {progress(self.trace).replicas}, newest checkpoint "
                                  f"{self.watch.newest})")
                    fault.survived = False
                    return
                break  # bench.goodput: the swap's cost, whichever tier it restores from
            self.watch.poll()
            time.sleep(0.1)
        fault.injected_step, fault.injected_at = progress(self.trace).step, time.time()  # the loss itself
        rank, pid = self.target(fault)
        node = node_of_pid(self.ctx.nodes, pid)
        starts_before, said_before = len(self.start_records()), len(self.restart_lines())
        kill_node(self.ctx.cluster, node)
        self.ctx.nodes.remove(node)
        self.disrupted(fault)
        # The driver's line comes through Ray's log streaming, later than the trace: wait for this
        # restart's own, not an earlier fault's.
        self.wait_for(lambda: self.recovered() and len(self.start_records()) > starts_before
                      and len(self.restart_lines()) > said_before, "a restart line after the node loss")
        start = self.start_records()[-1]
        size, step, source = self.restart_lines()[-1]
        fault.note = (f"rank {rank}'s node; continued on {size} from step {step} ({source}), "
                      f"{start['storage_read_bytes']} bytes read from storage")
        from_memory = source == "peer memory" and start["storage_read_bytes"] == 0
        fault.survived = size == str(MAX_WORKERS) and (from_memory or not self.swap_needs_memory)

    def restart_lines(self) -> list[tuple[str, str, str]]:
        """(world size, step, source) of each "continuing on" line the current driver logged."""
        return re.findall(r"continuing on (\d+) from step (\d+) \(([^)]*)\)", self.drivers[-1].read_text())

    def start_records(self) -> list[dict]:
        """The run's attempt starts as its metrics log has them so far."""
        text = read_log(self.run_dir)  # (a bucket's log is in parts)
        return [] if text is None else [r for r in parse_records(text) if r["kind"] == "start"]

    def mistake(self, fault: Fault, steps: int | None, expect: str) -> None:
        """An operator's launch that must be refused: exit 2, one `raychat: error:` line saying `expect`."""
        left = max(1, int(self.ctx.deadline - time.monotonic()))
        done = subprocess.run([*TRAIN, *self.flags(steps)], capture_output=True, text=True,
                              timeout=min(300, left), env={**os.environ, **self.env()})
        errors = [line for line in done.stderr.splitlines() if line.startswith("raychat: error:")]
        fault.survived = done.returncode == 2 and len(errors) == 1 and expect in errors[0]
        line = errors[0].replace(str(self.run_dir), "<run>") if errors else ""  # the table's width
        fault.note = (line[:110] if errors else f"exit {done.returncode}: " + done.stderr[-200:]).strip()

    def short_horizon(self, fault: Fault) -> None:
        latest = self.watch.newest
        shorter = max(1, min(latest - 1, int(latest * (0.3 + 0.6 * fault.pick))))
        self.mistake(fault, shorter, "past this plan's horizon")
        fault.note = f"--num-iterations {shorter}: {fault.note}"

    def second_driver(self, fault: Fault) -> None:
        self.mistake(fault, None, "being trained by another driver")


def reference_flags(run: ChaosRun) -> list[str]:
    """The steady run's command, fixed at 2 workers, under its own name, faults none."""
    flags = run.flags()
    flags[flags.index("--run-name") + 1] = "reference"
    flags[flags.index("--num-workers") + 1] = str(MAX_WORKERS)
    return flags


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule (default 0)")
    parser.add_argument("--short", action="store_true", help="one steady run with 4 faults (the suite's)")
    parser.add_argument("--time-limit", type=float, default=900,
                        help="seconds after which everything still running is stopped (default 900)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"),
                        help="directory for chaos.json and the drivers' logs (default $OUT or bench/out)")
    parser.add_argument("--results", default="bench/RESULTS.md",
                        help="markdown file whose 'Chaos' section gets this invocation's table ('' for none)")
    parser.add_argument("--temp-dir", default=None,
                        help="Ray's temp dir for the cluster (short; default a new one under /tmp)")
    args = parser.parse_args()
    return run_bench(args)


def run_bench(args: argparse.Namespace) -> int:
    use_token_auth()
    started, deadline = time.time(), time.monotonic() + args.time_limit
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    temp_dir = args.temp_dir or tempfile.mkdtemp(prefix="rc", dir="/tmp")
    try:
        return chaos(args, out, temp_dir, started, deadline)
    finally:
        if not args.temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


def chaos(args: argparse.Namespace, out: Path, temp_dir: str, started: float, deadline: float) -> int:
    """The runs of one invocation on one cluster, audited and reported; 0 when all passed."""
    rng = random.Random(args.seed)
    specs = MODES["short" if args.short else "full"]
    with tempfile.TemporaryDirectory(prefix="raychat-chaos-") as tmp:
        data, tok = prepare_inputs(Path(tmp), num_docs=1_200, docs_per_shard=100)
        # 4 nodes while the steady run and its reference train side by side, 2 for the elastic run.
        with local_cluster(2 * MAX_WORKERS, temp_dir=temp_dir) as (cluster, nodes):
            ctx = Context(cluster, nodes, data, tok, Path(tmp) / "runs", out, deadline, temp_dir)
            runs = [ChaosRun(spec, ctx) for spec in specs]
            for run in runs:
                run.schedule = draw_schedule(rng, run.spec.kinds, run.spec.faults, run.spec.steps)
            reference = start_driver(reference_flags(runs[0]), {"RAY_ADDRESS": cluster.address},
                                     stdout=(out / "reference.log").open("w"), stderr=subprocess.STDOUT)
            try:
                runs[0].run()
                with contextlib.suppress(subprocess.TimeoutExpired):  # killed below, reported as failed
                    reference.wait(timeout=max(1, deadline - time.monotonic()))
            finally:
                if reference.poll() is None:
                    reference.kill()
                reference.wait()
            for run in runs[1:]:
                for node in nodes[MAX_WORKERS:]:
                    cluster.remove_node(node)
                del nodes[MAX_WORKERS:]
                run.run()
            ref_dir = Storage(str(ctx.storage)).child("reference") if reference.returncode == 0 else None
            results = [audit_run(run, data, ref_dir) for run in runs]
            reference_goodput = run_ledger(ref_dir).goodput if ref_dir is not None else None
    summary = {"seed": args.seed, "mode": "short" if args.short else "full", "started": started,
               "seconds": round(time.time() - started, 1), "machine": machine(),
               "reference_exit": reference.returncode, "reference_goodput": reference_goodput,
               "runs": results}
    (out / "chaos.json").write_text(json.dumps(summary, indent=1, default=str))
    print_table(summary)
    if args.results:
        write_results(Path(args.results), summary)
    return 0 if all(r["ok"] for r in results) and reference.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
