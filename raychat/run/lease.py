"""One driver per run at a time: the next lease epoch, created atomically, and a heartbeat in it.

Ctrl-C on `ray job submit` stops following the logs, not the job; resubmitting it starts a second
driver on the same run name, and two drivers' saves and prunes would delete each other's
checkpoints. So a driver takes the run by creating the next epoch's record
(raychat.checkpoint.fence): the storage makes that create atomic, so of two drivers racing for one
epoch exactly one gets it, however slow either's requests are. Its workers stamp every checkpoint
with the epoch and write nothing once a higher epoch exists.

A driver that finds the newest epoch not released watches its heartbeat for a few beats on its
own monotonic clock: if the beat moves, the run has a live driver and the newcomer refuses in one
line; if not, the holder is gone (killed, node lost, paused) and the next epoch is created. No clock
is compared across machines. A record that cannot be read is retried, never taken as free. One
shortcut: a holder that ran on this machine, in this PID namespace, whose process is gone (a driver
killed or crashed and relaunched on the head node, a job resubmitted after `ray job stop`) is taken
over at once; a paused process is still there, and waits its beats out like any other.

The holder re-reads the lease at every heartbeat. Once superseded (a higher epoch exists: it was
paused or cut off for longer than the takeover takes), or unable to confirm its epoch for
STALE_AFTER_BEATS beats, it stops: `on_lost` tells its workers to stop at their next step, and the
driver exits with one line naming the new holder.
"""

import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from raychat.checkpoint import fence
from raychat.checkpoint.fence import LeaseLost, LeaseRecord
from raychat.common import RaychatError
from raychat.faults import StorageUnavailable
from raychat.storage import Storage

HEARTBEAT_S = 5.0  # $RAYCHAT_LEASE_HEARTBEAT_S overrides: a takeover waits STALE_AFTER_BEATS of them
STALE_AFTER_BEATS = 3  # heartbeats a silent lease is watched before it is taken over


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
        its epoch's record for the driver that may take the run over from it (`taken_over`)."""
        self.run_dir = run_dir
        self.coordinator = coordinator
        self.heartbeat_s = heartbeat_s or float(os.environ.get("RAYCHAT_LEASE_HEARTBEAT_S") or HEARTBEAT_S)
        self.on_lost = on_lost
        self.record: LeaseRecord | None = None
        self.lost: str | None = None  # why this driver no longer holds the run, once it does not
        self.taken_over: LeaseRecord | None = None  # the silent holder's record, when acquired from one
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
        log(f"Run {self.run_dir} is held by a driver ({self._describe(seen)}): checking whether it is alive "
            f"({STALE_AFTER_BEATS * self.heartbeat_s:.0f} s)")
        deadline = time.monotonic() + STALE_AFTER_BEATS * self.heartbeat_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.heartbeat_s / 2))
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
                             process=process_identity(os.getpid()))
        if not fence.create_record(self.run_dir, record):
            winner = fence.read_record(self.run_dir, record.epoch, log=log)
            raise RaychatError(f"run {self.run_dir} was just taken by another driver "
                               f"({self._describe(winner)}): wait for it to end or choose another --run-name")
        self.record, self.taken_over = record, stale
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

    def _lose(self, newer: int | None) -> None:
        if newer is not None:
            try:
                holder = self._describe(fence.read_record(self.run_dir, newer))
            except (OSError, RaychatError, StorageUnavailable):
                holder = f"lease epoch {newer}"
            self.lost = (f"run {self.run_dir} was taken over by another driver ({holder}) while this "
                         f"driver (lease epoch {self.epoch}) was paused or cut off: this driver stopped and "
                         "its workers wrote nothing after that; follow the new driver instead")
        else:
            self.lost = (f"this driver could not confirm its lease on {self.run_dir} for "
                         f"{STALE_AFTER_BEATS} heartbeats (storage unreachable): it stopped so that another "
                         "driver can take the run safely; re-run to resume once storage answers")
        if self.on_lost is not None:
            self.on_lost(self.lost)

    def _heartbeat(self) -> None:
        """Beat, then look for a higher epoch; stop the run once superseded or unconfirmed."""
        failures = 0
        while not self._stop.wait(self.heartbeat_s):
            try:
                # One beat's worth of retries: a holder must notice it cannot confirm its lease
                # before the silence lets another driver take the run.
                newer = fence.Fence(self.run_dir, self.epoch, budget_s=self.heartbeat_s / 2).newer()
                if newer is not None:
                    self._lose(newer)
                    return
                self.record.beat += 1
                fence.replace_record(self.run_dir, self.record, budget_s=self.heartbeat_s / 2)
                failures = 0
            except (OSError, StorageUnavailable, RaychatError):
                failures += 1  # a beat lost to storage: others see silence for as long
                if failures >= STALE_AFTER_BEATS:
                    self._lose(None)
                    return

    def release(self) -> None:
        """Let the next driver in at once (a killed driver's lease is taken over after 3 silent beats)."""
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
            wait = STALE_AFTER_BEATS * self.heartbeat_s
            print(f"raychat: warning: could not release the lease on {self.run_dir} ({e}); the next driver "
                  f"takes it over after {wait:.0f} s", file=sys.stderr, flush=True)
