"""The run's metrics log across restarts, on local disk and in a real S3 API (moto): what each
attempt wrote, and the final timeline a reader gets from it."""

import json
import os
import threading
import time
from urllib.parse import parse_qsl, urlsplit

import pytest
from conftest import s3_uri

from raychat import faults
from raychat.checkpoint.fence import Fence, LeaseRecord, create_record
from raychat.storage import Storage
from raychat.telemetry import metrics_log
from raychat.telemetry.append_writer import BackgroundWriter
from raychat.telemetry.metrics import Publisher
from raychat.telemetry.metrics_log import (
    METRICS_FILE,
    MetricsLog,
    final_timeline,
    parse_records,
    read_log,
    read_timeline,
)
from testkit.fault_proxy import FaultProxy


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


@pytest.mark.unit
def test_a_rerun_that_goes_back_drops_what_came_after(tmp_path):
    """--resume-from-step 4 after a run that reached 10: steps and evals after 4 are the rerun's."""
    run = Storage(str(tmp_path / "r"))
    attempt(run, 0, 10, [0, 4, 8], "first")
    attempt(run, 4, 6, [4], "rerun")
    timeline = read_timeline(run)
    assert [(r["step"], r["tag"]) for r in timeline.steps][-3:] == [(3, "first"), (4, "rerun"), (5, "rerun")]
    assert [(e["step"], e["tag"]) for e in timeline.evals] == [(0, "first"), (4, "rerun")]


@pytest.mark.unit
def test_non_finite_numbers_are_written_as_null(tmp_path):
    run = Storage(str(tmp_path / "r"))
    log = MetricsLog(run)
    log.write("report", step=0, min_val_bpb=float("inf"))
    log.flush()
    assert read_timeline(run).last_report["min_val_bpb"] is None


def test_steps_are_batched_and_a_superseded_writer_appends_nothing(storage, monkeypatch):
    """Step records wait for the next flush (LOCAL_FLUSH_S on local disk, REMOTE_FLUSH_S in a bucket,
    or any other record); every flush lists the run's lease first, so once another driver took the
    run (a newer epoch) nothing more reaches the file."""
    run = Storage(storage).child("r")
    create_record(run, LeaseRecord(epoch=1, holder="a", host="h", pid=1, started="then", floor=0))
    log = MetricsLog(run, Fence(run, 1))

    def kinds() -> list[str]:
        return [r["kind"] for r in map(json.loads, read_log(run).splitlines())]

    log.write("step", step=0, loss=4.0)
    assert log.wait(30) and read_log(run) is None
    log.write("eval", step=1, val_bpb=3.0)
    assert log.wait(30) and kinds() == ["step", "eval"]  # (the writer's thread writes it)
    monkeypatch.setattr(metrics_log, "LOCAL_FLUSH_S", 0.0)
    monkeypatch.setattr(metrics_log, "REMOTE_FLUSH_S", 0.0)
    log.write("step", step=1, loss=3.9)  # its interval is over: written at once
    assert log.wait(30) and kinds() == ["step", "eval", "step"]

    create_record(run, LeaseRecord(epoch=2, holder="b", host="h", pid=2, started="now", floor=0))
    log.write("step", step=2, loss=3.8)
    log.write("eval", step=3, val_bpb=2.9)
    log.flush()
    assert kinds() == ["step", "eval", "step"]


FULL_DISK_WRITER = """
import os, resource, signal, sys
from raychat.telemetry.metrics_log import METRICS_FILE, MetricsLog
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
log.write("start", step=0, world_size=1)  # written at once (by the log's thread): fails, kept
assert not log.wait(30)
for step in range(3):
    log.write("step", step=step, dt=1.0, loss=4.0)
disk_full_after(120)
assert not log.flush()  # cut short: the start record whole, the first step's cut
disk_full_after(40)
assert not log.flush()  # cut short inside the start record
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
log.write("eval", step=3, val_bpb=3.0)  # written at once, with all it held
assert log.wait(30)
"""


@pytest.mark.integration  # a subprocess
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


@pytest.mark.unit
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
    assert killed.wait(30)
    steps(killed, 0, 4)
    carried = Publisher([killed]).held_back()  # the replica of the state before step 4
    steps(killed, 4, 5)  # then the kill: nothing more reaches the file
    if run.appends_in_place:  # killed in the middle of a write: a torn last line
        with open(run.path(METRICS_FILE), "a") as f:
            f.write('{"kind": "eval", "step": 4, "va')
    assert [r["kind"] for r in parse_records(read_log(run))] == ["start"]

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

    records = parse_records(read_log(run))  # (the torn line skipped)
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


# -----------------------------------------------------------------------------
# The writer off the training thread (issue 48): parts in a bucket, a stalled store, a failing one


def bucket_objects(run: Storage) -> dict[str, tuple[str, int]]:
    """Every object below the run's prefix: key -> (ETag, size), as the bucket itself lists them."""
    import boto3

    parts = urlsplit(run.location.unredacted())
    endpoint = dict(parse_qsl(parts.query))["endpoint_override"]
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}")
    bucket, _, prefix = run.path().lstrip("/").partition("/")
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1:]: (o["ETag"], o["Size"]) for o in listed}


@pytest.mark.integration  # moto's S3 server
def test_a_bucket_log_is_one_new_object_per_flush(s3_endpoint):
    """An object store cannot append: each flush is a new object (a part) below the run, none is ever
    rewritten, and the parts in order are the log. A log an older writer left whole (with a torn last
    line: its writer killed) comes first."""
    run = Storage(s3_uri(s3_endpoint, f"parts-{time.time_ns()}")).child("r")
    old = json.dumps({"kind": "start", "time": 1.0, "step": 0, "world_size": 1, "tag": "old"})
    run.write_bytes(METRICS_FILE, (old + '\n{"kind": "step", "st').encode())
    log = MetricsLog(run)
    assert [r["tag"] for r in log.earlier] == ["old"]
    seen = bucket_objects(run)
    written = []
    for step in range(4):
        written.append(log.write("start" if step == 0 else "step", step=step, world_size=1, tag="new"))
        assert log.flush(wait_s=30)
        now = bucket_objects(run)
        assert {k: now[k] for k in seen} == seen  # nothing there before was rewritten
        assert len(now) == len(seen) + 1  # one new object per flush
        seen = now
    assert seen[METRICS_FILE] == bucket_objects(run)[METRICS_FILE]
    parts = [key for key in seen if key.startswith(f"{METRICS_FILE}.parts/")]
    assert len(parts) == 4
    text = "".join(run.read_text(key) for key in sorted(parts))
    assert [json.loads(line) for line in text.splitlines()] == written  # each line once, in order
    records = parse_records(read_log(run))
    assert [(r["kind"], r["tag"]) for r in records] == [("start", "old")] + [
        ("start", "new")] + [("step", "new")] * 3
    # The next attempt's parts come after this one's, whatever their numbers.
    again = MetricsLog(run)
    assert [r["tag"] for r in again.earlier] == ["old", "new", "new", "new", "new"]
    again.write("start", step=2, world_size=1, tag="next")
    assert again.flush(wait_s=30)
    assert [r["tag"] for r in read_timeline(run).starts] == ["old", "new", "next"]


@pytest.mark.integration  # moto's S3 server, the fault proxy
def test_the_training_thread_does_not_wait_on_a_stalled_bucket(s3_endpoint, monkeypatch):
    """Rank 0's training thread hands records over and goes on: a bucket frozen for a while (the fault
    proxy holds every request) delays the log, not the steps, and the log loses nothing meanwhile."""
    monkeypatch.setattr(faults, "FIRST_DELAY_S", 0.05)
    prefix = f"stalled-{time.time_ns()}"
    with FaultProxy(s3_endpoint, seed=0) as proxy:
        run = Storage(s3_uri(proxy.address, prefix)).child("r")
        log = MetricsLog(run)
        proxy.inject("stall", seconds=6)
        started = time.monotonic()
        log.write("start", step=0, world_size=1)  # written at once: in the background
        for step in range(50):
            log.write("step", step=step, dt=1.0, loss=4.0)
        log.write("eval", step=50, val_bpb=3.0)
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, f"the training thread waited {elapsed:.1f} s on a stalled bucket"
        assert log.flush(wait_s=0) is False  # asked for, not waited for
        assert len(log.held_back()) == 52  # nothing dropped while the bucket is frozen
        proxy.clear()
        assert log.flush(wait_s=60)
    timeline = read_timeline(Storage(s3_uri(s3_endpoint, prefix)).child("r"))
    assert [r["step"] for r in timeline.steps] == list(range(50)) and len(timeline.evals) == 1
    assert log.held_back() == []


@pytest.mark.unit
def test_the_training_thread_does_not_wait_on_a_hung_disk(tmp_path, capfd):
    """On local disk (or NFS) the log is appended in place, also off the training thread: a disk that
    hangs (here the log is a FIFO no one reads: opening it for writing blocks) delays the log only,
    and what it could not write is written once the disk is back."""
    run = Storage(str(tmp_path / "r"))
    log = MetricsLog(run)
    os.makedirs(run.path())
    os.mkfifo(run.path(METRICS_FILE))
    reader: list[int] = []
    # The disk "comes back" after 3 s (a reader opens the FIFO, which lets its writer's open return,
    # and the append then fails: a FIFO cannot be appended to): a training thread that waited for it
    # would wait that long.
    thaw = threading.Timer(3.0, lambda: reader.append(os.open(run.path(METRICS_FILE),
                                                               os.O_RDONLY | os.O_NONBLOCK)))
    thaw.start()
    try:
        started = time.monotonic()
        log.write("start", step=0, world_size=1)
        log.write("step", step=0, dt=1.0, loss=4.0)
        log.write("eval", step=1, val_bpb=3.0)
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, f"the training thread waited {elapsed:.1f} s on a hung disk"
        thaw.join()
        assert not log.wait(30)
    finally:
        thaw.cancel()
        for fd in reader:
            os.close(fd)
    assert "cannot write" in capfd.readouterr().err
    os.unlink(run.path(METRICS_FILE))  # a plain file system again
    assert log.flush()
    assert [r["kind"] for r in parse_records(read_log(run))] == ["start", "step", "eval"]


@pytest.mark.integration  # moto's S3 server, the fault proxy
def test_a_failing_bucket_is_retried_then_said_once_and_nothing_is_lost(s3_endpoint, monkeypatch, capfd):
    """A burst of 500s is ridden out (raychat.faults.retry_transient) without a word about the log; a
    bucket that keeps failing past the retry budget is said in one line, without slowing the training
    thread, the records are kept and the next flush once it works again writes each of them once."""
    monkeypatch.setattr(faults, "FIRST_DELAY_S", 0.05)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # boto3's own retries off: each fault reaches ours
    monkeypatch.setenv("RAYCHAT_RETRY_BUDGET_S", "60")
    prefix = f"failing-{time.time_ns()}"
    with FaultProxy(s3_endpoint, seed=0) as proxy:
        run = Storage(s3_uri(proxy.address, prefix)).child("r")
        log = MetricsLog(run)
        burst = proxy.inject("error500", count=3, method="PUT")
        log.write("start", step=0, world_size=1)
        assert log.flush(wait_s=60) and burst.hits == 3
        assert "cannot write" not in capfd.readouterr().err

        monkeypatch.setenv("RAYCHAT_RETRY_BUDGET_S", "0.5")
        proxy.inject("error500", method="PUT")  # until cleared
        for step in range(3):
            log.write("step", step=step, dt=1.0, loss=4.0)
        started = time.monotonic()
        log.write("eval", step=3, val_bpb=3.0)  # written at once: by the log's thread
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, f"the training thread waited {elapsed:.1f} s on a failing bucket"
        assert not log.flush(wait_s=60)
        assert not log.flush(wait_s=60)  # failing again: no second line
        err = capfd.readouterr().err
        assert sum("cannot write" in line for line in err.splitlines()) == 1, err
        assert [json.loads(line)["kind"] for line in log.held_back()] == ["step"] * 3 + ["eval"]
        proxy.clear()
        assert log.flush(wait_s=60) and log.held_back() == []
    records = parse_records(read_log(Storage(s3_uri(s3_endpoint, prefix)).child("r")))
    assert [r["kind"] for r in records] == ["start", "step", "step", "step", "eval"]


class _SlowStderr:
    """A stderr that takes its time (a loaded terminal, a pipe being drained) or is gone (`broken`)."""

    def __init__(self, broken: bool = False):
        self.text, self.broken = "", broken

    def write(self, text: str) -> int:
        if self.broken:
            raise OSError(9, "Bad file descriptor")
        time.sleep(0.3)
        self.text += text
        return len(text)

    def flush(self) -> None:
        if self.broken:
            raise OSError(9, "Bad file descriptor")


@pytest.mark.unit
def test_a_failed_write_is_said_before_a_waiter_hears_of_it_and_a_broken_stderr_ends_nothing(monkeypatch):
    """A caller that waited for a flush and heard it failed finds the writer's line already said (CI
    once read the output in that window and found nothing); a stderr that is gone (a detached job)
    costs the line, never the thread: the next flush still writes."""
    written: list[list[str]] = []
    failing = [True]

    def write(lines: list[str]) -> None:
        if failing[0]:
            raise OSError("disk unavailable")
        written.append(lines)

    stderr = _SlowStderr()
    monkeypatch.setattr("sys.stderr", stderr)
    writer = BackgroundWriter(write, "the log", max_lines=10)
    try:
        writer.add("a", flush=True)
        assert not writer.wait(10)
        assert "cannot write the log (disk unavailable)" in stderr.text
        monkeypatch.setattr("sys.stderr", _SlowStderr(broken=True))
        writer.add("b", flush=True)
        assert not writer.wait(10)
        failing[0] = False
        writer.add("c", flush=True)
        assert writer.wait(10)
        assert written == [["a", "b", "c"]]
    finally:
        writer.stop()
