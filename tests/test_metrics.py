"""The log line against seed 000 (a nanochat user's log line), Ray gauges on the node's Prometheus
endpoint, and wandb offline runs."""

import json
import struct
from pathlib import Path

import pytest

from raychat.common import RaychatError
from raychat.storage import Storage
from raychat.telemetry.metrics import (
    AttemptStarted,
    Publisher,
    Record,
    Reported,
    Sink,
    StepDone,
    StepMetrics,
    counts_toward_total_time,
    eta_seconds,
    format_val_line,
    smooth_loss,
)
from raychat.telemetry.metrics_log import MetricsLog, read_timeline
from raychat.telemetry.sinks import GAUGES, LogLines, RayMetrics, WandbLogger

# Seed 000: a nanochat d20 run on one MI300X, total batch 2**19 tokens.
SEED_LINE = ("step 00383/29000 (1.32%) | loss: 3.369286 | lrm: 1.00 | dt: 4052.93ms | tok/sec: 129,360 "
             "| bf16_mfu: 62.46 | epoch: 1 pq: 0 rg: 279 | total time: 25.43m | eta: 1951.2m")


def record(step: int = 383, num_iterations: int = 29000, loss: float = 3.369286, lrm: float = 1.0,
           dt: float = 4.05293, tokens_per_sec: float = 129360, mfu: float | None = 62.46,
           cursor: tuple[int, int, int] = (1, 0, 279), total_time_s: float = 25.43 * 60,
           eta_s: float | None = 1951.2 * 60) -> StepMetrics:
    epoch, pq, rg = cursor
    return StepMetrics(step=step, num_iterations=num_iterations, loss=loss, raw_loss=loss + 0.1, lrm=lrm,
                       dt=dt, tokens_per_sec=tokens_per_sec, mfu=mfu, epoch=epoch, pq=pq, rg=rg,
                       total_time_s=total_time_s, eta_s=eta_s, data_wait_s=0.01, world_size=8,
                       tokens_so_far=(step + 1) * 2**19, flops_so_far=(step + 1) * 2**19 * 6e8)


@pytest.mark.unit
def test_step_line_reproduces_the_seed_line():
    assert record().line() == SEED_LINE


@pytest.mark.unit
def test_seed_line_follows_from_the_loop_arithmetic():
    """The seed's numbers are consistent with nanochat's rules, and so are ours: tok/sec is
    int(2**19 / dt); the eta is (29000 - 383) steps at the mean of the 373 timed steps."""
    total_time_s = 1525.95  # 25.4325 min: prints as 25.43, like the seed
    line = record(tokens_per_sec=2**19 / 4.05293, total_time_s=total_time_s,
                  eta_s=eta_seconds(383, 29000, total_time_s)).line()
    assert line == SEED_LINE


@pytest.mark.unit
def test_cpu_line_marks_mfu_na_and_has_no_eta_before_timed_steps():
    line = record(3, 40, 6.25, 0.1, 0.5, 8192, None, (0, 2, 7), 0.0, eta_seconds(3, 40, 0.0)).line()
    assert line == ("step 00003/00040 (7.50%) | loss: 6.250000 | lrm: 0.10 | dt: 500.00ms | tok/sec: 8,192 "
                    "| bf16_mfu: n/a | epoch: 0 pq: 2 rg: 7 | total time: 0.00m")


@pytest.mark.unit
def test_loop_arithmetic_by_hand():
    # EMA with beta 0.9 from 0, debiased: losses 4, 2 -> 0.4/0.1 = 4.0, then 0.56/0.19
    smooth, shown = smooth_loss(0.0, 4.0, step=0)
    assert (smooth, shown) == pytest.approx((0.4, 4.0))
    smooth, shown = smooth_loss(smooth, 2.0, step=1)
    assert (smooth, shown) == pytest.approx((0.56, 0.56 / 0.19))
    # steps 0..10 are not timed; step 11 is the first
    assert [counts_toward_total_time(s) for s in (0, 10, 11)] == [False, False, True]
    assert eta_seconds(10, 100, 0.0) is None
    assert eta_seconds(15, 100, 10.0) == pytest.approx(85 * 2.0)  # 5 timed steps, 2 s each


@pytest.mark.unit
def test_val_line():
    assert format_val_line(250, 1.2345671) == "Step 00250 | Validation bpb: 1.234567"
    assert format_val_line(0, 3.0) == "Step 00000 | Validation bpb: 3.000000"


@pytest.mark.integration  # wandb's git calls, wandb-core, a subprocess
def test_one_record_reaches_the_line_wandb_and_the_metrics_log(wandb_env, monkeypatch, tmp_path):
    """Publisher.step writes the same StepMetrics to every sink: nanochat's line, wandb (every 100
    steps, as nanochat) and the run's metrics log, whose records carry every field."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    lines: list[str] = []
    run = Storage(str(tmp_path / "runs" / "r"))
    wandb_run = WandbLogger("fanout")
    publisher = Publisher([LogLines(lines.append), wandb_run, MetricsLog(run)])
    steps = [record(step=s, num_iterations=200, loss=5.0 - s / 100, mfu=None, eta_s=None)
             for s in (99, 100, 101)]
    for m in steps:
        publisher.step(m)
    publisher.eval(102, 1.75, 12.5)
    publisher.samples(102, ["The capital of France is Paris"])
    publisher.flush()
    wandb_run.finish()
    wandb.teardown()

    assert lines == [m.line() for m in steps] + ["Step 00102 | Validation bpb: 1.750000",
                                                 "The capital of France is Paris"]
    (run_dir,) = (wandb_env / "wandb").glob("offline-run-*")
    _, rows = _offline_history(run_dir)
    assert [(r["_step"], r.get("train/loss")) for r in rows if "train/loss" in r] == [("100", "4")]
    timeline = read_timeline(run)
    assert [r["step"] for r in timeline.steps] == [99, 100, 101]
    # ... and the attempt's running time outside steps, for the time ledger (raychat.telemetry.ledger)
    assert timeline.steps[1] == {"kind": "step", "time": timeline.steps[1]["time"], **vars(steps[1]),
                                 "eval_s_so_far": 0.0, "checkpoint_s_so_far": 0.0}
    assert timeline.steps[1]["tokens_so_far"] == 101 * 2**19
    assert [(e["step"], e["val_bpb"]) for e in timeline.evals] == [(102, 1.75)]
    assert timeline.samples[0]["samples"] == ["The capital of France is Paris"]


class Recorded(Sink):
    """A sink that keeps what it is handed."""

    def __init__(self):
        self.records: list[Record] = []
        self.flushes = 0

    def publish(self, record: Record) -> None:
        self.records.append(record)

    def flush(self) -> None:
        self.flushes += 1


@pytest.mark.unit
def test_every_sink_in_the_list_gets_every_typed_record(tmp_path):
    """A sink is one class in the publisher's list: it gets the attempt's start, each step's StepMetrics
    with the run's goodput and seconds outside steps, and the report, in the order they happen; the
    metrics log beside it writes the same start time and report."""
    run = Storage(str(tmp_path / "r"))
    first, second = Recorded(), Recorded()
    publisher = Publisher([first, MetricsLog(run), second])
    publisher.start([], step=0, world_size=1)
    m = record(step=0)
    publisher.step(m)
    publisher.report({"step": 0, "val_bpb": 1.5})
    publisher.flush()

    assert first.records == second.records and first.flushes == second.flushes == 1
    started, step, report = first.records
    assert isinstance(started, AttemptStarted) and started.fields == {"step": 0, "world_size": 1}
    assert isinstance(step, StepDone) and step.metrics is m and step.goodput is not None
    assert step.so_far == {"eval_s_so_far": 0.0, "checkpoint_s_so_far": 0.0}
    assert isinstance(report, Reported) and report.metrics["val_bpb"] == 1.5
    assert report.metrics["loss"] == m.loss and "goodput" in report.metrics
    timeline = read_timeline(run)
    assert timeline.starts[0]["time"] == started.time
    assert timeline.last_report["val_bpb"] == 1.5 and timeline.last_report["eval_s_so_far"] == 0.0


# The gauges of a real run reaching each node's Prometheus endpoint, through a resize, are checked in
# tests/test_elastic.py.


@pytest.mark.unit
def test_unknown_gauge_name_is_an_error():
    metrics = RayMetrics("driver-side")
    with pytest.raises(ValueError, match="known: loss, tokens_per_sec"):
        metrics.update(los=1.0)
    assert set(GAUGES) == {"loss", "tokens_per_sec", "mfu", "val_bpb", "step", "world_size",
                           "data_wait_seconds", "core_metric", "goodput"}


# ---------------------------------------------------------------------------------------------------
# wandb


FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # looks like a W&B key; must never be printed


def _offline_history(run_dir: Path) -> tuple[str, list[dict]]:
    """(project, history rows) of an offline run, read from its .wandb transaction log (LevelDB log
    format: 32 KiB blocks, 7-byte record headers, records split FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log_file,) = run_dir.glob("run-*.wandb")
    data, pos, pending, records = log_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(pending)
            pending = b""
    project, rows = "", []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "run":
            project = record.run.project
        elif record.WhichOneof("record_type") == "history":
            rows.append({"/".join(item.nested_key) or item.key: item.value_json
                         for item in record.history.item})
    return project, rows


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    yield tmp_path
    wandb.teardown()  # stops the wandb service process the test started


@pytest.mark.unit
def test_dummy_run_logs_nothing(wandb_env):
    logger = WandbLogger("dummy", config={"depth": 4})
    logger.log({"train/loss": 1.0}, step=1)
    logger.finish()
    assert not logger.enabled
    assert list(wandb_env.iterdir()) == []


@pytest.mark.integration  # wandb's git calls, wandb-core
def test_offline_run_records_the_logged_keys_and_never_prints_the_key(wandb_env, monkeypatch, capfd):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger("d4-offline", config={"depth": 4})
    assert logger.enabled
    logger.log({"train/loss": 3.5, "train/tok_per_sec": 1370}, step=10)
    logger.log({"val/bpb": 1.25}, step=20)
    logger.finish()
    wandb.teardown()  # the wandb service flushes the run's transaction log when it stops

    (run_dir,) = (wandb_env / "wandb").glob("offline-run-*")
    project, rows = _offline_history(run_dir)
    assert project == "raychat"
    logged = [(r["_step"], r.get("train/loss"), r.get("train/tok_per_sec"), r.get("val/bpb")) for r in rows]
    assert logged == [("10", "3.5", "1370", None), ("20", None, None, "1.25")]
    out = capfd.readouterr()
    assert FAKE_KEY not in out.out + out.err


@pytest.mark.integration  # wandb's git calls, wandb-core
def test_raychat_offline_without_wandb_mode_logs_offline(wandb_env, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("RAYCHAT_OFFLINE", "1")
    logger = WandbLogger("d4-raychat-offline")
    logger.log({"train/loss": 2.5}, step=1)
    logger.finish()
    assert len(list((wandb_env / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.integration  # wandb's git calls
def test_online_without_credentials_is_one_clear_line(wandb_env, monkeypatch, capfd):
    for var in ("WANDB_MODE", "RAYCHAT_OFFLINE", "WANDB_API_KEY", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(wandb_env))  # no ~/.netrc, no saved wandb login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(wandb_env / "config"))
    with pytest.raises(RaychatError) as err:
        WandbLogger("d4-online")
    message = str(err.value)
    assert "\n" not in message and "wandb login" in message and "WANDB_MODE=offline" in message


@pytest.mark.ray
def test_a_run_and_its_rerun_are_one_wandb_run_with_every_step_once(ray_session, tiny_corpus, tmp_path):
    """`--run` set, wandb offline: a run to step 8, then the same command to step 12. The rerun resumes
    the run's wandb run (its id kept in the run's directory) and redoes the evaluation at step 8,
    which the first run logged already: every step is in the run's history once, in order."""
    from helpers import run_train, tiny_flags

    from raychat.telemetry.sinks import WANDB_RUN_FILE

    storage, wandb_dir = tmp_path / "runs", tmp_path / "wandb-files"
    flags = tiny_flags(tiny_corpus, storage, "wb", "--run", "wb-test", "--num-workers", "1",
                       "--total-batch-size", "256", "--eval-every", "4", "--save-every", "4")
    for horizon in ("8", "12"):
        done = run_train(ray_session, [*flags, "--num-iterations", horizon], WANDB_DIR=str(wandb_dir))
        assert done.returncode == 0, done.stderr[-3000:]

    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # one offline directory per attempt ...
    ids = {run_dir.name.rsplit("-", 1)[1] for run_dir in runs}
    kept = json.loads((storage / "wb" / WANDB_RUN_FILE).read_text())
    assert ids == {kept["id"]}  # ... of one wandb run, whose id the run keeps
    steps = [int(row["_step"]) for run_dir in runs for row in _offline_history(run_dir)[1]]
    assert steps == [0, 4, 8, 12]
    assert kept["logged_step"] == 12


@pytest.mark.unit
def test_tokenizer_training_says_its_progress_on_a_large_corpus_only(tiny_corpus, tmp_path):
    """A line every so often while the corpus is read (here every batch: the interval is 0), then one
    when the merges start; nothing of it on a corpus read before the first interval ends."""
    from raychat.tokenizer.train import train_tokenizer

    data_dir, _ = tiny_corpus
    lines: list[str] = []
    train_tokenizer(data_dir, tmp_path / "every", vocab_size=300, log=lines.append, progress_every_s=0)
    progress = [line for line in lines if line.startswith("Tokenizer: read")]
    assert len(progress) >= 2 and "100%" in progress[-2] and progress[-1].endswith("learning the merges")
    lines.clear()
    train_tokenizer(data_dir, tmp_path / "quiet", vocab_size=300, log=lines.append)
    assert not [line for line in lines if line.startswith("Tokenizer:")]
