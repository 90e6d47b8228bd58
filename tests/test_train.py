"""The trainer end to end: `python -m raychat.train` as a user runs it, on the shared Ray cluster,
2 CPU workers with gloo, a tiny real-text corpus, runs stored on local disk and in a real S3 API.
Killed workers, resizes, resumes, bad input."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    STEP_LINE,
    VAL_LINE,
    all_files,
    final_model_state,
    log_lines,
    one_error_line,
    refusal,
    run_train,
    submit_job,
    tiny_flags,
)
from reused_processes import Commands
from run_output import foreign_lines
from trace_audit import assert_epoch1_exactly_once, attempts_by_step, latest_by_rank, whole_replica_step

from raychat.checkpoint.catalog import list_checkpoints
from raychat.checkpoint.format import damage, rank_file, read_meta
from raychat.checkpoint.reader import load_checkpoint
from raychat.storage import Storage
from testkit.trace import trace_env

pytestmark = pytest.mark.ray


def checkpoint_names(run: Storage) -> list[str]:
    return sorted(c.name for c in list_checkpoints(run))


def run_sample(commands: Commands, storage: str, run_name: str, tokenizer_dir,
               *extra: str) -> subprocess.CompletedProcess:
    return commands.run("raychat.sample", "--run-name", run_name, "--storage-path", storage,
                        "--tokenizer-dir", tokenizer_dir, "--prompt", "The", *extra, timeout=120)


# In the bucket only (the harder case, and one Ray Train run less for the suite): checkpoints on local
# disk are written, listed, pruned and resumed by the same Storage code in every other run here. The run
# and its rerun are conftest's `two_worker_run`, which tests/test_report.py reports on.
def test_two_workers_learn_log_checkpoint_sample_and_resume(two_worker_run, ray_session, tiny_corpus,
                                                            tmp_path, commands):
    data_dir, tokenizer_dir = tiny_corpus
    storage, out = two_worker_run.storage, two_worker_run.first.stdout
    assert "rows per step" in out and "tokens : scaling params" in out  # the plan is printed first
    steps = log_lines(out, STEP_LINE)
    assert [int(m.group(1)) for m in steps] == list(range(16))
    assert all(int(m.group(2)) == 16 for m in steps)
    assert int(steps[-1].group(7).replace(",", "")) > 0
    vals = log_lines(out, VAL_LINE)
    assert [int(m.group(1)) for m in vals] == [0, 8, 16]
    bpbs = [float(m.group(2)) for m in vals]
    assert bpbs[0] > bpbs[1] > bpbs[2] and bpbs[2] < bpbs[0] - 0.1, bpbs  # it learns
    # The seven sample prompts are printed at the end.
    assert "The capital of France is" in out and "If 5*x + 3 = 13, then x is" in out
    # Checkpoints at 4, 8, 12, 16, each save saying how long it stalled training, complete, with the
    # cursor and loop state; the two newest kept (--keep-checkpoints 2): 16 and the rerun's 20.
    saves = re.findall(r"Checkpoint checkpoint_0000(04|08|12|16) saved .* training stalled \d+ms", out)
    assert len(saves) == 4
    assert "min val bpb" in out and "checkpoint_000016" in out
    run = Storage(storage).child("basic")
    assert checkpoint_names(run) == ["checkpoint_000016", "checkpoint_000020"]
    assert all(damage(c, deep=True) is None for c in list_checkpoints(run))
    meta = read_meta(run.child("checkpoint_000016"))
    assert meta.step == 16 and meta.world_size == 2 and meta.cursor
    assert meta.loop_state.min_val_bpb == pytest.approx(min(bpbs), abs=1e-6)

    # The same run name resumed at step 16 (not 0) and trained on to 20.
    resumed = two_worker_run.rerun.stdout
    assert "resuming from checkpoint_000016 (step 16)" in resumed
    assert "Resumed from" in resumed and "at step 16" in resumed
    assert [int(m.group(1)) for m in log_lines(resumed, STEP_LINE)] == [16, 17, 18, 19]

    # Sampling from the run works; a tokenizer of another vocabulary is refused in one line.
    sample = run_sample(commands, storage, "basic", tokenizer_dir, "--max-tokens", "8")
    assert sample.returncode == 0, sample.stderr
    assert "step 20" in sample.stdout and "\nThe" in sample.stdout
    from raychat.tokenizer.train import train_tokenizer

    other_tok = tmp_path / "other_tok"
    train_tokenizer(data_dir, other_tok, vocab_size=300, log=lambda *_: None)
    line = one_error_line(run_sample(commands, storage, "basic", other_tok))
    assert "vocab" in line and "checkpoint_000020" in line

    # Neither run's attempt started Ray Train's Ray Data manager, an actor raychat has no use for
    # (raychat.run.driver.RaychatTrainer): one process less on every start and restart.
    from ray.util.state import list_actors

    # (The session's cluster named: without an address the state API looks for "the" cluster of the
    # machine, and finds two where another Ray runs beside the tests.)
    assert not list_actors(address=ray_session.dashboard_url, filters=[("class_name", "=", "DatasetManager")],
                           raise_on_missing_output=False)


# On local disk only: a restart reads its checkpoint back from the bucket in the test above (resume by
# name) and below (damaged newest, --resume-from-step).
@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_killed_worker_resumes_bit_identical(ray_session, tiny_corpus, tmp_path, storage):
    # 60 steps: the first replica waits for the holder's process to start (it imports torch), which on
    # a loaded 2-core machine (two runs starting at once) took 24 steps' time here and more in CI.
    flags = ["--num-workers", "2", "--total-batch-size", "1024", "--num-iterations", "60",
             "--eval-every", "-1", "--save-every", "12", "--replicate-every", "2"]
    trace = tmp_path / "trace"
    trace.mkdir()
    launched = time.time()
    reference = subprocess.Popen(
        [sys.executable, "-m", "raychat.train", *tiny_flags(tiny_corpus, storage, "reference", *flags)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_session.driver_env())
    crashed = subprocess.Popen(
        [sys.executable, "-m", "raychat.train", *tiny_flags(tiny_corpus, storage, "crashed", *flags)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=ray_session.driver_env(**trace_env(trace)))
    try:
        # Kill rank 1 for real past step 9 and well before the end, once every rank's holders took a
        # replica at least as new as the newest save that may exist (every 12; the one 1-9 steps back,
        # not one about to be taken): peer memory then holds a whole set the restore prefers to the
        # checkpoint. (Killed while the save's replica was still being sent, the group rightly resumes
        # from the checkpoint.) Saves 12 apart leave room for sends that lag a few steps on a loaded host.
        victim, seen = None, {}  # rank 1's steps -> the whole set then (the message if none fits)
        deadline = time.time() + 300
        while victim is None and time.time() < deadline and crashed.poll() is None:
            last = latest_by_rank(trace)
            whole, step = whole_replica_step(last), last.get(1, {}).get("step", -1)
            seen[step] = whole
            if whole is not None and 9 < step <= 50 and step % 12 <= 9 and whole >= step // 12 * 12:
                victim = last[1]["pid"]
            else:
                time.sleep(0.05)
        assert victim is not None, f"rank 1 never trained 1-9 steps past a save whose replica was whole: " \
                                   f"{seen}"
        os.kill(victim, signal.SIGKILL)
        crashed_out, _ = crashed.communicate(timeout=400)
        crashed_wall = time.time() - launched
        reference_out, _ = reference.communicate(timeout=400)
    finally:
        for proc in (crashed, reference):
            if proc.poll() is None:
                proc.kill()
    assert crashed.returncode == 0, crashed_out[-3000:]
    assert reference.returncode == 0, reference_out[-3000:]
    # The log is the run's (tests/run_output.py): raychat's lines, one per attempt with its world size,
    # nodes and checkpoint, and real warnings and errors; none of Ray's narration of the restart.
    foreign = foreign_lines(crashed_out)
    assert foreign == [], foreign
    starts = re.findall(r"^(Starting at step 0|Resumed from peer memory at step \d+) .*: training to step 60 "
                        r"at world size 2 \(2 worker\(s\) on 1 node\(s\)\)", crashed_out, re.M)
    assert len(starts) == 2 and starts[0] == "Starting at step 0", (starts, crashed_out[-4000:])
    assert re.search(r"^Ray: joined the cluster at \S+; dashboard http", crashed_out, re.M)
    # The restarted group resumed from the replicas its node's holder kept (raychat.elastic.replicas: the
    # killed process's copy outlived it), not from a checkpoint: a replica step (every 2), no older
    # than the newest set every rank's holders had taken when the first attempt's ranks last traced
    # a step (its holders keep that one). From the trace: worker output reaches the driver best-effort.
    by_step = attempts_by_step(trace)
    attempts = sorted({a for s in by_step.values() for a in s}, key=float)
    assert len(attempts) == 2, attempts
    last_killed = max(step for step, s in by_step.items() if attempts[0] in s)
    resumed = min(step for step, s in by_step.items() if attempts[1] in s)
    floor = whole_replica_step(latest_by_rank(trace, attempts[0]))
    assert resumed % 2 == 0 and floor is not None and floor <= resumed <= last_killed + 1, (resumed, floor,
                                                                                          last_killed)
    # The replica holders ended with their drivers' runs: no memory is left held for them.
    from ray.util.state import list_actors

    deadline = time.time() + 60
    holders = [("class_name", "=", "ReplicaHolder"), ("state", "=", "ALIVE")]
    while list_actors(address=ray_session.dashboard_url, filters=holders):
        assert time.time() < deadline, "replica holders outlived their runs"
        time.sleep(1)
    ref_state = final_model_state(Storage(storage).child("reference"))
    crash_state = final_model_state(Storage(storage).child("crashed"))
    assert ref_state.keys() == crash_state.keys()
    for name in ref_state:
        assert torch.equal(ref_state[name], crash_state[name]), name
    # The run's report (raychat.report): one point per step, the restart marked where it resumed,
    # and the steps it redid counted.
    from raychat.report.document import build_report

    report = build_report(Storage(storage).child("crashed"))
    assert [r["step"] for r in report.timeline.steps] == list(range(60))
    loss_axes = report.figures["loss.png"].axes[0]
    restart = [line for line in loss_axes.get_lines() if line.get_label() == "restart"]
    assert len(restart) == 1 and list(restart[0].get_xdata()) == [resumed, resumed]
    redone = report.timeline.starts[-1]["redone_steps"]
    # ... and read nothing from storage to do it (the first attempt had nothing to read either).
    assert [start["storage_read_bytes"] for start in report.timeline.starts] == [0, 0]
    assert 0 <= redone <= last_killed + 1 - resumed
    assert f"1 restart at step(s) {resumed}: {redone} step(s) redone" in report.summary()
    # The time ledger (raychat.telemetry.ledger): the restart's entry split into its causes, every cause
    # within the run's wall time (the driver's own, at most), summing to it, and goodput below 1.
    ledger = report.timeline.ledger
    assert [(a.kind, a.step) for a in ledger.attempts] == [("first", 0), ("restart", resumed)]
    restart = ledger.attempts[1].seconds
    assert restart["detect"] > 0 and restart["reschedule"] > 0 and restart["restore"] > 0, restart
    assert restart["training"] > 0 and ledger.attempts[0].seconds["startup"] > 0
    assert all(seconds >= 0 for seconds in ledger.seconds.values())
    assert ledger.wall_s <= crashed_wall
    assert abs(sum(ledger.seconds.values()) - ledger.wall_s) <= 0.02 * ledger.wall_s, ledger.seconds
    assert (ledger.seconds["redone"] > 0) == (last_killed >= resumed)
    assert 0 < ledger.goodput < 1 and "goodput" in report.summary() and "time.png" in report.figures


# Local only: the accounting does not depend on where checkpoints live, and resuming from the bucket
# is covered above and below (resume by name, kill -9, damaged newest, --resume-from-step).
@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_resize_one_three_two_consumes_every_doc_once(ray_session, tiny_corpus, tmp_path, storage):
    """Three launches of one run at W = 1, 3, 2 (each resumes the sharded checkpoint the last one
    saved, written by a different number of ranks: a grow, then a shrink to a size that does not
    divide the last): every epoch-1 document trained exactly once."""
    from raychat.corpus.index import CorpusIndex

    data_dir, _ = tiny_corpus
    trace = tmp_path / "trace"
    trace.mkdir()
    common = ["--total-batch-size", "2048", "--eval-every", "-1", "--save-every", "-1"]
    saved_by = None
    for workers, iterations in ((1, 8), (3, 16), (2, 24)):
        flags = tiny_flags(tiny_corpus, storage, "resize", "--num-workers", str(workers), "--num-iterations",
                           str(iterations), *common)
        done = run_train(ray_session, flags, **trace_env(trace))
        assert done.returncode == 0, done.stderr[-3000:]
        if saved_by is not None:
            assert f"saved by {saved_by} workers, now {workers}" in done.stdout
        saved_by = workers
        checkpoint = Storage(storage).child("resize", f"checkpoint_{iterations:06d}")
        assert read_meta(checkpoint).world_size == workers
        assert sorted(p.name for p in Path(checkpoint.root).glob("rank_*")) == [
            rank_file(rank, workers) for rank in range(workers)]  # one shard file per rank that saved

    cursor = read_meta(Storage(storage).child("resize", "checkpoint_000024")).cursor
    trained = assert_epoch1_exactly_once(trace, data_dir, cursor)
    # The audit is not vacuous: a good part of the 203 documents was trained (67 in these 24 steps).
    # Not all: with T=64 most docstrings are longer than a row, and best-fit keeps long documents
    # buffered until they are the shortest (nanochat's algorithm).
    index = CorpusIndex.load(data_dir)
    assert trained > sum(unit.num_rows for unit in index.train) // 4


def test_job_whose_workers_cannot_compile_fails_with_one_line(ray_session, tiny_corpus, tmp_path):
    """Under `ray job submit` the driver's machine is not the workers', so the workers check torch.compile
    themselves: here their nodes have no C++ compiler for inductor (a fresh inductor cache, so nothing
    compiled earlier can stand in), and the job ends with the one line instead of a traceback. No retry
    can fix that: even under --max-failures -1 the run ends on its first attempt."""
    no_compiler = {"env_vars": {"CXX": "/nonexistent/g++",
                                "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}}
    status, logs = submit_job(ray_session, tiny_flags(
        tiny_corpus, tmp_path, "job", "--num-workers", "1", "--total-batch-size", "512",
        "--num-iterations", "4", "--compile", "on", "--max-failures", "-1"), no_compiler)
    assert "FAILED" in status.upper(), status + logs[-3000:]
    errors = [line for line in logs.splitlines() if line.startswith("raychat: error:")]
    assert len(errors) == 1, logs[-3000:]
    assert errors[0].startswith("raychat: error: --compile:") and "run with --compile off" in errors[0]
    assert not list(tmp_path.glob("job/checkpoint_*"))


def test_bad_input_fails_fast_with_one_line(ray_session, tiny_corpus, tmp_path, commands):
    data_dir, tokenizer_dir = tiny_corpus
    # Impossible batch arithmetic: the total batch is not a whole number of rows.
    line = refusal(commands, tiny_flags(tiny_corpus, tmp_path, "bad", "--total-batch-size", "1000"),
                   ray_session)
    assert "--total-batch-size" in line
    # Storage path that cannot be written.
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    line = refusal(commands, tiny_flags(tiny_corpus, blocker / "runs", "bad"), ray_session)
    assert "--storage-path" in line
    # No corpus and no way to make one: the data dir is a file.
    flags = tiny_flags(tiny_corpus, tmp_path, "bad")
    flags[flags.index("--data-dir") + 1] = str(blocker)
    line = refusal(commands, flags, ray_session)
    assert str(blocker) in line
    # A corrupt shard is named.
    broken = tmp_path / "broken_data"
    shutil.copytree(data_dir, broken)
    victim = sorted(broken.glob("shard_*.parquet"))[1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    flags = tiny_flags(tiny_corpus, tmp_path, "bad")
    flags[flags.index("--data-dir") + 1] = str(broken)
    line = refusal(commands, flags, ray_session)
    assert victim.name in line


def test_bad_storage_fails_fast_with_one_line_and_writes_nothing(tiny_corpus, tmp_path, s3_endpoint,
                                                                 commands):
    from conftest import s3_uri

    # No Ray here: these must fail before the driver connects to any cluster.
    cases = {
        s3_uri(s3_endpoint, "runs", bucket="no-such-bucket"): "bucket",
        # Refused at once: nothing listens there (not the write's 20 s of retries, then pyarrow's).
        s3_uri("127.0.0.1:1", "runs"): "endpoint cannot be reached (127.0.0.1:1: connection refused)",
    }
    for uri, reason in cases.items():
        result = commands.run("raychat.train", *tiny_flags(tiny_corpus, uri, "bad"), timeout=120)
        line = one_error_line(result)
        assert "--storage-path" in line and uri in line and reason in line, line
        assert "No corpus" not in result.stdout  # failed before preparing anything
    assert not Storage(s3_uri(s3_endpoint, "runs")).exists()


def test_a_cluster_that_is_not_there_or_wants_a_token_is_one_line(ray_session, tiny_corpus, tmp_path,
                                                                  commands):
    """RAY_ADDRESS set to where no cluster runs (Ray's connect would wait minutes), and to the
    session's cluster without its token (Ray retries for ~13 s, printing, then a traceback)."""
    from conftest import free_port

    dead = f"127.0.0.1:{free_port()}"
    result = commands.run("raychat.train", *tiny_flags(tiny_corpus, tmp_path, "nowhere"),
                          env=ray_session.driver_env(RAY_ADDRESS=dead), timeout=120)
    line = one_error_line(result)
    assert f"RAY_ADDRESS={dead}: no Ray cluster answers there (connection refused)" in line, line
    assert "No corpus" not in result.stdout  # refused before preparing anything
    # The dashboard's port, a common slip: something answers, but not a Ray cluster.
    dashboard = ray_session.dashboard_url.removeprefix("http://")
    line = one_error_line(commands.run("raychat.train", *tiny_flags(tiny_corpus, tmp_path, "nowhere"),
                                       env=ray_session.driver_env(RAY_ADDRESS=dashboard), timeout=120))
    assert f"RAY_ADDRESS={dashboard}: something answers there, but not a Ray cluster" in line, line
    # Without the token: a fresh interpreter (Ray's client keeps the first token it reads for good),
    # with no token in its environment or its home.
    env = ray_session.driver_env(HOME=str(tmp_path))
    env = {name: value for name, value in env.items() if not name.startswith("RAY_AUTH")}
    command = [sys.executable, "-m", "raychat.train", *tiny_flags(tiny_corpus, tmp_path, "nowhere")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    line = one_error_line(result)
    assert line.startswith(f"raychat: error: RAY_ADDRESS={ray_session.gcs_address}: the cluster refuses this "
                           "driver's token (none, or another): set RAY_AUTH_MODE=token"), line
    assert result.stderr.strip() == line  # and nothing of Ray's
    assert not (tmp_path / "nowhere").exists()


# In the bucket only: these resume paths are the same code on both storages (raychat.storage), the
# local ones run in test_checkpoint, and six launches per storage cost two minutes of the suite.
@pytest.mark.parametrize("storage", ["s3"], indirect=True)
def test_wrong_tokenizer_nan_loss_damaged_checkpoint_and_resume_from_step(ray_session, tiny_corpus, tmp_path,
                                                                          storage, commands):
    base = ["--num-workers", "1", "--total-batch-size", "512", "--eval-every", "-1", "--save-every", "3"]
    # NaN loss (checked at the end): a run of its own, a driver process of its own, training beside
    # the resumes below.
    exploding = tiny_flags(tiny_corpus, storage, "nan", *base, "--num-iterations", "12", "--save-every", "1",
                           "--embedding-lr", "1e30", "--unembedding-lr", "1e30", "--matrix-lr", "1e30")
    nan_out, nan_err = tmp_path / "nan.out", tmp_path / "nan.err"
    with open(nan_out, "w") as out, open(nan_err, "w") as err:
        nan_run = subprocess.Popen([sys.executable, "-m", "raychat.train", *exploding], stdout=out,
                                   stderr=err, text=True, env=ray_session.driver_env())
    try:
        _resumes_and_refusals(ray_session, tiny_corpus, tmp_path, storage, commands, base)
        nan_run.wait(timeout=400)
    finally:
        if nan_run.poll() is None:
            nan_run.kill()
            nan_run.wait()

    # NaN loss: stop with the step named. Saving every step, a save is in flight when the loss goes
    # bad: it holds the weights from before that step and is finished, whole, not leaked.
    line = one_error_line(subprocess.CompletedProcess(nan_run.args, nan_run.returncode, nan_out.read_text(),
                                                      nan_err.read_text()))
    nan_step = int(re.search(r"NaN/inf at step (\d+)", line).group(1))
    # The last checkpoint is whole, at or before that step, and finite: a NaN is never saved (the
    # save refuses non-finite weights and stops the run as a NaN loss does).
    checkpoints = list_checkpoints(Storage(storage).child("nan"))
    assert checkpoints or nan_step <= 1
    if checkpoints:
        assert int(checkpoints[-1].name.removeprefix("checkpoint_")) <= nan_step
        assert damage(checkpoints[-1], deep=True) is None
        weights, _, _ = load_checkpoint(checkpoints[-1], load_optimizer=False)
        assert all(bool(t.float().isfinite().all()) for t in weights.values())


def _resumes_and_refusals(ray_session, tiny_corpus, tmp_path, storage, commands, base: list[str]) -> None:
    """A wrong tokenizer refused, a damaged newest checkpoint skipped, --resume-from-step, on one run."""
    from raychat.tokenizer.train import train_tokenizer

    data_dir, _ = tiny_corpus
    first = run_train(ray_session, tiny_flags(tiny_corpus, storage, "run", *base, "--num-iterations", "6"))
    assert first.returncode == 0, first.stderr[-3000:]
    run = Storage(storage).child("run")
    before = all_files(run)

    # Resuming with a tokenizer of another vocabulary is refused, and nothing is overwritten.
    other_tok = tmp_path / "other_tok"
    train_tokenizer(data_dir, other_tok, vocab_size=300, log=lambda *_: None)
    flags = tiny_flags(tiny_corpus, storage, "run", *base, "--num-iterations", "9")
    flags[flags.index("--tokenizer-dir") + 1] = str(other_tok)
    line = refusal(commands, flags, ray_session)
    assert "vocab" in line and "checkpoint_000006" in line
    assert all_files(run) == before

    # A damaged newest checkpoint is skipped for the previous one, with a warning naming it.
    newest = run.child("checkpoint_000006")
    shard = rank_file(0, read_meta(newest).world_size)
    data = newest.read_bytes(shard)
    newest.write_bytes(shard, data[: len(data) // 2])
    resumed = run_train(ray_session, tiny_flags(tiny_corpus, storage, "run", *base, "--num-iterations", "9"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping damaged checkpoint" in resumed.stdout + resumed.stderr
    assert "checkpoint_000006" in resumed.stdout + resumed.stderr
    assert "at step 3" in resumed.stdout
    assert [int(m.group(1)) for m in log_lines(resumed.stdout, STEP_LINE)] == list(range(3, 9))

    # --resume-from-step rewinds to a chosen checkpoint; an absent step is refused in one line.
    absent = tiny_flags(tiny_corpus, storage, "run", *base, "--num-iterations", "9",
                        "--resume-from-step", "4")
    line = refusal(commands, absent, ray_session)
    assert "--resume-from-step 4" in line and "checkpoint_000003" in line
    rewound = run_train(ray_session, tiny_flags(tiny_corpus, storage, "run", *base, "--num-iterations", "9",
                                                "--resume-from-step", "3"))
    assert rewound.returncode == 0, rewound.stderr[-3000:]
    assert "at step 3" in rewound.stdout
    assert [int(m.group(1)) for m in log_lines(rewound.stdout, STEP_LINE)] == list(range(3, 9))
