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
    """The first attempt's own start (from its workers' setup, less the evaluation before its first
    step and that step's steady share) stands for a restart's cost until one is measured; a restart
    after a failure then costs from the controller noticing it (the detection before is no grow's
    cost) to the new group's first step. Step times come from rank 0's progress calls as
    worker-seconds (each attempt's first step left out), so a restarted attempt judges at once; a
    verdict is said once per attempt."""
    session = uuid.uuid4().hex
    coordinator = start_coordinator(session)
    try:
        ray.get(coordinator.start_attempt.remote(0, 1, 100, time.time()))
        assert ray.get(coordinator.grow_verdict.remote(2)) is None  # nothing measured yet
        time.sleep(0.5)  # the setup, an evaluation of 0.2 s and the first step
        ray.get(coordinator.progress.remote(0, 0.01, 0.2))
        for step in range(1, 6):
            ray.get(coordinator.progress.remote(step, 0.1, 0.2))
        verdict = ray.get(coordinator.grow_verdict.remote(2))
        assert verdict.pays and "94 steps left at 0.10s would save 5s" in verdict.line, verdict.line
        said = [ray.get(coordinator.say_once.remote((1, 2, True))) for _ in range(2)]
        assert said == [True, False]

        time.sleep(3.0)  # the group is lost after step 5: 3 s until the controller notices ...
        ray.get(coordinator.restart_noticed.remote(time.time()))
        ray.get(coordinator.group_running.remote(2))  # the controller started a group of 2: a grow
        grow = ray.get(coordinator.grow_verdict.remote(4))  # is judged from that size from now on
        assert grow.line.startswith("Growing from 2 to 4 workers"), grow.line
        time.sleep(1.0)  # ... then 1 s to a group of 2 workers restored at step 3
        ray.get(coordinator.start_attempt.remote(3, 2, 100, time.time()))
        verdict = ray.get(coordinator.grow_verdict.remote(4))  # the last attempt's steps, at 2 workers
        assert verdict is not None and "at 0.05s" in verdict.line, verdict.line
        ray.get(coordinator.progress.remote(3, 0.05, 0.0))
        for step in range(4, 97):
            ray.get(coordinator.progress.remote(step, 0.1, 0.0))
        assert ray.get(coordinator.say_once.remote((1, 2, True)))  # a new attempt says its verdicts anew
        late = ray.get(coordinator.grow_verdict.remote(4))
        # 3 steps left at 0.1 s save 0.15 s; the restart cost about 1 s, not the 4 s since the last step
        assert not late.pays, late.line
        restart_s = float(late.line.rsplit("restart's ", 1)[1].rstrip("s"))
        assert 1 <= restart_s <= 3, late.line
    finally:
        stop_coordinator(session)


@pytest.mark.ray
def test_a_live_node_counts_for_workers_and_a_gone_one_does_not(ray_session):
    """A restart counts the workers that fit on nodes whose raylet answers (this machine's, on the
    session's Ray); a node the GCS does not list alive (an id it never knew) is gone, and so is an
    address that accepts no connection (a port nothing listens on: a raylet gone with its machine);
    with a node gone, the live nodes outside Ray's view count whole (spares).
    Where every node would be gone the probe is not believed (Ray's count stands). End to end in
    test_elastic: a lost node's restart, before the GCS declares the node dead, starts one group."""
    import socket

    from ray.train import ScalingConfig

    from raychat.elastic.controller import GrowWhenItPays, gone_nodes, silent_raylets, spare_nodes

    here, unknown = ray.get_runtime_context().get_node_id(), "f" * 56
    (node,) = [n for n in ray.nodes() if n["NodeID"] == here]
    node_resources = node["Resources"]
    assert gone_nodes([here]) == set()
    assert gone_nodes([here, unknown]) == {unknown}
    assert gone_nodes([unknown]) == set()  # all of them: a probe that cannot see the cluster
    policy = GrowWhenItPays(ScalingConfig(num_workers=(1, 4), resources_per_worker={"CPU": 1}), "session")
    reserved = {here: {"CPU": 2.0}, unknown: {"CPU": 1.0}}
    assert policy._count_possible_workers(reserved) == 3  # a running group's count: Ray's
    policy._restarting = True  # the count for a group to start: the node gone is left out, and the
    assert policy._count_possible_workers(reserved) == 2  # live nodes outside the view (none) put in
    assert spare_nodes({}) == {here: node_resources} and spare_nodes(reserved) == {}
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    raylets = {"live": (node["NodeManagerAddress"], node["NodeManagerPort"]), "gone": ("127.0.0.1", port)}
    assert silent_raylets(raylets) == {"gone"}


@pytest.mark.ray
def test_a_wait_in_one_state_is_one_event_to_the_coordinator(ray_session):
    """While it waits (for resources, for a group to start) the controller re-enters its state at
    every turn of its loop: the run's coordinator hears of one restart, noticed when it began, and of
    one failed group start, not of every turn; and a resize the controller begins as soon as the new
    group runs (before its rank 0 starts the attempt) is the next attempt's, not this one's."""
    from ray.train import ControllerError

    from raychat.elastic.controller import NoteRestart, PlannedResizeSave
    from raychat.ray_glue.ray_internals import (
        ReschedulingState,
        ResizeDecision,
        ResizingState,
        RestartingState,
        RunningState,
        SchedulingState,
    )

    session = uuid.uuid4().hex
    coordinator = start_coordinator(session)
    try:
        ray.get(coordinator.start_attempt.remote(0, 2, 100, time.time()))
        note, error = NoteRestart(session), ControllerError(RuntimeError("a node died"))
        began = time.time()
        note.after_controller_state_update(RunningState(), RestartingState(error))
        for _turn in range(50):  # the restart waits for resources, one turn at a time
            note.after_controller_state_update(RestartingState(error), RestartingState(error))
        note.after_controller_state_update(RestartingState(error), ReschedulingState(error))
        for _turn in range(50):  # the group of the old size never starts; the controller waits again
            note.after_controller_state_update(ReschedulingState(error), ReschedulingState(error))
        # A group of 1 starts; the node back, the controller decides a grow before that group's rank 0
        # has started its attempt: the attempt is still the restart's, and the grow's notice the next's.
        scheduled = SchedulingState(ResizeDecision(num_workers=1, resources_per_worker={"CPU": 1}))
        for callback in (PlannedResizeSave(session), note):
            callback.after_controller_state_update(scheduled, RunningState())
        time.sleep(0.6)
        grow_noticed = time.time()
        note.after_controller_state_update(RunningState(), ResizingState(
            ResizeDecision(num_workers=2, resources_per_worker={"CPU": 1})))
        previous = ray.get(coordinator.start_attempt.remote(5, 1, 100, time.time()))
        assert previous.failed_starts == 1
        assert began <= previous.noticed < began + 0.5, (began, previous.noticed)
        PlannedResizeSave(session).after_controller_state_update(
            SchedulingState(ResizeDecision(num_workers=2, resources_per_worker={"CPU": 1})), RunningState())
        previous = ray.get(coordinator.start_attempt.remote(6, 2, 100, time.time()))
        assert previous.failed_starts == 0 and grow_noticed <= previous.noticed < grow_noticed + 0.5
    finally:
        stop_coordinator(session)


@pytest.mark.unit
def test_a_running_group_is_never_shrunk():
    """Ray's own decision for a running group (here a policy that always decides `ray_says`) stands
    when it keeps the size; a shrink is refused (Ray's view of the cluster lags a restart, and a
    running group's workers are alive). A grow goes to the run's coordinator: test_elastic."""
    from types import SimpleNamespace

    from ray.train import ScalingConfig

    from raychat.elastic.controller import GrowWhenItPays
    from raychat.ray_glue.ray_internals import ElasticScalingPolicy, NoopDecision, ResizeDecision

    class RaySays(ElasticScalingPolicy):
        ray_says: object = None

        def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
            return self.ray_says

    class Policy(GrowWhenItPays, RaySays):  # GrowWhenItPays's super() is RaySays
        pass

    policy = Policy(ScalingConfig(num_workers=(1, 4), resources_per_worker={"CPU": 1}), "no-such-run")
    running = SimpleNamespace(num_workers=2)
    for workers, kept in ((2, True), (1, False)):
        policy.ray_says = ResizeDecision(num_workers=workers, resources_per_worker={"CPU": 1})
        decided = policy.make_decision_for_running_worker_group(running, None)
        assert (decided is policy.ray_says) == kept and (kept or isinstance(decided, NoopDecision)), workers
