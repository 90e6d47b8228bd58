"""One driver per run at a time: a lease file in the run's directory, kept alive by a heartbeat.

Ctrl-C on `ray job submit` stops following the logs, not the job; resubmitting it starts a second
driver on the same run name, and two drivers' saves and prunes would delete each other's
checkpoints. So a driver holds `raychat_lease.json` in the run directory while it trains and bumps a
counter in it every `heartbeat_s`. A new driver that finds a lease not released watches the counter
for a few heartbeats on its own monotonic clock: if the counter moves, the run has a live writer and
the new driver refuses in one line; if not, the holder is gone (killed, node lost) and the lease is
taken over. No clock is compared across machines: storage that sets file times from a skewed
client (FUSE mounts of buckets, Lustre) cannot fool it.
"""

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from raychat.common import RaychatError
from raychat.storage import Storage

LEASE_FILE = "raychat_lease.json"
HEARTBEAT_S = 5.0
STALE_AFTER_BEATS = 3  # heartbeats a silent lease is watched before it is taken over


class RunLease:
    """The lease of one driver on one run directory; `acquire`, train, `release`."""

    def __init__(self, run_dir: Storage, heartbeat_s: float = HEARTBEAT_S):
        self.run_dir = run_dir
        self.heartbeat_s = heartbeat_s
        self.holder = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        self._beat = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict | None:
        if not self.run_dir.exists(LEASE_FILE):
            return None
        try:
            return json.loads(self.run_dir.read_bytes(LEASE_FILE))
        except (ValueError, OSError):
            return None  # half-written by a holder that died mid-write: nobody holds it

    def _write(self, released: bool = False) -> None:
        lease = {**self.holder, "beat": self._beat, "released": released}
        self.run_dir.write_bytes(LEASE_FILE, json.dumps(lease).encode())

    def _check_free(self, log: Callable[[str], None]) -> None:
        """Return once no live driver holds the run; raise if one does."""
        seen = self._read()
        if seen is None or seen.get("released"):
            return
        log(f"Run {self.run_dir} has a lease from {seen.get('host')} (pid {seen.get('pid')}): "
            f"checking whether that driver is alive ({STALE_AFTER_BEATS * self.heartbeat_s:.0f} s)")
        deadline = time.monotonic() + STALE_AFTER_BEATS * self.heartbeat_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.heartbeat_s / 2))
            now = self._read()
            if now is None or now.get("released"):
                return
            if now.get("id") != seen.get("id") or now.get("beat") != seen.get("beat"):
                raise RaychatError(
                    f"run {self.run_dir} is being trained by another driver (host {now.get('host')}, pid "
                    f"{now.get('pid')}, since {now.get('started')}): wait for it to end or stop it "
                    "(`ray job stop`, Ctrl-C on a local run), or choose another --run-name")
        log(f"The lease on {self.run_dir} is stale (no heartbeat): taking it over")

    def acquire(self, log: Callable[[str], None] = print) -> None:
        """Hold the run, or raise one RaychatError line naming the driver that does."""
        self._check_free(log)
        self._write()
        # Two drivers that found the run free at the same moment both wrote: the last write wins,
        # and the other sees it here, after both writes have landed.
        time.sleep(min(1.0, self.heartbeat_s / 5))
        winner = self._read()
        if winner is not None and winner.get("id") != self.holder["id"]:
            raise RaychatError(f"run {self.run_dir} was just taken by another driver (host "
                               f"{winner.get('host')}, pid {winner.get('pid')}): choose another --run-name")
        self._thread = threading.Thread(target=self._heartbeat, name="raychat-lease", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._beat += 1
            # A storage hiccup: the next beat tries again (only 3 silent beats free the lease).
            with contextlib.suppress(OSError):
                self._write()

    def release(self) -> None:
        """Let the next driver in at once (a killed driver's lease frees itself after 3 beats)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        current = self._read()
        if current is not None and current.get("id") == self.holder["id"]:
            self._write(released=True)
