"""Goodput without Ray: the auto checkpoint cadence's arithmetic (raychat.elastic.cadence) and the time
ledger of a synthetic metrics log (raychat.telemetry.ledger), through the report and raychat.status."""

import json

import pytest

from raychat.config import PRESETS, TrainConfig
from raychat.elastic.cadence import PROBE_STEPS, SaveCadence, choose_interval, plan_line
from raychat.report.document import build_report
from raychat.scaling import resolve_plan
from raychat.status import storage_lines
from raychat.storage import Storage
from raychat.telemetry.ledger import CAUSES, ledger
from raychat.telemetry.metrics_log import METRICS_FILE, parse_records

pytestmark = pytest.mark.unit


def test_the_default_cadence_is_auto_and_the_fixed_ones_keep_their_meaning():
    assert TrainConfig().save_every == 0 and TrainConfig().max_lost_minutes == 1.0
    assert "save_every" not in PRESETS["cpu"]  # the preset runs on the cadence every run gets
    assert "auto" in plan_line(0, 1.0) and "1 min" in plan_line(0, 1.0)
    assert plan_line(7, 1.0) == "Checkpoints: every 7 steps and at the end (--save-every 7)"
    assert "only at the end" in plan_line(-1, 1.0)


def test_the_interval_loses_least_within_the_stall_budget_the_writer_and_the_loss_cap():
    # 4 s steps, a 100 ms stall: 1% of the time needs 3 steps between saves (0.1 / 0.04 = 2.5), and
    # the least loss at one node lost per 600 s is sqrt(2 x 0.1 x 600) = 11 s, 3 steps too.
    cheap = choose_interval(step_s=4.0, stall_s=0.1, write_s=1.0, max_lost_s=60.0)
    assert cheap.every == 3 and cheap.met and cheap.stall_share <= 0.01 and cheap.lost_s <= 60
    # 1 s steps, a 25 ms stall: the budget allows every 3 steps, the least loss is sqrt(30) = 5.5 s: 6.
    assert choose_interval(step_s=1.0, stall_s=0.025, write_s=0.5, max_lost_s=60.0).every == 6
    # Peer memory holds every rank's state, replicated every step: storage saves as rarely as the cap
    # allows (14 x 4 s + 1 s). Replicas every 5 steps bound a loss worse than saves every 3: no change.
    rare = choose_interval(step_s=4.0, stall_s=0.1, write_s=1.0, max_lost_s=60.0, replica_every=1)
    assert rare.every == 14 and rare.met and rare.lost_s == 57.0 and "peer memory" in rare.describe()
    sparse = choose_interval(step_s=4.0, stall_s=0.1, write_s=1.0, max_lost_s=60.0, replica_every=5)
    assert sparse.every == 3 and not sparse.peer_memory
    # A 20 s write keeps the writer busy at most half the interval: 10 steps, whatever the stall.
    slow_write = choose_interval(step_s=4.0, stall_s=0.01, write_s=20.0, max_lost_s=60.0)
    assert slow_write.every == 10 and slow_write.met and slow_write.lost_s == 60.0
    # 10 ms steps and a 20 ms stall: 200 steps (2 s) keep the stall at 1%; the least loss is at
    # sqrt(2 x 0.02 x 600) = 4.9 s, 490 steps.
    assert choose_interval(0.01, 0.02, 0.05, 60.0).every == 490
    # A 1 s stall at 0.5 s steps needs 200 steps (100 s) for 1%: the loss cap the user set wins
    # (110 steps + the 5 s write = 60 s), the cost is said.
    conflict = choose_interval(step_s=0.5, stall_s=1.0, write_s=5.0, max_lost_s=60.0)
    assert conflict.every == 110 and not conflict.met and conflict.lost_s == 60.0
    assert "saves stall it 1.82% (a longer --max-lost-minutes saves less often)" in conflict.describe()
    # ... but never over one save in flight: a 90 s write is waited for, whatever the cap.
    assert choose_interval(step_s=1.0, stall_s=0.01, write_s=90.0, max_lost_s=60.0).every == 90


def test_rank_zeros_cadence_probes_then_chooses_and_logs_changes():
    lines: list[str] = []
    cadence = SaveCadence(max_lost_minutes=1.0, first_step=100, log=lines.append)
    # Before any save: the probe, PROBE_STEPS steps into the attempt.
    assert not cadence.due(100 + PROBE_STEPS - 1, None) and cadence.due(100 + PROBE_STEPS, None)
    cadence.step_done(30.0)  # the attempt's first step (compilation) is not planned with
    for _ in range(PROBE_STEPS):
        cadence.step_done(4.0)
    cadence.save_stalled(0.1)
    cadence.save_written(1.0)
    assert cadence.interval.every == 3 and lines == [f"Checkpoint cadence: {cadence.interval.describe()}"]
    assert lines[0].startswith("Checkpoint cadence: every 3 steps (~12.0s; step 4000ms, save stall 100ms")
    assert not cadence.due(107, 105) and cadence.due(108, 105)
    cadence.save_stalled(0.11)  # a little longer: within the hysteresis, no change, no line
    cadence.save_written(1.0)
    assert cadence.interval.every == 3 and len(lines) == 1
    cadence.save_stalled(0.13)  # 4 steps would do: a neighbour, no flip-flop between 3 and 4
    cadence.save_written(1.0)
    assert cadence.interval.every == 3 and len(lines) == 1
    cadence.save_stalled(0.5)  # much longer: 13 steps keep the stall at 1%
    cadence.save_written(1.0)
    assert cadence.interval.every == 13
    assert lines[-1].startswith("Checkpoint cadence changed from every 3 steps: every 13 steps")


def test_a_save_comes_early_when_the_wall_clock_would_pass_the_loss_cap():
    """The interval is counted in steps measured at the last save; steps that slow down afterwards (or
    evaluations between saves) must not stretch a loss past --max-lost-minutes."""
    now = [0.0]
    lines: list[str] = []
    cadence = SaveCadence(max_lost_minutes=1.0, first_step=0, log=lines.append, clock=lambda: now[0])
    for _ in range(PROBE_STEPS + 1):
        cadence.step_done(0.5)
    cadence.save_stalled(0.01)  # the probe, at t = 0
    cadence.save_written(0.5, replica_every=1)  # peer memory: as rare as the cap allows
    assert cadence.interval.every == 119 and "peer memory" in lines[-1]  # (60 - 0.5) / 0.5
    now[0] = 30.0  # 30 steps later, at 1 s each: far from 119 steps, and 30 s + 0.5 s + 0.5 s < 60 s
    assert not cadence.due(35, 5)
    now[0] = 59.0  # 59 s since the save: its write and one more step reach the minute
    assert cadence.due(64, 5) and not cadence.due(5, 5)


def synthetic_log() -> list[dict]:
    """A run in one driver: attempt 1 starts at t=10 (launched at t=0), trains steps 0..9 (1 s each,
    0.1 s waiting for data) with a 2 s eval before step 0 and a 0.5 s save before step 6; it dies
    after step 9 (t=22.5). Ray notices at t=30, the new group runs the train function at t=33 and
    has restored step 6 at t=36; it trains 6..9 again from t=37 (the first step 1 s after restore),
    then saves the end in 0.5 s and reports at t=41.5."""
    records = [{"kind": "start", "time": 10.0, "step": 0, "session": "s", "launched": 0.0, "restarts": 0}]
    t, ckpt = 12.0, 0.0  # the eval at step 0 takes 10..12
    records.append({"kind": "eval", "time": t, "step": 0, "val_bpb": 3.0})
    for step in range(10):
        if step == 6:
            t, ckpt = t + 0.5, 0.5
        t += 1.0
        records.append({"kind": "step", "time": t, "step": step, "dt": 1.0, "data_wait_s": 0.1,
                        "eval_s_so_far": 2.0, "checkpoint_s_so_far": ckpt})
    records.append({"kind": "start", "time": 36.0, "step": 6, "session": "s", "launched": 0.0, "restarts": 1,
                    "noticed": 30.0, "setup_started": 33.0, "last_progress": t})
    t = 37.0
    for step in range(6, 10):
        t += 1.0
        records.append({"kind": "step", "time": t, "step": step, "dt": 1.0, "data_wait_s": 0.1,
                        "eval_s_so_far": 0.0, "checkpoint_s_so_far": 0.0})
    records.append({"kind": "report", "time": t + 0.5, "step": 10, "eval_s_so_far": 0.0,
                    "checkpoint_s_so_far": 0.5, "train_done": True})
    return records


def test_the_ledger_accounts_every_second_of_a_restarted_run():
    run = ledger(synthetic_log())
    assert run.wall_s == pytest.approx(41.5)
    assert sum(run.seconds.values()) == pytest.approx(run.wall_s)
    first, restart = run.attempts
    assert first.kind == "first" and restart.kind == "restart" and restart.step == 6
    # Attempt 1: start-up until its first step began (t=12 less the 2 s eval), steps 0..5 advanced,
    # 6..9 were redone, one save, one eval.
    assert first.seconds["startup"] == pytest.approx(10.0)
    assert first.seconds["eval"] == 2.0 and first.seconds["checkpoint"] == 0.5
    assert first.seconds["redone"] == pytest.approx(4.0)
    # The restart: noticed 7.5 s after the last step, 3 s to a new group, 3 s of restore, 1 s to its
    # first step; 6..9 advanced this time, then the final save.
    assert restart.seconds["detect"] == pytest.approx(7.5)
    assert restart.seconds["reschedule"] == pytest.approx(3.0)
    assert restart.seconds["restore"] == pytest.approx(3.0)
    assert restart.seconds["first_step"] == pytest.approx(1.0)
    assert restart.seconds["checkpoint"] == 0.5
    totals = run.seconds
    assert totals["training"] == pytest.approx(10 * 0.9) and totals["data_wait"] == pytest.approx(10 * 0.1)
    assert run.goodput == pytest.approx(9.0 / 41.5)
    assert totals["other"] == pytest.approx(0.0, abs=1e-9)
    assert set(totals) == set(CAUSES)


def test_compiling_is_a_cause_of_its_own_in_each_attempt():
    """Each attempt's first step compiles (0.6 s of its 1 s, by the step record's compile_s), the
    restart's too, though its steps are redone: the ledger's compile bucket holds both, training and
    redone lose them, and the causes still add up to the wall time."""
    records = synthetic_log()
    first_steps = [r for r in records if r["kind"] == "step" and r["step"] in (0, 6)]
    for record in first_steps[0], first_steps[2]:  # attempt 1's step 0, the restart's step 6
        record["compile_s"] = 0.6
    run = ledger(records)
    first, restart = run.attempts
    assert first.seconds["compile"] == pytest.approx(0.6) and restart.seconds["compile"] == pytest.approx(0.6)
    assert first.seconds["redone"] == pytest.approx(4.0)  # step 6 of attempt 1 compiled nothing
    assert run.seconds["training"] == pytest.approx(10 * 0.9 - 1.2)
    assert sum(run.seconds.values()) == pytest.approx(run.wall_s)
    assert any("compile 0.6s" in line for line in run.lines()), run.lines()
    # The set-up's compile probe (inductor's start-up, which the first step would pay otherwise) is
    # compile too: 4 s of the first attempt's start-up, 2 s of the restart's 3 s restore.
    starts = [r for r in records if r["kind"] == "start"]
    starts[0]["setup_phases"] = {"compile_probe": 4.0, "build_model": 1.0}
    starts[1]["setup_phases"] = {"compile_probe": 2.0, "build_model": 0.5}
    probed = ledger(records)
    first, restart = probed.attempts
    assert (first.seconds["startup"], first.seconds["compile"]) == (pytest.approx(6.0), pytest.approx(4.6))
    assert restart.seconds["restore"] == pytest.approx(1.0)
    assert restart.seconds["compile"] == pytest.approx(2.6)
    assert sum(probed.seconds.values()) == pytest.approx(probed.wall_s)


def test_the_report_and_status_show_the_ledger(tmp_path):
    records = synthetic_log()
    cfg = TrainConfig(depth=2, aspect_ratio=32, head_dim=32, max_seq_len=64, num_iterations=10,
                      total_batch_size=512, device_batch_size=4)
    plan = resolve_plan(cfg, vocab_size=512, world_size=1).to_json()
    for record in records:
        if record["kind"] == "step":
            record.update(loss=3.0, raw_loss=3.0, lrm=1.0, tokens_per_sec=512.0, mfu=None, total_time_s=1.0,
                          num_iterations=10, world_size=1, tokens_so_far=512, flops_so_far=5e8)
        if record["kind"] == "start":
            record.update(plan=plan, world_size=1, peak_flops_source="none", device="cpu")
    run = Storage(str(tmp_path / "r"))
    run.write_bytes(METRICS_FILE, "".join(json.dumps(r) + "\n" for r in records).encode())
    assert len(parse_records(run.read_text(METRICS_FILE))) == len(records)
    report = build_report(run)
    assert "goodput 21.7%" in report.summary() and "restart at step 6: detect 7.5s" in report.summary()
    bars = report.figures["time.png"].axes[0]
    labels = [t.get_text() for t in bars.get_yticklabels()]
    assert labels[0] == "run: goodput 21.7%" and labels[2] == "2. restart at step 6: 18.9%"
    assert {p.get_label() for p in bars.containers} >= {"training", "redone", "detect", "restore"}
    status = storage_lines(run)
    assert any(line.startswith("  goodput 21.7%") for line in status), status


def test_a_restart_counts_unlogged_steps_as_redone_only_when_the_coordinator_saw_one():
    """The coordinator's progress call follows each step's record: a few ms after the last record
    for the same step is detection, not redone work; a step the log never got is redone."""
    logged = synthetic_log()
    same_step = [dict(r, last_progress=22.503, last_progress_step=9) if r.get("restarts") == 1 else r
                 for r in logged]
    assert ledger(same_step).attempts[1].seconds["redone"] == 0.0  # (6..9 count in the attempt that ran them)
    unlogged = [dict(r, last_progress=23.5, last_progress_step=10) if r.get("restarts") == 1 else r
                for r in logged]
    assert ledger(unlogged).attempts[1].seconds["redone"] == pytest.approx(1.0)  # step 10's second


def test_each_restart_line_shows_the_steps_it_redid_not_those_redone_after_it():
    """The synthetic run dies a second time after step 9 of its second attempt and restarts from step
    8: the first restart redid 6..9 (4 s), the second 8..9 of the second attempt (2 s)."""
    records = [r for r in synthetic_log() if r["kind"] != "report"]
    records.append({"kind": "start", "time": 50.0, "step": 8, "session": "s", "launched": 0.0,
                    "restarts": 2, "noticed": 45.0, "setup_started": 47.0, "last_progress": 41.0})
    records += [{"kind": "step", "time": 51.0 + i, "step": 8 + i, "dt": 1.0, "data_wait_s": 0.0,
                 "eval_s_so_far": 0.0, "checkpoint_s_so_far": 0.0} for i in range(2)]
    lines = ledger(records).lines()
    first_restart = next(line for line in lines if line.startswith("- restart at step 6"))
    second_restart = next(line for line in lines if line.startswith("- restart at step 8"))
    assert "4.0s of steps redone" in first_restart, first_restart
    assert "2.0s of steps redone" in second_restart, second_restart


def test_the_live_goodput_counts_training_as_the_ledger_does(monkeypatch):
    """The gauge and Tune's `goodput` (Publisher.goodput) leave a step's data wait and its compile out
    of the time that advanced training, as the ledger does: 2 s of wall time, one 1 s step of which
    0.6 s compiled and 0.1 s waited for data, is 15% goodput."""
    from raychat.telemetry import metrics
    from raychat.telemetry.metrics import Publisher, StepMetrics

    now = [100.0]
    monkeypatch.setattr(metrics.time, "time", lambda: now[0])
    publisher = Publisher([])
    publisher.start([], step=0, session="s", launched=100.0)
    publisher.step(StepMetrics(step=0, num_iterations=10, loss=3.0, raw_loss=3.0, lrm=1.0, dt=1.0,
                               tokens_per_sec=1.0, mfu=None, epoch=0, pq=0, rg=0, total_time_s=0.0,
                               eta_s=None, data_wait_s=0.1, world_size=1, tokens_so_far=1, flops_so_far=1.0,
                               compile_s=0.6))
    now[0] = 102.0
    assert publisher.goodput() == pytest.approx(0.3 / 2.0)
