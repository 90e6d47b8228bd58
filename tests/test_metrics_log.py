"""The run's metrics log across restarts, on local disk and in a real S3 API (moto): what each
attempt wrote, and the final timeline a reader gets from it."""

import json

import pytest

from raychat.checkpoint.fence import Fence, LeaseRecord, create_record
from raychat.run import metrics_log
from raychat.run.metrics import Publisher
from raychat.run.metrics_log import METRICS_FILE, MetricsLog, final_timeline, parse_records, read_timeline
from raychat.storage import Storage


def attempt(run: Storage, start: int, stop: int, evals: list[int], tag: str) -> MetricsLog:
    """One attempt of rank 0: its start record, steps start..stop-1 and evals before the given steps."""
    log = MetricsLog(run)
    log.write("start", step=start, world_size=2, tag=tag)
    for step in range(start, stop):
        if step in evals:
            log.write("eval", step=step, val_bpb=3.0 - step / 100, tag=tag)
        log.write("step", step=step, loss=4.0 - step / 100, tag=tag)
    log.flush()
    return log


def test_restarted_attempts_leave_the_final_timeline(storage):
    run = Storage(storage).child("r")
    assert read_timeline(run) is None  # no log yet: the report says so
    attempt(run, 0, 10, [0, 5], "first")  # checkpoint at 6, killed after step 9
    if run.appends_in_place:  # killed in the middle of a write: a torn last line
        with open(run.path(METRICS_FILE), "a") as f:
            f.write('{"kind": "step", "step": 10, "lo')
    attempt(run, 6, 12, [10], "second")  # resumed from step 6, killed after 11
    attempt(run, 12, 14, [], "third")
    timeline = read_timeline(run)
    assert [(r["step"], r["tag"]) for r in timeline.steps] == (
        [(s, "first") for s in range(6)] + [(s, "second") for s in range(6, 12)]
        + [(12, "third"), (13, "third")])
    assert [(e["step"], e["tag"]) for e in timeline.evals] == [(0, "first"), (5, "first"), (10, "second")]
    assert [s["tag"] for s in timeline.starts] == ["first", "second", "third"]
    if run.appends_in_place:  # the torn line was closed off: the next attempt's records are whole
        lines = run.read_text(METRICS_FILE).splitlines()
        assert sum(1 for line in lines if line.startswith('{"kind": "step", "step": 10, "lo')) == 1
        assert json.loads(lines[-1])["tag"] == "third"


def test_a_rerun_that_goes_back_drops_what_came_after(tmp_path):
    """--resume-from-step 4 after a run that reached 10: steps and evals after 4 are the rerun's."""
    run = Storage(str(tmp_path / "r"))
    attempt(run, 0, 10, [0, 4, 8], "first")
    attempt(run, 4, 6, [4], "rerun")
    timeline = read_timeline(run)
    assert [(r["step"], r["tag"]) for r in timeline.steps][-3:] == [(3, "first"), (4, "rerun"), (5, "rerun")]
    assert [(e["step"], e["tag"]) for e in timeline.evals] == [(0, "first"), (4, "rerun")]


def test_non_finite_numbers_are_written_as_null(tmp_path):
    run = Storage(str(tmp_path / "r"))
    log = MetricsLog(run)
    log.write("report", step=0, min_val_bpb=float("inf"))
    log.flush()
    assert read_timeline(run).last_report["min_val_bpb"] is None


@pytest.mark.parametrize("storage", ["local", "s3"], indirect=True)
def test_steps_are_batched_and_a_superseded_writer_appends_nothing(storage, monkeypatch):
    """Step records wait for the next flush (LOCAL_FLUSH_S on local disk, REMOTE_FLUSH_S in a bucket,
    or any other record); every flush lists the run's lease first, so once another driver took the
    run (a newer epoch) nothing more reaches the file."""
    run = Storage(storage).child("r")
    create_record(run, LeaseRecord(epoch=1, holder="a", host="h", pid=1, started="then", floor=0))
    log = MetricsLog(run, Fence(run, 1))

    def kinds() -> list[str]:
        return [r["kind"] for r in map(json.loads, run.read_text(METRICS_FILE).splitlines())]

    log.write("step", step=0, loss=4.0)
    assert not run.exists(METRICS_FILE)
    log.write("eval", step=1, val_bpb=3.0)
    assert kinds() == ["step", "eval"]
    monkeypatch.setattr(metrics_log, "LOCAL_FLUSH_S", 0.0)
    monkeypatch.setattr(metrics_log, "REMOTE_FLUSH_S", 0.0)
    log.write("step", step=1, loss=3.9)  # its interval is over: written at once
    assert kinds() == ["step", "eval", "step"]

    create_record(run, LeaseRecord(epoch=2, holder="b", host="h", pid=2, started="now", floor=0))
    log.write("step", step=2, loss=3.8)
    log.write("eval", step=3, val_bpb=2.9)
    log.flush()
    assert kinds() == ["step", "eval", "step"]


FULL_DISK_WRITER = """
import os, resource, signal, sys
from raychat.run.metrics_log import METRICS_FILE, MetricsLog
from raychat.storage import Storage

run = Storage(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG), as on a full disk
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)


def disk_full_after(extra: int) -> None:
    path = run.path(METRICS_FILE)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + extra, hard))


log = MetricsLog(run)
disk_full_after(0)
log.write("start", step=0, world_size=1)  # written at once: fails, kept
for step in range(3):
    log.write("step", step=step, dt=1.0, loss=4.0)
disk_full_after(120)
log.flush()  # cut short: the start record whole, the first step's cut
disk_full_after(40)
log.flush()  # cut short inside the start record
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
log.write("eval", step=3, val_bpb=3.0)  # written at once, with all it held
"""


def test_an_append_cut_short_adds_nothing_and_loses_nothing(tmp_path):
    """Writes to local disk that fail halfway (the disk fills; here the process's file-size limit) are
    cut off again: no torn line, no record written twice, and the retry writes them all."""
    import subprocess
    import sys

    run = Storage(tmp_path).child("r")
    done = subprocess.run([sys.executable, "-c", FULL_DISK_WRITER, str(run.location)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cannot write" in done.stderr and "will retry" in done.stderr
    lines = [line for line in run.read_text(METRICS_FILE).splitlines() if line]
    assert [json.loads(line)["kind"] for line in lines] == ["start", "step", "step", "step", "eval"]
    timeline = read_timeline(run)
    assert [r["step"] for r in timeline.steps] == [0, 1, 2] and timeline.ledger.seconds["training"] == 3.0


def test_torn_and_repeated_lines_are_read_once():
    """Where a write cut short could not be cut off again (a filesystem that refuses the truncation),
    the log keeps a torn line and the retry repeats what was written whole: a reader skips the torn
    line and reads each record once (one attempt, not two)."""
    start = json.dumps({"kind": "start", "time": 10.0, "step": 0, "world_size": 1})
    steps = [json.dumps({"kind": "step", "time": 11.0 + s, "step": s, "dt": 1.0}) for s in range(2)]
    text = "\n".join([start, steps[0][:30], "", start, *steps, ""])
    records = parse_records(text)
    assert [r["kind"] for r in records] == ["start", "step", "step"]
    timeline = final_timeline(records)
    assert len(timeline.starts) == 1 and len(timeline.ledger.attempts) == 1
    assert timeline.ledger.seconds["training"] == 2.0


@pytest.mark.parametrize("storage", ["local", "s3"], indirect=True)
def test_steps_held_back_at_a_replica_are_written_by_the_attempt_resumed_from_it(storage, monkeypatch):
    """Rank 0 killed while it held step records back: those before its last memory replica travel with
    that set (`Publisher.held_back`, taken with the replica), and an attempt resumed from the set writes
    them before its start, once however often the set is resumed from. The steps after the replica are
    the killed attempt's lost tail: the resumed attempt redoes them."""
    monkeypatch.setattr(metrics_log, "LOCAL_FLUSH_S", 3600.0)
    monkeypatch.setattr(metrics_log, "REMOTE_FLUSH_S", 3600.0)
    run = Storage(storage).child("r")

    def steps(log: MetricsLog, first: int, stop: int) -> None:
        for step in range(first, stop):
            log.write("step", step=step, dt=1.0, loss=4.0 - step / 100)

    killed = MetricsLog(run)
    killed.write("start", step=0, world_size=1)  # written at once
    steps(killed, 0, 4)
    carried = Publisher([killed]).held_back()  # the replica of the state before step 4
    steps(killed, 4, 5)  # then the kill: nothing more reaches the file
    if run.appends_in_place:  # killed in the middle of a write: a torn last line
        with open(run.path(METRICS_FILE), "a") as f:
            f.write('{"kind": "eval", "step": 4, "va')
    assert [r["kind"] for r in parse_records(run.read_text(METRICS_FILE))] == ["start"]

    resumed = MetricsLog(run, carried=carried)
    assert [r["kind"] for r in resumed.earlier] == ["start", "step", "step", "step", "step"]
    resumed.write("start", step=4, world_size=1, restarts=1)
    steps(resumed, 4, 6)  # killed too, after flushing, before a replica of its own
    resumed.flush()
    again = MetricsLog(run, carried=carried)  # the same set resumed from again: nothing to write
    assert again.held_back() == []
    again.write("start", step=4, world_size=1, restarts=2)
    steps(again, 4, 7)
    again.flush()

    records = parse_records(run.read_text(METRICS_FILE))  # (the torn line skipped)
    assert [r["kind"] for r in records] == (
        ["start"] + ["step"] * 4 + ["start"] + ["step"] * 2 + ["start"] + ["step"] * 3)
    timeline = read_timeline(run)
    assert [r["step"] for r in timeline.steps] == list(range(7))
    # Steps 0-3 advanced training once; the resumed attempt's 4 and 5 were redone by the last.
    assert timeline.ledger.seconds["training"] == 7.0 and timeline.ledger.seconds["redone"] >= 2.0
    # What a replica carries is bounded: a storage outage holds back everything while it lasts.
    monkeypatch.setattr(metrics_log, "CARRIED_MAX", 2)
    steps(again, 7, 10)
    assert [json.loads(line)["step"] for line in again.held_back()] == [8, 9]
