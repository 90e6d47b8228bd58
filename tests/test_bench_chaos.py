"""bench.chaos's timing of a node swap: it lands only while peer memory covers the run's state, so
the restart it provokes tests the memory tier, never a restore the durable checkpoint rightly wins."""

import json

from bench.chaos import ChaosRun, Context, RunSpec


def swap_run(tmp_path) -> ChaosRun:
    ctx = Context(cluster=None, nodes=[], data=tmp_path, tok=tmp_path, storage=tmp_path / "runs",
                  out=tmp_path / "out", deadline=0.0, temp_dir=str(tmp_path))
    return ChaosRun(RunSpec("steady", ("node_swap",), 1, 150), ctx)


def trace(run: ChaosRun, attempt: float, step: int, replicas: list[int | None]) -> None:
    """Each rank's trace line for `step` of `attempt`, with the newest step its holders took."""
    for rank, held in enumerate(replicas):
        with (run.trace / f"{attempt}_rank{rank}_{100 + rank}.jsonl").open("a") as f:
            f.write(json.dumps({"attempt": attempt, "step": step, "rank": rank, "world_size": len(replicas),
                                "pid": 100 + rank, "ids": [], "replica": held}) + "\n")


def test_a_node_swap_waits_until_every_rank_is_held_at_or_past_the_newest_checkpoint(tmp_path):
    run = swap_run(tmp_path)
    run.watch.newest = 90  # the newest whole checkpoint
    trace(run, 1.0, 85, [84, 84])
    assert not run.memory_covers()  # held before the checkpoint: a restart would read storage
    # A restart at 90 (a killed worker, CI's stop 41): its first steps, no replica of its own yet.
    trace(run, 2.0, 90, [None, None])
    assert not run.memory_covers()
    trace(run, 2.0, 92, [92, None])
    assert not run.memory_covers()  # rank 1's copy still on its way
    trace(run, 2.0, 93, [92, 92])
    assert run.memory_covers()
    # A few steps before a save: the checkpoint could land as the node goes, and win.
    trace(run, 2.0, 97, [97, 97])
    assert not run.memory_covers()
    # A save at step 100 under way (the loop is at step 100), not whole yet: newer than the replicas.
    trace(run, 2.0, 99, [98, 98])
    assert not run.memory_covers()
    trace(run, 2.0, 101, [100, 100])
    assert run.memory_covers()
