"""The trace readers the resume tests decide and judge by (tests/trace_audit.py), read while a group
writes: a half-written line, a rank not traced yet, an ended attempt of another world size."""

import json

import pytest
from trace_audit import attempts_by_step, last_traced_step, latest_by_rank, whole_replica_step

pytestmark = pytest.mark.unit


def _trace(path, records, partial=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + partial)


def _rec(attempt, rank, step, sent, world_size):
    return {"attempt": attempt, "rank": rank, "step": step, "sent": sent, "world_size": world_size,
            "pid": 100 + rank, "ids": [], "replica": None}


def test_the_newest_whole_set_is_the_least_any_rank_of_the_running_attempt_sent(tmp_path):
    # An ended attempt of 3 ranks, then a running one of 2 whose rank 1 is writing a line.
    for rank in range(3):
        records = [_rec("10.0", rank, s, s - 1, 3) for s in range(5)]
        _trace(tmp_path / f"10.0_rank{rank}_{rank}.jsonl", records)
    steps = (6, 7, 8, 9)
    _trace(tmp_path / "20.0_rank0_7.jsonl", [_rec("20.0", 0, s, 6 if s > 7 else None, 2) for s in steps])
    _trace(tmp_path / "20.0_rank1_8.jsonl", [_rec("20.0", 1, s, 8 if s > 8 else None, 2) for s in steps],
           partial='{"attempt": "20.0", "rank": 1, "st')
    latest = latest_by_rank(tmp_path)
    assert {rank: r["step"] for rank, r in latest.items()} == {0: 9, 1: 9}
    assert whole_replica_step(latest) == 6
    assert whole_replica_step(latest_by_rank(tmp_path, "10.0")) == 3
    assert last_traced_step(tmp_path) == 9
    assert sorted(attempts_by_step(tmp_path)[4]) == ["10.0"]


def test_no_set_is_whole_before_every_rank_sent_one(tmp_path):
    _trace(tmp_path / "1.0_rank0_1.jsonl", [_rec("1.0", 0, 3, 2, 2)])
    assert whole_replica_step(latest_by_rank(tmp_path)) is None  # rank 1 has traced nothing yet
    _trace(tmp_path / "1.0_rank1_2.jsonl", [_rec("1.0", 1, 3, None, 2)])
    assert whole_replica_step(latest_by_rank(tmp_path)) is None  # its holders took nothing yet
    assert whole_replica_step({}) is None
