"""Elastic runs that lose no work on a planned resize, and say what happened at every restart.

Ray Train V2's elastic policy (`ScalingConfig(num_workers=(min, max))`) restarts the worker group
in two cases: a failure (a worker or its node died; the group restarts with as many workers as fit)
and a planned resize (the group is healthy and more workers now fit: the controller goes
RunningState -> ResizingState -> SchedulingState and calls
`ControllerCallback.before_controller_execute_resize_decision` before it shuts the old group down;
ray/train/v2/_internal/execution/controller/controller.py, `_execute_resize_decision`). Both restart
from the latest checkpoint. A failure cannot be planned for, but a resize can: `PlannedResizeSave`
holds the controller in that hook until the workers have saved a checkpoint at their next step
boundary, so the larger group resumes exactly where the smaller one stopped.

The run's `Coordinator` actor (raychat.elastic.coordinator) carries the request to the workers and
remembers each attempt, so a new attempt can log "Lost 1 worker(s) ...; 7 steps redone",
"Preempted (saved step 23 on the notice): ..." or "Grew to 3 workers at step 160 (no steps
redone)".
"""

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import ray

from raychat.checkpoint.fence import LeaseRecord
from raychat.elastic.coordinator import coordinator_name
from raychat.ray_glue.ray_internals import (
    AUTOSCALING_COORDINATOR,
    ControllerCallback,
    ElasticScalingPolicy,
    NoopDecision,
    ReschedulingState,
    ResizeDecision,
    ResizingState,
    RestartingState,
    RunningState,
    SchedulingState,
    train_requester_id,
)
from raychat.storage import Storage
from raychat.telemetry.console import log_line

SAVE_WAIT_S = 300.0  # how long the controller waits for the planned save before resizing anyway
# A raylet accepting no connection within this is gone (gone_nodes): past Linux's first SYN retransmit
# (1 s), so one packet lost on a live link is not taken for a dead node; a dead host's is refused at
# once, or, where its address drops packets (a reclaimed VM), costs a restart this long.
RAYLET_PROBE_S = 2.5
RESERVATION_FILE = "raychat_reservation.json"  # in the run directory: the controller's resource request


class PlannedResizeSave(ControllerCallback):
    """Before a planned resize restarts the group, have the workers checkpoint the current step; when
    a new group starts, tell the run's coordinator, whose save requests from then on are that group's."""

    def __init__(self, session: str, wait_s: float = SAVE_WAIT_S):
        self.session = session
        self.wait_s = wait_s
        self._planned = False

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if isinstance(current_state, ResizingState):
            self._planned = True  # a healthy group about to be resized (not a restart after a failure)
        elif isinstance(current_state, RunningState) and isinstance(previous_state, SchedulingState):
            # A new group started: save requests from now on are its own (Coordinator.group_running).
            # Sent before any resize decision about it (one caller's calls reach an actor in order).
            with contextlib.suppress(ValueError, ray.exceptions.RayError):
                ray.get_actor(coordinator_name(self.session)).group_running.remote(
                    previous_state.scaling_decision.num_workers)

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        if not self._planned:
            return
        self._planned = False
        deadline = time.monotonic() + self.wait_s
        try:  # without the run's coordinator (its driver gone) there is no save to wait for
            coordinator = ray.get_actor(coordinator_name(self.session))
            ray.get(coordinator.request_save.remote(), timeout=30)
            while time.monotonic() < deadline:
                if ray.get(coordinator.get_saved_step.remote(), timeout=30) is not None:
                    return
                time.sleep(0.2)
        except (ValueError, ray.exceptions.RayError):
            return


class GrowWhenItPays(ElasticScalingPolicy):
    """Ray Train's elastic policy, which grows a running group whenever more workers fit, less the
    grows that do not pay: a grow restarts the group, and near the end of a run (or while restarts
    are slow) the steps left would finish sooner at the size the group has. The run's coordinator
    judges (raychat.elastic.coordinator.grow_verdict, from the measured restart cost and step time)
    and the verdict is said once; `always` (--grow always) says it and grows anyway. After a veto
    the policy asks the autoscaler for no more workers than the group has, so nodes it will not use
    are not held for it. A grow Ray decides before anything is measured stands as Ray decides it; a
    running group is never shrunk (its workers are alive: a lost node fails them, and the restart is
    sized then), and a restart counts no workers on a node already gone
    (`make_decision_for_non_running_worker_group`)."""

    def __init__(self, scaling_config, session: str, always: bool = False):
        super().__init__(scaling_config)
        self.session, self.always = session, always
        self.held_at: int | None = None  # the group's size when a grow was vetoed: what is asked for
        self._restarting = False  # deciding the size of a group to start (nodes already gone not counted)
        # A view of the cluster, its nodes gone and the live nodes outside it (see _count_possible_workers)
        self._probed: tuple[dict | None, set[str], dict] = (None, set(), {})

    def _get_num_workers_for_resource_request(self) -> int:
        wanted = super()._get_num_workers_for_resource_request()
        return wanted if self.held_at is None else min(wanted, self.held_at)

    def make_decision_for_non_running_worker_group(self):
        """Ray's decision of the size to (re)start the group at, from a view of the cluster without
        the nodes already gone and with the live nodes it does not hold yet.

        A node that dies is listed alive until the GCS's health checks give up on it (3 s with the
        cluster configs' settings, 15 s with Ray's defaults), and the controller notices its workers
        die before that. Ray's view (its autoscaling coordinator's reservation for the run) then
        still holds the dead node, and not a spare that could replace it. Counted, the dead node
        makes the restart ask for the old size and, with no spare, wait out
        RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S before it starts a smaller group: two group starts
        per loss. So when the view holds a node that is gone (`gone_nodes`: listed dead, or its
        raylet silent), that node is not counted and every live node outside the view is, as a
        whole node (`spare_nodes`): one group start, of the old size where a spare is up. Only
        here: a running group is never resized on a probe's word (a network blip of a second would
        cost two restarts)."""
        self._restarting = True
        try:
            return super().make_decision_for_non_running_worker_group()
        finally:
            self._restarting = False

    def _count_possible_workers(self, reserved_resources: dict) -> int:
        if self._restarting and reserved_resources:
            if self._probed[0] is not reserved_resources:  # once per view: re-read at most once a second
                gone = gone_nodes(reserved_resources)
                self._probed = (reserved_resources, gone, spare_nodes(reserved_resources) if gone else {})
            _, gone, spares = self._probed
            if gone:
                kept = {n: r for n, r in reserved_resources.items() if n not in gone}
                reserved_resources = {**kept, **spares}
        return super()._count_possible_workers(reserved_resources)

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        current = worker_group_state.num_workers
        if not isinstance(decision, ResizeDecision) or decision.num_workers == current:
            return decision
        if decision.num_workers < current:
            # Ray shrinks a running group when its view of the cluster says fewer workers fit; that
            # view lags a restart (bench.goodput saw a group grown to 2 shrunk to 1 two steps later,
            # then grown again: two restarts for nothing). A running group's workers are alive, and
            # a node that goes fails them: the restart after that is sized then.
            return NoopDecision()
        try:
            coordinator = ray.get_actor(coordinator_name(self.session))
            verdict = ray.get(coordinator.grow_verdict.remote(decision.num_workers), timeout=10)
        except (ValueError, ray.exceptions.RayError):  # no verdict to be had: Ray's decision stands
            return decision
        if verdict is None:
            return decision
        grow = verdict.pays or self.always
        with contextlib.suppress(ray.exceptions.RayError):  # the line is said at most once, or not at all
            key = (current, decision.num_workers, verdict.pays)
            if ray.get(coordinator.say_once.remote(key), timeout=10):
                log_line(verdict.line + (" (--grow always: growing)" if grow and not verdict.pays else ""))
        if grow:
            return decision
        self.held_at = current
        return NoopDecision()


def grow_when_it_pays(controller_kwargs: dict, session: str, always: bool = False) -> dict:
    """The controller's arguments with an elastic run's scaling policy replaced by GrowWhenItPays."""
    policy = controller_kwargs.get("scaling_policy")
    if type(policy) is not ElasticScalingPolicy:
        return controller_kwargs
    return {**controller_kwargs, "scaling_policy": GrowWhenItPays(policy.scaling_config, session, always)}


class NoteRestart(ControllerCallback):
    """Tell the run's coordinator when the controller starts a restart (it noticed a failure) or a
    resize, the time ledger's end of detection (raychat.telemetry.ledger), and when a new group
    failed to start (ReschedulingState): the next attempt's start record counts those."""

    def __init__(self, session: str):
        self.session = session

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if type(previous_state) is type(current_state):
            return  # the controller waiting (for resources, a group to start) re-enters a state each turn
        with contextlib.suppress(ValueError, ray.exceptions.RayError):  # the ledger only loses a split
            if isinstance(current_state, (RestartingState, ResizingState)):
                ray.get_actor(coordinator_name(self.session)).restart_noticed.remote(time.time())
            elif isinstance(current_state, ReschedulingState):
                ray.get_actor(coordinator_name(self.session)).start_failed.remote()


class FreshClusterView(ControllerCallback):
    """After a failure, size the restarted group from the cluster as it is now.

    Ray Train's elastic policy counts the workers that fit from Ray's autoscaling coordinator
    (ray/data/_internal/cluster_autoscaler), which re-reads the cluster only every 20 s. Right after
    a node dies it still lists that node, so the controller asks for the old size and waits out
    RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S for resources that are gone (`python -m bench.recovery
    --timeline` shows the wait). Asking the coordinator to re-read once when the controller starts
    a restart (or reschedules after such a timeout) removes that wait, once the GCS has declared
    the node dead; until then GrowWhenItPays leaves out a node whose raylet is gone."""

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if isinstance(current_state, (RestartingState, ReschedulingState)) and \
                type(previous_state) is not type(current_state):  # once, not at each turn of a wait
            refresh_cluster_view()


def gone_nodes(node_ids: Iterable[str], probe_s: float = RAYLET_PROBE_S) -> set[str]:
    """The nodes among `node_ids` that are gone though a view of the cluster may still count them: the
    GCS lists them dead or not at all, or lists them alive but their raylet refuses a TCP connection,
    or accepts none within `probe_s` (a raylet killed with its machine, a host reclaimed). Where that
    would be every node, or the GCS cannot be asked, nothing is left out: a controller that cannot
    reach any raylet (a firewall) must not take the whole cluster for gone, and Ray's count stands."""
    wanted = set(node_ids)
    try:
        listed = {n["NodeID"]: n for n in ray.nodes() if n.get("NodeID") in wanted}
        raylets = {node: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for node, n in listed.items()
                   if n.get("Alive") and n.get("NodeManagerPort")}
        gone = (wanted - set(raylets)) | silent_raylets(raylets, probe_s)
    except Exception:  # noqa: BLE001 (the GCS, a name, threads: the controller must not fail on a probe)
        return set()
    return set() if gone >= wanted else gone


def spare_nodes(view: dict) -> dict[str, dict]:
    """The live nodes the GCS lists that `view` (node: resources) does not hold, with their whole
    resources: what a restart may start workers on besides the view's (a start that finds them
    taken fails as any start does). Nothing where the GCS cannot be asked."""
    try:
        return {n["NodeID"]: dict(n.get("Resources") or {}) for n in ray.nodes()
                if n.get("Alive") and n.get("NodeID") not in view}
    except Exception:  # noqa: BLE001 (the controller must not fail on it)
        return {}


def silent_raylets(raylets: dict[str, tuple[str, int]], probe_s: float = RAYLET_PROBE_S) -> set[str]:
    """The keys of `raylets` (node: host and port) whose address accepts no TCP connection within
    `probe_s`, probed at once. A live raylet accepts at once, even a busy one: the kernel answers."""
    if not raylets:
        return set()

    def refuses(address: tuple[str, int]) -> bool:
        try:
            socket.create_connection(address, timeout=probe_s).close()
            return False
        except OSError:  # refused at once, or no answer within probe_s
            return True

    with ThreadPoolExecutor(max_workers=min(32, len(raylets))) as pool:
        answers = dict(zip(raylets, pool.map(refuses, raylets.values()), strict=True))
    return {node for node, silent in answers.items() if silent}


def refresh_cluster_view() -> None:
    """Make Ray's autoscaling coordinator re-read the cluster now (a best effort: a Ray without that
    actor or its `recompute` argument keeps its own 20 s timing)."""
    with contextlib.suppress(ValueError, TypeError, ray.exceptions.RayError):
        coordinator = autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote("raychat", recompute=True), timeout=10)


def autoscaling_coordinator() -> ray.actor.ActorHandle:
    """Ray's autoscaling coordinator actor; ValueError where the cluster has none (yet)."""
    name, namespace = AUTOSCALING_COORDINATOR
    return ray.get_actor(name, namespace=namespace)


class RecordReservation(ControllerCallback):
    """Write down, in the run directory, the resource request this run's controller holds with Ray's
    autoscaling coordinator.

    The controller cancels that request when it shuts down, but one killed with its driver (the job
    stopped, the driver's process or node gone) never does, and the coordinator keeps the workers'
    resources reserved for it until it expires, 180 s later. A relaunched run then sees "ready
    resources for 0 workers" on a cluster sized for it and waits out those minutes before its first
    step (bench/RESULTS.md, "Chaos", has the relaunch with and without the release). The next driver
    of the run, holding its lease, releases what this file names (`release_stale_reservation`), when it
    took the run over from this controller's driver (the file says its lease epoch)."""

    def __init__(self, run_dir: str, lease_epoch: int):
        self.run_dir, self.lease_epoch = run_dir, lease_epoch

    def after_controller_start(self, train_run_context) -> None:
        record = {"requester": train_requester_id(train_run_context.run_id), "epoch": self.lease_epoch}
        with contextlib.suppress(OSError):  # without the record a relaunch only waits longer
            Storage(self.run_dir).replace_atomically(RESERVATION_FILE, json.dumps(record).encode())


def release_stale_reservation(run_dir: Storage, taken_over: LeaseRecord | None,
                              log: Callable[[str], None] = print) -> None:
    """Cancel the resource request the controller of the driver this one took the run over from
    (`RunLease.taken_over`) left behind. A driver that released the run had its controller cancel
    its own; a record of another epoch is not this takeover's (a superseded driver that wakes must
    not release its successor's)."""
    if taken_over is None:
        return
    try:
        record = json.loads(run_dir.read_replaceable(RESERVATION_FILE))
        requester, epoch = record["requester"], record["epoch"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no previous controller recorded one
    if epoch != taken_over.epoch:
        return
    try:
        coordinator = autoscaling_coordinator()
        held = ray.get(coordinator.get_reserved_resources.remote(requester), timeout=10)
        if held:
            ray.get(coordinator.cancel_request.remote(requester), timeout=10)
    except (ValueError, TypeError, ray.exceptions.RayError):
        return  # no coordinator on this cluster (yet): nothing is reserved
    if held:
        log(f"Released the resources Ray still reserved for this run's previous controller ({requester}, "
            f"{len(held)} node(s)): its driver ended without releasing them")
