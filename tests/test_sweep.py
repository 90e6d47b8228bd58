"""tune.sweep: grid construction and trial configs (no Ray), then a real sweep on the shared cluster:
3 tiny trials (3 depths, CPU, two at a time), interrupted with Ctrl-C after a trial finished and
resumed by re-running the command, all in a real S3 API (moto): every trial reports val bpb, the
finished trial is not re-run, the table and plots are written into the bucket."""

import csv
import io
import json
import math
import signal
import subprocess
import sys
import time

import pytest
from conftest import s3_uri
from helpers import copy_tree

from raychat.checkpoint.catalog import list_checkpoints
from raychat.checkpoint.meta import CheckpointMeta, LoopState
from raychat.common import RaychatError, run_cli
from raychat.config import TrainConfig
from raychat.run.driver import final_report
from raychat.run.prepare import PreparedRun
from raychat.scaling import resolve_plan
from raychat.storage import Storage
from tune.report import SWEEP_SPEC_FILE, load_sweep, one_result_per_step
from tune.sweep import asha_scheduler, best_trial, build_trials, check_same_grid, main, parse_list, trial_name

# d2/d3, width 32 per layer, T 64, 256-token steps: each trial is a few steps of the full model.
TINY = ["--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64", "--window-pattern", "L",
        "--device-batch-size", "4", "--total-batch-size", "256", "--eval-tokens", "2048", "--eval-every", "5",
        "--warmup-steps", "2", "--sample-every", "-1", "--vocab-size", "512"]


def tiny_base(**changes) -> TrainConfig:
    return TrainConfig(depth=2, aspect_ratio=32, head_dim=32, max_seq_len=64, window_pattern="L",
                       device_batch_size=4, total_batch_size=256, **changes)


@pytest.mark.unit
def test_parse_list():
    assert parse_list("10,12,14", int, "--depths") == [10, 12, 14]
    assert parse_list("1e18, 3e18", float, "--flops") == [1e18, 3e18]
    for bad in ("", "10,x", "10,10", "0,2", "-1"):
        with pytest.raises(RaychatError, match="--depths"):
            parse_list(bad, int, "--depths")


@pytest.mark.unit
def test_trial_names():
    assert trial_name(12, ratio=8) == "d12_r8"
    assert trial_name(12, ratio=0.5) == "d12_r0.5"
    assert trial_name(10, flops=1e18) == "f1e18_d10"
    assert trial_name(10, flops=2.15e18) == "f2.15e18_d10"
    assert trial_name(2, flops=1e6) == "f1e6_d2"


@pytest.mark.unit
def test_ratio_grid_trials():
    trials = build_trials(tiny_base(run="exp"), [2, 3], [4.0, 8.0], [], "1:2", "/runs", vocab_size=512)
    assert [t["name"] for t in trials] == ["d2_r4", "d2_r8", "d3_r4", "d3_r8"]
    for t in trials:
        cfg = TrainConfig.from_dict(t["train_config"])
        assert (cfg.depth, cfg.target_param_data_ratio) == (t["depth"], t["ratio"])
        assert cfg.num_iterations == -1 and cfg.target_flops == -1  # the ratio is the horizon
        assert (cfg.run_name, cfg.storage_path, cfg.num_workers) == (t["name"], "/runs", "1:2")
        assert cfg.run == f"exp_{t['name']}"  # one wandb run per trial
        plan = t["plan"]
        # horizon: ratio x scaling params, in whole 256-token steps
        assert plan["num_iterations"] == int(t["ratio"] * plan["scaling_params"]) // 256
        assert plan["total_flops"] == plan["flops_per_token"] * plan["total_tokens"]
        assert plan["n_embd"] == 32 * t["depth"]
    # deeper model, more parameters
    assert trials[2]["plan"]["scaling_params"] > trials[0]["plan"]["scaling_params"]


@pytest.mark.unit
def test_iso_flop_trials_spend_each_budget():
    budgets = [2e10, 6e10]
    trials = build_trials(tiny_base(), [2, 3, 4], [], budgets, "1", "/runs", vocab_size=512)
    assert [t["name"] for t in trials] == ["f2e10_d2", "f2e10_d3", "f2e10_d4", "f6e10_d2", "f6e10_d3",
                                           "f6e10_d4"]
    for t in trials:
        cfg = TrainConfig.from_dict(t["train_config"])
        assert cfg.target_flops == t["flops_budget"] and cfg.target_param_data_ratio == -1
        step_flops = t["plan"]["flops_per_token"] * t["plan"]["total_batch_size"]
        # a whole number of steps, the nearest to the budget
        assert abs(t["plan"]["total_flops"] - t["flops_budget"]) <= step_flops / 2
    # same budget: the bigger model sees fewer tokens
    tokens = [t["plan"]["total_tokens"] for t in trials[:3]]
    assert tokens == sorted(tokens, reverse=True)


@pytest.mark.unit
def test_budget_too_small_names_the_trial():
    with pytest.raises(RaychatError, match="trial f1e6_d2: --target-flops"):
        build_trials(tiny_base(), [2], [], [1e6], "1", "/runs", vocab_size=512)


@pytest.mark.unit
def test_dry_run_prints_the_grid(capsys, tmp_path):
    assert main(["--depths", "2,3", "--flops", "2e10,6e10", *TINY, "--storage-path", str(tmp_path),
                 "--name", "dry", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 trials" in out and "f6e10_d3" in out
    assert not (tmp_path / "dry").exists()  # nothing run, nothing written


@pytest.mark.unit
def test_flag_errors(capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--depths", "2", "--ratios", "4", "--flops", "1e18", "--dry-run"])
    assert e.value.code == 2
    assert "--ratios and --flops" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--depths", "2", "--workers-per-trial", "4:2", "--dry-run"])
    assert e.value.code == 2
    assert "--workers-per-trial must be N or MIN:MAX" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--depths", "2", "--name", "../elsewhere", "--dry-run"])
    assert e.value.code == 2
    assert "--name must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--depths", "2", "--metric", "core", "--core-metric-every", "-1", "--dry-run"])
    assert e.value.code == 2
    assert "--metric core ranks trials by CORE, which --core-metric-every -1" in capsys.readouterr().err


@pytest.mark.unit
def test_the_best_trial_and_asha_follow_the_metric():
    rows = [{"trial": "a", "val_bpb": 1.2, "core_metric": 0.10},
            {"trial": "b", "val_bpb": 1.1, "core_metric": 0.05},
            {"trial": "c", "val_bpb": None, "core_metric": None}]
    assert best_trial(rows, "val_bpb") == "Best trial by val bpb: b (1.1000)"  # lower is better
    assert best_trial(rows, "core") == "Best trial by CORE: a (0.1000)"  # higher is better
    assert best_trial(rows[2:], "core") is None
    trials = [{"plan": {"total_flops": 3e15}}, {"plan": {"total_flops": 9e15}}]
    assert asha_scheduler(trials, "core").metric == "core_metric"
    assert asha_scheduler(trials).metric == "val_bpb"


@pytest.mark.unit
def test_a_restarted_trial_counts_each_step_once():
    """A trial restored from its checkpoint at step 4 redoes and re-reports steps 5-6: the report
    keeps one result per (trial, step), the later one, in step order."""
    reports = [{"step": 0, "val_bpb": 3.0}, {"step": 4, "val_bpb": 2.5}, {"step": 6, "val_bpb": 2.4},
               {"step": 4, "val_bpb": 2.5}, {"step": 6, "val_bpb": 2.3}, {"step": 8, "val_bpb": 2.2}]
    kept = one_result_per_step(reports)
    assert [(r["step"], r["val_bpb"]) for r in kept] == [(0, 3.0), (4, 2.5), (6, 2.3), (8, 2.2)]


@pytest.mark.unit
def test_the_final_report_of_a_run_at_its_horizon_is_its_last_reports_fields():
    """What a trial reports for a run that was already at its horizon (raychat.run.driver.final_report:
    the loop's last report, train_done, from the final checkpoint's loop state)."""
    trial = build_trials(tiny_base(), [2], [4.0], [], "1", "/runs", vocab_size=512)[0]
    cfg = TrainConfig.from_dict(trial["train_config"])
    plan = resolve_plan(cfg, 512, world_size=1)
    n = plan.num_iterations
    loop = LoopState(step=n, min_val_bpb=1.4, val_bpb=1.5, core_metric=0.1, total_training_time=3.0,
                     restarts=2, final_evaluated=True)
    meta = CheckpointMeta(step=n, model_config=plan.model, world_size=2, loop_state=loop)
    run = PreparedRun(cfg=cfg, plan=plan, tokenizer=None, index=None, resume_meta=meta)
    assert final_report(run) == {"step": n, "world_size": 2, "tokens_so_far": plan.total_tokens,
                                 "flops_so_far": plan.total_flops, "min_val_bpb": 1.4,
                                 "total_training_time": 3.0, "checkpoint_step": n, "train_done": True,
                                 "restarts": 2, "resizes": 0, "redone_steps": 0, "val_bpb": 1.5,
                                 "core_metric": 0.1}


@pytest.mark.unit
def test_resume_refuses_another_grid(tmp_path):
    trials = build_trials(tiny_base(), [2, 3], [4.0], [], "1", "/runs", vocab_size=512)
    sweep_dir = Storage(str(tmp_path / "s"))
    sweep_dir.write_bytes(SWEEP_SPEC_FILE, json.dumps({"trials": trials}).encode())
    check_same_grid(sweep_dir, trials, "s")  # same grid: fine
    with pytest.raises(RaychatError, match="started with trials d2_r4,d3_r4 but this command defines d2_r4"):
        check_same_grid(sweep_dir, trials[:1], "s")


# ------------------------------------------------------------------------------------------------
# A real sweep on the shared cluster

def _trial_status(experiment: Storage) -> dict[str, str]:
    """Trial -> Tune status from the newest experiment state Tune has written (what a restore reads)."""
    states = sorted(i.base_name for i in experiment.entries() if i.base_name.startswith("experiment_state-"))
    if not states:
        return {}
    try:
        state = json.loads(experiment.read_bytes(states[-1]))
    except (json.JSONDecodeError, FileNotFoundError):  # caught mid-write
        return {}
    return {json.loads(t)["relative_logdir"]: json.loads(t)["status"] for t, _ in state["trial_data"]}


@pytest.fixture(scope="module")
def interrupted_sweep(ray_session, tiny_corpus, s3_endpoint, tmp_path_factory):
    """Start a 2-trial sweep in the S3 bucket, one trial at a time (so d4 has barely started when d2
    is done), Ctrl-C it once a trial has finished, then re-run the same command. (On a bucket: the
    harder case; local paths go through the same Storage code.)"""
    data_dir, tokenizer_dir = tiny_corpus
    storage = s3_uri(s3_endpoint, f"sweeps-{time.time_ns()}")
    cmd = [sys.executable, "-m", "tune.sweep", "--depths", "2,4", "--ratios", "0.004", *TINY,
           "--data-dir", str(data_dir), "--tokenizer-dir", str(tokenizer_dir), "--storage-path", storage,
           "--name", "tiny", "--max-concurrent", "1", "--metric", "core"]
    experiment = Storage(storage).child("tiny")
    first_log = tmp_path_factory.mktemp("sweep-logs") / "first.log"
    with open(first_log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ray_session.driver_env())
        try:
            deadline = time.time() + 600
            while time.time() < deadline and proc.poll() is None:
                finished = [t for t, s in _trial_status(experiment).items() if s == "TERMINATED"]
                if finished:
                    break
                time.sleep(1)
            assert finished, "no trial finished in time:\n" + first_log.read_text()[-3000:]
            proc.send_signal(signal.SIGINT)  # what Ctrl-C does
            first_rc = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # What had finished when the Ctrl-C took effect, as Tune saved it (another trial may have finished
    # between the poll above and the signal).
    finished = [t for t, s in _trial_status(experiment).items() if s == "TERMINATED"]
    before = {t: experiment.child(t).read_bytes("result.json") for t in finished}
    # The re-run and the report in the session's reused driver interpreter (helpers.run_train).
    second = ray_session.drivers.run(*cmd[2:], env=ray_session.driver_env(), timeout=600)
    report = ray_session.drivers.run("tune.report", "--name", "tiny", "--storage-path", storage, timeout=120)
    return {"experiment": experiment, "finished_first": finished, "before": before, "first_rc": first_rc,
            "first_out": first_log.read_text(), "second": second, "report": report, "cmd": cmd,
            "storage": storage}


@pytest.mark.ray
def test_interrupted_sweep_resumes_without_rerunning_finished_trials(interrupted_sweep):
    s = interrupted_sweep
    second = s["second"]
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = second.stdout + second.stderr
    assert "Resuming sweep tiny" in out
    for trial in s["finished_first"]:
        # Tune never started it again, and its results are exactly those of the first run
        assert f"Trial {trial} started" not in out
        assert s["experiment"].child(trial).read_bytes("result.json") == s["before"][trial]
    names = ("d2_r0.004", "d4_r0.004")
    started_again = [t for t in names if f"Trial {t} started" in out]
    assert len(started_again) == 2 - len(s["finished_first"])
    # the interrupted run said so (exit code 130, like any Ctrl-C) and how to resume
    assert s["first_rc"] == 130
    assert "re-run the same command to resume" in s["first_out"]


@pytest.mark.ray
def test_every_trial_reports_val_bpb(interrupted_sweep):
    trials = load_sweep(interrupted_sweep["experiment"].location)
    assert [t.name for t in trials] == ["d2_r0.004", "d4_r0.004"]
    for t in trials:
        assert t.status == "finished", t.name
        plan = t.spec["plan"]
        evals = [r for r in t.results if r.get("val_bpb") is not None]
        # eval at step 0, every 5 steps and at the last step
        expected_steps = sorted({*range(0, plan["num_iterations"], 5), plan["num_iterations"]})
        assert [r["step"] for r in evals] == expected_steps, t.name
        assert all(0 < r["val_bpb"] < 20 and math.isfinite(r["val_bpb"]) for r in evals)
        assert t.last("tokens_so_far") == plan["total_tokens"]
        assert t.last("flops_so_far") == plan["total_flops"]
        # ASHA compares trials at equal FLOPs: every report says the FLOPs spent by its step
        flops_per_step = plan["total_flops"] / plan["num_iterations"]
        assert all(r["flops_so_far"] == pytest.approx(r["step"] * flops_per_step) for r in t.results)
        # the trial's raychat run lives under the sweep in the bucket and kept its final checkpoint
        run = interrupted_sweep["experiment"].child("runs", t.name)
        assert f"checkpoint_{plan['num_iterations']:06d}" in [c.name for c in list_checkpoints(run)]


@pytest.mark.ray
def test_sweep_writes_table_and_plots_into_the_bucket(interrupted_sweep):
    report = interrupted_sweep["experiment"].child("report")
    rows = list(csv.DictReader(io.StringIO(report.read_text("trials.csv"))))
    assert [r["trial"] for r in rows] == ["d2_r0.004", "d4_r0.004"]
    assert {r["status"] for r in rows} == {"finished"}
    assert all(float(r["val_bpb"]) > 0 for r in rows)
    assert report.info("val_bpb_vs_flops.png").size > 10_000
    # each trial's own run report (raychat.report), linked from the table, beside the sweep's
    assert [r["report"] for r in rows] == [f"trials/{r['trial']}/report.md" for r in rows]
    for r in rows:
        trial_report = report.child("trials", r["trial"])
        assert "## Validation bpb" in trial_report.read_text("report.md") and trial_report.exists("loss.png")
    assert "d4_r0.004" in interrupted_sweep["second"].stdout  # the table is printed too
    # CORE (on by default, scored at each trial's end): a column, a plot, the ranking (--metric core)
    assert all(-1 <= float(r["core_metric"]) <= 1 for r in rows)
    assert report.info("core_metric_vs_flops.png").size > 10_000
    best = max(rows, key=lambda r: float(r["core_metric"]))
    line = f"Best trial by CORE: {best['trial']} ({float(best['core_metric']):.4f})"
    assert line in interrupted_sweep["second"].stdout
    # tune.report --storage-path URI reads the sweep from the bucket and writes there again
    again = interrupted_sweep["report"]
    assert again.returncode == 0, again.stderr[-2000:]
    assert "d4_r0.004" in again.stdout and report.location.split("?")[0] in again.stdout


@pytest.mark.ray
def test_a_trial_whose_run_is_done_already_ends_finished_with_its_final_result(ray_session,
                                                                              interrupted_sweep):
    """A sweep interrupted after a trial's final save but before Tune recorded its final report runs
    the trial again on resume, and its run has nothing left to train. Made certain here: d2's finished
    run is copied into a new sweep's runs, whose one trial then trains nothing and still ends
    'finished' with the run's final val bpb (not 'stopped early' without it)."""
    s = interrupted_sweep
    done = s["experiment"].child("runs", "d2_r0.004")
    copy_tree(done, Storage(s["storage"]).child("done", "runs", "d2_r0.004"))
    cmd = list(s["cmd"])
    cmd[cmd.index("--depths") + 1], cmd[cmd.index("--name") + 1] = "2", "done"
    out = ray_session.drivers.run(*cmd[2:], env=ray_session.driver_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "nothing to train" in out.stdout + out.stderr
    (trial,) = load_sweep(Storage(s["storage"]).child("done").location)
    (original,) = [t for t in load_sweep(s["experiment"].location) if t.name == "d2_r0.004"]
    assert trial.status == "finished"
    assert trial.last("val_bpb") == original.last("val_bpb") and trial.last("step") == original.last("step")
