"""`python -m tune.sweep`: many raychat runs at once with Ray Tune, to find the compute-optimal model.

Two grids. Depth x tokens:params ratio (`--depths 10,12,14 --ratios 8,12,20`) shows how much data
each size wants; iso-FLOP (`--depths ... --flops 1e18,3e18`) trains every depth to exactly each
budget, which is what the compute-optimal fit in `tune.report` needs (Chinchilla's approach 2).

Each trial is a complete raychat run through the same driver as `python -m raychat.train`
(raychat.run.driver: the same checks, the same trainer, the same one-line errors; Ray Train V2
inside Tune), so a trial has its own worker group, elasticity, failure handling and checkpoints.
Rank 0's reports reach Tune through a TuneReportCallback; the trial driver itself does no work and
sits on the head node when the cluster offers `raychat_driver` slots (cluster/*.yaml), never on a
preemptible GPU node.

Resume: the sweep lives in <storage>/<name> (Tune's experiment) with the trials' runs under
<storage>/<name>/runs/<trial>. Re-running the same command restores the experiment: finished trials
are kept, the others start again, and each of those resumes from its own latest checkpoint because
its run name and storage path do not change.
"""

import argparse
import dataclasses
import json
import os
import time

import ray
import ray.tune as tune
from ray.tune.integration.ray_train import TuneReportCallback

import raychat
from raychat.common import RaychatError, check_name, require_extra, run_cli
from raychat.config import TrainConfig, add_config_flags, config_from_args
from raychat.locations import join_uri
from raychat.plan import plan_vocab_size
from raychat.ray_glue.cluster_address import check_cluster_answers
from raychat.run.driver import connect_ray, final_report, fit_run, ray_storage
from raychat.run.prepare import prepare_inputs, prepare_run, resolve_paths
from raychat.scaling import Plan, resolve_plan
from raychat.storage import Storage
from tune.report import (
    SWEEP_SPEC_FILE,
    TRAIN_RUNS_DIR,
    default_out_dir,
    experiment_path,
    format_table,
    resolve_storage,
    write_report,
)

# Flags the sweep sets per trial; every other raychat.train flag passes through to all trials.
PER_TRIAL_FLAGS = {"depth", "num_iterations", "target_flops", "target_param_data_ratio", "run_name",
                   "num_workers"}
DRIVER_RESOURCE = "raychat_driver"  # custom resource of the head node in cluster/*.yaml
# --metric: the reported key, Tune's mode, and how the end of the sweep names it
METRICS = {"val_bpb": ("val_bpb", "min", "val bpb"), "core": ("core_metric", "max", "CORE")}

EPILOG = """\
examples:
  python -m tune.sweep --depths 10,12,14 --ratios 8,12,20 --workers-per-trial 8 --name ratios
  python -m tune.sweep --depths 8,10,12,14,16 --flops 1e18,3e18,1e19 --workers-per-trial 8 \\
      --max-concurrent 4 --storage-path s3://bucket/raychat --name isoflop
  python -m tune.sweep --preset cpu --depths 2,3 --ratios 2,4 --dry-run     # just print the grid
  python -m tune.report --name isoflop --storage-path s3://bucket/raychat   # table and plots

Re-running a sweep's command resumes it (finished trials are kept, the others continue from their
checkpoints). Any raychat.train flag below applies to every trial.
"""


def parse_list(text: str, kind: type, flag: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values) or len(set(values)) != len(values):
        raise RaychatError(f"{flag} takes distinct positive numbers separated by commas (e.g. "
                           f"{'10,12,14' if kind is int else '8,12,20'}), got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tune.sweep",
        description="Run a grid of raychat trainings with Ray Tune: every depth x tokens:params ratio, or "
                    "every depth x FLOPs budget (iso-FLOP). Each trial is a full raychat run on its own "
                    "worker group, reporting val bpb at every eval. Writes a table and plots at the end "
                    "(python -m tune.report prints them again at any time).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--depths", required=True, help="depths to train, e.g. 10,12,14")
    sweep.add_argument("--ratios", default="", help="tokens:params ratios (--target-param-data-ratio) to "
                       "train each depth at, e.g. 8,12,20 (default: the configured ratio)")
    sweep.add_argument("--flops", default="", help="iso-FLOP budgets instead of ratios: every depth trains "
                       "to exactly each budget (--target-flops), e.g. 1e18,3e18,1e19")
    sweep.add_argument("--workers-per-trial", default="1", metavar="N",
                       help="training workers of each trial: N, or MIN:MAX for elastic trials (default: 1)")
    sweep.add_argument("--max-concurrent", type=int, default=0, metavar="K",
                       help="trials running at once (default: as many as the cluster's GPUs, or CPUs, hold "
                       "now; raise it on an autoscaling cluster to let it grow; a resumed sweep keeps the "
                       "value it started with)")
    sweep.add_argument("--name", default="sweep", help="the sweep's directory under --storage-path; "
                       "re-running with the same name resumes it (default: sweep)")
    sweep.add_argument("--metric", default="val_bpb", choices=tuple(METRICS),
                       help="what ranks the trials (the best is named at the end) and what --asha "
                       "compares: val_bpb (lower is better; default) or core, nanochat's CORE metric "
                       "(higher is better; scored every --core-metric-every steps and at each trial's end)")
    sweep.add_argument("--asha", action="store_true", help="stop trials early when their --metric trails "
                       "the others' at the same FLOPs spent (ASHA; compares where the metric is reported)")
    sweep.add_argument("--dry-run", action="store_true", help="print the trials and their plans, run nothing")
    add_config_flags(parser, only={f.name for f in dataclasses.fields(TrainConfig)} - PER_TRIAL_FLAGS)
    return parser


def trial_name(depth: int, ratio: float | None = None, flops: float | None = None) -> str:
    """d12_r8 for the ratio grid, f1e18_d12 for iso-FLOP: the trial's directory and run name."""
    if flops is not None:
        mantissa, _, exponent = f"{flops:.3g}".partition("e")
        return f"f{mantissa}" + (f"e{int(exponent)}" if exponent else "") + f"_d{depth}"
    return f"d{depth}_r{ratio:g}"


def plan_summary(plan: Plan) -> dict:
    """What tune.report needs to know about a trial's model and horizon (stored in params.json)."""
    return {
        "n_layer": plan.model.n_layer, "n_embd": plan.model.n_embd, "n_head": plan.model.n_head,
        "vocab_size": plan.model.vocab_size, "scaling_params": plan.scaling_params,
        "total_params": plan.params["total"], "flops_per_token": plan.flops_per_token,
        "total_batch_size": plan.total_batch_size, "num_iterations": plan.num_iterations,
        "total_tokens": plan.total_tokens, "total_flops": plan.total_flops,
        "tokens_per_param": plan.tokens_per_param,
    }


def build_trials(base: TrainConfig, depths: list[int], ratios: list[float], budgets: list[float],
                 workers: str, runs_path: str, vocab_size: int) -> list[dict]:
    """One spec per trial: its name, grid point, full TrainConfig and resolved plan."""
    points = ([(d, None, c) for c in budgets for d in depths] if budgets
              else [(d, r, None) for d in depths for r in ratios])
    trials = []
    for depth, ratio, flops in points:
        name = trial_name(depth, ratio, flops)
        cfg = dataclasses.replace(
            base, depth=depth, num_iterations=-1, target_flops=flops or -1.0,
            target_param_data_ratio=ratio or -1.0, run_name=name, storage_path=runs_path,
            num_workers=workers, run=base.run if base.run == "dummy" else f"{base.run}_{name}")
        min_workers, max_workers = cfg.worker_range()
        try:
            plan = resolve_plan(cfg, vocab_size, world_size=max_workers)
            resolve_plan(cfg, vocab_size, world_size=min_workers)  # every size of an elastic range must fit
        except RaychatError as e:
            raise RaychatError(f"trial {name}: {e}") from None
        trials.append({"name": name, "depth": depth, "ratio": ratio, "flops_budget": flops,
                       "train_config": cfg.to_dict(), "plan": plan_summary(plan)})
    return trials


def format_trials(trials: list[dict]) -> str:
    rows = [{"trial": t["name"], "status": "planned", "depth": t["depth"], "width": t["plan"]["n_embd"],
             "scaling_params": t["plan"]["scaling_params"], "total_params": t["plan"]["total_params"],
             "flops_per_token": t["plan"]["flops_per_token"], "tokens": t["plan"]["total_tokens"],
             "tokens_per_param": t["plan"]["tokens_per_param"], "total_flops": t["plan"]["total_flops"],
             "val_bpb": None, "wall_time_s": None} for t in trials]
    return format_table(rows)


def run_trial(config: dict) -> None:
    """The Tune trainable: one raychat run, driven from this trial's actor."""
    spec = config["trial"]
    try:
        # A restored sweep re-runs unfinished trials: each resumes its own run from its checkpoints.
        run = prepare_run(TrainConfig.from_dict(spec["train_config"]))
        fit_run(run, callbacks=[TuneReportCallback()])
        if run.finished:
            # The run was at its horizon before this trial ran (a sweep interrupted after the trial's
            # final save, before Tune recorded its final report): fit_run trained and reported
            # nothing. Report the final result from the checkpoint, or Tune ends the trial without
            # it (tune.report: "stopped early", no final val bpb, CORE, tokens or FLOPs).
            tune.report(final_report(run))
    except RaychatError as e:
        raise RaychatError(f"trial {spec['name']}: {e}") from None


def _trial_dirname(trial) -> str:
    return trial.config["trial"]["name"]


def trial_resources() -> tune.PlacementGroupFactory:
    """A trial's own actor only waits on fit(): a head-node driver slot if the cluster has them, else a
    sliver of a CPU (a whole one would starve the Ray Data tasks that feed the workers)."""
    if ray.cluster_resources().get(DRIVER_RESOURCE, 0) >= 1:
        return tune.PlacementGroupFactory([{DRIVER_RESOURCE: 1}])
    return tune.PlacementGroupFactory([{"CPU": 0.01}])


def default_concurrency(cfg: TrainConfig) -> int:
    """Trials whose worker groups fit the cluster as it is now: GPUs / GPUs per trial, or for CPU
    trials CPUs / (worker CPUs + one CPU left for each trial's data tasks)."""
    resources = ray.cluster_resources()
    workers = cfg.worker_range()[1]
    gpus = cfg.gpus_per_worker if cfg.gpus_per_worker >= 0 else (1.0 if resources.get("GPU", 0) > 0 else 0.0)
    if gpus > 0:
        return max(1, int(resources.get("GPU", 0) // (workers * gpus)))
    cpus = cfg.cpus_per_worker if cfg.cpus_per_worker > 0 else 1.0
    return max(1, int(resources.get("CPU", 0) // (workers * cpus + 1)))


def asha_scheduler(trials: list[dict], metric: str = "val_bpb") -> tune.schedulers.ASHAScheduler:
    """ASHA on the sweep's metric at equal FLOPs spent: rungs from a third of the smallest trial's
    budget up (a report without the metric, e.g. a step with no CORE, is not compared)."""
    flops = [t["plan"]["total_flops"] for t in trials]
    key, mode, _ = METRICS[metric]
    return tune.schedulers.ASHAScheduler(
        time_attr="flops_so_far", metric=key, mode=mode, max_t=max(flops),
        grace_period=min(flops) / 3, reduction_factor=3, stop_last_trials=False)


def best_trial(rows: list[dict], metric: str) -> str | None:
    """'Best trial by CORE: d12_r20 (0.1234)' from the report's rows, or None if none has the metric."""
    key, mode, label = METRICS[metric]
    scored = [r for r in rows if r.get(key) is not None]
    if not scored:
        return None
    pick = min if mode == "min" else max
    best = pick(scored, key=lambda r: r[key])
    return f"Best trial by {label}: {best['trial']} ({best[key]:.4f})"


def check_same_grid(sweep_dir: Storage, trials: list[dict], name: str) -> None:
    """Resuming runs the grid the sweep was started with: refuse a command that defines another."""
    if not sweep_dir.exists(SWEEP_SPEC_FILE):
        return
    before = [t["name"] for t in json.loads(sweep_dir.read_text(SWEEP_SPEC_FILE))["trials"]]
    now = [t["name"] for t in trials]
    if before != now:
        raise RaychatError(f"sweep {name!r} at {sweep_dir} was started with trials {','.join(before)} "
                           f"but this command defines {','.join(now)}: re-run the original command to "
                           "resume it, or choose a new --name")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_extra("matplotlib", "report", "a sweep (its report at the end)")  # before hours of trials
    depths = parse_list(args.depths, int, "--depths")
    if args.ratios and args.flops:
        raise RaychatError("--ratios and --flops are two kinds of sweep: pass one of them")
    budgets = parse_list(args.flops, float, "--flops") if args.flops else []
    base = config_from_args(args)
    ratios = [] if budgets else (parse_list(args.ratios, float, "--ratios") if args.ratios
                                 else [base.target_param_data_ratio])
    try:
        TrainConfig.from_dict({**base.to_dict(), "num_workers": args.workers_per_trial})
    except RaychatError:
        raise RaychatError(f"--workers-per-trial must be N or MIN:MAX with 1 <= MIN <= MAX, got "
                           f"{args.workers_per_trial!r}") from None
    check_name(args.name, "--name")  # it names a directory under --storage-path

    if args.metric == "core" and base.core_metric_every <= 0:
        raise RaychatError("--metric core ranks trials by CORE, which --core-metric-every "
                           f"{base.core_metric_every} turns off: give it a positive number of steps")

    path = experiment_path(args.name, base.storage_path)
    runs_path = join_uri(path, TRAIN_RUNS_DIR)
    if args.dry_run:
        vocab_size, source = plan_vocab_size(base)
        trials = build_trials(base, depths, ratios, budgets, args.workers_per_trial, runs_path, vocab_size)
        print(f"Sweep {args.name}: {len(trials)} trials (vocab size from {source}), would run in {path}")
        print(format_trials(trials))
        return 0

    check_cluster_answers(os.environ.get("RAY_ADDRESS", ""))
    Storage(runs_path).check_writable()
    # Every trial reads the corpus and tokenizer the driver checks here, wherever it runs.
    storage_path = base.storage_path
    base = dataclasses.replace(resolve_paths(base), storage_path=storage_path)
    tokenizer, _ = prepare_inputs(base)
    trials = build_trials(base, depths, ratios, budgets, args.workers_per_trial, runs_path,
                          tokenizer.vocab_size)
    print(f"Sweep {args.name}: {len(trials)} trials in {path}", flush=True)
    print(format_trials(trials), flush=True)

    trial_cfg = TrainConfig.from_dict(trials[0]["train_config"])  # what every trial asks of the cluster
    connect_ray(trial_cfg)
    trainable = tune.with_resources(run_trial, trial_resources())
    sweep_dir = Storage(path)
    # Tune gets a URI as a filesystem and a bare path, as Ray Train does: its state shows no credentials.
    experiment = ray_storage(path)
    experiment_fs = experiment.get("storage_filesystem")
    if tune.Tuner.can_restore(experiment["storage_path"], experiment_fs):
        check_same_grid(sweep_dir, trials, args.name)
        print(f"Resuming sweep {args.name}: finished trials are kept, the others continue from their "
              "checkpoints (each trial keeps the settings it was started with)", flush=True)
        tuner = tune.Tuner.restore(experiment["storage_path"], trainable=trainable, resume_unfinished=True,
                                   resume_errored=True, storage_filesystem=experiment_fs)
    else:
        concurrency = args.max_concurrent or default_concurrency(trial_cfg)
        print(f"Running up to {concurrency} trials at once (--max-concurrent to change; on an autoscaling "
              "cluster, raise it to let the cluster grow)", flush=True)
        sweep_dir.write_bytes(SWEEP_SPEC_FILE, json.dumps({
            "name": args.name, "mode": "flops" if budgets else "ratio",
            "raychat_version": raychat.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "trials": trials}, indent=1).encode())
        tuner = tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search(trials)},
            tune_config=tune.TuneConfig(max_concurrent_trials=concurrency,
                                        scheduler=asha_scheduler(trials, args.metric) if args.asha else None,
                                        trial_name_creator=_trial_dirname,
                                        trial_dirname_creator=_trial_dirname),
            run_config=tune.RunConfig(name=args.name, verbose=1,
                                      **ray_storage(resolve_storage(base.storage_path))),
        )
    tuner.fit()

    # Statuses as Tune saved them: after Ctrl-C, Tune's in-memory trials all read "terminated".
    rows = write_report(path, default_out_dir(path))
    unfinished = [r["trial"] for r in rows if r["status"] not in ("finished", "stopped early", "error")]
    failed = [r["trial"] for r in rows if r["status"] == "error"]
    if unfinished:
        print(f"Sweep interrupted with {len(unfinished)} trial(s) unfinished ({', '.join(unfinished)}): "
              "re-run the same command to resume.")
        return 130
    if failed:
        print(f"{len(failed)} trial(s) failed ({', '.join(failed)}); their errors are in "
              f"{join_uri(path, '<trial>', 'error.txt')}. Re-run the same command to retry them from "
              "their checkpoints.")
        return 1
    best = best_trial(rows, args.metric)
    if best is not None:
        print(best)
    print(f"Sweep {args.name} done. Report again any time: python -m tune.report --name {args.name}"
          + (f" --storage-path {base.storage_path}" if base.storage_path else ""))
    return 0


if __name__ == "__main__":
    run_cli(main)
