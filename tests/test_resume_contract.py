"""The resume contract, tried as an operator would: a rerun, a second driver, changed flags, a grown
corpus either continue correctly or are refused in one line before any worker starts, and no
checkpoint is lost to them."""

import re
import shutil
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import ray
import torch
from conftest import s3_uri
from helpers import STEP_LINE, all_files, copy_tree, log_lines, one_error_line, run_train, tiny_flags

from raychat.checkpoint import fence
from raychat.checkpoint.catalog import list_checkpoints
from raychat.checkpoint.format import read_meta
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.reader import CheckpointReader
from raychat.checkpoint.resume import candidates
from raychat.checkpoint.saver import CheckpointSaver
from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.corpus.writer import CorpusWriter
from raychat.locations import redact
from raychat.model.gpt import GPTConfig, build_model
from raychat.model.precision import resolve_precision
from raychat.optim.muon_adamw import build_optimizer
from raychat.run.driver import ray_storage
from raychat.storage import Storage
from raychat.worker.state import apply_share, read_share, state_pieces

SECRET_URI = "s3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http"


@pytest.mark.unit
def test_credentials_never_leave_the_uri():
    assert redact(SECRET_URI) == "s3://***@bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    with_params = "s3://bucket/runs?access_key=AK&secret_key=SK&session_token=T&region=eu"
    assert redact(with_params) == "s3://bucket/runs?access_key=***&secret_key=***&session_token=***&region=eu"
    assert redact("/data/runs") == "/data/runs"
    shown = TrainConfig(storage_path=SECRET_URI, data_dir=SECRET_URI).to_public_dict()
    assert "wJalrXUtnFEMI" not in str(shown) and "AKIDEXAMPLE" not in str(shown)
    # Ray Train is given a filesystem object and the bare path: its run settings show no secret.
    settings = ray_storage(SECRET_URI)
    assert settings["storage_path"] == "bucket/runs" and "storage_filesystem" in settings
    assert ray_storage("/data/runs") == {"storage_path": "/data/runs"}


@pytest.mark.unit
def test_a_checkpoint_the_driver_chose_that_is_gone_is_an_error(tmp_path):
    run = Storage(str(tmp_path / "run"))
    assert candidates(run, "session", None) == []  # a fresh run
    with pytest.raises(RaychatError, match="checkpoint_000005 .* is gone"):
        candidates(run, "session", "checkpoint_000005")


def _optimizer(lr_scale: float):
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                       window_pattern="L")
    cpu = torch.device("cpu")
    model = build_model(config, cpu, resolve_precision("fp32", False, "tensorwise", cpu))
    optimizer = build_optimizer(model, embedding_lr=0.3 * lr_scale, unembedding_lr=0.004 * lr_scale,
                                matrix_lr=0.02 * lr_scale, scalar_lr=0.5 * lr_scale,
                                weight_decay=0.1 * lr_scale)
    return model, optimizer


@pytest.mark.unit
def test_resumed_optimizer_keeps_the_rates_it_was_built_with(tmp_path):
    """The worker's resume path (its pieces saved, read back by read_share/apply_share): the moments
    come back, the rates are the rerun's."""
    model, optimizer = _optimizer(1.0)
    x = torch.randint(0, 64, (2, 16))
    model(x, x).backward()
    optimizer.step()
    saver = CheckpointSaver(Storage(str(tmp_path)), keep=0, rank=0, world_size=1, log=lambda _: None)
    pieces, plain = state_pieces(model, optimizer, 1, 0)
    saver.save(1, pieces, "token", CheckpointMeta(step=1, model_config=GPTConfig()), extra=plain, wait=True)
    saver.close()

    lower_model, lower = _optimizer(0.1)  # the rerun after a NaN, with rates lowered tenfold
    built = [{k: v for k, v in g.items() if k not in ("params", "names")} for g in lower.param_groups]
    with CheckpointReader(tmp_path / "checkpoint_000001") as reader:
        share = read_share(reader, lower_model, lower, 1, 0)
    apply_share(share, lower_model, lower, 1, torch.device("cpu"))
    assert [{k: v for k, v in g.items() if k not in ("params", "names")} for g in lower.param_groups] == built
    saved = optimizer.state_dict()
    assert built[0]["initial_lr"] != saved["param_groups"][0]["initial_lr"]
    resumed = lower.state_dict()["state"]
    assert resumed.keys() == saved["state"].keys()
    for name, entry in saved["state"].items():  # the moments came back
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(resumed[name][key]), torch.as_tensor(value)), (name, key)


@pytest.mark.ray
def test_reruns_of_a_run_continue_or_are_refused_and_lose_nothing(ray_session, tiny_corpus, tmp_path):
    storage = tmp_path / "storage"
    base = ["--num-workers", "1", "--total-batch-size", "512", "--eval-every", "-1", "--save-every", "3"]
    first = run_train(ray_session, tiny_flags(tiny_corpus, storage, "run", *base, "--num-iterations", "6"))
    assert first.returncode == 0, first.stderr[-3000:]
    run = Storage(str(storage)).child("run")
    before = all_files(run)

    # A shorter horizon than the checkpoint's step: refused, nothing written.
    line = one_error_line(run_train(ray_session, tiny_flags(tiny_corpus, storage, "run", *base,
                                                            "--num-iterations", "4")))
    assert "checkpoint_000006" in line and "past this plan's horizon of 4 steps" in line
    assert all_files(run) == before

    # The same horizon again: nothing to train, no checkpoint rewritten.
    again = run_train(ray_session, tiny_flags(tiny_corpus, storage, "run", *base, "--num-iterations", "6"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already reached its horizon" in again.stdout
    assert all_files(run) == before

    # A second driver while the first trains: refused in one line. Then the first driver pauses
    # (SIGSTOP: a long GC, a partition) past the takeover: a third takes the run over, the paused
    # one's workers write nothing more (they stop at their next save), and once resumed the paused
    # driver stops with one line naming the new holder. Nothing it wrote after the takeover is kept.
    longer = tiny_flags(tiny_corpus, storage, "run", *base, "--num-iterations", "400")
    beat = {"RAYCHAT_LEASE_HEARTBEAT_S": "1"}
    paused = subprocess.Popen([sys.executable, "-m", "raychat.train", *longer], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=ray_session.driver_env(**beat))
    taker = None
    try:
        for line in paused.stdout:  # the first step line: the lease is held and workers train
            if log_lines(line, STEP_LINE):
                break
        second = run_train(ray_session, longer, **beat)
        assert "being trained by another driver" in one_error_line(second)
        # The paused driver's coordinator owns the replica holders: their memory must not stay held
        # beside the taker's while it sleeps.
        record = fence.read_record(run, 2)  # epochs: 1 the first run, 2 this one
        paused_coordinator = ray.get_actor(record.coordinator, namespace=record.namespace)
        paused_holders = list(ray.get(paused_coordinator.replica_holders.remote([])).values())
        assert paused_holders
        paused.send_signal(signal.SIGSTOP)
        taker = subprocess.Popen([sys.executable, "-m", "raychat.train", *longer], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=ray_session.driver_env(**beat))
        taken = []
        for line in taker.stdout:
            taken.append(line)
            if log_lines(line, STEP_LINE):
                break
        assert any("is stale" in line and "taking it over" in line for line in taken), "".join(taken)[-3000:]
        ended = f"took the run over from (lease epoch 2), with its {len(paused_holders)} replica holder(s)"
        assert any(ended in line for line in taken), "".join(taken)[-3000:]
        assert _ends([paused_coordinator.poll_request, *(holder.nbytes for holder in paused_holders)])
        resumed_at = fence.read_record(run, 3).resumed  # epochs: 1 the first run, 2 paused, 3 taker
        paused.send_signal(signal.SIGCONT)
        out, _ = paused.communicate(timeout=120)
        assert paused.returncode == 2, out[-3000:]
        lost = [line for line in out.splitlines() if line.startswith("raychat: error:")]
        assert len(lost) == 1 and "taken over by another driver" in lost[0], out[-3000:]
        assert f"pid {taker.pid}" in lost[0] and "lease epoch 3" in lost[0]
        # Its workers had stopped by themselves at their first save after the takeover: the fence.
        fenced = "(lease epoch 3, this writer's 2): this writer stopped and wrote nothing more"
        assert fenced in out, out[-3000:]
    finally:
        for driver in (paused, taker):
            if driver is not None and driver.poll() is None:
                driver.send_signal(signal.SIGCONT)
                driver.send_signal(signal.SIGINT)  # Ctrl-C: the driver lets go of its lease
                driver.wait(timeout=120)
    # No checkpoint the paused driver's workers wrote after the takeover can be chosen.
    for checkpoint in list_checkpoints(run):
        meta = read_meta(checkpoint)
        assert meta.lease_epoch == 3 or meta.sequence <= resumed_at, (checkpoint.name, meta.sequence)
    assert fence.read_record(run, 3).released
    assert fence.epochs(run) == [1, 2, 3]  # refused drivers and a finished run's rerun created none


@pytest.mark.ray
def test_a_grown_corpus_is_refused_before_any_worker(ray_session, tiny_corpus, two_worker_run, s3_endpoint,
                                                      tmp_path):
    """A copy of conftest's `two_worker_run` (in the bucket, at step 20: a copy, so that what this test
    breaks shows here), re-run on its corpus re-prepared with more documents: the driver refuses it,
    and nothing of the run changes."""
    data_dir, _ = tiny_corpus
    grown = tmp_path / "grown"
    shutil.copytree(data_dir, grown)
    storage = s3_uri(s3_endpoint, f"grown-corpus-{time.time_ns()}")
    run = Storage(storage).child(two_worker_run.name)
    copy_tree(Storage(two_worker_run.storage).child(two_worker_run.name), run)
    before = all_files(run)
    # One more train shard (the corpus was re-prepared with more documents).
    shards = sorted(grown.glob("shard_*.parquet"))
    texts = [t for s in shards for t in pq.read_table(s)["text"].to_pylist()]
    for shard in shards:
        shard.unlink()
    with CorpusWriter(grown, docs_per_shard=40) as writer:
        writer.add_train(texts[:-40] + texts[:40])
        writer.add_val(texts[-40:])
    # --max-failures -1: a refusal a worker made (not the driver) would retry it without end
    rerun = tiny_flags(tiny_corpus, storage, two_worker_run.name, *two_worker_run.flags,
                       "--num-iterations", "24", "--max-failures", "-1")
    rerun[rerun.index("--data-dir") + 1] = str(grown)
    result = run_train(ray_session, rerun, timeout=300)
    line = one_error_line(result)
    saved, now = map(int, re.search(r"corpus of (\d+) train row groups, but .* has (\d+)", line).groups())
    assert now == saved + 1 and str(grown) in line and "new --run-name" in line
    assert "Resumed from" not in result.stdout + result.stderr  # refused by the driver
    assert all_files(run) == before


@pytest.mark.unit
def test_a_rank_with_another_tokenizer_is_refused_in_one_line(tiny_corpus, tmp_path):
    """A node whose tokenizer directory was made at another time (another vocabulary) is refused by
    name before it trains a token; the driver's own tokenizer passes."""
    from raychat.tokenizer.core import Tokenizer
    from raychat.tokenizer.train import train_tokenizer
    from raychat.worker.setup import _the_drivers_tokenizer

    data_dir, tokenizer_dir = tiny_corpus
    drivers = Tokenizer.load(tokenizer_dir).fingerprint
    assert _the_drivers_tokenizer(str(tokenizer_dir), drivers, "rank 0").fingerprint == drivers
    other = tmp_path / "other-tokenizer"
    train_tokenizer(data_dir, other, vocab_size=300, log=lambda *_: None)
    with pytest.raises(RaychatError, match="rank 1 \\(10.0.0.2\\) loads another tokenizer") as err:
        _the_drivers_tokenizer(str(other), drivers, "rank 1 (10.0.0.2)")
    assert str(other) in str(err.value) and "\n" not in str(err.value)


def _ends(calls: list, within_s: float = 30.0) -> bool:
    """Whether each actor method's actor is dead within `within_s` (an owner's death reaches the
    actors it owns a moment later)."""
    deadline = time.monotonic() + within_s
    for call in calls:
        while True:
            try:
                ray.get(call.remote(), timeout=within_s)
            except ray.exceptions.RayActorError:
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


@pytest.mark.ray
def test_only_the_coordinator_a_takeover_names_is_ended(ray_session):
    """The record of the epoch taken over names its driver's coordinator: that one ends, with its
    replica holders. A record naming an actor raychat did not start, or none, ends nothing."""
    import uuid

    from raychat.checkpoint.fence import LeaseRecord
    from raychat.elastic.coordinator import (
        _LIVE,
        coordinator_name,
        end_coordinator_taken_over,
        start_coordinator,
    )

    @ray.remote(num_cpus=0)
    class Bystander:
        def replica_holders(self, node_ids: list[str]) -> dict:
            return {}

    namespace = ray.get_runtime_context().namespace
    paused, other = uuid.uuid4().hex, uuid.uuid4().hex
    coordinator, bystander = start_coordinator(paused), Bystander.options(name=f"bystander-{other}").remote()
    try:
        holders = ray.get(coordinator.replica_holders.remote([ray.get_runtime_context().get_node_id()]))
        ray.get([holder.nbytes.remote() for holder in holders.values()])  # up
        record = LeaseRecord(epoch=4, holder="h", host="host", pid=1, started="then", floor=0)
        said: list[str] = []
        for foreign in (None, f"bystander-{other}", coordinator_name(other)):
            record.coordinator, record.namespace = foreign, namespace
            end_coordinator_taken_over(record, log=said.append)
        end_coordinator_taken_over(None, log=said.append)  # a clean hand-over
        assert not said and ray.get(bystander.replica_holders.remote([])) == {}
        assert ray.get(coordinator.poll_request.remote()) is False  # still alive

        record.coordinator = coordinator_name(paused)
        end_coordinator_taken_over(record, log=said.append)
        assert said == ["Ended the coordinator of the driver this one took the run over from (lease epoch "
                        "4), with its 1 replica holder(s) (0.0 MiB of memory freed)"]
        assert _ends([coordinator.poll_request, *(holder.nbytes for holder in holders.values())])
    finally:
        _LIVE.pop(paused, None)
        ray.kill(bystander)


@pytest.mark.ray
def test_a_takeover_releases_only_the_reservation_of_the_epoch_it_took_over(ray_session, tmp_path):
    """The run directory's reservation record (RecordReservation) says which lease epoch's controller
    holds a request with Ray's autoscaling coordinator. A driver releases it only when it took the run
    over from that epoch: a clean hand-over, or a superseded driver that wakes holding an older epoch's
    record, must not cancel the request of a controller still training."""
    import json
    import uuid

    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    from raychat.checkpoint.fence import LeaseRecord
    from raychat.elastic.controller import RESERVATION_FILE, release_stale_reservation

    coordinator = get_or_create_autoscaling_coordinator()
    requester = f"train-{uuid.uuid4().hex}"

    def held() -> dict:
        return ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True), timeout=30)

    try:
        ray.get(coordinator.request_resources.remote(requester_id=requester, resources=[{"CPU": 1}],
                                                     expire_after_s=300), timeout=30)
        assert held()
        run_dir = Storage(str(tmp_path))
        run_dir.write_bytes(RESERVATION_FILE, json.dumps({"requester": requester, "epoch": 2}).encode())
        said: list[str] = []
        for taken_over in (None, 1, 3):  # a clean hand-over; a driver that took over another epoch
            record = None if taken_over is None else LeaseRecord(epoch=taken_over, holder="h", host="host",
                                                                 pid=1, started="then", floor=0)
            release_stale_reservation(run_dir, record, log=said.append)
        assert held() and not said

        epoch_2 = LeaseRecord(epoch=2, holder="h", host="host", pid=1, started="then", floor=0)
        release_stale_reservation(run_dir, epoch_2, log=said.append)
        assert not held()
        assert said == [f"Released the resources Ray still reserved for this run's previous controller "
                        f"({requester}, 1 node(s)): its driver ended without releasing them"]
    finally:
        ray.get(coordinator.cancel_request.remote(requester), timeout=30)


@pytest.mark.ray
def test_resize_requests_belong_to_one_attempt_and_the_last_step_answers_them(ray_session):
    """The run's real coordinator actor and the controller's real callback: a request the old group
    never answered is dropped when the controller starts the next group; one for the new group that
    comes before its rank 0 has started the attempt (a grow decided as soon as the group runs) is
    kept and answered, and the attempt still says the planned resize it came from; one that arrives
    at (or after) the last step is answered with the final step, so the controller does not hold
    the resize for SAVE_WAIT_S."""
    import uuid

    import ray

    from raychat.elastic.controller import PlannedResizeSave
    from raychat.elastic.coordinator import _LIVE, FinalResult, start_coordinator
    from raychat.elastic.signals import ElasticSignals
    from raychat.ray_glue.ray_internals import ResizeDecision, RunningState, SchedulingState

    def group_started(workers: int) -> None:  # what the controller's state update says, in order
        scheduled = SchedulingState(ResizeDecision(num_workers=workers, resources_per_worker={"CPU": 1}))
        PlannedResizeSave(session).after_controller_state_update(scheduled, RunningState())

    session = uuid.uuid4().hex
    coordinator = start_coordinator(session)
    try:
        group_started(2)
        ray.get(coordinator.start_attempt.remote(0, 2))
        ray.get(coordinator.request_save.remote())  # the old group dies before answering
        group_started(2)
        ray.get(coordinator.start_attempt.remote(5, 2))
        assert ray.get(coordinator.poll_request.remote()) is False

        # A planned shrink's save, then a grow decided while the smaller group still sets up: its
        # request reaches that group's rank 0 after the attempt starts, and the attempt is the
        # planned resize's.
        ray.get(coordinator.request_save.remote())
        ray.get(coordinator.saved.remote(6))
        group_started(1)
        ray.get(coordinator.request_save.remote())
        assert ray.get(coordinator.get_saved_step.remote()) is None  # the controller waits for it
        assert ray.get(coordinator.start_attempt.remote(6, 1)).planned_step == 6
        assert ray.get(coordinator.poll_request.remote()) is True
        ray.get(coordinator.saved.remote(7))
        assert ray.get(coordinator.get_saved_step.remote()) == 7
        group_started(2)
        assert ray.get(coordinator.start_attempt.remote(7, 2)).planned_step == 7
        ray.get(coordinator.start_attempt.remote(5, 2))  # (the rest as before: a restart from step 5)
        assert ray.get(coordinator.poll_request.remote()) is False

        # Rank 0's one call per step tells the step done and brings back the request: a reply that
        # comes later than the next step is still read (the oldest unread one is kept).
        signals = ElasticSignals(coordinator)
        assert signals._poll_resize() is False  # nothing asked yet this attempt
        ray.get(coordinator.request_save.remote())
        signals.progress(5)
        signals.progress(6)
        deadline = time.monotonic() + 30
        while not signals._poll_resize():
            assert time.monotonic() < deadline, "the request never reached rank 0"
            time.sleep(0.01)
        signals.progress(7)  # after the step that heard it: its reply still says "save"
        signals.resize_saved(8)
        signals.progress(8)
        ray.get(signals.save_request)
        assert signals._poll_resize() is False  # saved once: a group not stopped trains on
        assert ray.get(coordinator.start_attempt.remote(9, 2)).last_step == 8  # what a restart redoes

        ray.get(coordinator.request_save.remote())  # arrives at the last step: the loop saves no more
        ray.get(coordinator.finish.remote(FinalResult(step=9, tokens_so_far=0, min_val_bpb=1.0,
                                                      total_training_time=0.0)))
        assert ray.get(coordinator.get_saved_step.remote()) == 9
        callback = PlannedResizeSave(session, wait_s=60)
        callback._planned = True  # the controller saw a healthy group about to be resized
        callback.before_controller_execute_resize_decision(None)  # after the finish: answered at once
        assert ray.get(coordinator.get_saved_step.remote()) == 9
        assert ray.get(coordinator.poll_request.remote()) is False
    finally:
        ray.kill(_LIVE.pop(session))
