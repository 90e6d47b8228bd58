"""Drivers racing for one run's lease at one moment: how each race ended, driver by driver.

bench.lease_race counts, over many seeded trials, how often more than one driver won; tests/test_lease.py
asserts that exactly one does, on local disk and against a real S3 API with some drivers slowed by the
fault proxy. In testkit because both race the same way; raychat itself never imports it.
"""

import random
import threading
import time

from raychat.common import RaychatError
from raychat.elastic.lease import RunLease
from raychat.storage import Storage


def race(runs: list[Storage], rng: random.Random, heartbeat_s: float = 0.5) -> list[str]:
    """One driver per entry of `runs` (views of one run directory, e.g. direct and proxied) acquires
    at the same moment, after a seeded jitter of a few ms; "won" or the line each refusal said. The
    heartbeat is long beside the race: with a 50 ms beat, a loaded machine's scheduler stalls a
    winner's beats long enough for a legitimate takeover, which is not a race lost."""
    start = threading.Barrier(len(runs))
    outcomes = [""] * len(runs)
    leases = [RunLease(run, heartbeat_s=heartbeat_s) for run in runs]
    jitter = [rng.uniform(0, 0.004) for _ in runs]

    def go(i: int) -> None:
        start.wait()
        time.sleep(jitter[i])
        try:
            leases[i].acquire(floor=lambda: 0, log=lambda _: None)
            outcomes[i] = "won"
        except RaychatError as e:
            outcomes[i] = str(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lease in leases:
        lease.release()
    return outcomes
