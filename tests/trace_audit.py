"""Exactly-once accounting from the trainer's trace ($RAYCHAT_TRACE_DIR): which documents the final
timeline trained, and whether epoch 1 is fully accounted for against the final data cursor."""

import json
from pathlib import Path

from testkit.chaos_audit import expand, owed_documents  # noqa: F401 (expand: for the tests)


def trace_records(path: Path) -> list[dict]:
    """One rank's trace file, whole lines only: a rank may be writing its last line as it is read, or
    have been killed while writing it."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


def _all_records(trace_dir: Path) -> list[dict]:
    return [rec for path in sorted(trace_dir.glob("*.jsonl")) for rec in trace_records(path)]


def read_trace(trace_dir: Path) -> dict[int, list[tuple[int, int, int]]]:
    """step -> doc ids trained at that step (all ranks), keeping for each step the latest attempt
    that ran it: a step redone after a restore supersedes the lost attempt's records."""
    by_step: dict[int, dict[str, list]] = {}
    for rec in _all_records(trace_dir):
        ids = by_step.setdefault(rec["step"], {}).setdefault(rec["attempt"], [])
        ids.extend(tuple(i) for i in rec["ids"])
    return {step: attempts[max(attempts, key=float)] for step, attempts in by_step.items()}


def attempts_by_step(trace_dir: Path) -> dict[int, set[str]]:
    """step -> the attempts (worker-group starts) that trained it; more than one means redone."""
    seen: dict[int, set[str]] = {}
    for rec in _all_records(trace_dir):
        seen.setdefault(rec["step"], set()).add(rec["attempt"])
    return seen


def world_sizes_by_attempt(trace_dir: Path) -> list[int]:
    """The world size of each attempt, in order of the attempts' starts."""
    sizes = {rec["attempt"]: rec["world_size"] for rec in _all_records(trace_dir)}
    return [sizes[a] for a in sorted(sizes, key=float)]


def last_traced_step(trace_dir: Path) -> int:
    """The highest step any rank of any attempt has traced so far (-1: none)."""
    return max((rec["step"] for rec in _all_records(trace_dir)), default=-1)


def latest_by_rank(trace_dir: Path, attempt: str | None = None) -> dict[int, dict]:
    """Each rank's newest record of `attempt` (default: the newest attempt so far): where a running
    group is, read while it runs, or where an ended attempt's ranks stopped."""
    last = [records[-1] for path in trace_dir.glob("*.jsonl") if (records := trace_records(path))]
    attempt = attempt or max((r["attempt"] for r in last), key=float, default=None)
    newest: dict[int, dict] = {}
    for rec in last:
        kept = newest.get(rec["rank"])
        if rec["attempt"] == attempt and (kept is None or rec["step"] > kept["step"]):
            newest[rec["rank"]] = rec
    return newest


def whole_replica_step(latest: dict[int, dict]) -> int | None:
    """The newest step of which every rank's memory-tier holders (its own node's and its peer node's)
    took the replica, from `latest_by_rank`: a set a restore may choose (None: none yet)."""
    sent = [r.get("sent") for r in latest.values()]
    if not sent or None in sent or len(sent) < latest[min(latest)]["world_size"]:
        return None
    return min(sent)


def assert_epoch1_exactly_once(trace_dir: Path, data_dir: Path, cursor: "Cursor") -> int:  # noqa: F821
    """No document trained twice; every epoch-1 document trained once or still in flight in the
    final cursor (a long document can wait in the packer's buffer), none lost. Returns how many
    epoch-1 documents were trained."""
    from raychat.corpus.index import CorpusIndex

    consumed = [doc for ids in read_trace(trace_dir).values() for doc in ids]
    assert len(consumed) == len(set(consumed)), "a document was trained on twice"
    index = CorpusIndex.load(data_dir)
    assert cursor.frontier >= len(index.train), "the run should pass the end of epoch 1"
    owed = owed_documents(index, cursor)
    epoch1 = {(1, unit.index, row) for unit in index.train for row in range(unit.num_rows)}
    trained1 = {d for d in consumed if d[0] == 1}
    owed1 = {d for d in owed if d[0] == 1}
    assert not trained1 & owed1, "a document both trained and still owed"
    assert trained1 | owed1 == epoch1, f"{len(epoch1 - trained1 - owed1)} epoch-1 documents lost"
    return len(trained1)
