"""Stopping what a local Ray cluster started, and losing one of its nodes on purpose.

`stop_processes_under` ends every process of one cluster (found by its session or temp directory in
their command lines), agents that outlive their raylet included; `kill_node` and `node_of_pid` take
a `ray.cluster_utils.Cluster` node down without notice, as a reclaimed VM goes. In testkit because
the tests' fixtures and cluster tests (tests/conftest.py, tests/test_elastic.py, ...) and the benches
that kill things (bench.multinode's clusters, bench.chaos, bench.recovery) both use them; raychat
itself never does.
"""

import contextlib
import os
import signal


def stop_processes_under(marker: str, grace_s: float = 2.0) -> None:
    """Stop every process whose command line mentions `marker` (a cluster's session directory), and
    their children: a raylet's agents retitle themselves ("ray::DashboardAgent") and, their raylet
    gone, linger for minutes. What has not ended `grace_s` after SIGTERM is killed: a raylet, its GCS
    and its runtime-env agent outlive a SIGTERM sent to the whole cluster at once by over 10 s."""
    import psutil

    def under_marker() -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if p.pid != os.getpid() and marker in " ".join(p.info["cmdline"] or []):
                    found[p.pid] = p
                    found.update((child.pid, child) for child in p.children(recursive=True))
        found.pop(os.getpid(), None)
        return list(found.values())

    procs = under_marker()
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # Then whatever is left, and whatever a raylet started meanwhile.
    left = alive + [p for p in under_marker() if p not in alive]
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=5)


def kill_node(cluster, node) -> None:
    """`node` gone without notice, as a reclaimed VM goes: its raylet and every process it started,
    killed at once, then dropped from `cluster`. (`remove_node` alone kills the raylet and its store
    but not its workers, which find their raylet gone only at their next call to it: a Train worker
    went on training, and saved a checkpoint, for seconds on a node already lost.)"""
    import psutil

    started = node.all_processes["raylet"][0].process
    if started.poll() is None:  # (a raylet already dead and reaped: its pid may be another's now)
        raylet = psutil.Process(started.pid)
        for process in [raylet, *raylet.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    cluster.remove_node(node, allow_graceful=False)


def node_of_pid(nodes: list, pid: int):
    """The Cluster node whose raylet started process `pid` (each node is its own raylet here)."""
    import psutil

    raylets = {n.all_processes["raylet"][0].process.pid: n for n in nodes}
    for parent in psutil.Process(pid).parents():
        if parent.pid in raylets:
            return raylets[parent.pid]
    raise LookupError(f"process {pid} is under no node's raylet")
