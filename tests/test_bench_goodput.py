"""bench.goodput reads two things written elsewhere: the cadence line the trainer logs and the health
checks the shipped cluster config starts Ray with. Both are checked against their writers here, so a
changed log line or config cannot leave the bench measuring nothing. The readers are
testkit.goodput_bounds, which bench.goodput imports."""

from pathlib import Path

import pytest

from raychat.elastic.cadence import choose_interval
from raychat.elastic.replicas import Replicator
from testkit.goodput_bounds import (
    cadences,
    fault_bounds,
    loss_bound,
    replica_bound,
    shipped_health_checks,
    steady_goodput,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def test_the_loss_bound_is_read_from_the_cadence_line_the_trainer_logs():
    # 400 ms steps, a 10 ms stall, written in 5.0 s: the stall needs 3 steps (10/(0.01*400) = 2.5), the
    # least loss sqrt(2 x 0.01 x 600) = 3.5 s 9 steps, the write 5.0/(0.5*0.4) = 25: every 25 steps;
    # a loss redoes <= 25 + ceil(5.0/0.4) + 1 = 39 steps.
    interval = choose_interval(step_s=0.4, stall_s=0.010, write_s=5.0, max_lost_s=60)
    assert interval.every == 25
    log = f"step 00004/...\nCheckpoint cadence: {interval.describe()}\nstep 00005/...\n"
    assert loss_bound(log) == 39
    changed = choose_interval(step_s=0.4, stall_s=0.010, write_s=0.2, max_lost_s=60)  # every 9: least loss
    log += f"Checkpoint cadence changed from every 25 steps: {changed.describe()}\n"
    assert loss_bound(log) == 9 + 1 + 1
    # with peer memory, as rare as the cap allows: floor((60 - 0.2) / 0.4) = 149
    rare = choose_interval(step_s=0.4, stall_s=0.010, write_s=0.2, max_lost_s=60, replica_every=9)
    log += f"Checkpoint cadence changed from every 9 steps: {rare.describe()}\n"
    assert loss_bound(log) == 149 + 1 + 1
    assert loss_bound("no cadence line yet") is None


def test_the_cadences_are_read_from_the_lines_the_trainer_logs():
    lines: list[str] = []
    replicator = Replicator(None, None, epoch=1, attempt=0, log=lines.append, warn=lines.append, every=0,
                            sends_compete=True)
    try:
        replicator.replicated.append(2)
        replicator.send_cpu_s = 0.02
        replicator.writer.snapshot_seconds = 0.01
        # 0.5 s steps, 30 ms of copy and send: sqrt(2 x 0.03 x 600) = 6 s, 12 steps
        replicator.auto_due(3, 0, step_s=0.5)
    finally:
        replicator.close()
    saves = choose_interval(step_s=0.5, stall_s=0.01, write_s=0.2, max_lost_s=60, replica_every=5)
    log = f"Checkpoint cadence: {saves.describe()}\n" + "\n".join(lines)
    assert cadences(log) == ("storage saves every 119 steps, "
                             "memory replicas every 12 step(s) (copy 0.2% of training)")
    assert cadences("") == "no storage cadence logged"
    # A loss restored from peer memory redoes at most two replica intervals (the newest replica may be
    # in flight as the node goes) and the step in flight; one restored from storage, the cadence's bound.
    assert replica_bound(log) == 2 * 12 + 1 and replica_bound("") is None
    run = {"faults": [{"note": "continued on 2 from step 90 (peer memory), 0 bytes read from storage"},
                      {"note": "continued on 2 from step 80 (checkpoint_000080), 2 MB read from storage"}],
           "bounds": [151, 151], "replica_bounds": [25, 25]}
    assert fault_bounds(run) == [("replica", 25), ("cadence", 151)]


def test_steady_goodput_leaves_out_the_first_start_up_and_the_final_evaluation():
    # 20 s start-up, 900 s training, a 10 s final evaluation, 10 s saves, 10 s else: 900 / (950 - 30)
    seconds = {"startup": 20.0, "training": 900.0, "eval": 10.0, "checkpoint": 10.0, "other": 10.0}
    assert steady_goodput(seconds, 950.0) == 900.0 / 920.0
    assert steady_goodput({"startup": 5.0}, 5.0) is None


def test_the_bench_runs_with_the_health_checks_the_shipped_head_starts_with():
    assert shipped_health_checks(REPO / "cluster" / "h100.yaml") == {
        "health_check_period_ms": 1000, "health_check_failure_threshold": 3}
