"""The memory tier (raychat.elastic.replicas): where each rank's replica goes, which set a restore takes,
how often auto replicates, and a real holder actor that keeps two steps and gives the state back bit
for bit through the sharded reader's interface. A node lost mid-run is in tests/test_elastic.py."""

import time

import pytest
import ray
import torch
from helpers import assert_bitwise_equal, modules_loaded_by, step_components

from raychat.checkpoint.meta import LoopState
from raychat.config import TrainConfig
from raychat.data.cursor import RankCursor, merge_cursor
from raychat.elastic.cadence import REPLICA_STALL_BUDGET, holder_bytes, replica_line
from raychat.elastic.holders import Replica, ReplicaHolder, start_holders
from raychat.elastic.replicas import (
    MemoryRestore,
    Replicator,
    choose_replica_interval,
    choose_set,
    peer_nodes,
    replicas_needed,
    retain_only,
)
from raychat.elastic.signals import ElasticSignals, StepFlags
from raychat.model.gpt import GPTConfig
from raychat.worker.state import apply_share, read_share, state_pieces
from raychat.worker.step import train_step

CPU = torch.device("cpu")


@pytest.mark.unit
def test_each_rank_is_mirrored_on_the_next_node_of_the_ring():
    # ranks 0,1 on node b, 2 on a, 3 on c: the ring is a -> b -> c -> a
    assert peer_nodes(["b", "b", "a", "c"]) == ["c", "c", "b", "a"]
    assert peer_nodes(["a", "b"]) == ["b", "a"]
    assert peer_nodes(["a", "a"]) == [None, None]  # one node: no copy survives it


def _inventory(epoch, step, attempt, ranks, world):
    return [{"epoch": epoch, "key": (step, attempt), "rank": r, "world_size": world, "pieces": []}
            for r in ranks]


@pytest.mark.unit
def test_a_restore_takes_the_newest_whole_set_of_its_epoch_not_older_than_storage():
    # holder A kept ranks 0 of steps 10 and 11, holder B rank 1 of step 10 only (11 was in flight)
    a = _inventory(3, 10, 0, [0], 2) + _inventory(3, 11, 0, [0], 2)
    b = _inventory(3, 10, 0, [1], 2)
    assert choose_set([a, b], epoch=3, min_step=0) == ((10, 0), 2)
    assert choose_set([a, b], epoch=3, min_step=11) is None  # storage is newer
    assert choose_set([a, b], epoch=4, min_step=0) is None  # a superseded driver's replicas
    assert choose_set([a], epoch=3, min_step=0) is None  # rank 1's holder is gone
    # a later attempt's set of the same step at another world size is its own set
    c = _inventory(3, 11, 1, [0, 1, 2], 3)
    assert choose_set([a, b, c], epoch=3, min_step=0) == ((11, 1), 3)


@pytest.mark.unit
def test_the_storage_cadence_leans_on_peer_memory_only_while_a_peer_holds_a_recent_replica():
    peered = Replicator(object(), object(), epoch=1, attempt=0, log=print, warn=print, every=3)
    alone = Replicator(object(), None, epoch=1, attempt=0, log=print, warn=print, every=3)
    try:
        assert peered.peer_interval(10, [None, None]) is None  # nothing replicated, nothing held yet
        peered.replicated.extend([10, 13])  # the last two steps replicated (a holder keeps two per rank)
        # every rank holds one of them: all hold step 10, a whole set; the interval is --replicate-every's
        assert peered.peer_interval(14, [10, 13]) == 3 and peered.peer_interval(14, [13, 13]) == 3
        # rank 0's replicas held, another rank's not (its sends fail or its peer holder hangs): that
        # rank's state would come from storage, so storage saves may not lean on memory
        assert peered.peer_interval(14, [13, None]) is None and peered.peer_interval(14, []) is None
        # a rank whose newest held step is older than both (its sends fail while others' land): no
        # whole set of a recent step
        assert peered.peer_interval(14, [13, 7]) is None
        # a hung holder: 13's send in flight (up to HOLDER_CALL_S) skips every step after it on all
        # ranks, so nothing moves; two intervals and a step past 10, the set is stale
        assert peered.peer_interval(17, [13, 10]) == 3 and peered.peer_interval(18, [13, 10]) is None
        # sends slower than the interval (a loaded host): steps 14-21 skipped while 13's was in flight,
        # 22 replicated; 13 is held by all, so a whole set exists, 9 steps apart: the interval they keep
        peered.replicated.append(22)
        assert peered.peer_interval(25, [13, 13]) == 9 and peered.peer_interval(25, [22, 13]) == 9
        # ... and once 22 landed everywhere, saves up to 2 x 9 + 1 steps on lean on it (the next send going)
        assert peered.peer_interval(41, [22, 22]) == 9 and peered.peer_interval(42, [22, 22]) is None
        # every send failing (the holders gone) while replication goes on: the held steps fall behind
        peered.replicated.append(25)
        assert peered.peer_interval(26, [13, 13]) is None
        alone.replicated.extend([7, 10])
        assert alone.peer_interval(11, [10, 10]) is None  # a one-node group: its node's copy dies with it
    finally:
        peered.close()
        alone.close()


@pytest.mark.unit
def test_auto_interval_loses_least_at_the_planned_loss_rate_within_the_budgets():
    # Young/Daly at one loss per 600 s: a 10 ms copy every T s against T/2 redone per loss is least
    # at T = sqrt(2 x 0.01 x 600) = 3.46 s, where 1 step would do for the 2% budget (0.01 / 0.02)
    assert replicas_needed(step_s=1.0, stall_s=0.01, send_s=0.5) == pytest.approx(12 ** 0.5)
    # a copy that fits in the step's shadow (a GPU's, 0.5 ms): 0.77 steps, every step
    assert choose_replica_interval(replicas_needed(step_s=1.0, stall_s=0.0005, send_s=0.1)) == 1
    # a long copy: the 2% budget needs 30 steps (0.6 / (0.02 x 1)), more than sqrt(2 x 0.6 x 600) = 26.8
    assert replicas_needed(step_s=1.0, stall_s=0.6, send_s=0.5) == pytest.approx(30.0)
    # the send takes 35 steps, and the host stays idle half the time: 70 (Young: 11)
    assert replicas_needed(step_s=0.1, stall_s=0.001, send_s=3.5) == pytest.approx(70.0)
    # training on the host's CPUs: the send is taken from it, copy and send together are the cost:
    # sqrt(2 x 0.06 x 600) = 8.49 s (the 2% budget alone: 3 steps)
    compete = replicas_needed(step_s=1.0, stall_s=0.01, send_s=0.05, sends_compete=True)
    assert compete == pytest.approx(72 ** 0.5)
    assert choose_replica_interval(2.5) == 3 and choose_replica_interval(7.0) == 7
    assert choose_replica_interval(0.3) == 1
    # measurements that wobble around a boundary keep the interval (the log said 1, 2, 1, 2, ... before)
    assert choose_replica_interval(1.2, current=1) == 1 and choose_replica_interval(0.9, current=2) == 2
    assert choose_replica_interval(1.6, current=1) == 2 and choose_replica_interval(0.5, current=2) == 1
    assert choose_replica_interval(7.0, current=3) == 7
    # per node: its own ranks' and its peer's ranks' shares, two steps each
    assert holder_bytes(share_bytes=100, ranks_per_node=2) == 800
    line = replica_line(0, share_bytes=2**30)
    assert "auto (--replicate-every 0)" in line and "4.00 GiB held per rank on each node" in line
    assert "off (--replicate-every -1)" in replica_line(-1)


@pytest.mark.unit
def test_auto_replicates_at_least_as_often_as_an_explicit_save_interval():
    """A restore reads the newer of memory and storage: replicas rarer than --save-every N are never
    read, so auto takes N where its own interval is longer, but never so often that the copies pass
    their budget (2% of training): a faster restore is not worth that."""
    def auto_interval(saves_every: int, copy_s: float = 0.01, send_s: float = 0.02,
                      step_s: float = 0.5) -> tuple[int, list[str]]:
        lines: list[str] = []
        replicator = Replicator(None, None, epoch=1, attempt=0, log=lines.append, warn=lines.append,
                                sends_compete=True, saves_every=saves_every)
        try:
            replicator.replicated.append(2)
            replicator.send_cpu_s = send_s
            replicator.writer.snapshot_seconds = copy_s
            replicator.auto_due(3, 0, step_s=step_s)
        finally:
            replicator.close()
        return replicator.every, lines

    # sqrt(2 x 0.03 x 600) = 6 s: 12 steps of 0.5 s (the budget: 0.03 / 0.02 = 1.5 s, 3 steps)
    assert auto_interval(0)[0] == 12 and auto_interval(20)[0] == 12 and auto_interval(-1)[0] == 12
    every, lines = auto_interval(10)
    assert every == 10 and lines[-1].endswith(", as often as --save-every)"), lines
    # A 200 ms copy and a 100 ms send beside 300 ms steps: the budget needs 0.3 / 0.02 = 15 s, 50 steps,
    # whatever --save-every 1 asks (Young's own: sqrt(2 x 0.3 x 600) = 19 s, 64 steps).
    assert auto_interval(0, copy_s=0.2, send_s=0.1, step_s=0.3)[0] == 64
    every, lines = auto_interval(1, copy_s=0.2, send_s=0.1, step_s=0.3)
    assert every == 50 and "--save-every" not in lines[-1], lines


def _rows(step: int) -> torch.Tensor:
    return torch.randint(0, 200, (4, 17), generator=torch.Generator().manual_seed(step))


def _components():
    """A d2 model and its MuonAdamW as a worker builds them (tests/helpers.py), 4 rows of 16 a step."""
    cfg = TrainConfig(depth=2, aspect_ratio=32, head_dim=32, max_seq_len=16, window_pattern="L",
                      device_batch_size=4, total_batch_size=64, num_iterations=8)
    return step_components(cfg, 200, _rows)


def _train(c, steps):
    for step in steps:
        train_step(c, step)


def _replica(model, optimizer, step, epoch=7, attempt=0):
    pieces, plain = state_pieces(model, optimizer, 1, 0)
    # a host copy, as the replicator's snapshot is: the live tensors train on
    pieces = [p._replace(tensor=p.tensor.clone()) for p in pieces]
    return Replica(epoch=epoch, attempt=attempt, step=step, rank=0, world_size=1, pieces=pieces,
                   cursor=RankCursor(0, 1, 5, [[1, 2, 0, 3]]), extra=plain, units=(9, 1234),
                   loop_state=LoopState(step=step, min_val_bpb=2.5), log_tail=[f'{{"step": {step - 1}}}'])


@pytest.mark.ray
def test_a_holder_keeps_two_steps_and_gives_the_state_back_bit_for_bit(ray_session):
    c = _components()
    model, optimizer = c.model, c.optimizer
    holder, peer = ReplicaHolder.remote(), ReplicaHolder.remote()
    try:
        _train(c, range(2))
        at_step_2 = _replica(model, optimizer, 2)
        ray.get(holder.put.remote(at_step_2))
        expected_model = {k: v.clone() for k, v in model.state_dict().items()}
        expected_optim = optimizer.state_dict()
        _train(c, [2])
        ray.get(holder.put.remote(_replica(model, optimizer, 3)))
        _train(c, [3])
        held = ray.get(holder.put.remote(_replica(model, optimizer, 4)))
        keys = sorted({tuple(r["key"]) for r in ray.get(holder.inventory.remote())})
        assert keys == [(3, 0), (4, 0)]  # the newest two steps
        one_step = sum(p.tensor.nbytes for p in _replica(model, optimizer, 4).pieces)
        assert held == 2 * one_step

        # A new attempt resumed from step 3: the holder keeps that set alone.
        retain_only([holder], (3, 0))
        assert {tuple(r["key"]) for r in ray.get(holder.inventory.remote())} == {(3, 0)}
        ray.get(holder.put.remote(at_step_2))  # an older step, put back for the read below
        retain_only([holder], (2, 0))
        ray.get(peer.put.remote(at_step_2))  # the peer node's copy of it

        # The restore's own path: rank 0 chooses, every rank reads its share through the reader.
        logs: list[str] = []
        restore = MemoryRestore.agree([holder, peer], epoch=7, min_step=0, model=GPTConfig(), rank=0,
                                      all_gather=lambda obj: [obj], log=logs.append)
        assert restore is not None and restore.meta.step == 2 and restore.meta.loop_state.min_val_bpb == 2.5
        assert restore.meta.cursor == merge_cursor([RankCursor(0, 1, 5, [[1, 2, 0, 3]])], 9, 1234)
        assert restore.log_tail == ['{"step": 1}']  # the step records rank 0 held back, for the new attempt
        fresh = _components()
        fresh_model, fresh_optimizer = fresh.model, fresh.optimizer
        share = restore.load(lambda reader: read_share(reader, fresh_model, fresh_optimizer, 1, 0))
        apply_share(share, fresh_model, fresh_optimizer, 1, CPU)
        assert_bitwise_equal(fresh_model.state_dict(), expected_model)
        # (the state; not the groups' lr, which the step sets from the schedule before each update)
        assert_bitwise_equal(fresh_optimizer.state_dict()["state"], expected_optim["state"])
        assert not logs

        # Another epoch's driver finds nothing to restore; a holder that is gone is a set lost.
        assert MemoryRestore.agree([holder], epoch=8, min_step=0, model=GPTConfig(), rank=0,
                                   all_gather=lambda obj: [obj], log=logs.append) is None
        # Kept twice, a piece is read from the rank's own node's holder: the other may be gone.
        ray.kill(holder)
        again = _components()
        share = restore.load(lambda reader: read_share(reader, again.model, again.optimizer, 1, 0),
                             local=peer)
        apply_share(share, again.model, again.optimizer, 1, CPU)
        assert_bitwise_equal(again.model.state_dict(), expected_model)
        assert not logs
        # With no local holder, the first listed is read first: it is gone, so the other copy is read.
        other = _components()
        share = restore.load(lambda reader: read_share(reader, other.model, other.optimizer, 1, 0))
        apply_share(share, other.model, other.optimizer, 1, CPU)
        assert_bitwise_equal(other.model.state_dict(), expected_model)
        assert not logs
        # Both copies gone: the set is lost, and every rank resumes from storage.
        ray.kill(peer)
        assert restore.load(lambda reader: read_share(reader, fresh_model, fresh_optimizer, 1, 0)) is None
        assert logs and "could not be read whole" in logs[-1] and "resuming from storage" in logs[-1]
    finally:
        ray.kill(holder)
        ray.kill(peer)


@ray.remote(num_cpus=0)
class _HungHolder:
    """A holder that keeps the steps put to it; the put after `hang` takes that long (its node stopped
    answering for a while)."""

    def __init__(self, hang_s: float):
        import torch  # noqa: F401  (as a real holder loads it when it starts: raychat.elastic.holders)

        self.hang_s, self.steps = hang_s, []

    def hang(self, seconds: float) -> None:
        self.hang_s = seconds

    def put(self, replica: Replica) -> None:
        time.sleep(self.hang_s)
        self.hang_s = 0.0
        self.steps.append(replica.step)

    def kept(self) -> list[int]:
        return self.steps


@ray.remote(num_cpus=0)
class _CountingHolder:
    """A holder that counts how often it is asked whether it is alive."""

    def __init__(self):
        self.asked = 0

    def nbytes(self) -> int:
        self.asked += 1
        return 0

    def times_asked(self) -> int:
        return self.asked


@pytest.mark.ray
def test_holders_are_started_and_checked_once_per_node_however_many_ranks_it_has(ray_session):
    """Eight ranks on a node list it eight times: its holder is checked once (a holder just started
    would otherwise be waited for, on every attempt's set-up path), and a node without one gets one."""
    here = ray.get_runtime_context().get_node_id()
    alive, started = _CountingHolder.remote(), {}
    try:
        holders = start_holders({here: alive}, [here] * 8)
        assert holders == {here: alive} and ray.get(alive.times_asked.remote()) == 1
        start_holders(started, [here] * 8)
        assert list(started) == [here] and ray.get(started[here].nbytes.remote()) == 0
    finally:
        for holder in [alive, *started.values()]:
            ray.kill(holder)


@pytest.mark.ray
def test_every_step_is_replicated_and_a_hung_holder_stalls_none_every_rank_skipping_alike(ray_session):
    """Fixed --replicate-every 1, two ranks, the loop's protocol (raychat.worker.loop): each rank
    replicates when the last step's summed flags say so (raychat.elastic.signals.ElasticSignals), its
    still-sending flag asked at the step's all-reduce, after the step's work. Healthy holders keep
    every step. Then rank 1's holder hangs for 6 s: both ranks skip the same steps (a restore needs
    whole sets), rank 0 says so once, no step waits, and the last step, replicated unasked, is
    skipped by all while a rank is still sending."""
    c = _components()
    holders = [_HungHolder.remote(0.0), _HungHolder.remote(0.0)]
    logs: list[str] = []
    ranks = [Replicator(holder, None, epoch=7, attempt=0, log=log, warn=logs.append, every=1)
             for holder, log in zip(holders, [logs.append, lambda line: None], strict=True)]
    signals = [ElasticSignals(), ElasticSignals()]
    step_s = 0.3  # a step's work; the healthy sends (a d2 model's state) take a few ms

    def steps(first: int, last: int, last_step: int = 100) -> None:
        for step in range(first, last + 1):
            for replicator, mine in zip(ranks, signals, strict=True):
                if (step == last_step and not mine.any_sending) or mine.replicate_due:
                    replicator.replicate(_replica(c.model, c.optimizer, step))
                elif mine.replicate_skipped:
                    replicator.skipped(step)
            time.sleep(step_s)
            # each rank's flags at the all-reduce, as local_flags makes them (it reads the Ray Train
            # context for a spot notice, which a test has not), summed as the all-reduce does
            flags = [StepFlags(replicate=float(rank == 0 and replicator.wanted(step + 1, 0, step_s)),
                               sending=float(replicator.sending())).values()
                     for rank, replicator in enumerate(ranks)]
            for mine in signals:
                mine.update(StepFlags.from_values([sum(values) for values in zip(*flags, strict=True)]))

    try:
        assert ray.get([h.kept.remote() for h in holders]) == [[], []]  # both actors up
        steps(0, 3)
        for replicator in ranks:
            replicator.writer.wait()
        assert ray.get([h.kept.remote() for h in holders]) == [[1, 2, 3]] * 2, logs
        assert not logs

        ray.get(holders[1].hang.remote(6.0))
        started = time.monotonic()
        steps(4, 7)
        assert time.monotonic() - started < 4 * step_s + 2.0  # no step waited out the hang
        assert logs == ["Memory replicas: step 5 skipped: a rank's last replica is still being sent (a slow "
                        "or unresponsive holder); training does not wait for it"], logs
        steps(8, 8, last_step=8)  # the last step: rank 1 still sending, so nobody replicates it
        ranks[1].writer.wait()  # the hang ends
        steps(9, 10)
        for replicator in ranks:
            replicator.writer.wait()
        assert "Memory replicas: go on at step 10 (skipped from 5)" in logs, logs
        assert ray.get([h.kept.remote() for h in holders]) == [[1, 2, 3, 4, 10]] * 2
    finally:
        for replicator in ranks:
            replicator.close()
        for holder in holders:
            ray.kill(holder)


@pytest.mark.ray
def test_auto_on_a_cpu_counts_the_sends_cpu_time_not_its_wait_on_the_holders(ray_session):
    """Training on the host's CPUs, auto weighs what a send takes from training: its CPU time, not
    its wall time, which is mostly the holders' answer (here a holder that takes 1 s to answer)."""
    c = _components()
    holder = _HungHolder.remote(0.0)
    logs: list[str] = []
    replicator = Replicator(holder, None, epoch=7, attempt=0, log=logs.append, warn=logs.append, every=0,
                            sends_compete=True)
    try:
        assert ray.get(holder.kept.remote()) == []
        ray.get(holder.hang.remote(1.0))
        replicator.replicate(_replica(c.model, c.optimizer, 2))  # the probe
        replicator.writer.wait()
        assert replicator.writer.write_seconds >= 1.0 and replicator.send_cpu_s < 0.25
        # A 50 s step's 2% is 1 s: the copy and the send's CPU time fit in it, even on a loaded host (the
        # suite's), so every step is replicated; the send's wall time alone (>= 1 s) would need 2 steps.
        step_s = 1.0 / REPLICA_STALL_BUDGET
        assert replicator.auto_due(3, 0, step_s=step_s) and replicator.every == 1, logs
        assert "of CPU" in logs[-1], logs
    finally:
        replicator.close()
        ray.kill(holder)


@pytest.mark.integration  # a subprocess
def test_the_coordinators_process_imports_no_torch():
    """The run's coordinator is a process on every run's start path (the driver creates it before the
    worker group), and it starts the replica holders: on a 2-core node a torch import is 1.5-3 s of
    CPU the worker group's start waits behind. Its module and the holders' must not import it (a
    holder's process loads it in its constructor, raychat.elastic.holders)."""
    assert not modules_loaded_by("import raychat.elastic.coordinator, raychat.elastic.holders", "torch")

