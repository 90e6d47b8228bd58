"""bench.goodput reads two things written elsewhere: the cadence line the trainer logs and the health
checks the shipped cluster config starts Ray with. Both are checked against their writers here, so a
changed log line or config cannot leave the bench measuring nothing."""

from pathlib import Path

from bench.goodput import loss_bound, shipped_health_checks
from raychat.run.cadence import choose_interval

REPO = Path(__file__).resolve().parents[1]


def test_the_loss_bound_is_read_from_the_cadence_line_the_trainer_logs():
    # 400 ms steps, a 10 ms stall, written in 1.0 s: every 3 steps (stall 10/(0.01*400) = 2.5 -> 3,
    # write 1.0/(0.5*0.4) = 5 -> 5): every 5 steps; a loss redoes <= 5 + ceil(1.0/0.4) + 1 = 9 steps.
    interval = choose_interval(step_s=0.4, stall_s=0.010, write_s=1.0, max_lost_s=60)
    assert interval.every == 5
    log = f"step 00004/...\nCheckpoint cadence: {interval.describe()}\nstep 00005/...\n"
    assert loss_bound(log) == 9
    changed = choose_interval(step_s=0.4, stall_s=0.010, write_s=0.2, max_lost_s=60)  # every 3: by stall
    log += f"Checkpoint cadence changed from every 5 steps: {changed.describe()}\n"
    assert loss_bound(log) == 3 + 1 + 1
    assert loss_bound("no cadence line yet") is None


def test_the_bench_runs_with_the_health_checks_the_shipped_head_starts_with():
    assert shipped_health_checks(REPO / "cluster" / "h100.yaml") == {
        "health_check_period_ms": 1000, "health_check_failure_threshold": 3}
