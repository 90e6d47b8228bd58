"""The lease's timing is its holder's (issue 48: D3, D8, D10, D11): a newcomer watches a live holder
for the holder's beats, not its own; a heartbeat below the floor is refused; a holder rides out a
storage outage and stops only once it sees a newer epoch; a create whose answer was lost is the
driver's own; a record of the wrong shape is damage in one line; and a lease lost in one rank's
background save stops every rank at the same step."""

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import s3_uri
from helpers import gloo_group, step_components

from raychat.checkpoint import fence
from raychat.checkpoint.fence import Fence, LeaseLost, LeaseRecord
from raychat.checkpoint.format import MANIFEST_FILE
from raychat.common import RaychatError
from raychat.config import add_config_flags, config_from_args
from raychat.elastic import lease
from raychat.elastic.lease import MIN_TAKEOVER_S, RunLease, takeover_wait_s
from raychat.storage import Storage
from testkit.fault_proxy import FaultProxy

QUIET = lambda _: None  # noqa: E731


@pytest.mark.unit
def test_a_newcomer_with_a_shorter_beat_waits_out_the_holders_beats(tmp_path):
    """A holder beating every 2 s is alive: a newcomer configured for 0.3 s beats used to take it
    over after 0.9 s of its own clock. It now watches for the holder's 3 x 2 s, sees a beat, and
    refuses."""
    run = Storage(str(tmp_path / "run"))
    holder = RunLease(run, heartbeat_s=2.0)
    holder.acquire(floor=lambda: 0, log=QUIET)
    try:
        assert fence.read_record(run, 1).heartbeat_s == 2.0  # the record carries the holder's timing
        with pytest.raises(RaychatError, match="being trained by another driver"):
            RunLease(run, heartbeat_s=0.3).acquire(floor=lambda: 0, log=QUIET)
        assert fence.epochs(run) == [1] and holder.lost is None
    finally:
        holder.release()


@pytest.mark.unit
def test_a_silent_lease_is_watched_for_its_holders_beats_and_never_less_than_the_floor(tmp_path):
    """A record whose holder named a tiny beat (a test's, an old raychat's) is not taken in a blink,
    and a record from before beats were kept is read with the default one."""
    run = Storage(str(tmp_path / "run"))
    silent = LeaseRecord(epoch=1, holder="gone", host="another-host", pid=1, started="then", floor=0,
                         heartbeat_s=0.05)
    assert fence.create_record(run, silent)
    said: list[str] = []
    started = time.monotonic()
    taker = RunLease(run, heartbeat_s=0.05)
    taker.acquire(floor=lambda: 0, log=said.append)
    try:
        assert time.monotonic() - started >= MIN_TAKEOVER_S and taker.epoch == 2
        assert any("stale" in line for line in said), said
    finally:
        taker.release()
    old = json.loads(silent.to_json())
    del old["heartbeat_s"]
    record = LeaseRecord.from_json(json.dumps(old).encode(), "old")
    assert record.heartbeat_s is None
    assert takeover_wait_s(record) == lease.STALE_AFTER_BEATS * lease.HEARTBEAT_S
    assert takeover_wait_s(dataclasses.replace(record, heartbeat_s=60)) == 180


@pytest.mark.unit
@pytest.mark.parametrize("value", ["0", "0.2", "-5", "nan", "inf", "fast", "1e999", "1e10"])
def test_a_heartbeat_below_the_floor_or_not_a_number_is_refused_in_one_line(tmp_path, monkeypatch, value):
    """RAYCHAT_LEASE_HEARTBEAT_S=0 gave instant takeovers and a write storm; now the driver refuses
    it when it takes the run, naming the variable."""
    monkeypatch.setenv("RAYCHAT_LEASE_HEARTBEAT_S", value)
    with pytest.raises(RaychatError, match="RAYCHAT_LEASE_HEARTBEAT_S") as refused:
        RunLease(Storage(str(tmp_path / "run")))
    assert "\n" not in str(refused.value) and "from 1 to 600" in str(refused.value)


@pytest.mark.unit
def test_a_heartbeat_at_the_floor_or_unset_is_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYCHAT_LEASE_HEARTBEAT_S", "1")
    assert RunLease(Storage(str(tmp_path / "run"))).heartbeat_s == 1.0
    monkeypatch.delenv("RAYCHAT_LEASE_HEARTBEAT_S")
    assert RunLease(Storage(str(tmp_path / "run"))).heartbeat_s == lease.HEARTBEAT_S


def _swap(path: Path, keep: Path, put: Path) -> None:
    """`path` moved to `keep` and `put` moved to `path`; whatever a beat recreated at `path` in
    between (its write makes the lease directory) is dropped."""
    path.rename(keep)
    while True:
        try:
            put.rename(path)
            return
        except OSError:
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.unit
def test_a_holder_rides_out_an_outage_and_stops_only_on_a_newer_epoch(tmp_path, monkeypatch, capfd):
    """Storage gone for 2.5 s (8 beats of 0.3 s, past a 1 s retry budget: the run directory is a
    file meanwhile, so every listing and write fails): the holder used to stop its run after 3
    beats, exit 2. Now it keeps beating, warns once the budget is spent, beats again once storage
    answers, and stops (LeaseLost, one line) only when it sees a higher epoch."""
    monkeypatch.setenv("RAYCHAT_RETRY_BUDGET_S", "1")
    lost: list[str] = []
    run = Storage(str(tmp_path / "run"))
    holder = RunLease(run, heartbeat_s=0.3, on_lost=lost.append)
    holder.acquire(floor=lambda: 0, log=QUIET)
    try:
        away, gone = tmp_path / "run.away", tmp_path / "gone"
        gone.write_text("storage is gone")
        _swap(tmp_path / "run", away, gone)
        time.sleep(2.5)
        assert holder.unconfirmed is not None and not lost and holder.lost is None
        _swap(tmp_path / "run", gone, away)
        beat = fence.read_record(run, 1).beat
        deadline = time.monotonic() + 20
        while fence.read_record(run, 1).beat == beat and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fence.read_record(run, 1).beat > beat, "no beat after storage came back"
        assert not lost and holder.lost is None
        err = capfd.readouterr().err
        for said in ("could not confirm the lease", "still retrying", "confirmed again"):
            assert said in err, err

        newer = dataclasses.replace(fence.read_record(run, 1), epoch=2, holder="newcomer")
        assert fence.create_record(run, newer)
        deadline = time.monotonic() + 20
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lost) == 1 and "lease epoch 2" in lost[0] and "\n" not in lost[0]
        with pytest.raises(LeaseLost):
            holder.check()
    finally:
        holder.release()


@pytest.mark.integration  # moto's S3 server, the fault proxy
def test_a_create_whose_answer_was_lost_is_the_drivers_own(s3_endpoint):
    """The retried create found the record the first try wrote, and the driver refused the run to
    itself ("taken by another driver ... pid <its own>"). It now counts as created."""
    with FaultProxy(s3_endpoint, seed=0) as proxy:
        lost = proxy.inject("lost_reply", method="PUT", match="/lease/epoch_", count=1)
        prefix = f"lost-reply-{time.time_ns()}"
        held = RunLease(Storage(s3_uri(proxy.address, prefix)).child("run"), heartbeat_s=60)
        held.acquire(floor=lambda: 0, log=QUIET)
        try:
            assert lost.hits == 1 and held.epoch == 1
            direct = Storage(s3_uri(s3_endpoint, prefix)).child("run")
            assert fence.epochs(direct) == [1] and fence.read_record(direct, 1).holder == held._holder
        finally:
            held.release()


@pytest.mark.unit
@pytest.mark.parametrize("data", [b"[]", b"null", b"3", b'"x"', b"{}",
                                  b'{"epoch": "x", "holder": "h", "host": "h", "pid": 1, "started": "s", '
                                  b'"floor": 0}',
                                  b'{"epoch": true, "holder": "h", "host": "h", "pid": 1, "started": "s", '
                                  b'"floor": 0}',
                                  b'{"epoch": 1, "holder": "h", "host": "h", "pid": 1, "started": "s", '
                                  b'"floor": 0, "heartbeat_s": NaN}',
                                  b'{"epoch": 1, "holder": "h", "host": "h", "pid": 1, "started": "s", '
                                  b'"floor": 0, "released": "no"}',
                                  # another epoch than its file's, or a negative floor: either would
                                  # disown checkpoints the record has nothing to do with
                                  b'{"epoch": 99, "holder": "h", "host": "h", "pid": 1, "started": "s", '
                                  b'"floor": 0}',
                                  b'{"epoch": 1, "holder": "h", "host": "h", "pid": 1, "started": "s", '
                                  b'"floor": -7}',
                                  b'{"epoch": 1, "holder": "h", "host": "h", "pid": 1, "started": "s", '
                                  b'"floor": 0, "heartbeat_s": -1}'])
def test_a_record_of_the_wrong_shape_is_damage_in_one_line(tmp_path, data):
    run = Storage(str(tmp_path / "run"))
    fence.lease_dir(run).make_dir()
    fence.lease_dir(run).write_bytes(fence.epoch_file(1), data)
    with pytest.raises(RaychatError, match=r"lease record .*epoch_00000001.json is damaged") as refused:
        RunLease(run, heartbeat_s=0.05).acquire(floor=lambda: 0, log=QUIET)
    assert "\n" not in str(refused.value)
    assert fence.epochs(run) == [1]


@pytest.mark.unit
def test_an_older_raychats_long_beat_is_read_and_watched_for_at_most_the_longest_beat(tmp_path):
    """An older raychat took any heartbeat: its record (3600 s here) is no damage, and a newcomer
    watches it for at most three of the longest beats raychat takes now."""
    run = Storage(str(tmp_path / "run"))
    fence.lease_dir(run).make_dir()
    old = (b'{"epoch": 1, "holder": "h", "host": "h", "pid": 1, "started": "s", "floor": 0, '
           b'"heartbeat_s": 3600}')
    fence.lease_dir(run).write_bytes(fence.epoch_file(1), old)
    record = fence.read_record(run, 1)
    assert record.heartbeat_s == fence.MAX_HEARTBEAT_S
    assert takeover_wait_s(record) == 3 * fence.MAX_HEARTBEAT_S


# ------------------------------------------------------------------------------------------------
# D11: a lease lost in one rank's background save stops every rank at the same step

SAVE_AT = 2
STEPS = 60  # far more than it takes to stop: a rank that trains them all never heard of the loss
VOCAB, T, ROWS = 128, 16, 8


def _config():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args([
        "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", str(T),
        "--window-pattern", "L", "--device-batch-size", "4", "--total-batch-size", str(ROWS * T),
        "--num-iterations", str(STEPS)]))


def _rows(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, T + 1), generator=torch.Generator().manual_seed(step))


def _one_rank_meets_the_takeover(rank: int, tmp: str, run_location: str) -> None:
    """A rank of the loop's step as raychat.worker.loop runs it (saver.poll, then train_step carrying
    the fault tolerance's flags, then its after_step), where only rank 0 saves at SAVE_AT, after
    another driver took the run: its background write is fenced, and no other rank's is."""
    from types import SimpleNamespace

    from raychat.checkpoint.meta import CheckpointMeta, LoopState
    from raychat.checkpoint.saver import CheckpointSaver
    from raychat.elastic import signals
    from raychat.elastic.signals import ElasticSignals
    from raychat.model.gpt import GPTConfig
    from raychat.worker.fault_tolerance import FaultTolerance
    from raychat.worker.state import state_pieces
    from raychat.worker.step import train_step

    run = Storage(run_location)
    with gloo_group(rank, tmp):
        c = step_components(_config(), VOCAB, _rows, 2, rank)
        w = SimpleNamespace(saver=CheckpointSaver(run, keep=0, rank=rank, world_size=2, log=QUIET,
                                                  fence=Fence(run, 1)),
                            master=rank == 0, log=QUIET,
                            cfg=SimpleNamespace(save_every=1, max_lost_minutes=5.0))
        ft = FaultTolerance(w, ElasticSignals(), replicator=None, first_step=0)
        out: dict = {"rank": rank}
        step = 0
        # No Ray Train context here, so no spot notice to read (this process is reused: put back below).
        deadline_of_a_notice = signals.preemption_deadline
        signals.preemption_deadline = lambda: None
        try:  # as raychat.worker.loop.train_loop_per_worker: a lost lease ends the loop without an error
            for step in range(STEPS):
                w.saver.poll()
                if step == SAVE_AT and rank == 0:
                    newer = LeaseRecord(epoch=2, holder="newcomer", host="h", pid=1, started="now", floor=0)
                    assert fence.create_record(run, newer)  # taken over after the save's own fence check
                    out["saved_at"] = time.time()
                    pieces, plain = state_pieces(c.model, c.optimizer, 2, rank)
                    meta = CheckpointMeta(step=step, model_config=GPTConfig(), world_size=2)
                    w.saver.save(step, pieces, "token", meta, extra=plain)  # in the background
                result = train_step(c, step, also_sum=ft.flags(step, busy_next=False))
                ft.after_step(LoopState(step=step), result)
        except LeaseLost as e:
            out.update(step=step, at=time.time(), message=str(e))
        finally:
            signals.preemption_deadline = deadline_of_a_notice
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
        if rank == 0:  # as a Ray worker whose loop returned, its process stays until the group ends
            deadline = time.monotonic() + 20
            while not Path(tmp, "rank1.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)


@pytest.mark.integration  # gloo ranks
def test_a_lease_lost_in_one_ranks_background_save_stops_every_rank_at_the_same_step(ranks, tmp_path):
    """Rank 0 alone met the takeover (its background write was fenced) and used to leave the loop,
    while rank 1 waited in the next step's all-reduce until the collective's timeout (30 min in a
    run). The loss now rides on the step's all-reduce: both ranks stop at the same step, promptly."""
    run = tmp_path / "run"
    assert fence.create_record(Storage(str(run)), LeaseRecord(epoch=1, holder="us", host="h", pid=1,
                                                              started="then", floor=0))
    ranks.run(_one_rank_meets_the_takeover, 2, str(tmp_path), str(run), timeout=60)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert "step" in got[0] and "step" in got[1], got
    assert got[0]["step"] == got[1]["step"] < STEPS, got
    assert max(g["at"] for g in got) - got[0]["saved_at"] < 10, got
    assert "lease epoch 2" in got[0]["message"] and "another driver" in got[1]["message"]
    assert not (run / "checkpoint_000002" / MANIFEST_FILE).exists()
