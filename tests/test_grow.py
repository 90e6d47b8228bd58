"""A grow only when it pays: the verdict's arithmetic, and the run's real coordinator actor measuring
what a restart costs and what a step takes, then judging grows early and late in a run."""

import time
import uuid

import pytest
import ray

from raychat.elastic.coordinator import grow_verdict, start_coordinator, stop_coordinator


@pytest.mark.unit
def test_a_grow_pays_when_the_steps_left_save_more_than_a_restart_costs():
    # 1 -> 2 workers halves the time of each step left: 100 steps of 2 s save 100 s.
    early = grow_verdict(world_size=1, to_workers=2, steps_left=100, step_s=2.0, restart_s=60.0)
    assert early.pays
    assert early.line == ("Growing from 1 to 2 workers: 100 steps left at 2.00s would save 100s against a "
                          "restart's 60s")
    # 2 -> 3 saves a third: 30 steps of 2 s save 20 s, less than the restart's 60 s.
    late = grow_verdict(world_size=2, to_workers=3, steps_left=30, step_s=2.0, restart_s=60.0)
    assert not late.pays and late.line.startswith("Not growing from 2 to 3 workers: 30 steps left")
    assert not grow_verdict(world_size=2, to_workers=4, steps_left=0, step_s=2.0, restart_s=0.0).pays


@pytest.mark.ray
def test_the_coordinator_measures_a_restart_and_judges_grows_by_the_steps_left(ray_session):
    """The first attempt's start-up stands for a restart's cost until one is measured; after a
    restart, its cost (from the old group's last step to the new group's first, less that step) does.
    Step times come from rank 0's progress calls, the first step of each attempt (compile, warm-up)
    left out; a verdict for the same sizes is said once per attempt."""
    session = uuid.uuid4().hex
    coordinator = start_coordinator(session)
    try:
        ray.get(coordinator.start_attempt.remote(0, 1, 100))
        assert ray.get(coordinator.grow_verdict.remote(2)) is None  # nothing measured yet
        time.sleep(0.3)  # the start-up: at least 0.3 s before the first step's end
        ray.get(coordinator.progress.remote(0, 0.01))
        for step in range(1, 6):
            ray.get(coordinator.progress.remote(step, 0.1))
        verdict = ray.get(coordinator.grow_verdict.remote(2))
        assert verdict.pays and "94 steps left at 0.10s would save 5s" in verdict.line, verdict.line
        said = [ray.get(coordinator.say_once.remote((1, 2))) for _ in range(2)]
        assert said == [True, False]

        time.sleep(1.2)  # the group is lost after step 5 and restarts at 2 workers from step 3
        ray.get(coordinator.start_attempt.remote(3, 2, 100))
        assert ray.get(coordinator.grow_verdict.remote(4)) is None  # no step of this attempt yet
        ray.get(coordinator.progress.remote(3, 0.05))
        for step in range(4, 97):
            ray.get(coordinator.progress.remote(step, 0.1))
        assert ray.get(coordinator.say_once.remote((1, 2)))  # a new attempt says its verdicts anew
        late = ray.get(coordinator.grow_verdict.remote(4))
        # 3 steps left at 0.1 s save 0.15 s; the restart cost at least 1.2 - 0.05 s
        assert not late.pays, late.line
        restart_s = float(late.line.rsplit("restart's ", 1)[1].rstrip("s"))
        assert restart_s >= 1
    finally:
        stop_coordinator(session)
