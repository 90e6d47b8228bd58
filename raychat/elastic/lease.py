"""One driver per run at a time: the next lease epoch, created atomically, and a heartbeat in it.

Ctrl-C on `ray job submit` stops following the logs, not the job; resubmitting it starts a second
driver on the same run name, and two drivers' saves and prunes would delete each other's
checkpoints. So a driver takes the run by creating the next epoch's record
(raychat.checkpoint.fence): the storage makes that create atomic, so of two drivers racing for one
epoch exactly one gets it, however slow either's requests are. Its workers stamp every checkpoint
with the epoch and write nothing once a higher epoch exists.

A driver that finds the newest epoch not released watches its heartbeat, on its own monotonic
clock, for STALE_AFTER_BEATS of the holder's beats. The record says how long a beat is, so the wait
follows the holder's timing, never the newcomer's, and is never shorter than MIN_TAKEOVER_S. If the
beat moves, the run has a live driver and the newcomer refuses in one line. If it does not, the
holder is gone (killed, its node lost, or paused) and the newcomer creates the next epoch. No clock
is compared across machines. A record that cannot be read is retried, never taken as free.

One shortcut: a holder that ran on this machine, in this PID namespace, and whose process is gone is
taken over at once. That is a driver killed or crashed and relaunched on the head node, or a job
resubmitted after `ray job stop`. A paused process is still there, so its beats are waited out like
any other's.

The holder re-reads the lease at every heartbeat. Once it sees itself superseded (a higher epoch
exists: it was paused or cut off for longer than the takeover takes), it stops for good: `on_lost`
tells its workers to stop, and the driver exits with one line naming the new holder.

A holder that cannot reach storage meets a storage fault like any other, not a lost lease: it
keeps beating through it, and warns once the fault outlasts the retry budget (raychat.faults). Its
workers, whose own reads and writes meet the same fault, fail their attempt with the plain,
retryable StorageUnavailable past that budget, and Ray restarts them. A newcomer may take the run
over meanwhile (all it sees is silence), and that is safe: the takeover is the atomic create of
the next epoch, rank 0 checks the epochs before each checkpoint's manifest and each prune
(raychat.checkpoint.fence.Fence), and what an old writer finishes after the takeover is never
chosen or counted. So the holder's silence can cost it the run, never give the run two writers;
stopping on a brownout instead would turn every storage hiccup of a few beats into a lost run that
no retry policy restarts.
"""

import math
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from raychat.checkpoint import fence
from raychat.checkpoint.fence import MAX_HEARTBEAT_S, LeaseLost, LeaseRecord
from raychat.common import RaychatError
from raychat.faults import StorageUnavailable, retry_budget_s, retry_transient, short_reason
from raychat.storage import Storage

HEARTBEAT_S = 5.0  # $RAYCHAT_LEASE_HEARTBEAT_S overrides: a takeover waits STALE_AFTER_BEATS of them
MIN_HEARTBEAT_S = 1.0  # a shorter beat is refused: each beat is a listing and a write to storage
STALE_AFTER_BEATS = 3  # the holder's heartbeats a silent lease is watched before it is taken over
# The least a newcomer watches a silent lease, whatever beat its record names (one written by a test,
# or by an older raychat that took any beat): a driver's process stalls for a second or two (a
# collection, a loaded host) without being gone.
MIN_TAKEOVER_S = 3.0


def heartbeat_from_env() -> float:
    """$RAYCHAT_LEASE_HEARTBEAT_S, else HEARTBEAT_S; a value that is no number of seconds at least
    MIN_HEARTBEAT_S is refused in one line (0 would let any newcomer take a live run at once)."""
    value = os.environ.get("RAYCHAT_LEASE_HEARTBEAT_S", "")
    if not value:
        return HEARTBEAT_S
    try:
        beat = float(value)
    except ValueError:
        beat = math.nan
    if not (math.isfinite(beat) and MIN_HEARTBEAT_S <= beat <= MAX_HEARTBEAT_S):
        raise RaychatError(f"RAYCHAT_LEASE_HEARTBEAT_S={value!r} is not a heartbeat: set it to a number "
                           f"of seconds from {MIN_HEARTBEAT_S:g} to {MAX_HEARTBEAT_S:g} (default "
                           f"{HEARTBEAT_S:g}), or unset it")
    return beat


def takeover_wait_s(record: LeaseRecord) -> float:
    """How long a newcomer watches `record` for a beat before taking the run: STALE_AFTER_BEATS of
    its holder's beats (the default beat for a record from before they were kept), at least
    MIN_TAKEOVER_S."""
    return max(MIN_TAKEOVER_S, STALE_AFTER_BEATS * (record.heartbeat_s or HEARTBEAT_S))


def _warn(line: str) -> None:
    print(f"raychat: warning: {line}", file=sys.stderr, flush=True)


def _this_machine() -> str | None:
    """This kernel's boot and this process's PID namespace, where pids mean one process (None
    without Linux's /proc)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _state_and_start(pid: int) -> tuple[str, str] | None:
    """Process `pid`'s state letter and start time in clock ticks since boot, from /proc (None: it
    cannot be read, which says nothing of whether the process lives: hidepid, another user's)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    after_name = stat.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return after_name[0], after_name[19]  # fields 3 (state) and 22 (starttime)


def process_identity(pid: int) -> str | None:
    """`pid` as no other process on any machine is named: the machine (_this_machine) and its start."""
    machine, stat = _this_machine(), _state_and_start(pid)
    return f"{machine}/{stat[1]}" if machine and stat else None


def holder_is_gone(record: LeaseRecord) -> bool:
    """Whether `record`'s driver ran on this host and machine and its process has ended (its pid free,
    a zombie, or taken by a later process). False whenever that cannot be known for sure: another
    host or machine, no /proc, a process this one may not see, an old record."""
    here = _this_machine()
    if record.process is None or record.host != socket.gethostname() or here is None:
        return False
    machine, _, started = record.process.rpartition("/")
    if machine != here:
        return False
    try:
        os.kill(record.pid, 0)  # asks the kernel, which /proc's hidepid does not hide
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # a process of another user's holds that pid: whose, /proc may not say
    stat = _state_and_start(record.pid)
    return stat is not None and (stat[0] == "Z" or stat[1] != started)


class RunLease:
    """The lease of one driver on one run directory: `acquire`, `record_resume`, train, `release`."""

    def __init__(self, run_dir: Storage, heartbeat_s: float | None = None,
                 on_lost: Callable[[str], None] | None = None, coordinator: tuple[str, str] | None = None):
        """`coordinator`: (Ray namespace, actor name) of this driver's run coordinator, written into
        its epoch's record for the driver that may take the run over from it (`taken_over`).
        `heartbeat_s`: this driver's beat (tests give short ones; a driver reads
        $RAYCHAT_LEASE_HEARTBEAT_S, refused below MIN_HEARTBEAT_S)."""
        beat_ok = heartbeat_s is None or (math.isfinite(heartbeat_s) and 0 < heartbeat_s <= MAX_HEARTBEAT_S)
        if not beat_ok:
            raise ValueError(f"heartbeat_s={heartbeat_s!r}: a positive number of seconds")
        self.run_dir = run_dir
        self.coordinator = coordinator
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else heartbeat_from_env()
        self.on_lost = on_lost
        self.record: LeaseRecord | None = None
        self.lost: str | None = None  # why this driver no longer holds the run, once it does not
        self.taken_over: LeaseRecord | None = None  # the silent holder's record, when acquired from one
        self.unconfirmed: str | None = None  # the storage fault the last beat met, while it lasts
        self._holder = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def epoch(self) -> int:
        return self.record.epoch if self.record is not None else 0

    def _describe(self, record: LeaseRecord) -> str:
        return f"host {record.host}, pid {record.pid}, since {record.started}, lease epoch {record.epoch}"

    def _wait_for_silence(self, seen: LeaseRecord, log: Callable[[str], None]) -> LeaseRecord | None:
        """`seen`, once its holder has been silent for STALE_AFTER_BEATS beats or its process is
        gone from this machine (None if it released the run meanwhile); raise if it beats."""
        if holder_is_gone(seen):
            log(f"The lease on {self.run_dir} is held by a driver that is gone ({self._describe(seen)}: its "
                "process on this machine has ended): taking it over")
            return seen
        wait = takeover_wait_s(seen)
        log(f"Run {self.run_dir} is held by a driver ({self._describe(seen)}): checking whether it is alive "
            f"({wait:.0f} s)")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(1.0, (seen.heartbeat_s or HEARTBEAT_S) / 2))
            newest = fence.epochs(self.run_dir, log=log)[-1]
            now = fence.read_record(self.run_dir, newest, log=log)
            if now.epoch != seen.epoch or now.beat != seen.beat:
                if now.released:
                    return None
                raise RaychatError(
                    f"run {self.run_dir} is being trained by another driver ({self._describe(now)}): wait "
                    "for it to end or stop it (`ray job stop`, Ctrl-C on a local run), or choose another "
                    "--run-name")
        log(f"The lease on {self.run_dir} is stale (no heartbeat from epoch {seen.epoch}): taking it over")
        return seen

    def acquire(self, floor: Callable[[], int], log: Callable[[str], None] = print) -> None:
        """Hold the run (a new epoch), or raise one RaychatError line naming the driver that does.
        `floor()` is the highest sequence among the run's checkpoints, asked for at the last moment
        before the epoch is created (a holder being taken over may still be saving)."""
        found = fence.epochs(self.run_dir, log=log)
        newest = found[-1] if found else 0
        stale = None
        if newest:
            seen = fence.read_record(self.run_dir, newest, log=log)
            if not seen.released:
                stale = self._wait_for_silence(seen, log)
        namespace, coordinator = self.coordinator or (None, None)
        record = LeaseRecord(epoch=newest + 1, holder=self._holder, host=socket.gethostname(),
                             pid=os.getpid(), started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), floor=floor(),
                             coordinator=coordinator, namespace=namespace,
                             process=process_identity(os.getpid()), heartbeat_s=self.heartbeat_s)
        if not fence.create_record(self.run_dir, record):
            winner = fence.read_record(self.run_dir, record.epoch, log=log)
            raise RaychatError(f"run {self.run_dir} was just taken by another driver "
                               f"({self._describe(winner)}): wait for it to end or choose another --run-name")
        self.record, self.taken_over = record, stale
        self._budget_s = retry_budget_s()  # read here: a malformed setting is refused before training
        self._thread = threading.Thread(target=self._heartbeat, name="raychat-lease", daemon=True)
        self._thread.start()

    def record_resume(self, sequence: int) -> None:
        """The sequence of the checkpoint this epoch resumes from (0: a fresh start). Older epochs'
        checkpoints numbered above it are never chosen or counted again (a rewind, or a superseded
        writer's late save)."""
        self.record.resumed = sequence
        fence.replace_record(self.run_dir, self.record)
        self.check()

    def check(self) -> None:
        """Raise LeaseLost once another driver holds the run."""
        if self.lost is not None:
            raise LeaseLost(self.lost)
        newer = fence.Fence(self.run_dir, self.epoch).newer()
        if newer is not None:
            self._lose(newer)
            raise LeaseLost(self.lost)

    def _lose(self, newer: int) -> None:
        try:
            holder = self._describe(fence.read_record(self.run_dir, newer))
        except (OSError, RaychatError, StorageUnavailable):
            holder = f"lease epoch {newer}"
        self.lost = (f"run {self.run_dir} was taken over by another driver ({holder}) while this "
                     f"driver (lease epoch {self.epoch}) was paused or cut off: this driver stopped and "
                     "its workers wrote nothing after that; follow the new driver instead")
        if self.on_lost is not None:
            self.on_lost(self.lost)

    def _heartbeat(self) -> None:
        """Beat, then look for a higher epoch; stop the run once superseded. Storage faults are
        ridden out (the module's docstring says why that is safe): each beat retries for half a
        beat, so the beats keep their pace and the first one after the fault gets through; a fault
        that outlasts the retry budget is said once, and the beats go on."""
        unconfirmed_since: float | None = None  # the first beat of a fault that has not ended
        past_budget = False
        while not self._stop.wait(self.heartbeat_s):
            try:
                newer = self._beat()
                if newer is not None:
                    self._lose(newer)
                    return
                if unconfirmed_since is not None:
                    _warn(f"the lease on {self.run_dir} is confirmed again after "
                          f"{time.monotonic() - unconfirmed_since:.0f} s of storage faults")
                unconfirmed_since, past_budget, self.unconfirmed = None, False, None
            except (OSError, StorageUnavailable, RaychatError) as e:
                now = time.monotonic()
                self.unconfirmed = short_reason(e)
                if unconfirmed_since is None:
                    unconfirmed_since = now
                    _warn(f"could not confirm the lease on {self.run_dir} ({self.unconfirmed}); retrying at "
                          "every heartbeat")
                elif not past_budget and now - unconfirmed_since >= self._budget_s:
                    past_budget = True
                    _warn(f"the lease on {self.run_dir} has not been confirmed for "
                          f"{now - unconfirmed_since:.0f} s; still retrying. The workers' own storage faults "
                          "fail their attempt past the same budget (Ray restarts it), and their saves stop "
                          "if another driver takes the run")

    def _beat(self) -> int | None:
        """One heartbeat: the highest epoch above this one if there is one, else the beat written.
        Each step is retried for half a beat, quietly (the heartbeat says when a fault begins and
        ends), so the beats keep their pace through a fault and the first one after it gets through."""
        budget, quiet = self.heartbeat_s / 2, lambda _: None
        found = fence.epochs(self.run_dir, log=quiet, budget_s=budget)
        if found and found[-1] > self.epoch:
            return found[-1]
        self.record.beat += 1
        directory, name = fence.lease_dir(self.run_dir), fence.epoch_file(self.epoch)
        data = self.record.to_json()
        retry_transient(lambda: directory.replace_atomically(name, data), f"writing {directory.child(name)}",
                        log=quiet, budget_s=budget)
        return None

    def release(self) -> None:
        """Let the next driver in at once (a killed driver's lease is taken over after its silence)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        # Best effort, briefly: it runs in `finally` after training, and must neither hide the
        # error that ended the run nor hang its exit on a dead endpoint. An unreleased lease is
        # taken over after STALE_AFTER_BEATS silent beats anyway.
        budget = 2 * self.heartbeat_s
        try:
            if self.lost is None and fence.Fence(self.run_dir, self.epoch, budget_s=budget).newer() is None:
                self.record.released = True
                fence.replace_record(self.run_dir, self.record, budget_s=budget)
        except (OSError, StorageUnavailable, RaychatError) as e:
            wait = max(MIN_TAKEOVER_S, STALE_AFTER_BEATS * self.heartbeat_s)
            print(f"raychat: warning: could not release the lease on {self.run_dir} ({e}); the next driver "
                  f"takes it over after {wait:.0f} s", file=sys.stderr, flush=True)
