"""What a chaos run left behind, counted rather than asserted (bench.chaos prints the numbers).

The trainer's trace ($RAYCHAT_TRACE_DIR, one `<attempt>_rank<r>_<pid>.jsonl` per worker process and
attempt: the documents each rank trained at each step) tells where the run is while faults land and,
at the end, which documents the final timeline trained: for each step the latest attempt that ran
it (a step redone after a restore supersedes the lost attempt's). The run's checkpoints are watched
while it runs: the newest whole one must never go back (a checkpoint a restart would need was pruned
or rewritten), and at the end the kept ones must be the newest ones saved (and the one the last
attempt resumed from, which its saver never prunes).

In testkit because the benches (bench.chaos, bench.goodput, bench.chaos_report) and the tests
(tests/trace_audit.py's exactly-once audit, tests/test_bench_chaos.py) read a run's trace and
checkpoints with the same code; raychat itself never imports it.
"""

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from raychat.checkpoint.catalog import latest_valid_checkpoint, list_checkpoints, step_of
from raychat.checkpoint.format import damage, read_meta
from raychat.checkpoint.reader import load_checkpoint
from raychat.storage import Storage


@dataclass
class Progress:
    """The latest attempt (a worker-group start) that traced a step, and how far it got."""

    attempt: float = -1.0  # the attempt's start time (time.time() on rank 0), -1 before any step
    world_size: int = 0
    step: int = -1
    pids: dict[int, int] = field(default_factory=dict)  # rank -> worker process id
    replicas: dict[int, int | None] = field(default_factory=dict)  # rank -> newest step held in peer memory


def _last_line(path: Path) -> dict | None:
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 65536))
        lines = [line for line in f.read().splitlines() if line.endswith(b"}")]
    return json.loads(lines[-1]) if lines else None


def progress(trace_dir: Path) -> Progress:
    """Where the run is now, from the last line of each trace file (cheap: polled twice a second)."""
    now = Progress()
    for path in trace_dir.glob("*.jsonl"):
        attempt, rank, pid = path.stem.split("_")
        if float(attempt) < now.attempt:
            continue
        last = _last_line(path)
        if last is None:
            continue
        if float(attempt) > now.attempt:
            now = Progress(float(attempt), last["world_size"])
        now.step = max(now.step, last["step"])
        now.pids[int(rank.removeprefix("rank"))] = int(pid)
        now.replicas[int(rank.removeprefix("rank"))] = last.get("replica")
    return now



def replicas_cover(now: Progress, newest: int, save_every: int | None) -> bool:
    """Whether peer memory holds every rank's state at or past the newest checkpoint saved (whole,
    or submitted at a step of --save-every's), with none due in the next three steps. Else a restart
    rightly restores the checkpoint: right after a restart (the attempt's first replica comes a few
    steps in) or a save that lands as the node goes, which is not what a node swap is there to
    test. `now`: `progress` of the run's trace; `newest`: its newest whole checkpoint's step (-1:
    none); `save_every`: the run's --save-every (None, the auto cadence: only the whole checkpoints
    are known)."""
    held = [now.replicas.get(rank) for rank in range(now.world_size)]
    if any(step is None for step in held):
        return False
    if save_every:  # the loop is at step now.step + 1, where a save may be under way
        newest = max(newest, save_every * ((now.step + 1) // save_every))
        # the next three steps: the node takes ~1 s to go
        if any((now.step + ahead) % save_every == 0 for ahead in (2, 3, 4)):
            return False
    return min(held) >= newest

def read_records(trace_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(trace_dir.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.endswith("}")]


def attempt_spans(records: list[dict]) -> list[tuple[float, int, int, int]]:
    """(start time, world size, first step, last step) of each attempt, in order."""
    spans: dict[float, list[int]] = {}
    for rec in records:
        span = spans.setdefault(float(rec["attempt"]), [rec["world_size"], rec["step"], rec["step"]])
        span[1], span[2] = min(span[1], rec["step"]), max(span[2], rec["step"])
    return [(start, *spans[start]) for start in sorted(spans)]


def redone_by_attempt(records: list[dict]) -> list[tuple[float, int]]:
    """(start time, steps it trained again that the attempt before it had trained) of each restart."""
    spans = attempt_spans(records)
    return [(start, max(0, prev_last + 1 - first))
            for (_, _, _, prev_last), (start, _, first, _) in zip(spans, spans[1:], strict=False)]


def expand(runs: Iterable[Sequence[int]]) -> list[tuple[int, int, int]]:
    """The document ids of a cursor's runs [epoch, unit, first row, end row) (raychat.data.cursor)."""
    return [(epoch, unit, row) for epoch, unit, start, stop in runs for row in range(start, stop)]


def owed_documents(index: "CorpusIndex", cursor: "Cursor") -> set[tuple[int, int, int]]:  # noqa: F821
    """(epoch, unit, row) of every document a final cursor still owes: those in flight (a long
    document can wait in the packer's buffer) and those of units not started yet."""
    from raychat.data.cursor import UnitSchedule

    unit_at = UnitSchedule(index, None)
    owed = set(expand(cursor.in_flight))
    for position in cursor.unstarted:
        epoch, unit, num_rows = unit_at(position)
        owed |= {(epoch, unit, row) for row in range(num_rows)}
    return owed


def document_counts(records: list[dict], data_dir: Path, cursor: "Cursor") -> dict:  # noqa: F821
    """Documents of the final timeline: how many trained, repeated (the same document twice in one
    epoch), and epoch-1 documents lost (neither trained nor still owed by the final cursor: a long
    document can wait in the packer's buffer)."""
    from raychat.corpus.index import CorpusIndex

    latest: dict[int, float] = {}
    for rec in records:
        latest[rec["step"]] = max(latest.get(rec["step"], -1.0), float(rec["attempt"]))
    consumed = [tuple(i) for rec in records if float(rec["attempt"]) == latest[rec["step"]]
                for i in rec["ids"]]
    index = CorpusIndex.load(data_dir)
    owed = owed_documents(index, cursor)
    epoch1 = {(1, unit.index, row) for unit in index.train for row in range(unit.num_rows)}
    trained1 = {d for d in consumed if d[0] == 1}
    return {"steps": sorted(latest), "documents": len(consumed),
            "repeated": len(consumed) - len(set(consumed)),
            "epoch1_passed": cursor.frontier >= len(index.train),
            "epoch1_lost": len(epoch1 - trained1 - owed), "trained_and_owed": len(trained1 & owed)}


class CheckpointWatch:
    """Polled while a run trains: every whole checkpoint seen, and each time the newest whole one
    went back (a checkpoint the run could resume from was deleted or rewritten in place)."""

    def __init__(self, run_dir: Storage, keep: int):
        self.run_dir, self.keep = run_dir, keep
        self.seen: set[int] = set()
        self.newest = -1
        self.went_back: list[str] = []

    def whole_steps(self) -> set[int]:
        return {step_of(c.name) for c in list_checkpoints(self.run_dir)
                if damage(c, deep=False) is None}

    def poll(self) -> None:
        try:
            whole = self.whole_steps()
        except (OSError, ValueError):
            return  # a checkpoint deleted or written while listed: the next poll sees it settled
        self.seen |= whole
        newest = max(whole, default=-1)
        if newest < self.newest:
            self.went_back.append(f"newest whole checkpoint went from step {self.newest} to {newest}")
        self.newest = max(self.newest, newest)

    def final_problems(self, horizon: int, resumed_at: int | None) -> tuple[list[str], Storage | None]:
        """What is wrong with the checkpoints at the end (empty: nothing), and the final one.
        `resumed_at`: the step the last attempt started from. Its saver never prunes the checkpoint
        it resumed from: the one at that step, or, resumed from peer memory, the newest durable
        one then, from which the lineage goes on (raychat.worker.setup)."""
        self.poll()
        problems = list(self.went_back)
        final = latest_valid_checkpoint(self.run_dir, deep=True, log=lambda m: problems.append(m))
        if final is None or read_meta(final).step != horizon:
            problems.append(f"the final checkpoint is {final}, not a whole one at step {horizon}")
        problems += lineage_problems(self.run_dir)
        whole = sorted(self.whole_steps())
        expected = set(sorted(self.seen)[-self.keep:])
        resumed_from = max((step for step in self.seen if resumed_at is not None and step <= resumed_at),
                           default=None)
        if resumed_from is not None:
            expected.add(resumed_from)
        if whole != sorted(expected):
            problems.append(f"checkpoints kept at steps {whole}, expected the newest {self.keep} saved "
                            f"and the one the last attempt resumed from: {sorted(expected)}")
        return problems, final


def lineage_problems(run_dir: Storage) -> list[str]:
    """The kept checkpoints must form one lineage: distinct sequence numbers, each checkpoint's
    parent an earlier step, the newest by sequence the latest."""
    metas = [(c.name, read_meta(c)) for c in list_checkpoints(run_dir) if damage(c, deep=False) is None]
    problems = []
    sequences = [m.sequence for _, m in metas]
    if len(set(sequences)) != len(sequences) or sequences != sorted(sequences):
        problems.append(f"checkpoint sequences out of order: {[(n, m.sequence) for n, m in metas]}")
    for name, meta in metas:
        if meta.parent is not None and step_of(meta.parent) >= meta.step:
            problems.append(f"{name} names {meta.parent} as its parent, not an earlier step")
    return problems


def weights_equal(a: Storage, b: Storage) -> tuple[bool, float]:
    """Whether two checkpoints hold bit-identical weights, and the largest absolute difference."""
    model_a, _, _ = load_checkpoint(a, load_optimizer=False)
    model_b, _, _ = load_checkpoint(b, load_optimizer=False)
    if model_a.keys() != model_b.keys():
        return False, float("inf")
    diff = max(float((model_a[k].double() - model_b[k].double()).abs().max()) for k in model_a)
    return all(model_a[k].equal(model_b[k]) for k in model_a), diff
