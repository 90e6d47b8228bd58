"""`python -m tune.report --name S`: what a sweep found, as a table (printed and CSV) and plots (PNG).

Reads the sweep's Ray Tune experiment directory as it lies in storage (local or s3://...), with
plain JSON parsing only, so it works while the sweep is still running, after it was interrupted,
and on a copy of the directory on a laptop without the cluster:

  <storage>/<name>/raychat_sweep.json         the grid the sweep was started with (tune.sweep)
  <storage>/<name>/experiment_state-*.json    Tune's trial states (the newest file wins)
  <storage>/<name>/<trial>/params.json        the trial's config: {"trial": spec}
  <storage>/<name>/<trial>/result.json        one JSON line per ray.train.report of rank 0
  <storage>/<name>/runs/<trial>/...           the trial's raychat run (checkpoints)

Plots: val bpb against FLOPs spent, one colour per depth (every eval of every trial); and for
iso-FLOP sweeps the iso-FLOP valleys with their parabola fits and the power laws of the optimal
model size and token count against compute (tune/fit.py does the numbers, tune/plots.py draws).
"""

import argparse
import csv
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from raychat.common import RaychatError, check_name, default_storage_path, require_extra, run_cli
from raychat.locations import join_uri, normalize_location
from raychat.report.document import REPORT_FILE, write_run_report
from raychat.storage import Storage
from raychat.telemetry.metrics_log import has_log
from tune.fit import ComputeOptimal, compute_optimal

if TYPE_CHECKING:  # matplotlib is the `report` extra: imported where a plot is drawn
    from tune.plots import EvalCurve

SWEEP_SPEC_FILE = "raychat_sweep.json"  # written by tune.sweep before Tune starts
TRAIN_RUNS_DIR = "runs"  # the trials' raychat runs, inside the experiment directory
TRIAL_REPORTS_DIR = "trials"  # each trial's run report (raychat.report), inside the report directory

COLUMNS = ["trial", "status", "depth", "width", "target_ratio", "flops_budget", "scaling_params",
           "total_params", "flops_per_token", "tokens", "tokens_per_param", "total_flops", "val_bpb",
           "core_metric", "wall_time_s", "goodput", "report"]


def resolve_storage(storage_path: str = "") -> str:
    """--storage-path as Ray wants it: an absolute local path or a URI (default: raychat's runs dir)."""
    return normalize_location(storage_path or str(default_storage_path()))


def experiment_path(name: str, storage_path: str = "") -> str:
    """<storage>/<name>: where the sweep `name` lives (a URI's ?query stays at the end)."""
    return join_uri(resolve_storage(storage_path), name)


@dataclass
class Trial:
    name: str
    status: str  # finished | stopped early | error | running | pending | paused | not started | unknown
    spec: dict[str, Any]  # the trial spec tune.sweep built: depth, ratio, flops_budget, plan, ...
    results: list[dict[str, Any]] = field(default_factory=list)  # in report order

    def last(self, key: str) -> Any:
        """The latest reported value of `key` (None if never reported)."""
        for result in reversed(self.results):
            if result.get(key) is not None:
                return result[key]
        return None


def _trial_states(storage: Storage) -> dict[str, str]:
    """Trial directory name -> Tune status, from the newest experiment state (JSON, never unpickled)."""
    states = sorted(info.base_name for info in storage.entries()
                    if info.base_name.startswith("experiment_state-") and info.base_name.endswith(".json"))
    if not states:
        return {}
    state = json.loads(storage.read_text(states[-1]))
    statuses = {}
    for trial_json, _runtime in state.get("trial_data", []):
        trial = json.loads(trial_json)
        statuses[trial.get("relative_logdir") or trial.get("custom_dirname")] = trial["status"]
    return statuses


def _status(tune_status: str | None, results: list[dict[str, Any]]) -> str:
    if tune_status is None:
        return "unknown"
    if tune_status == "TERMINATED":
        # A trial Tune ended before its last step was stopped by the scheduler (--asha).
        return "finished" if any(r.get("train_done") for r in results) else "stopped early"
    return tune_status.lower()


def load_sweep(path: str) -> list[Trial]:
    """Every trial of the sweep at `path`, in the order the sweep defined them."""
    storage = Storage(path)
    if not storage.exists():
        raise RaychatError(f"no sweep at {path}: check --name and --storage-path (the sweep prints "
                           "its directory when it starts)")
    specs: dict[str, dict[str, Any]] = {}
    if storage.exists(SWEEP_SPEC_FILE):
        specs = {t["name"]: t for t in json.loads(storage.read_text(SWEEP_SPEC_FILE))["trials"]}
    statuses = _trial_states(storage)
    found: dict[str, Trial] = {}
    for info in storage.entries():
        if info.type != pafs.FileType.Directory or not storage.exists(f"{info.base_name}/params.json"):
            continue
        spec = json.loads(storage.read_text(f"{info.base_name}/params.json")).get("trial")
        if not isinstance(spec, dict) or "name" not in spec:
            continue  # not a tune.sweep trial
        results = []
        if storage.exists(f"{info.base_name}/result.json"):
            results = one_result_per_step([json.loads(line) for line in storage.read_text(
                f"{info.base_name}/result.json").splitlines() if line.strip()])
        status = _status(statuses.get(info.base_name), results)
        found[spec["name"]] = Trial(spec["name"], status, spec, results)
    if not found and not specs:
        raise RaychatError(f"{path} holds no tune.sweep trials: is it the directory of a sweep started "
                           "with `python -m tune.sweep`?")
    order = list(specs) + sorted(set(found) - set(specs))
    return [found.get(name) or Trial(name, "not started", specs[name]) for name in order]


def one_result_per_step(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A trial restarted from a checkpoint redoes (and reports again) the steps after it: keep the
    latest report of each step, in step order, so every (trial, step) counts once. Reports without a
    step (not raychat's) are kept as they are."""
    by_step: dict[Any, dict[str, Any]] = {}
    for result in results:
        key = result["step"] if result.get("step") is not None else ("report", id(result))
        by_step.pop(key, None)  # re-insert: the latest report takes the latest place
        by_step[key] = result
    stepped = sorted((r for r in by_step.values() if r.get("step") is not None), key=lambda r: r["step"])
    return stepped + [r for r in by_step.values() if r.get("step") is None]


def trial_row(trial: Trial) -> dict[str, Any]:
    """One table row. Model numbers come from the plan the sweep resolved; tokens, FLOPs and val bpb
    from what the trial reported last (a stopped or unfinished trial shows how far it got)."""
    plan = trial.spec.get("plan", {})
    tokens = trial.last("tokens_so_far") or 0
    flops = trial.last("flops_so_far")
    if flops is None and plan.get("flops_per_token"):
        flops = tokens * plan["flops_per_token"]
    scaling = plan.get("scaling_params")
    return {
        "trial": trial.name,
        "status": trial.status,
        "depth": trial.spec.get("depth"),
        "width": plan.get("n_embd"),
        "target_ratio": trial.spec.get("ratio"),
        "flops_budget": trial.spec.get("flops_budget"),
        "scaling_params": scaling,
        "total_params": plan.get("total_params"),
        "flops_per_token": plan.get("flops_per_token"),
        "tokens": tokens,
        "tokens_per_param": tokens / scaling if scaling else None,
        "total_flops": flops or 0,
        "val_bpb": trial.last("val_bpb"),
        "core_metric": trial.last("core_metric"),
        "wall_time_s": trial.last("time_total_s"),
        "goodput": trial.last("goodput"),  # of the trial's run so far (raychat.telemetry.ledger)
    }


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS} for row in rows)


def _si(x: float | None) -> str:
    """12345678 -> 12.3M: counts readable at a glance."""
    if x is None:
        return "-"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def format_table(rows: list[dict[str, Any]]) -> str:
    headers = ["trial", "status", "depth", "width", "params", "params total", "FLOPs/tok", "tokens",
               "tok:param", "FLOPs", "val bpb", "CORE", "wall"]
    body = []
    for r in rows:
        body.append([
            r["trial"], r["status"], str(r["depth"]), str(r["width"] or "-"), _si(r["scaling_params"]),
            _si(r["total_params"]), _si(r["flops_per_token"]), _si(r["tokens"]),
            "-" if r["tokens_per_param"] is None else f"{r['tokens_per_param']:.3g}", _sci(r["total_flops"]),
            "-" if r["val_bpb"] is None else f"{r['val_bpb']:.4f}",
            "-" if r.get("core_metric") is None else f"{r['core_metric']:.4f}",
            "-" if r["wall_time_s"] is None else f"{r['wall_time_s'] / 60:.1f}m",
        ])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)).rstrip() for b in body]
    return "\n".join(lines)


def iso_flop_points(rows: list[dict[str, Any]]) -> list[tuple[float, float, float, float]]:
    """(budget, N, D, val bpb) of the finished iso-FLOP trials: only they spent their whole budget."""
    return [(r["flops_budget"], r["scaling_params"], r["tokens"], r["val_bpb"]) for r in rows
            if r["flops_budget"] and r["status"] == "finished" and r["val_bpb"] is not None
            and r["scaling_params"] and r["tokens"]]


def format_compute_optimal(result: ComputeOptimal) -> str:
    lines = ["Compute-optimal model per FLOPs budget (parabola of val bpb in ln N; N = scaling params):",
             f"  {'budget':<10}{'N_opt':<10}{'D_opt':<10}{'D/N':<8}{'val bpb':<10}{'fit R^2':<9}"
             f"{'trials':<8}source"]
    for o in result.optima:
        r2 = "-" if o.r2 is None else f"{o.r2:.4f}"
        lines.append(f"  {o.flops:<10.3g}{_si(o.params):<10}{_si(o.tokens):<10}{o.ratio:<8.1f}"
                     f"{o.val_bpb:<10.4f}{r2:<9}{o.num_points:<8}{o.source}")
    for o in result.optima:
        if o.source == "extrapolated":
            side = "smaller" if o.params < o.params_tried[0] else "larger"
            lines.append(f"  note: at {o.flops:.3g} the valley's bottom lies outside the depths tried: add "
                         f"{side} depths for a measured optimum")
        elif o.source == "best point":
            lines.append(f"  note: at {o.flops:.3g} no valley ({o.num_points} trials): the best trial is "
                         "shown; use at least 3 depths that bracket the optimum")
    if result.params_law is None or result.tokens_law is None:
        lines.append("Power laws need at least 2 budgets with a fitted valley.")
        return "\n".join(lines)
    a, b = result.params_law, result.tokens_law

    def quality(law) -> str:
        return (f"R^2 {law.r2:.4f}" if law.r2 is not None
                else f"{law.num_points} budgets: exact through the points, no fit quality")

    per_budget = ", ".join(f"{o.ratio:.1f}" for o in result.optima if o.source != "best point")
    ratios = [o.ratio for o in result.optima if o.source != "best point"]
    mean = sum(ratios) / len(ratios)
    std = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1)) if len(ratios) > 1 else 0.0
    lines += [
        f"Power laws: N_opt ~ C^{a.exponent:.3f} ({quality(a)}),  D_opt ~ C^{b.exponent:.3f} ({quality(b)})",
        f"Compute-optimal tokens:params ratio: {result.ratio_at_reference:.1f} at C = "
        f"{result.reference_flops:.3g} (ratio ~ C^{result.ratio_exponent:+.3f}; "
        f"0 = the same ratio at every budget)",
        f"  per budget: {per_budget} (mean {mean:.1f} +- {std:.1f}); use it as --target-param-data-ratio",
    ]
    return "\n".join(lines)


def eval_curves(trials: list[Trial], metric: str = "val_bpb") -> "list[EvalCurve]":
    """(depth, [(FLOPs so far, metric) of each eval]) per trial: what the metric-vs-FLOPs plots draw."""
    return [(t.spec["depth"], [(r["flops_so_far"], r[metric]) for r in t.results
                               if r.get(metric) is not None and r.get("flops_so_far")]) for t in trials]


def plot_bpb_vs_flops(trials: list[Trial], path: Path) -> None:
    """Every eval of every trial: val bpb against FLOPs spent so far, one colour per depth."""
    from tune.plots import bpb_vs_flops_figure, save_figure

    save_figure(bpb_vs_flops_figure(eval_curves(trials)), path)


def plot_core_vs_flops(trials: list[Trial], path: Path) -> None:
    """The same for nanochat's CORE metric (higher is better), where the trials scored it."""
    from tune.plots import bpb_vs_flops_figure, save_figure

    figure = bpb_vs_flops_figure(eval_curves(trials, "core_metric"), ylabel="CORE metric (centered, mean "
                                 "of the tasks)", title="CORE vs compute")
    save_figure(figure, path)


def plot_iso_flop(points: list[tuple[float, float, float, float]], result: ComputeOptimal,
                  path: Path) -> None:
    """Iso-FLOP valleys with their parabolas, then N_opt and D_opt against compute with the power laws."""
    from tune.plots import iso_flop_figure, save_figure

    save_figure(iso_flop_figure(points, result), path)


def write_report(path: str, out: str | Path, log=print) -> list[dict[str, Any]]:
    """Table (printed + trials.csv) and plots of the sweep at `path`, and each trial's own run
    report (raychat.report) under trials/<trial>/, written to `out` (a local directory or a URI:
    the files are made in a temporary directory, then copied there)."""
    require_extra("matplotlib", "report", "a sweep's report")
    target = Storage.of(out)
    runs = Storage(path).child(TRAIN_RUNS_DIR)
    reports = {}
    for name in runs.subdirs():
        if has_log(runs.child(name)):
            write_run_report(runs.child(name), target.child(TRIAL_REPORTS_DIR, name), log=lambda _: None)
            reports[name] = f"{TRIAL_REPORTS_DIR}/{name}/{REPORT_FILE}"
    with tempfile.TemporaryDirectory(prefix="raychat-report-") as tmp:
        rows, written = _write_report_files(path, Path(tmp), log, reports)
        for file in written:
            target.write_bytes(file.name, file.read_bytes())
    log("Wrote " + ", ".join(join_uri(target.location, f.name) for f in written))
    if reports:
        where = join_uri(target.location, TRIAL_REPORTS_DIR, "<trial>", REPORT_FILE)
        log(f"Trial reports ({len(reports)}, the column 'report' of trials.csv): {where}")
    return rows


def _write_report_files(path: str, out_dir: Path, log,
                        reports: dict[str, str]) -> tuple[list[dict[str, Any]], list[Path]]:
    trials = load_sweep(path)
    rows = [{**trial_row(t), "report": reports.get(t.name)} for t in trials]
    log(f"Sweep {path}: {len(rows)} trials")
    log(format_table(rows))
    write_csv(rows, out_dir / "trials.csv")
    written = [out_dir / "trials.csv"]
    if any(t.results for t in trials):
        plot_bpb_vs_flops(trials, out_dir / "val_bpb_vs_flops.png")
        written.append(out_dir / "val_bpb_vs_flops.png")
    if any(r.get("core_metric") is not None for t in trials for r in t.results):
        plot_core_vs_flops(trials, out_dir / "core_metric_vs_flops.png")
        written.append(out_dir / "core_metric_vs_flops.png")
    points = iso_flop_points(rows)
    if points:
        result = compute_optimal(points)
        log(format_compute_optimal(result))
        with open(out_dir / "compute_optimal.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["flops_budget", "params_opt", "tokens_opt", "ratio", "val_bpb", "fit_r2",
                             "trials", "source"])
            for o in result.optima:
                writer.writerow([o.flops, o.params, o.tokens, o.ratio, o.val_bpb,
                                 "" if o.r2 is None else o.r2, o.num_points, o.source])
        plot_iso_flop(points, result, out_dir / "iso_flop.png")
        written += [out_dir / "compute_optimal.csv", out_dir / "iso_flop.png"]
    return rows, written


def default_out_dir(path: str) -> str:
    """<storage>/<name>/report: beside the trials, on local disk or in the bucket."""
    return join_uri(path, "report")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tune.report",
        description="Summarise a tune.sweep: a table of every trial (printed and trials.csv) and "
                    "plots: val bpb vs training FLOPs per depth, and for iso-FLOP sweeps (--flops) the "
                    "compute-optimal model size and tokens per budget, their power laws and the "
                    "tokens:params ratio they imply.",
        epilog="example:\n  python -m tune.report --name scaling --storage-path s3://bucket/raychat\n"
               "Works while the sweep runs, after it was interrupted, and on a copied directory.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="the sweep's --name")
    parser.add_argument("--storage-path", default="",
                        help="the sweep's --storage-path (default: $RAYCHAT_HOME/runs)")
    parser.add_argument("--out", default="", help="where to write the CSV and PNG files, a directory or "
                        "a URI (default: <storage>/<name>/report)")
    args = parser.parse_args(argv)
    path = experiment_path(check_name(args.name, "--name"), args.storage_path)
    write_report(path, args.out or default_out_dir(path))
    return 0


if __name__ == "__main__":
    run_cli(main)
