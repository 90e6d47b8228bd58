"""bench.chaos's timing of a node swap: it lands only while peer memory covers the run's state, so
the restart it provokes tests the memory tier, never a restore the durable checkpoint rightly wins.
The decision is testkit.chaos_audit.replicas_cover, which bench.chaos asks with its run's trace, its
newest whole checkpoint and its --save-every (10)."""

import json
from pathlib import Path

import pytest

from testkit.chaos_audit import progress, replicas_cover

pytestmark = pytest.mark.unit

SAVE_EVERY = 10  # bench.chaos's --save-every


def trace(trace_dir: Path, attempt: float, step: int, replicas: list[int | None]) -> None:
    """Each rank's trace line for `step` of `attempt`, with the newest step its holders took."""
    for rank, held in enumerate(replicas):
        with (trace_dir / f"{attempt}_rank{rank}_{100 + rank}.jsonl").open("a") as f:
            f.write(json.dumps({"attempt": attempt, "step": step, "rank": rank, "world_size": len(replicas),
                                "pid": 100 + rank, "ids": [], "replica": held}) + "\n")


def test_a_node_swap_waits_until_every_rank_is_held_at_or_past_the_newest_checkpoint(tmp_path):
    newest = 90  # the newest whole checkpoint

    def covers() -> bool:
        return replicas_cover(progress(tmp_path), newest, SAVE_EVERY)

    trace(tmp_path, 1.0, 85, [84, 84])
    assert not covers()  # held before the checkpoint: a restart would read storage
    # A restart at 90 (a killed worker, CI's stop 41): its first steps, no replica of its own yet.
    trace(tmp_path, 2.0, 90, [None, None])
    assert not covers()
    trace(tmp_path, 2.0, 92, [92, None])
    assert not covers()  # rank 1's copy still on its way
    trace(tmp_path, 2.0, 93, [92, 92])
    assert covers()
    # A few steps before a save: the checkpoint could land as the node goes, and win.
    trace(tmp_path, 2.0, 97, [97, 97])
    assert not covers()
    # A save at step 100 under way (the loop is at step 100), not whole yet: newer than the replicas.
    trace(tmp_path, 2.0, 99, [98, 98])
    assert not covers()
    trace(tmp_path, 2.0, 101, [100, 100])
    assert covers()
